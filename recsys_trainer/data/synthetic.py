"""Moved to ``recsys_trainer.data.generators.synthetic`` (the data generators live apart from the
reader). This path keeps working: it re-exports the module's public names."""

from recsys_trainer.data.generators.synthetic import (
    PlantedSignal,
    synthetic_batches,
)

__all__ = [
    "PlantedSignal",
    "synthetic_batches",
]
