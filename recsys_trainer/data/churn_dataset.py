"""Moved to ``recsys_trainer.data.generators.churn_dataset`` (the data generators live apart
from the reader). This path keeps working: it re-exports the module's public names, and
``python -m recsys_trainer.data.churn_dataset`` still runs it."""

from recsys_trainer.data.generators.churn_dataset import (
    DEVICE_TABLE_ROWS,
    DEVICES,
    churn_features,
    ensure_churn_dataset,
    main,
    write_churn_dataset,
)

__all__ = [
    "DEVICES",
    "DEVICE_TABLE_ROWS",
    "churn_features",
    "ensure_churn_dataset",
    "main",
    "write_churn_dataset",
]

if __name__ == "__main__":
    main()
