"""The publisher process of ``PublishHook`` (``python -m recsys_trainer.hooks._publish_worker
INIT``); see ``recsys_trainer.hooks.publisher``."""

import sys

from recsys_trainer.hooks.publisher import worker_main

if __name__ == "__main__":
    worker_main(sys.argv[1])
