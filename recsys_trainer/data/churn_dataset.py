"""Moved to ``recsys_trainer.data.generators.churn_dataset`` (the data generators live apart
from the reader). This path keeps working: it re-exports that module's ``__all__``, and
``python -m recsys_trainer.data.churn_dataset`` still runs it."""

from recsys_trainer.data.generators.churn_dataset import *  # noqa: F403 - the names of its __all__
from recsys_trainer.data.generators.churn_dataset import __all__ as __all__
from recsys_trainer.data.generators.churn_dataset import main

if __name__ == "__main__":
    main()
