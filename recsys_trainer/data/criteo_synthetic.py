"""Moved to ``recsys_trainer.data.generators.criteo_synthetic`` (the data generators live apart
from the reader). This path keeps working: it re-exports the module's public names, and
``python -m recsys_trainer.data.criteo_synthetic`` still runs it."""

from recsys_trainer.data.generators.criteo_synthetic import (
    DENSE_COLUMNS,
    NUM_DENSE,
    NUM_SPARSE,
    SPARSE_COLUMNS,
    BehaviourSignal,
    CriteoSignal,
    behaviour_features,
    criteo_features,
    ensure_dataset,
    generate_hour,
    main,
    vocab_sizes,
    write_dataset,
)

__all__ = [
    "BehaviourSignal",
    "CriteoSignal",
    "DENSE_COLUMNS",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_COLUMNS",
    "behaviour_features",
    "criteo_features",
    "ensure_dataset",
    "generate_hour",
    "main",
    "vocab_sizes",
    "write_dataset",
]

if __name__ == "__main__":
    main()
