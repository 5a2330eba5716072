"""``python -m recsys_trainer CONFIG.yaml [--section.key VALUE ...]``: the ``recsys-train`` CLI."""

import sys

from recsys_trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
