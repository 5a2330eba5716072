"""Moved to ``recsys_trainer.data.generators.synthetic`` (the data generators live apart from
the reader). This path keeps working: it re-exports that module's ``__all__``."""

from recsys_trainer.data.generators.synthetic import *  # noqa: F403 - the names of its __all__
from recsys_trainer.data.generators.synthetic import __all__ as __all__
