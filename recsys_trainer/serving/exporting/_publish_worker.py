"""The publisher process of ``PublishHook`` (``python -m
recsys_trainer.serving.exporting._publish_worker INIT``):
``recsys_trainer.serving.exporting.publisher.worker_main``. A module of its own so that the
publisher's module is imported under its name (its loggers are ``recsys_trainer``'s), not run
as ``__main__``."""

import sys

from recsys_trainer.serving.exporting.publisher import worker_main

if __name__ == "__main__":
    worker_main(sys.argv[1])
