"""How often something periodic happens (logging, evaluation, saving): every N steps, rows,
windows or epochs.

A period in *rows* counts training rows of all ranks (``TrainerState.rows_seen``, agreed at
each batch fetch, so it is the same number on every rank even when ranks read uneven batches).
It falls due after the first step at which ``rows_seen`` reaches the next multiple of N, so
every rank acts after the same step; a step that crosses two multiples acts once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from recsys_trainer.validation import check_int

Unit = Literal["steps", "rows", "windows", "epochs"]


class Progress(Protocol):
    """The counters a period reads (``TrainerState`` has them)."""

    global_step: int
    rows_seen: int
    last_step_rows: int


@dataclass(frozen=True)
class Period:
    """Every ``every`` ``unit``."""

    every: int
    unit: Unit

    def due_after_step(self, progress: Progress) -> bool:
        """After an optimizer step (steps and rows periods)."""
        if self.unit == "steps":
            return progress.global_step % self.every == 0
        if self.unit == "rows":
            before = progress.rows_seen - progress.last_step_rows
            return progress.rows_seen // self.every > before // self.every
        return False

    def due_after_window(self, windows_done: int) -> bool:
        """After a train window (windows periods); ``windows_done`` counts from 1."""
        return self.unit == "windows" and windows_done % self.every == 0

    def due_after_epoch(self, epochs_done: int) -> bool:
        """After an epoch (epochs periods); ``epochs_done`` counts from 1."""
        return self.unit == "epochs" and epochs_done % self.every == 0


def report_due(every_steps: int | None, log_period: Period, progress: Progress) -> bool:
    """Whether a reporter reports after this step: every ``every_steps`` steps when it has its
    own ``every``, else on the run's log period (``TrainingArguments.log_period``)."""
    period = Period(every_steps, "steps") if every_steps else log_period
    return period.due_after_step(progress)


def one_period(what: str, fields: Mapping[str, tuple[int | None, Unit]]) -> Period | None:
    """The period given by at most one of ``fields`` (name -> (value, unit)); None if none is
    set. Raises ``ValueError`` naming the fields when a value is bad or more than one is set."""
    given = {}
    for name, (value, unit) in fields.items():
        check_int(name, value, allow_none=True)
        if value is not None:
            given[name] = Period(value, unit)
    if len(given) > 1:
        raise ValueError(
            f"the {what} period is given {len(given)} ways: "
            f"{', '.join(f'`{n}`={p.every}' for n, p in given.items())}; set only one of "
            f"{', '.join(f'`{n}`' for n in fields)}."
        )
    return next(iter(given.values()), None)


__all__ = ["Period", "Progress", "Unit", "one_period", "report_due"]
