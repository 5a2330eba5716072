"""Moved to ``recsys_trainer.data.generators.interactions_synthetic`` (the data generators live
apart from the reader). This path keeps working: it re-exports that module's ``__all__``, and
``python -m recsys_trainer.data.interactions_synthetic`` still runs it."""

from recsys_trainer.data.generators.interactions_synthetic import *  # noqa: F403 - the names of its __all__
from recsys_trainer.data.generators.interactions_synthetic import __all__ as __all__
from recsys_trainer.data.generators.interactions_synthetic import main

if __name__ == "__main__":
    main()
