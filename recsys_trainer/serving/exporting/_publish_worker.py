"""The publisher process of ``PublishHook`` (``python -m
recsys_trainer.serving.exporting._publish_worker INIT``): ``publisher_client.run_publisher``
driving a ``Publisher``. A module of its own so that the publisher's modules are imported under
their names (their loggers are ``recsys_trainer``'s), not run as ``__main__``."""

import sys

from recsys_trainer.serving.exporting.publisher import Publisher
from recsys_trainer.serving.exporting.publisher_client import run_publisher

if __name__ == "__main__":
    run_publisher(sys.argv[1], Publisher)
