"""Where the project's INFO lines go by default (``recsys_trainer.logs``), in process.

The end-to-end check (a program that sets up no logging sees the loss and dynamic-table lines)
runs a fresh interpreter: tests/test_dynamic.py. Here: the case that one cannot produce after
importing torchrec (no handler anywhere), ranks other than 0, and a level the program chose.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

from recsys_trainer.logs import LOGGER_NAME, default_logging, setup_logging


@contextlib.contextmanager
def bare_logging() -> Iterator[logging.Logger]:
    """No handler on the root logger (pytest's, which it adds for each test's call phase, are
    removed) and a pristine project logger; all restored afterwards."""
    root, log = logging.getLogger(), logging.getLogger(LOGGER_NAME)
    saved = (root.handlers[:], log.handlers[:], log.level, log.propagate)
    root.handlers.clear()
    log.handlers.clear()
    log.setLevel(logging.NOTSET)
    try:
        yield log
    finally:
        root.handlers[:] = saved[0]
        log.handlers[:] = saved[1]
        log.setLevel(saved[2])
        log.propagate = saved[3]


def _stderr_of(log: logging.Logger) -> io.StringIO:
    out = io.StringIO()
    for h in log.handlers:
        assert isinstance(h, logging.StreamHandler)
        h.setStream(out)
    return out


def test_with_no_handler_anywhere_rank_0_prints_info_lines_until_the_program_adds_one() -> None:
    with bare_logging() as log:
        default_logging(0)
        default_logging(0)  # idempotent: one handler
        assert len(log.handlers) == 1 and log.level == logging.INFO
        out = _stderr_of(log)
        log.info("dynamic table t_u after window w0: ...")
        assert "INFO recsys_trainer: dynamic table t_u after window w0" in out.getvalue()
        # The program configures logging later: its handler shows the line, ours steps aside.
        program = io.StringIO()
        logging.basicConfig(stream=program, format="PROGRAM %(message)s")
        log.info("step 2 | loss 0.7")
        assert "step 2" not in out.getvalue()
        assert program.getvalue() == "PROGRAM step 2 | loss 0.7\n"


def test_other_ranks_and_a_level_the_program_set_are_left_alone() -> None:
    with bare_logging() as log:
        default_logging(1)
        assert log.handlers == [] and log.level == logging.NOTSET
        log.setLevel(logging.WARNING)
        default_logging(0)
        assert log.level == logging.WARNING


def test_setup_logging_replaces_the_default_handler_with_its_own() -> None:
    with bare_logging() as log:
        default_logging(0)
        setup_logging(logging.DEBUG)
        assert len(log.handlers) == 1 and log.level == logging.DEBUG and not log.propagate
        out = _stderr_of(log)
        log.debug("x")
        assert out.getvalue().endswith("DEBUG recsys_trainer: x\n")
