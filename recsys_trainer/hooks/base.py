"""``Hook``: the base class for everything that watches or steers a run.

Every method is a no-op. Subclass and override the events you need; the Trainer works out once
which events each hook overrides, so an event no hook overrides costs nothing per step.
The event order is written out in ``Trainer``'s docstring and the README.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from recsys_trainer.batch import Batch

if TYPE_CHECKING:
    from recsys_trainer.preemption import Preemption
    from recsys_trainer.trainer import Trainer

logger = logging.getLogger(__name__)


@dataclass
class MicroBatchOutput:
    """One forward (and, in training, backward) pass.

    ``loss`` is the model's loss for this micro-batch (detached). ``outputs`` is the second
    element when the model's forward returns ``(loss, outputs)`` (e.g. logits), else None.
    """

    batch: Batch
    loss: torch.Tensor
    outputs: Any


@dataclass
class StepOutput:
    """What ``after_step``/``after_eval_step`` receive.

    In training one step is one optimizer step over ``gradient_accumulation_steps`` micro-batches
    (fewer at the end of a window); in evaluation one step is one batch. ``loss`` is the mean of
    the micro-batch losses, detached (reading it as a float is a device sync: do it every
    ``log_steps``, not every step).
    """

    step: int
    loss: torch.Tensor
    micro_batches: Sequence[MicroBatchOutput]
    is_padding: bool = False

    @property
    def num_samples(self) -> int:
        return sum(m.batch.batch_size for m in self.micro_batches)


@dataclass
class MetricReport:
    """What ``on_metrics`` receives: one set of metric values, identical on every rank.

    ``mode`` is "train" or "eval". ``scope`` says which rows the values cover: "interval" (train
    rows since the previous train report, every ``log_steps``), "window" (one data window) or
    "eval" (a whole evaluation pass). ``step`` is ``state.global_step`` when it was computed;
    ``window_id`` is set for "window" reports (``window_index`` counts them per mode).
    """

    mode: str
    scope: str
    step: int
    values: dict[str, float]
    window_id: str | None = None
    window_index: int | None = None


EVENTS: tuple[str, ...] = (
    "before_train",
    "after_train",
    "before_evaluate",
    "after_evaluate",
    "before_epoch",
    "after_epoch",
    "before_window",
    "after_window",
    "after_data",
    "out_of_data",
    "before_step",
    "after_step",
    "before_eval_step",
    "after_eval_step",
    "before_save_checkpoint",
    "after_save_checkpoint",
    "after_load_checkpoint",
    "on_metrics",
    "on_exception",
    "on_preempt",
    "end",
)


ResumePoint = Literal["step", "window", "epoch", "wait", "end", "preempt"]
"""Where ``on_resume_point`` fires: a checkpoint taken there resumes exactly."""

RESUME_POINT_EVENTS: tuple[str, ...] = ("on_resume_point",)
"""Events about the training position rather than the data, kept out of ``EVENTS`` (the
documented data order): they fire at the points a run can resume from. ``CheckpointHook`` saves
there."""


class Hook:
    """Base class: override any subset of the events below. All are no-ops here.

    Every event receives the ``Trainer``; read counters from ``trainer.state`` (``global_step``,
    ``epoch``, ``mode``, ``window_id``...). To stop a run, call ``trainer.request_stop(reason)``:
    the request is agreed across ranks at the next batch fetch, so every rank stops after the
    same step.
    """

    def before_train(self, trainer: Trainer) -> None:
        """Once, when ``train()`` (or ``train_and_evaluate()``) starts, before any data."""

    def after_train(self, trainer: Trainer) -> None:
        """Once, when training ends normally (limit reached, data exhausted, or stop agreed)."""

    def before_evaluate(self, trainer: Trainer) -> None:
        """At the start of each evaluation pass."""

    def after_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """At the end of each evaluation pass; ``metrics`` holds at least ``loss`` (averaged
        over all ranks' real rows) and ``num_samples``; hooks may add their own."""

    def before_epoch(self, trainer: Trainer, epoch: int) -> None:
        """Before each training epoch (a pass over all train windows)."""

    def after_epoch(self, trainer: Trainer, epoch: int) -> None:
        """After each training epoch that started."""

    def before_window(self, trainer: Trainer, window_id: str) -> None:
        """Before the first batch of a window; ``trainer.state.mode`` says train or eval."""

    def after_window(self, trainer: Trainer, window_id: str) -> None:
        """After a window ends (all ranks agreed it is exhausted, or a limit/stop cut it)."""

    def after_data(self, trainer: Trainer, batch: Batch) -> None:
        """After each batch is fetched (and moved to the device), before it is used."""

    def out_of_data(self, trainer: Trainer, window_id: str, rows_unread: int) -> None:
        """When all ranks agreed the current window is exhausted. In training, ranks that
        still had data drop it (``rows_unread`` counts this rank's rows left in the batch it
        fetched); in evaluation nothing is dropped (exhausted ranks pad instead), so it is 0."""

    def before_step(self, trainer: Trainer) -> None:
        """Before the first micro-batch of each optimizer step (``state.global_step`` is the
        number of steps done so far)."""

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        """After each optimizer step (``state.global_step`` already counts it)."""

    def before_eval_step(self, trainer: Trainer) -> None:
        """Before each evaluation batch's forward pass."""

    def after_eval_step(self, trainer: Trainer, output: StepOutput) -> None:
        """After each evaluation batch's forward pass; padding batches have ``is_padding``."""

    def before_save_checkpoint(self, trainer: Trainer, path: str) -> None:
        """Before a checkpoint snapshot is taken for ``path``."""

    def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
        """After the checkpoint at ``path`` is committed (for async saves: when it commits)."""

    def after_load_checkpoint(self, trainer: Trainer, path: str) -> None:
        """After the state was restored from ``path``."""

    def on_metrics(self, trainer: Trainer, report: MetricReport) -> None:
        """When a ``MetricReportHook`` has computed metrics (on every rank, same values); fired
        by that hook, so only runs that include one see it."""

    def on_resume_point(self, trainer: Trainer, point: ResumePoint) -> None:
        """When training reaches a point a checkpoint resumes from exactly: ``"step"`` after
        each step (after an evaluation due then), ``"window"`` once a train window is finished
        (after its evaluation; the position is the next window), ``"epoch"`` once an epoch is
        finished, ``"wait"`` while training waits for a stream's next window (at each of the
        stream's heartbeats, after every poll that found nothing new, which every rank reaches
        together; the position is the last point's: no step ran since), ``"end"``
        when training ends normally (before ``after_train``), ``"preempt"`` when every rank
        stopped for a preemption signal (``trainer.preemption``; before ``on_preempt``). Not in
        ``EVENTS``: see ``RESUME_POINT_EVENTS``."""

    def on_exception(self, trainer: Trainer, exc: BaseException) -> None:
        """When ``train``/``evaluate``/``train_and_evaluate`` raises; ``end`` still follows."""

    def on_preempt(self, trainer: Trainer, preemption: Preemption) -> None:
        """When a preemption signal (SIGTERM/SIGINT) stopped training on every rank after the
        same step, once that step's checkpoint was saved (or failed to be:
        ``preemption.committed``, ``preemption.error``). ``end`` follows, then ``train()``
        raises ``Preempted``. It runs inside the grace period before the launcher's SIGKILL:
        keep it short (flush, report), no collectives."""

    def end(self, trainer: Trainer) -> None:
        """Exactly once per top-level call (``train``, ``evaluate``, ``train_and_evaluate``),
        last, whether it ended normally or by an exception."""

    def in_smoke_test(self, directory: str) -> None:
        """Called once, when the Trainer is built in test mode (``args.smoke_test``): a hook that
        writes somewhere other than ``args.logging_dir`` (a serving location, a table) points
        itself under ``directory``, the smoke test's own, which is removed afterwards; the test
        mode must never touch what the real job writes. Default: nothing."""

    def handled_events(self) -> set[str] | None:
        """Which events this hook handles; None (the default) means: those its class overrides."""
        return None

    # -- state for checkpoints: hooks with state override both --
    def state_dict(self) -> dict[str, Any]:
        """State to save in checkpoints (e.g. early-stopping counters). Default: none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


_EVENT_PREFIXES = ("before_", "after_", "on_")
_ALL_EVENTS = EVENTS + RESUME_POINT_EVENTS


def check_event_names(hook: Hook) -> None:
    """Refuse a public method that reads like an event but is not one (``after_train_step``,
    ``on_step_end``): the Trainer would never call it, and the hook would silently do nothing."""
    for cls in type(hook).__mro__:
        if cls is Hook or not issubclass(cls, Hook):
            continue
        for name, value in vars(cls).items():
            if callable(value) and name.startswith(_EVENT_PREFIXES) and name not in _ALL_EVENTS:
                close = difflib.get_close_matches(name, EVENTS, n=3, cutoff=0.6)
                hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
                raise TypeError(
                    f"hook {type(hook).__name__} defines {name}(), which is not a Trainer event, "
                    f"so it would never be called.{hint} The events are: {', '.join(EVENTS)}. "
                    "A helper method of the hook can keep its name with a leading underscore."
                )


def overridden_events(hook: Hook) -> set[str]:
    """The events ``hook`` handles (so the dispatcher can skip the rest for free): those its
    class overrides, or what the hook's ``handled_events()`` says (e.g. ``LambdaHook``)."""
    declared = hook.handled_events()
    if declared is not None:
        return set(declared)
    cls = type(hook)
    return {e for e in _ALL_EVENTS if getattr(cls, e) is not getattr(Hook, e)}


class HookList:
    """Calls hooks in list order, each only for the events it overrides.

    Hooks given as ``last`` stay after every hook added later (the Trainer's ``CheckpointHook``:
    it must see what the others did first).

    Also the hooks' part of a checkpoint (a ``Stateful``): each hook with state is saved under
    ``ClassName#k`` (the k-th hook of that class), a key that stays the same when stateless
    hooks are added or removed.
    """

    def __init__(self, hooks: Sequence[Hook] = (), last: Sequence[Hook] = ()) -> None:
        self._hooks: list[Hook] = []
        self._last: list[Hook] = []
        for h in hooks:
            self.add(h)
        for h in last:
            self._check(h)
            self._last.append(h)
        self._index()

    @staticmethod
    def _check(hook: Hook) -> None:
        if not isinstance(hook, Hook):
            raise TypeError(f"hooks must be recsys_trainer.Hook instances, got {type(hook).__name__}.")
        check_event_names(hook)

    def _index(self) -> None:
        self._by_event: dict[str, list[Hook]] = {e: [] for e in _ALL_EVENTS}
        for h in self._hooks + self._last:
            for e in overridden_events(h):
                self._by_event[e].append(h)

    def set_last(self, hooks: Sequence[Hook]) -> None:
        """Make ``hooks`` the ``last`` hooks (replacing those there were)."""
        for h in hooks:
            self._check(h)
        self._last = list(hooks)
        self._index()

    def add(self, hook: Hook) -> None:
        """Append ``hook`` (before the ``last`` hooks)."""
        self._check(hook)
        self._hooks.append(hook)
        self._index()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._hooks + self._last)

    def __len__(self) -> int:
        return len(self._hooks) + len(self._last)

    def has(self, event: str) -> bool:
        return bool(self._by_event[event])

    def fire(self, event: str, *args: Any) -> None:
        for h in self._by_event[event]:
            getattr(h, event)(*args)

    def _keyed(self) -> list[tuple[str, Hook]]:
        seen: dict[str, int] = {}
        out = []
        for h in self._hooks + self._last:
            name = type(h).__qualname__
            out.append((f"{name}#{seen.get(name, 0)}", h))
            seen[name] = seen.get(name, 0) + 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"ClassName#k": state}`` of every hook whose ``state_dict()`` is not empty."""
        out = {}
        for key, h in self._keyed():
            s = h.state_dict()
            if s:
                out[key] = s
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give each hook its saved state; state of hooks this list lacks is logged, not an
        error (a run may drop a hook)."""
        remaining = dict(state_dict)
        for key, h in self._keyed():
            if key in remaining:
                h.load_state_dict(remaining.pop(key))
        if remaining:
            logger.warning("checkpoint holds state for hooks this trainer does not have: %s",
                           sorted(remaining))
