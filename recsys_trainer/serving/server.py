"""Moved to ``recsys_trainer.serving.runtime.server`` (the serving runtime lives apart from the
export side). This path keeps working: it re-exports that module's ``__all__``, it is still the
module of the ``recsys-serve`` console script (``pyproject.toml``), and
``python -m recsys_trainer.serving.server`` still runs the server."""

from recsys_trainer.serving.runtime.server import *  # noqa: F403 - the names of its __all__
from recsys_trainer.serving.runtime.server import __all__ as __all__
from recsys_trainer.serving.runtime.server import main

if __name__ == "__main__":
    main()
