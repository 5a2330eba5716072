"""Moved to ``recsys_trainer.data.generators.open_bandit`` (the data generators live apart
from the reader). This path keeps working: it re-exports the module's public names, and
``python -m recsys_trainer.data.open_bandit`` still runs it."""

from recsys_trainer.data.generators.open_bandit import (
    NUM_AFFINITY,
    NUM_USER_FEATURES,
    OBP_VERSION,
    OBP_WHEEL,
    OBP_WHEEL_SHA256,
    SOURCES,
    OpenBanditSampleError,
    cache_dir,
    convert,
    fetch_sample,
    main,
    open_bandit_features,
    read_sample_csv,
)

__all__ = [
    "NUM_AFFINITY",
    "NUM_USER_FEATURES",
    "OBP_VERSION",
    "OBP_WHEEL",
    "OBP_WHEEL_SHA256",
    "OpenBanditSampleError",
    "SOURCES",
    "cache_dir",
    "convert",
    "fetch_sample",
    "main",
    "open_bandit_features",
    "read_sample_csv",
]

if __name__ == "__main__":
    main()
