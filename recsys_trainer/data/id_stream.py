"""Moved to ``recsys_trainer.data.generators.id_stream`` (the data generators live apart from the
reader). This path keeps working: it re-exports the module's public names."""

from recsys_trainer.data.generators.id_stream import (
    ChurnStream,
    IdStream,
)

__all__ = [
    "ChurnStream",
    "IdStream",
]
