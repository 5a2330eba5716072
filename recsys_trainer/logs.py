"""Where the project's log lines go: the ``recsys_trainer`` logger.

A library should not configure the program's logging, but the lines users rely on (the
``LoggerHook``'s loss line, the dynamic tables' per-window line, checkpoint commits) are INFO
records, and Python's default effective level is WARNING: without a call users do not know of,
they were dropped. So ``default_logging(rank)``, called by the Trainer, on rank 0 only:

* sets the ``recsys_trainer`` logger to INFO unless the program set its level (set it to
  WARNING to silence the project's INFO lines);
* leaves the records to the program's handlers: they propagate to the root logger as usual.
  (Importing fbgemm_gpu, hence torchrec, calls ``logging.info`` on the root logger, which runs
  ``logging.basicConfig()``: the root logger then has a stderr handler, and a later
  ``logging.basicConfig(...)`` does nothing without ``force=True``.)
* only when no handler would receive them at all, adds a stderr handler to ``recsys_trainer``,
  which steps aside by itself once the program adds a handler (no record is shown twice).

Other ranks keep Python's defaults (their warnings and errors still reach stderr).
``setup_logging(level)`` instead gives every rank its own stderr handler with time, level and
logger name (what ``recsys-train`` does). Neither touches the root logger.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "recsys_trainer"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _DefaultHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, for as long as no other handler would receive the project's records."""

    def emit(self, record: logging.LogRecord) -> None:
        # Checked per record, not once: the program may configure logging after the Trainer.
        if logging.getLogger().handlers or any(
                h is not self for h in logging.getLogger(LOGGER_NAME).handlers):
            return
        super().emit(record)


def default_logging(rank: int) -> None:
    """On rank 0, make the project's INFO records visible when the program has not decided
    otherwise (idempotent; see the module docstring)."""
    if rank != 0:
        return
    log = logging.getLogger(LOGGER_NAME)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.hasHandlers():  # ours already, setup_logging's, the root logger's
        handler = _DefaultHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        log.addHandler(handler)


def setup_logging(level: int = logging.INFO) -> None:
    """Log ``recsys_trainer`` messages at ``level`` to stderr on this rank, with time, level and
    logger name (idempotent). Without it, rank 0 already shows them when the program configures
    no logging of its own."""
    log = logging.getLogger(LOGGER_NAME)
    for h in [h for h in log.handlers if isinstance(h, _DefaultHandler)]:
        log.removeHandler(h)
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


__all__ = ["LOGGER_NAME", "default_logging", "setup_logging"]
