"""The publisher process of ``PublishHook`` (``python -m recsys_trainer.hooks._publish_worker
INIT``); see ``recsys_trainer.hooks.publish``."""

import sys

from recsys_trainer.hooks.publish import _worker_main

if __name__ == "__main__":
    _worker_main(sys.argv[1])
