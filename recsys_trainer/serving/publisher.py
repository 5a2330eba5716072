"""Moved to ``recsys_trainer.serving.exporting.publisher`` (the export side of serving lives
apart from the runtime). This path keeps working: it re-exports that module's ``__all__``."""

from recsys_trainer.serving.exporting.publisher import *  # noqa: F403 - the names of its __all__
from recsys_trainer.serving.exporting.publisher import __all__ as __all__
