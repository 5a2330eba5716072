"""The one "is it due" rule for everything periodic: logging, evaluation, saving, publishing.

A ``Period`` is every N ``steps``, ``rows``, ``windows``, ``epochs``, ``seconds`` or
``event_seconds``; a
``Trigger`` is any of several periods, kept by the component that acts on it (the
``CheckpointHook``'s saves, the ``PublishHook``'s publishes). The rule:

* **Counted units** (steps, rows, windows, epochs) count something that only grows and is the
  same on every rank: ``global_step``; ``rows_seen`` (training rows of all ranks, agreed at each
  batch fetch, so the same even when ranks read uneven batches); the train windows or epochs
  finished. Such a period falls due at the point where its count reaches the next multiple of N;
  a count that jumps past several multiples at once (a step of many rows) falls due once. The
  counts survive a resume, so a resumed run acts at the same counts as one never stopped.
* **Seconds** fall due at the first point N seconds after the trigger last fell due (or was
  made). Clocks differ between ranks, so the ranks agree at that point, which they all reach
  together, in one one-int all-reduce: due when any rank's clock says so. A period in seconds
  never acts on one rank's timer.

Where each unit is checked (``Trigger.due``'s ``point``, the Trainer's resume points): steps,
rows and seconds after a step; windows, event seconds and seconds after a train window; epochs
after an epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from recsys_trainer.validation import check_int, check_number

if TYPE_CHECKING:
    from recsys_trainer.distributed import Gang

Unit = Literal["steps", "rows", "windows", "epochs", "seconds", "event_seconds"]

Point = Literal["step", "window", "epoch"]
"""Where a trigger is asked (``on_resume_point``'s points that move the counts)."""

_CHECKED_AT: dict[Point, tuple[Unit, ...]] = {
    "step": ("steps", "rows", "seconds"),
    "window": ("windows", "event_seconds", "seconds"),
    "epoch": ("epochs",),
}


class Progress(Protocol):
    """The counters a period reads (``TrainerState`` has them)."""

    global_step: int
    rows_seen: int
    last_step_rows: int
    windows_done: int
    epoch: int
    event_time_s: float
    last_window_event_s: float


@dataclass(frozen=True)
class Period:
    """Every ``every`` ``unit`` (see the module docstring for when that is)."""

    every: float
    unit: Unit

    def crossed(self, before: float, after: float) -> bool:
        """The rule for a count: whether it moved from ``before`` to ``after`` past a multiple
        of ``every`` (once, however many it passed; a count of 0 has reached none)."""
        return after > 0 and after // self.every > before // self.every

    def due_after_step(self, progress: Progress) -> bool:
        """After an optimizer step (steps and rows periods)."""
        if self.unit == "steps":
            return self.crossed(progress.global_step - 1, progress.global_step)
        if self.unit == "rows":
            return self.crossed(progress.rows_seen - progress.last_step_rows, progress.rows_seen)
        return False

    def due_after_window(self, windows_done: int) -> bool:
        """After a train window (windows periods); ``windows_done`` counts from 1."""
        return self.unit == "windows" and self.crossed(windows_done - 1, windows_done)

    def due_in_event_time(self, progress: Progress) -> bool:
        """After a train window of an event-time source (``event_seconds`` periods): whether the
        event time trained through crossed a multiple of ``every`` seconds (of Unix time) with
        this window."""
        return self.unit == "event_seconds" and self.crossed(
            progress.event_time_s - progress.last_window_event_s, progress.event_time_s)

    def due_after_epoch(self, epochs_done: int) -> bool:
        """After an epoch (epochs periods); ``epochs_done`` counts from 1."""
        return self.unit == "epochs" and self.crossed(epochs_done - 1, epochs_done)


def check_period(name: str, value: float | None, unit: Unit) -> Period | None:
    """``Period(value, unit)`` for the field ``name``, None when unset; a ``ValueError`` naming
    the field when the value is not a count >= 1 (counted units) or a number > 0 (seconds)."""
    if unit in ("seconds", "event_seconds"):
        check_number(name, value, above=0, allow_none=True)
    else:
        check_int(name, value, allow_none=True)
    return None if value is None else Period(value, unit)


class Trigger:
    """Due when any of ``periods`` is (the rule of the module docstring).

    Args:
        periods: the periods (None entries, unset fields, are left out).
        clock: the seconds periods' clock (default ``time.monotonic``).
    """

    def __init__(self, periods: Iterable[Period | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.periods: tuple[Period, ...] = tuple(p for p in periods if p is not None)
        self._clock = clock
        self._since = clock()

    @classmethod
    def of(cls, fields: Mapping[str, tuple[float | None, Unit]],
           clock: Callable[[], float] = time.monotonic) -> Trigger:
        """A trigger of the periods given by ``fields`` (name -> (value, unit)), each checked
        by name (``check_period``)."""
        return cls((check_period(name, value, unit) for name, (value, unit) in fields.items()),
                   clock)

    def __bool__(self) -> bool:
        return bool(self.periods)

    def due(self, point: Point, progress: Progress, *, gang: Gang | None = None) -> bool:
        """Whether a period is due at ``point``: after a step, a train window or an epoch, by
        ``progress``'s counters (a run's: ``windows_done``, ``epoch`` and ``event_time_s``
        count the windows, epochs and event time finished, so a resumed run acts after the same
        ones). With a seconds period and
        a ``gang`` of several ranks, every rank must ask at the same point (the agreement is a
        collective there). Falling due restarts the seconds clock."""
        units = _CHECKED_AT[point]
        due = any(
            p.due_after_step(progress) if point == "step"
            else (p.due_after_window(progress.windows_done) or p.due_in_event_time(progress))
            if point == "window"
            else p.due_after_epoch(progress.epoch)
            for p in self.periods if p.unit in units)
        seconds = [p for p in self.periods if p.unit == "seconds"] if "seconds" in units else []
        # Counted periods are due on every rank alike, so skipping the agreement when one is due
        # keeps the ranks' collectives matched.
        if not due and seconds:
            elapsed = self._clock() - self._since
            due = any(elapsed >= p.every for p in seconds)
            if gang is not None and gang.world_size > 1:
                due = bool(gang.all_reduce_max([int(due)])[0])
        if due:
            self.restart_clock()
        return due

    def restart_clock(self) -> None:
        """Count the seconds periods from now (the owner acted for another reason too)."""
        self._since = self._clock()


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
        period = check_period(name, value, unit)
        if period is not None:
            given[name] = period
    if len(given) > 1:
        raise ValueError(
            f"the {what} period is given {len(given)} ways: "
            f"{', '.join(f'`{n}`={p.every}' for n, p in given.items())}; set only one of "
            f"{', '.join(f'`{n}`' for n in fields)}."
        )
    return next(iter(given.values()), None)


__all__ = ["Period", "Point", "Progress", "Trigger", "Unit", "check_period", "one_period",
           "report_due"]
