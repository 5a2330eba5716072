"""Moved to ``recsys_trainer.serving.exporting.export`` (the export side of serving lives apart
from the runtime). This path keeps working: it re-exports that module's ``__all__``."""

from recsys_trainer.serving.exporting.export import *  # noqa: F403 - the names of its __all__
from recsys_trainer.serving.exporting.export import __all__ as __all__
