"""Moved to ``recsys_trainer.serving.runtime.server`` (the serving runtime lives apart from the
export side). This path keeps working: it re-exports the module's public names, it is still the
module of the ``recsys-serve`` console script (``pyproject.toml``), and ``python -m
recsys_trainer.serving.server`` still runs the server."""

from recsys_trainer.serving.runtime.server import (
    ARROW_STREAM,
    OPTIONS_ENV,
    BadRequest,
    app_from_env,
    create_app,
    main,
    parse_args,
)

__all__ = ["ARROW_STREAM", "OPTIONS_ENV", "BadRequest", "app_from_env", "create_app", "main",
           "parse_args"]

if __name__ == "__main__":
    main()
