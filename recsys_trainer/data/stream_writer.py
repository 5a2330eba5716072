"""Moved to ``recsys_trainer.data.generators.stream_writer`` (the data generators live apart
from the reader). This path keeps working: it re-exports the module's public names, and
``python -m recsys_trainer.data.stream_writer`` still runs it."""

from recsys_trainer.data.generators.stream_writer import (
    DEFAULT_START,
    END_MARKER,
    StreamConfig,
    StreamWriter,
    main,
    stream_dataset,
    stream_features,
    stream_windows,
)

__all__ = [
    "DEFAULT_START",
    "END_MARKER",
    "StreamConfig",
    "StreamWriter",
    "main",
    "stream_dataset",
    "stream_features",
    "stream_windows",
]

if __name__ == "__main__":
    main()
