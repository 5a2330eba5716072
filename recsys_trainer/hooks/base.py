"""``Hook``: the base class for everything that watches or steers a run.

Every method is a no-op. Subclass and override the events you need; the Trainer works out once
which events each hook overrides, so an event no hook overrides costs nothing per step.
The event order is written out in ``Trainer``'s docstring and docs/hooks.md.

Every event receives the Trainer as a ``TrainerView``: the members a hook may use, written down
here so that hooks never import the Trainer (which imports the default hooks to build itself).
``Trainer`` implements it; ``recsys_trainer.trainer`` has mypy check that it still does.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch

from recsys_trainer.batch import Batch

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import nn

    from recsys_trainer.args import TrainingArguments
    from recsys_trainer.data.base import WindowedDataset
    from recsys_trainer.distributed import Gang
    from recsys_trainer.preemption import Preemption
    from recsys_trainer.step import NonFiniteGuard, StepTimings
    from recsys_trainer.trainer_state import TrainerState

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


@dataclass
class SaveRequest:
    """A hook's request for a checkpoint of the current step (``TrainerView.request_save``),
    which the ``CheckpointHook`` fills in.

    ``path`` is the directory the checkpoint of ``step`` is committed to. ``committed`` is True
    once it is: at once when it was committed before the request (no ``after_save_checkpoint``
    follows), else when its ``after_save_checkpoint`` fires (every hook sees that event; the
    request is marked first). ``blocked_s``: how long the save blocked the loop (the snapshot of
    an asynchronous save, the whole write of a blocking one), set when it is saved."""

    reason: str
    step: int
    path: str
    committed: bool = False
    blocked_s: float = 0.0


ResumePoint = Literal["step", "window", "epoch", "wait", "end", "preempt"]
"""Where ``on_resume_point`` fires: a checkpoint taken there resumes exactly."""

RESUME_POINT_EVENTS: tuple[str, ...] = ("on_resume_point",)
"""Events about the training position rather than the data, kept out of ``EVENTS`` (the
documented data order): they fire at the points a run can resume from. ``CheckpointHook`` saves
there."""


class TrainerView(Protocol):
    """What a hook may use of the Trainer: every event receives one. ``Trainer`` implements it.

    All members are read-only here (a hook may change what they hold, e.g. ``state``'s counters
    or ``preemption``'s fields, but never rebind them). Anything else on the Trainer (its
    optimizers, the loop's internals) is outside the contract.
    """

    @property
    def state(self) -> TrainerState:
        """The counters: ``global_step``, ``epoch``, ``mode``, ``window_id``, ``rows_seen``..."""

    @property
    def args(self) -> TrainingArguments:
        """The run's settings (in test mode, the smoke test's)."""

    @property
    def rank(self) -> int:
        """This process's rank in the job."""

    @property
    def world_size(self) -> int:
        """How many ranks train together."""

    @property
    def is_rank_zero(self) -> bool:
        """Whether this is rank 0 (the one that logs and writes shared files)."""

    @property
    def gang(self) -> Gang:
        """The control collectives (small host-side all-reduces and object gathers)."""

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the model's tensor collectives run on (metric syncs); None: the default."""

    @property
    def device(self) -> torch.device:
        """The model's device (where batches are when a hook sees them)."""

    @property
    def model(self) -> nn.Module:
        """The model being trained, as sharded (a TorchRec ``DistributedModelParallel``)."""

    @property
    def accelerator(self) -> Any:
        """The ``accelerate.Accelerator`` behind mixed precision (``.scaler``: the fp16 scale)."""

    @property
    def train_dataset(self) -> WindowedDataset | None:
        """The training data (``features``: its ``FeatureSpec``); None when not given."""

    @property
    def eval_dataset(self) -> WindowedDataset | None:
        """The evaluation data; None when not given."""

    @property
    def hooks(self) -> HookList:
        """Every hook of the run, in order (``fire`` an event such as ``on_metrics`` on all)."""

    @property
    def timings(self) -> StepTimings:
        """Where the last training step's wall time went (read it in ``after_step``)."""

    @property
    def non_finite(self) -> NonFiniteGuard:
        """The non-finite-loss policy (``args.non_finite_loss``) and its skip count."""

    @property
    def preemption(self) -> Preemption | None:
        """What the preemption that stopped training did; None when none did."""

    @property
    def stop_signalled(self) -> bool:
        """Whether a stop signal (SIGTERM/SIGINT) reached this rank and the ranks have not yet
        agreed to stop: a hook that blocks (a wait while the stream waits) gives way to it."""

    def request_stop(self, reason: str = "requested by a hook") -> None:
        """Stop training after the current step, on every rank (agreed at the next fetch)."""

    def request_save(self, reason: str) -> SaveRequest:
        """Ask for a checkpoint of the current step, from ``on_resume_point`` on every rank (the
        save is collective): the ``CheckpointHook`` saves it at the end of that resume point,
        with its own periods' save (one save however many ask; a no-op when the step is saved
        already), blocking at ``"end"``, asynchronous elsewhere when ``async_save``; at
        ``"preempt"`` the preemption's save serves it. The returned request says where the
        checkpoint goes and when it has committed."""

    def dense_lr(self) -> float:
        """The dense optimizer's current learning rate."""

    def sparse_lr(self) -> float | None:
        """The tables' current lr when they all share one, else None (see ``sparse_lrs``)."""

    def sparse_lrs(self) -> dict[str, float]:
        """``{table: lr}``: each embedding table's configured learning rate."""


