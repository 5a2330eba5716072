"""Moved to ``recsys_trainer.data.generators.open_bandit`` (the data generators live apart from
the reader). This path keeps working: it re-exports that module's ``__all__``, and
``python -m recsys_trainer.data.open_bandit`` still runs it."""

from recsys_trainer.data.generators.open_bandit import *  # noqa: F403 - the names of its __all__
from recsys_trainer.data.generators.open_bandit import __all__ as __all__
from recsys_trainer.data.generators.open_bandit import main

if __name__ == "__main__":
    main()
