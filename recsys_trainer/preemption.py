"""Preemption: SIGTERM / SIGINT while training becomes an agreed stop, a committed checkpoint and
a documented exit code.

Schedulers announce preemption with a signal and a grace period before SIGKILL: Kubernetes and
Slurm send SIGTERM (often 30 s before SIGKILL), torchrun's agent forwards the SIGTERM / SIGINT it
gets to every worker and SIGKILLs them ``--shutdown-timeout`` (30 s) later, Ctrl-C sends SIGINT.
While ``train()`` runs, ``PreemptionWatcher`` handles these signals in each rank; its handler
only records the signal and the time. The Trainer folds "a signal arrived" into the all-reduce
it already runs at every batch fetch (``data.sync``), so every rank stops after the same step,
saves that step's checkpoint and leaves ``train()`` with ``Preempted``: a ``SystemExit`` whose
code is ``128 + signal number`` (143 for SIGTERM, 130 for SIGINT), the status a shell or
Kubernetes reports for a process ended by that signal (Kubeflow's ``ExitCode`` restart policy
retries 128-255). The save must commit within ``TrainingArguments.preemption_grace_s`` of the
signal; if it cannot, the previous checkpoint stays, the error is logged and the process exits
at once with the same code.

A second signal within ``DUPLICATE_WINDOW_S`` of the first is the same preemption (Slurm signals
every process of a job and torchrun forwards its own copy). A later one acts at once as it would
without the Trainer (the handler installed before ``train()``: SIGTERM's default ends the
process, Python's SIGINT handler raises ``KeyboardInterrupt``): a checkpoint being written then
is never committed, and an uncommitted checkpoint is never loaded, so the previous one stays the
newest.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
"""The signals that mean "save and stop": what schedulers, torchrun's agent and Ctrl-C send."""

DUPLICATE_WINDOW_S = 2.0
"""A second signal this soon after the first is the same preemption, delivered twice."""


def exit_code(signum: int) -> int:
    """The exit status of a process ended by ``signum`` as a shell reports it: 128 + signum."""
    return 128 + int(signum)


@dataclass
class Preemption:
    """What a preemption did (``trainer.preemption``; the ``on_preempt`` hooks get it)."""

    signal: str
    """The signal's name, e.g. "SIGTERM" (of the rank that got it first, for every rank)."""
    step: int
    """The step every rank stopped after (the checkpoint's step)."""
    checkpoint: str | None = None
    """The checkpoint saved for it (None: the run saves no checkpoints, or the save failed)."""
    committed: bool = False
    """Whether that checkpoint committed within the grace period."""
    seconds_to_stop: float = 0.0
    """From the signal (on this rank; from the agreed stop on a rank that got none) to the
    agreed stop."""
    seconds_to_commit: float | None = None
    """From the signal to the commit."""
    error: str | None = None
    """Why no checkpoint was committed, when none was."""
    signalled_at: float | None = None
    """``time.monotonic()`` when this rank got the signal (when it agreed to stop, on a rank that
    got none): the grace period counts from it."""
    save_still_running: bool = False
    """The save missed the grace period and its writer thread still holds collectives: the
    process must end at once (an interpreter exit would wait for that thread)."""

    @property
    def exit_code(self) -> int:
        return exit_code(signal.Signals[self.signal])


class Preempted(SystemExit):
    """Raised by ``train()`` / ``train_and_evaluate()`` when a preemption signal stopped training,
    after its checkpoint was saved (``preemption.committed``; when the save missed the grace
    period the process ends instead, with the same code). A ``SystemExit`` with code
    ``128 + signal`` (143 for SIGTERM): unhandled, it ends the script with that status and no
    traceback, and ``except Exception`` does not swallow it."""

    def __init__(self, preemption: Preemption) -> None:
        super().__init__(preemption.exit_code)
        self.preemption = preemption

    def __str__(self) -> str:
        p = self.preemption
        saved = f"checkpoint {p.checkpoint} committed" if p.committed else \
            f"no checkpoint committed ({p.error})"
        return f"preempted by {p.signal} after step {p.step}: {saved}"


class PreemptionWatcher:
    """Handles ``PREEMPTION_SIGNALS`` while ``watching()``: the handler records the first signal
    and its time, nothing else; a later one (after ``DUPLICATE_WINDOW_S``) is handed to the
    handler that was there before (``kill``, for tests, replaces that). Outside ``watching()``
    the previous handlers are in place. Handlers can only be installed from the main thread;
    elsewhere ``watching()`` logs through ``warn`` and does nothing."""

    def __init__(self, *, kill: Callable[[int], None] | None = None) -> None:
        self.signum: int | None = None
        """The first signal received while watching (None: none yet)."""
        self.received_at: float | None = None
        """``time.monotonic()`` when it arrived."""
        self._kill = kill if kill is not None else self._as_before
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes; records and returns.
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()
        elif self.received_at is not None and time.monotonic() - self.received_at > DUPLICATE_WINDOW_S:
            self._kill(signum)

    def _as_before(self, signum: int) -> None:
        """Deliver ``signum`` again, to the handler there was before ``watching()``."""
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        os.kill(os.getpid(), signum)

    @contextmanager
    def watching(self, warn: Callable[[str], None] = lambda _msg: None) -> Iterator[None]:
        """Handle the signals inside the block; what was recorded is forgotten when it ends (a
        signal after the last step, which ended training normally, does not stop the next
        call)."""
        self.signum = self.received_at = None
        if threading.current_thread() is not threading.main_thread():
            warn("train() runs outside the main thread, where signal handlers cannot be "
                 "installed: SIGTERM/SIGINT stop the process without a checkpoint.")
            yield
            return
        self._previous = {s: signal.signal(s, self._handle) for s in PREEMPTION_SIGNALS}
        try:
            yield
        finally:
            for s, previous in self._previous.items():
                signal.signal(s, previous)
            self._previous = {}
            self.signum = self.received_at = None


def exit_now(code: int) -> None:
    """End the process with ``code`` at once (no interpreter exit, which would wait for threads
    still writing), after flushing the log handlers and standard streams."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


__all__ = ["DUPLICATE_WINDOW_S", "PREEMPTION_SIGNALS", "Preempted", "Preemption",
           "PreemptionWatcher", "exit_code", "exit_now"]