class Hook:
    """Base class: override any subset of the events below. All are no-ops here.

    Every event receives the Trainer as a ``TrainerView`` (what a hook may use); read counters
    from ``trainer.state`` (``global_step``, ``epoch``, ``mode``, ``window_id``...). To stop a
    run, call ``trainer.request_stop(reason)``: the request is agreed across ranks at the next
    batch fetch, so every rank stops after the same step.
    """

    requests_saves: ClassVar[bool] = False
    """True for a hook that asks for checkpoints (``trainer.request_save``): a run with one
    saves as a run with a save trigger in ``args`` does, even without one: it holds
    ``output_dir``'s lock, prepares the staging buffers before the loop, and saves the stopped
    step at a preemption."""

    def before_train(self, trainer: TrainerView) -> None:
        """Once, when ``train()`` (or ``train_and_evaluate()``) starts, before any data."""

    def after_train(self, trainer: TrainerView) -> None:
        """Once, when training ends normally (limit reached, data exhausted, or stop agreed)."""

    def before_evaluate(self, trainer: TrainerView) -> None:
        """At the start of each evaluation pass."""

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        """At the end of each evaluation pass; ``metrics`` holds at least ``loss`` (averaged
        over all ranks' real rows) and ``num_samples``; hooks may add their own."""

    def before_epoch(self, trainer: TrainerView, epoch: int) -> None:
        """Before each training epoch (a pass over all train windows)."""

    def after_epoch(self, trainer: TrainerView, epoch: int) -> None:
        """After each training epoch that started."""

    def before_window(self, trainer: TrainerView, window_id: str) -> None:
        """Before the first batch of a window; ``trainer.state.mode`` says train or eval."""

    def after_window(self, trainer: TrainerView, window_id: str) -> None:
        """After a window ends (all ranks agreed it is exhausted, or a limit/stop cut it)."""

    def after_data(self, trainer: TrainerView, batch: Batch) -> None:
        """After each batch is fetched (and moved to the device), before it is used."""

    def out_of_data(self, trainer: TrainerView, window_id: str, rows_unread: int) -> None:
        """When all ranks agreed the current window is exhausted. In training, ranks that
        still had data drop it (``rows_unread`` counts this rank's rows left in the batch it
        fetched); in evaluation nothing is dropped (exhausted ranks pad instead), so it is 0."""

    def before_step(self, trainer: TrainerView) -> None:
        """Before the first micro-batch of each optimizer step (``state.global_step`` is the
        number of steps done so far)."""

    def after_step(self, trainer: TrainerView, output: StepOutput) -> None:
        """After each optimizer step (``state.global_step`` already counts it)."""

    def before_eval_step(self, trainer: TrainerView) -> None:
        """Before each evaluation batch's forward pass."""

    def after_eval_step(self, trainer: TrainerView, output: StepOutput) -> None:
        """After each evaluation batch's forward pass; padding batches have ``is_padding``."""

    def before_save_checkpoint(self, trainer: TrainerView, path: str) -> None:
        """Before a checkpoint snapshot is taken for ``path``."""

    def after_save_checkpoint(self, trainer: TrainerView, path: str) -> None:
        """After the checkpoint at ``path`` is committed (for async saves: when it commits)."""

    def after_load_checkpoint(self, trainer: TrainerView, path: str) -> None:
        """After the state was restored from ``path``."""

    def on_metrics(self, trainer: TrainerView, report: MetricReport) -> None:
        """When a ``MetricReportHook`` has computed metrics (on every rank, same values); fired
        by that hook, so only runs that include one see it."""

    def on_resume_point(self, trainer: TrainerView, point: ResumePoint) -> None:
        """When training reaches a point a checkpoint resumes from exactly: ``"step"`` after
        each step (after an evaluation due then), ``"window"`` once a train window is finished
        (after its evaluation; the position is the next window), ``"epoch"`` once an epoch is
        finished, ``"wait"`` while training waits for a stream's next window (at each of the
        stream's heartbeats, after every poll that found nothing new, which every rank reaches
        together; the position is the last point's: no step ran since), ``"end"``
        when training ends normally (before ``after_train``), ``"preempt"`` when every rank
        stopped for a preemption signal (``trainer.preemption``; before ``on_preempt``). Not in
        ``EVENTS``: see ``RESUME_POINT_EVENTS``."""

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        """When ``train``/``evaluate``/``train_and_evaluate`` raises; ``end`` still follows."""

    def on_preempt(self, trainer: TrainerView, preemption: Preemption) -> None:
        """When a preemption signal (SIGTERM/SIGINT) stopped training on every rank after the
        same step, once that step's checkpoint was saved (or failed to be:
        ``preemption.committed``, ``preemption.error``). ``end`` follows, then ``train()``
        raises ``Preempted``. It runs inside the grace period before the launcher's SIGKILL:
        keep it short (flush, report), no collectives."""

    def end(self, trainer: TrainerView) -> None:
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
