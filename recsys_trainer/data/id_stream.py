"""Moved to ``recsys_trainer.data.generators.id_stream`` (the data generators live apart from
the reader). This path keeps working: it re-exports that module's ``__all__``."""

from recsys_trainer.data.generators.id_stream import *  # noqa: F403 - the names of its __all__
from recsys_trainer.data.generators.id_stream import __all__ as __all__
