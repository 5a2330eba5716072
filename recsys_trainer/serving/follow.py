"""Moved to ``recsys_trainer.serving.runtime.follow`` (the serving runtime lives apart from the
export side). This path keeps working: it re-exports that module's ``__all__``."""

from recsys_trainer.serving.runtime.follow import *  # noqa: F403 - the names of its __all__
from recsys_trainer.serving.runtime.follow import __all__ as __all__
