"""Moved to ``recsys_trainer.data.generators.stream_writer`` (the data generators live apart
from the reader). This path keeps working: it re-exports that module's ``__all__``, and
``python -m recsys_trainer.data.stream_writer`` still runs it."""

from recsys_trainer.data.generators.stream_writer import *  # noqa: F403 - the names of its __all__
from recsys_trainer.data.generators.stream_writer import __all__ as __all__
from recsys_trainer.data.generators.stream_writer import main

if __name__ == "__main__":
    main()
