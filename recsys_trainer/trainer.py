"""The Trainer: a hook-list training loop over sharded sparse and DDP dense parameters.

(Longer than 600 lines on purpose: the event order below is this file's code read top to bottom,
the entry points, the loop, the step and the evaluation pass; what they use is built in
``builder.py``, decided in ``eval_schedule.py`` and ``hooks/checkpoint.py``, and run in
``step.py`` and ``pipeline.py``.)

Event order (every event fires exactly as written; ``end`` once per top-level call)::

    train():
        before_train
        for epoch in epochs (until train_epoch, train_steps or an agreed stop):
            before_epoch(epoch)
            for window in train windows (at most window_iter):
                [a stream waits for it, after a window of this call: on_resume_point("wait")
                 at each of its heartbeats, on every rank]   # CheckpointHook: commits the save
                before_window(window_id)
                loop:
                    batch = next()                   # one all-reduce: out of data / stop agreed
                    if all ranks agreed to stop: out_of_data(window_id, rows_unread) if data ran out; break
                    before_step
                    for each micro-batch (gradient_accumulation_steps, fewer at a window's end):
                        after_data(batch)
                        forward, backward            # fused sparse update happens here
                    dense optimizer step, lr scheduler step, global_step += 1
                    after_step(output)
                    [train_and_evaluate with eval_every_n_steps/_rows: evaluate, if due]
                    on_resume_point("step")          # CheckpointHook: step and row triggers
                    if global_step == train_steps: break all
                after_window(window_id)
                [train_and_evaluate with windowed eval: evaluate eval window i (see below)]
                on_resume_point("window")            # unless training ended in this window
            after_epoch(epoch)
            [train_and_evaluate with unwindowed eval: evaluate]
            on_resume_point("epoch")                 # unless training ended in this epoch
        on_resume_point("end")                       # CheckpointHook: save_end, wait for the save
        after_train
        end

    Evaluation is decided by ``EvalSchedule`` (``recsys_trainer.eval_schedule``); saving by the
    ``CheckpointHook`` (``recsys_trainer.hooks.checkpoint``), the last hook, at the resume points
    (``on_resume_point`` is not in ``hooks.EVENTS``: see docs/hooks.md). Components are built
    once by ``recsys_trainer.builder`` on one ``Placement``.

    evaluate():
        before_evaluate
        for window in eval windows:
            before_window(window_id)
            for batch (exhausted ranks pad with zero-weight batches until all are done):
                after_data(batch); before_eval_step; forward; after_eval_step(output)
            out_of_data(window_id, 0); after_window(window_id)
        after_evaluate(metrics)
        end                                           # only when evaluate() is the top-level call

    predict(dataset, output_dir):                     # recsys_trainer.predict: no hook events
        for window: skip if committed; score every row; each rank writes its file; commit marker
        end

On an exception: on_exception(exc), then end, then the exception propagates.

On a preemption signal (SIGTERM/SIGINT while training, ``recsys_trainer.preemption``): the next
batch fetch (training or evaluation) stops every rank, after the same step; an evaluation it
interrupts is abandoned (a window's is redone on resume). Then the checkpoint of that step
(on_resume_point("preempt"): within args.preemption_grace_s of the signal), on_preempt(preemption), end, and ``Preempted``
(a SystemExit with code 128 + signal) propagates; no after_window/after_epoch/after_train.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from recsys_trainer import dynamic
from recsys_trainer.batch import Batch
from recsys_trainer.builder import TrainerParts, build_trainer_parts, takes_arguments_of
from recsys_trainer.checkpoint.contents import RestoreMode
from recsys_trainer.data.base import (
    Lookahead,
    WindowedDataset,
    as_windowed,
    nothing_to_train_error,
)
from recsys_trainer.data.sync import SyncedIterator, SyncState
from recsys_trainer.data.windows import WaitInterrupted
from recsys_trainer.distributed import Gang, peer_lost_error
from recsys_trainer.eval_schedule import EvalPlan, EvalSchedule
from recsys_trainer.hooks.base import (
    Hook,
    MicroBatchOutput,
    SaveRequest,
    StepOutput,
    TrainerView,
)
from recsys_trainer.hooks.checkpoint import CheckpointHook
from recsys_trainer.pipeline import SparseDistPipeline
from recsys_trainer.predict import Activation, PredictOptions, PredictSummary, predict
from recsys_trainer.preemption import Preempted, Preemption, PreemptionWatcher, exit_now
from recsys_trainer.rng import RNGState
from recsys_trainer.sharding import dense_no_sync
from recsys_trainer.smoke import Runs
from recsys_trainer.step import NonFiniteGuard, split_output
from recsys_trainer.trainer_state import TrainerState

logger = logging.getLogger("recsys_trainer")


class _PreemptionStop(Exception):
    """Every rank agreed, at a batch fetch, that a preemption signal arrived (internal)."""


@dataclass
class _EvalTotals:
    """What one evaluation pass counted on this rank (summed across ranks at its end)."""

    loss_sum: float = 0.0
    """The batches' mean losses, each times its rows with weight > 0."""
    rows: int = 0
    steps: int = 0
    """Batches evaluated, padding included (``eval_steps`` counts them)."""


@dataclass
class _Walked:
    """What one ``train()`` call walked, to tell "nothing to train" from "nothing left"."""

    start_step: int
    epochs: int = 0
    listed: int = 0
    entered: int = 0


class Trainer:
    """Trains a model whose embedding tables are sharded by TorchRec and whose dense part is DDP.

    Args:
        model: an *unsharded* ``nn.Module`` with torchrec ``EmbeddingBagCollection``s (tables
            may be on the meta device) whose ``forward(batch: Batch)`` returns the loss, or
            ``(loss, outputs)``; ``outputs`` (e.g. logits) reaches hooks as
            ``StepOutput.micro_batches[i].outputs``. Losses should honour ``batch.weights``.
        args: ``TrainingArguments``.
        train_dataset / eval_dataset: a ``WindowedDataset`` or any re-iterable of ``Batch``
            (then: one window, not sharded — give each rank its own data).
        hooks: run in list order. A ``LoggerHook`` is added unless one is given or
            ``add_logger_hook=False``.
        dense_optimizers: ``(optimizer or factory params->optimizer, scheduler or factory
            optimizer->scheduler or None)``. The factory form is preferred: the Trainer hands it
            exactly the parameters without an in-backward optimizer.
        sparse_optimizer: the fused optimizer for the embedding tables (default
            ``SparseOptimizer()``, row-wise Adagrad).
        table_optimizers: ``{table name or fnmatch glob: SparseOptimizer}``: another fused
            optimizer / lr for the tables a key matches (an exact name wins over patterns, then
            the first matching pattern); ``sparse_optimizer`` serves the rest. A key that
            matches no table is an error.
        checkpointer: saves, rotates and restores checkpoints; by default
            ``CheckpointManager.from_args(args)``. It gets ``state_components()``.
        gang: the control collectives (tests pass a ``FakeGang``); by default a gloo group.
        placement: where this rank trains (``recsys_trainer.placement.place``), when the caller
            started the job already; by default the constructor calls ``place(args)``.

    The constructor builds every component once through ``recsys_trainer.builder`` (the process
    group via accelerate under torchrun, or a world-size-1 gloo group in a plain process; the
    sharded model; both optimizers) and wires them together. ``Trainer.from_parts`` takes
    components built by ``build_trainer_parts`` instead.
    """

    @takes_arguments_of(build_trainer_parts)  # the Args above: written once, on the builder
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._wire(build_trainer_parts(*args, **kwargs))

    @classmethod
    def from_parts(cls, parts: TrainerParts) -> Trainer:
        """A Trainer over components ``build_trainer_parts`` built (each is used as is)."""
        trainer = cls.__new__(cls)
        trainer._wire(parts)
        return trainer

    def _wire(self, parts: TrainerParts) -> None:
        """Take the built components and connect them (no component is built here). Kept: what
        ``hooks.base.TrainerView`` names (what hooks read), what the loop uses, and what users
        read (``placement``, ``optimizer``, ``lr_scheduler``, ``dense_params``...)."""
        self.args = parts.args
        self.placement = parts.placement
        self.device = parts.placement.device
        self.rank, self.world_size = parts.placement.rank, parts.placement.world_size
        self.gang: Gang = parts.placement.gang
        self.process_group: dist.ProcessGroup | None = parts.placement.process_group
        """The group the model's tensor collectives run on (sharding, DDP, metric sync); control
        decisions run on ``gang``."""
        self.model = parts.model
        self.precision = parts.precision
        self.table_optimizers = parts.table_optimizers
        """``{table: SparseOptimizer}``: the fused optimizer each embedding table trains with."""
        self.optimizer = parts.optimizer
        self.lr_scheduler = parts.lr_scheduler
        self.dense_params = parts.dense_params
        self.train_dataset: WindowedDataset | None = parts.train_dataset
        self.eval_dataset: WindowedDataset | None = parts.eval_dataset
        self.vocabularies = parts.vocabularies
        """The vocabularies the datasets' id features map through: built from the data when
        training starts (``VocabFromData``), restored on resume; a checkpoint component."""
        self.hooks = parts.hooks
        self.checkpointer = parts.checkpointer
        # Saving is this hook, bound to the manager the Trainer uses (a replaced
        # parts.checkpointer too), after every other hook, also those added later; it makes
        # every save (its periods' and those hooks ask for) and fires the manager's events.
        self._saving = CheckpointHook(self.checkpointer, self)
        self.hooks.set_last([self._saving])
        self.non_finite: NonFiniteGuard = parts.non_finite
        """The non-finite-loss policy (``args.non_finite_loss``) and its skip count."""
        self.timings = parts.timings
        """Wall-time breakdown of the last training step (read it in ``after_step``)."""
        self._batch_check = parts.batch_check
        """Checks batches no FeatureSpec decoded (ids inside their tables, features present)."""
        self._dense_step = parts.dense_step
        self._dynamic_steps = dynamic.StepBoundaries(self.model)  # step and window ends
        self.state = TrainerState()
        self._pipeline: SparseDistPipeline | None = None
        self._stop_local = False
        self._non_finite_local = False
        self._preemption_watcher = PreemptionWatcher()
        for ds in (d for d in (self.train_dataset, self.eval_dataset) if d is not None):
            ds.set_stop_check(lambda: self._preemption_watcher.requested)  # ends a stream's wait
            ds.set_wait_hook(self._stream_waits)
        self._exit_now = False
        self.preemption: Preemption | None = None
        """What the last preemption did (``recsys_trainer.preemption``); None: none."""
        self._depth = 0
        self._train_it: SyncedIterator | None = None
        self._schedule = EvalSchedule(None, None, enabled=False)
        self.smoke = parts.smoke
        """With ``args.smoke_test``: the smoke test that ``train``/``evaluate``/``predict`` run
        instead (``recsys_trainer.smoke``); None otherwise."""
        self.checkpointer.attach(self.state_components(), run_args=self.args.to_jsonable(),
                                 listener=self._saving.relay)

    @functools.cached_property
    def _runs(self) -> Runs:
        """What the entry points run: the job itself, or in test mode the smoke test around it
        (made on the first call, so that building a Trainer never enters ``smoke``)."""
        direct = _DirectRuns(self)
        return self.smoke.around(self, direct) if self.smoke is not None else direct

    # ------------------------------------------------------------------ public API

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def stop_signalled(self) -> bool:
        """Whether a stop signal reached this rank, not yet acted on (``TrainerView``)."""
        return self._preemption_watcher.requested

    @property
    def accelerator(self) -> Any:
        """The ``accelerate.Accelerator`` behind ``precision`` (autocast, scaler)."""
        return self.precision.accelerator

    def add_hook(self, hook: Hook) -> None:
        """Append a hook (runs after those already added)."""
        self.hooks.add(hook)

    def add_hooks(self, hooks: Sequence[Hook]) -> None:
        for h in hooks:
            self.add_hook(h)

    def request_stop(self, reason: str = "requested by a hook") -> None:
        """Ask to stop training. Agreed across ranks at the next batch fetch, so every rank stops
        after the same step (the current step completes)."""
        self._stop_local = True
        if self.state.stop_reason is None:
            self.state.stop_reason = reason

    def request_save(self, reason: str) -> SaveRequest:
        """Ask for a checkpoint of the current step (``TrainerView.request_save``): the
        ``CheckpointHook`` saves it at the end of this resume point."""
        return self._saving.request(reason)

    def report_non_finite_loss(self) -> None:
        """Flag this rank's loss as non-finite: like ``request_stop``, every rank stops after the
        same step (agreed at the next batch fetch), with stop reason "non-finite loss"."""
        self._non_finite_local = True

    def dense_lr(self) -> float:
        return self.optimizer.dense_lr()

    def sparse_lr(self) -> float | None:
        """The sparse lr when every table has the same one (FBGEMM's value, read from the live
        fused optimizer), else None: then see ``sparse_lrs()``."""
        if len({o.lr for o in self.table_optimizers.values()}) > 1:
            return None
        return self.optimizer.sparse_lr()

    def sparse_lrs(self) -> dict[str, float]:
        """``{table: lr}``: the configured lr of every embedding table's fused optimizer
        (``table_optimizers``). FBGEMM keeps it for the run unless an
        ``optimizers.SparseLRSchedule`` rewrites it each step; then these are the schedule's base
        lrs, not the current ones: ``sparse_lr()`` and ``optimizer.sparse_lrs()`` read the live
        fused groups."""
        return {t: o.lr for t, o in self.table_optimizers.items()}

    def state_components(self) -> dict[str, Stateful]:
        """Everything a checkpoint holds, as named ``Stateful`` components (what each is:
        ``recsys_trainer.checkpoint.contents``). The objects are the live ones; the checkpointer
        gets this mapping once, when the Trainer is built."""
        comps: dict[str, Stateful] = {
            "model": self.model,
            "dense_optimizer": self.optimizer.dense_state,
            "sparse_optimizer": self.optimizer.sparse_state,
            "trainer_state": self.state,
            "rng": RNGState(),
            "hooks": self.hooks,
            "non_finite": self.non_finite,
            "vocabularies": self.vocabularies,
        }
        optional = {"lr_scheduler": self.lr_scheduler, "scaler": self.precision.scaler,
                    "train_dataset": self.train_dataset, "eval_dataset": self.eval_dataset}
        comps.update({k: v for k, v in optional.items() if v is not None})
        if dynamic.dynamic_table_names(self.model):
            comps["dynamic_tables"] = dynamic.DynamicTablesState(self.model, self.world_size,
                                                                 self.process_group)
        return comps

    def resume(self, *, mode: RestoreMode = "training") -> None:
        """Restore the state ``args.resume_from`` names ("auto": the newest committed checkpoint
        in ``output_dir`` that verifies), or else warm-start from ``args.model_bank``; all ranks
        call this. ``train()`` does it itself at its start; only the first such call does
        anything. To evaluate or score a trained model call ``resume(mode="scoring")``: it
        restores the model (and what the model needs, see ``checkpoint.contents``) and the step,
        never a dataset position, the optimizers or hook state, so the datasets may differ from
        training's; a later ``train()`` still resumes in full."""
        # Before the resume: a run that saves claims output_dir's lock there.
        self.checkpointer.saves_requested = any(h.requests_saves for h in self.hooks)
        self.checkpointer.resume(mode=mode)

    def save_checkpoint(self, path: str | None = None) -> str:
        """Save a checkpoint now and wait for it to commit (all ranks must call this); returns
        its directory (default ``output_dir/step_<global_step>``)."""
        return self.checkpointer.save(path, blocking=True)

    def load_checkpoint(self, path: str, *, mode: RestoreMode = "training") -> None:
        """Restore the full training state from the committed checkpoint at ``path``, or with
        ``mode="scoring"`` only what scoring needs (as ``resume``); all ranks must call this."""
        self.checkpointer.load(path, mode=mode)

    def train(self) -> None:
        """Train on ``train_dataset`` (see the module docstring for the event order)."""
        self._runs.train()

    def evaluate(self) -> dict[str, float]:
        """Evaluate the model *in memory* on ``eval_dataset``; returns the metrics. To evaluate
        a trained model, ``resume(mode="scoring")`` first."""
        return self._runs.evaluate()

    def predict(self, dataset: Any, output_dir: str, *, activation: Activation = "sigmoid",
                output_names: Sequence[str] | None = None,
                rows_per_row_group: int = PredictOptions.rows_per_row_group,
                filesystem: Any = None) -> PredictSummary:
        """Score every row of ``dataset`` with the model *in memory* and write, per window, the
        outputs next to the passthrough columns as parquet under ``output_dir`` (a path or URL),
        one file per rank, committed by a ``_SUCCESS`` marker; a re-run skips committed windows
        and redoes the others. ``activation="sigmoid"`` writes probabilities of logits
        (``"none"``: outputs as returned); ``output_names`` names the output columns (default:
        the dataset's labels). ``filesystem``: a ``pyarrow.fs.FileSystem`` to write through
        (default: the one ``output_dir``'s scheme names). To score a trained model, ``resume(mode="scoring")`` or
        ``load_checkpoint(path, mode="scoring")`` first. See ``recsys_trainer.predict`` and docs/predict.md. All ranks call this."""
        options = PredictOptions(output_dir=output_dir, activation=activation,
                                 output_names=output_names, rows_per_row_group=rows_per_row_group)
        ds = as_windowed(dataset)
        if ds is None:
            raise ValueError("`dataset` is None; pass the data to score to predict(...).")
        ds.setup(self.rank, self.world_size)
        ds.set_gang(self.gang)
        ds.follow_id_kinds(self.train_dataset)  # ids read as training read them (integer/string)
        self.vocabularies.attach(ds, "the predict dataset")
        return self._runs.predict(ds, options, filesystem)

    def train_and_evaluate(self) -> None:
        """Train, evaluating after each train window (windowed eval data: eval window ``i``
        after train window ``i``) or after each epoch (unwindowed eval data), or on the eval
        period (``args.eval_every_n_*``)."""
        self._require(self.eval_dataset, "eval_dataset")
        self._runs.train_and_evaluate()

    # ------------------------------------------------------------------ loops

    @contextlib.contextmanager
    def _top_level(self) -> Iterator[None]:
        self._depth += 1
        preempted: Preempted | None = None
        try:
            yield
        except Preempted as exc:  # the checkpoint is saved; on_preempt has fired
            preempted = exc
            raise
        except BaseException as exc:
            # A gloo timeout or closed connection, named: which peer problem, where, what to check.
            lost = peer_lost_error(exc, rank=self.rank, timeout_s=self.args.collective_timeout_s,
                                   where=self._where())
            # Never leave a save half-written behind an exception: let it commit first.
            try:
                self.checkpointer.close()
            except Exception:  # noqa: BLE001 - the original exception matters more
                logger.exception("finishing the in-flight checkpoint save failed")
            self.hooks.fire("on_exception", self, lost or exc)
            if lost is not None:
                raise lost from exc
            raise
        finally:
            self._depth -= 1
            self.state.mode = "idle"
            if self._depth == 0:
                self.hooks.fire("end", self)
            if preempted is not None and self._exit_now:
                # The save missed its deadline and its writer thread still holds collectives:
                # an interpreter exit would wait for it (until the launcher's SIGKILL).
                exit_now(preempted.preemption.exit_code)

    def _where(self) -> str:
        st = self.state
        return f"after step {st.global_step} ({st.mode}, window {st.window_id!r})"

    def _train(self, with_eval: bool) -> None:
        self._stop_local = self._non_finite_local = False
        self.state.stop_reason = None
        self.preemption = None
        grace = self.args.preemption_grace_s
        watch = self._preemption_watcher.watching(logger.warning) if grace is not None \
            else contextlib.nullcontext()
        with watch:
            try:
                self._train_loop(with_eval)
            except (_PreemptionStop, WaitInterrupted):  # a signal at a fetch, or while waiting
                self._stop_for_preemption()

    def _stream_waits(self) -> None:
        """A dataset's heartbeat while it waits for data (every rank is at the same one): the
        ``"wait"`` resume point, while training (the position is the last resume point's)."""
        if self.state.mode == "train":
            self.hooks.fire("on_resume_point", self, "wait")

    def _stop_flag(self) -> int:
        """This rank's stop flag for the next fetch: 2 preemption, 1 requested, 0 none."""
        return 2 if self._preemption_watcher.requested else int(self._stop_local)

    def _stop_for_preemption(self) -> None:
        """Every rank: name the signal, save this step within the grace period (the
        ``"preempt"`` resume point), on_preempt, then raise ``Preempted``."""
        st, watcher = self.state, self._preemption_watcher
        agreed_at = time.monotonic()
        signalled_at = watcher.received_at if watcher.received_at is not None else agreed_at
        # The signal may have reached some ranks only: every rank names the same one.
        signum = self.gang.all_reduce_max([watcher.signum or 0])[0]
        p = self.preemption = Preemption(signal=signal.Signals(signum).name, step=st.global_step,
                                         seconds_to_stop=agreed_at - signalled_at,
                                         signalled_at=signalled_at)
        st.stop_reason = f"preempted by {p.signal}"
        if self.is_rank_zero:
            logger.warning("%s: every rank stopped after step %d (%.2f s after the signal); "
                           "saving its checkpoint within preemption_grace_s=%g s", p.signal,
                           p.step, p.seconds_to_stop, self.args.preemption_grace_s)
        self.hooks.fire("on_resume_point", self, "preempt")
        if p.committed:
            logger.warning("%s: checkpoint of step %d committed %.2f s after the signal: %s",
                           p.signal, p.step, p.seconds_to_commit, p.checkpoint)
        else:
            p.error = p.error or "no hook saved a checkpoint at the preemption"
            logger.error("PreemptionError: rank %d: %s after step %d, but no checkpoint was "
                         "committed: %s A rerun resumes from the last committed checkpoint.",
                         self.rank, p.signal, p.step, p.error)
        self._exit_now = p.save_still_running
        self.hooks.fire("on_preempt", self, p)
        raise Preempted(p)

    def _train_loop(self, with_eval: bool) -> None:
        """Resume, then train epoch after epoch until ``train_steps``, ``train_epoch``, the end
        of the data or an agreed stop; ``train_and_evaluate`` evaluates as ``EvalSchedule``
        decides."""
        train_ds = self._require(self.train_dataset, "train_dataset")
        st = self.state
        self.resume()
        self.vocabularies.build(train_ds)  # VocabFromData: from the first windows (unless restored)
        self.hooks.fire("before_train", self)
        schedule = self._schedule = EvalSchedule(self.eval_dataset, self.args.eval_period, with_eval)
        walked = _Walked(start_step=st.global_step)
        if self._step_limit_reached():  # resumed from a run that reached train_steps
            owed = schedule.owed_on_resume(st.eval_owed)
            if owed is not None:  # stopped after the last step, before the evaluation after it
                self._evaluate(owed.dataset, owed.windows)
                st.eval_owed = None
        else:
            while st.epoch < self.args.train_epoch and not self._train_epoch(train_ds, walked):
                pass
        self._report_end(train_ds, walked)
        self.hooks.fire("on_resume_point", self, "end")
        self.hooks.fire("after_train", self)

    def _train_epoch(self, train_ds: WindowedDataset, walked: _Walked) -> bool:
        """One pass over the train windows (from the resume position); True when training must
        end."""
        st, schedule = self.state, self._schedule
        walked.epochs += 1
        self.hooks.fire("before_epoch", self, st.epoch)
        train_ds.set_epoch(st.epoch)  # e.g. reseeds a per-epoch shuffle
        # Windows are walked lazily: a streaming source yields each window when it appears, and
        # training on it starts then (not once the whole stream has ended).
        windows = Lookahead(itertools.islice(train_ds.window_ids(), self.args.window_iter))
        done = False
        for index, window_id, plan in schedule.windows(windows):
            walked.listed += 1
            if index < st.window_index:
                continue  # trained before the checkpoint this run resumed from
            st.window_index = index
            walked.entered += 1
            done = self._train_and_evaluate_window(train_ds, index, window_id, plan)
            if done:
                break
        self.hooks.fire("after_epoch", self, st.epoch)
        epoch_eval = schedule.due_after_epoch(st.epoch + 1)
        if epoch_eval is not None:
            st.eval_owed = []
            self._evaluate(epoch_eval.dataset, None)
            st.eval_owed = None
        if not done:
            st.epoch = st.epoch + 1
            st.next_window(0)
            self.hooks.fire("on_resume_point", self, "epoch")
        return done

    def _train_and_evaluate_window(self, train_ds: WindowedDataset, index: int, window_id: str,
                                   plan: EvalPlan | None) -> bool:
        """Train one window, then evaluate its plan if due; True when training must end."""
        st, schedule = self.state, self._schedule
        schedule.current = plan  # a steps/rows eval period evaluates this while training
        after = plan if plan is not None and plan.after_window else None
        st.eval_owed = after.owed if after is not None else None
        done = self._train_window(train_ds, window_id)
        if after is not None:
            schedule.check_pair_before_eval(training_ended=done)
            self._evaluate(after.dataset, after.windows)
        st.eval_owed, schedule.current = None, None
        if not done:  # the window is finished: the resume position moves to the next one
            st.next_window(index + 1)
            st.windows_done += 1
            st.finish_window_in_event_time(train_ds.window_end_time(window_id))
            self.hooks.fire("on_resume_point", self, "window")
        return done

    def _step_limit_reached(self) -> bool:
        limit = self.args.train_steps
        return limit is not None and self.state.global_step >= limit

    def _report_end(self, train_ds: WindowedDataset, walked: _Walked) -> None:
        """Refuse a run that trained nothing although it had windows to train; say why a run
        ended before ``train_steps``."""
        st, args = self.state, self.args
        if st.global_step == walked.start_step and st.stop_reason is None and (
                walked.entered or (walked.epochs and not walked.listed)):
            # Same on every rank (agreed listing, agreed fetches): every rank raises.
            raise nothing_to_train_error(train_ds, walked.listed, st.rows_unread)
        if args.train_steps is not None and st.global_step < args.train_steps and st.stop_reason is None:
            logger.warning(
                "training ended after %d of train_steps=%d steps: the data ran out after "
                "train_epoch=%d epochs.", st.global_step, args.train_steps, args.train_epoch
            )
        if st.rows_unread and self.is_rank_zero:
            logger.info("rank 0 left %d train rows unread at window ends (uneven data)", st.rows_unread)

    def _train_window(self, ds: WindowedDataset, window_id: str) -> bool:
        """Train one window; returns True when training must end (limit or agreed stop)."""
        args, st = self.args, self.state
        st.mode, st.window_id = "train", window_id
        self.model.train()
        self.hooks.fire("before_window", self, window_id)
        it = self._train_it = SyncedIterator(
            self._batch_check.batches(ds, window_id, skip_batches=st.batches_in_window,
                                      earlier=st.segments()),
            self.gang,
            pad=False,
            local_flags=lambda: (self._stop_flag(), self._non_finite_local),
        )
        try:
            if args.pipeline == "sparse_dist":
                finished = self._train_pipelined(it)
            else:
                finished = self._train_plain(it)
        finally:
            # A window cut short (train_steps, an exception) must still release the dataset's
            # read-ahead thread and open files; the pipeline keeps a reference to `it`.
            it.close()
        if it.state.preempted:
            raise _PreemptionStop
        if it.state.stop_requested or it.state.non_finite_loss:
            finished = True
            if it.state.non_finite_loss:
                st.stop_reason = "non-finite loss"
            st.stop_reason = st.stop_reason or "stop requested on another rank"
        if it.state.out_of_data:
            st.rows_unread += it.state.rows_unread
            self.hooks.fire("out_of_data", self, window_id, it.state.rows_unread)
        self._dynamic_steps.end_window()  # dynamic tables' expiry in windows
        self.hooks.fire("after_window", self, window_id)
        return finished

    def _train_plain(self, it: SyncedIterator) -> bool:
        """Train the window one step at a time; True when training must end."""
        batch = self._fetch(it)
        while batch is not None:
            self._train_step(batch, it)
            if self._end_of_step():
                return True
            batch = self._fetch(it)
        return False

    def _train_pipelined(self, it: SyncedIterator) -> bool:
        """Train the window through ``SparseDistPipeline`` (one batch per step, the same events
        and dense update as the plain loop); True when training must end."""
        if self.non_finite.action == "skip":
            raise ValueError(
                "skipping non-finite losses needs a decision before backward, which "
                "TrainPipelineSparseDist runs itself; use pipeline='none' with that guard."
            )
        if self._pipeline is None:
            self._pipeline = SparseDistPipeline(self.model, self._dense_step, self.device,
                                                self._pipelined_forward)

        def after_batch(micro: MicroBatchOutput) -> bool:
            self.state.batches_in_window += 1
            self._finish_step([micro], skipped=False)
            return self._end_of_step()

        return self._pipeline.train_window(it, after_batch)

    def _pipelined_forward(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        # The pipeline calls this once per progress(), with the batch being trained.
        self.hooks.fire("before_step", self)
        self.hooks.fire("after_data", self, batch)
        return self._forward(batch)

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        with self.precision.autocast():
            return split_output(self.model(batch))

    def _end_of_step(self) -> bool:
        """An eval period in steps or rows, the ``"step"`` resume point (checkpoint triggers),
        then the ``train_steps`` limit; True when training must end."""
        plan = self._schedule.due_after_step(self.state)
        if plan is not None:
            window_id = self.state.window_id
            self._evaluate(plan.dataset, plan.windows)
            self.state.window_id = window_id  # still training this window
        self.hooks.fire("on_resume_point", self, "step")
        if self._step_limit_reached():
            self.state.stop_reason = self.state.stop_reason or f"train_steps={self.args.train_steps} reached"
            return True
        return False

    def _fetch(self, it: SyncedIterator) -> Batch | None:
        t0 = time.perf_counter()
        b = next(it, None)
        out = None if b is None else b.to(self.device, non_blocking=True)
        self.timings.add_data_wait(t0)
        return out

    def _train_step(self, batch: Batch, it: SyncedIterator) -> None:
        """One optimizer step over up to k micro-batches starting with ``batch``.

        The next micro-batch is fetched *before* running the current one, so we know whether the
        current one is the last of the step: only the last runs with DDP's gradient all-reduce
        (the others under ``no_sync``, saving k-1 all-reduces of every dense gradient).
        """
        k, tm = self.args.gradient_accumulation_steps, self.timings
        self.hooks.fire("before_step", self)
        micro: list[MicroBatchOutput] = []
        current: Batch | None = batch
        skipped = False
        t_fb, wait_before = time.perf_counter(), tm.data_wait_s
        while current is not None:
            nxt = self._fetch(it) if len(micro) < k - 1 else None
            is_last = nxt is None
            self.precision.set_sync_gradients(is_last)
            self.hooks.fire("after_data", self, current)
            with dense_no_sync(self.model, not is_last), self._dynamic_steps.micro_batch(is_last):
                loss, outputs = self._forward(current)
                # The precision module divides by k: dense grads become the mean over the
                # micro-batches; fused sparse updates see loss/k on every micro-batch.
                if self.non_finite.skip_backward(loss, self.gang):
                    # No backward at all, on every rank: the fused sparse update runs inside
                    # backward, so this is the only way to keep a NaN out of the tables, and
                    # skipping on all ranks together keeps DDP's and the shards' collectives
                    # matched.
                    skipped = True
                else:
                    self.precision.backward(loss)
            micro.append(MicroBatchOutput(current, loss.detach(), outputs))
            self.state.batches_in_window += 1
            current = nxt
        tm.forward_backward_s += time.perf_counter() - t_fb - (tm.data_wait_s - wait_before)
        self._dense_step.step(len(micro), skipped=skipped)
        self._finish_step(micro, skipped)

    def _finish_step(self, micro: list[MicroBatchOutput], skipped: bool) -> None:
        """Count the step and fire ``after_step`` (both loops)."""
        st = self.state
        st.global_step += 1
        assert self._train_it is not None
        st.last_step_rows = self._train_it.take_rows(len(micro))
        st.rows_seen += st.last_step_rows
        loss_mean = torch.stack([m.loss.float() for m in micro]).mean()
        report, stop = self.non_finite.after_step(loss_mean, st.global_step, skipped,
                                                  rank=self.rank)
        if report:
            self.report_non_finite_loss()
        if stop is not None:
            self.request_stop(stop)
        self.hooks.fire("after_step", self, StepOutput(st.global_step, loss_mean, micro))
        self.timings.reset()

    @torch.no_grad()
    def _evaluate(self, ds: WindowedDataset, windows: list[str] | None) -> dict[str, float]:
        st, eval_steps = self.state, self.args.eval_steps
        prev_mode, prev_window = st.mode, st.window_id
        st.mode = "eval"
        self.model.eval()
        self.hooks.fire("before_evaluate", self)
        totals = _EvalTotals()
        for window_id in windows if windows is not None else ds.window_ids():
            st.window_id = window_id
            self.hooks.fire("before_window", self, window_id)
            sync = self._evaluate_window(ds, window_id, totals)
            if sync.preempted:
                # Abandoned: the checkpoint holds the training position (a window's
                # evaluation is redone on resume: the position is still in that window).
                st.mode, st.window_id = prev_mode, prev_window
                raise _PreemptionStop
            if sync.out_of_data:
                self.hooks.fire("out_of_data", self, window_id, 0)
            self.hooks.fire("after_window", self, window_id)
            if eval_steps is not None and totals.steps >= eval_steps:
                break
        total_loss, total_rows = self.gang.all_reduce_sum_float(
            [totals.loss_sum, float(totals.rows)])
        metrics = {
            "loss": total_loss / total_rows if total_rows else math.nan,
            "num_samples": total_rows,
        }
        self.hooks.fire("after_evaluate", self, metrics)  # CheckpointHook last: records them
        st.mode = prev_mode
        if prev_mode == "train":
            self.model.train()
        return metrics

    def _evaluate_window(self, ds: WindowedDataset, window_id: str,
                         totals: _EvalTotals) -> SyncState:
        """One eval window's batches (exhausted ranks pad until all are done), up to
        ``eval_steps`` in all; returns how its synced iterator ended."""
        it = SyncedIterator(
            self._batch_check.batches(ds, window_id), self.gang, pad=True,
            padding_batch=ds.padding_batch,
            local_flags=lambda: (2 if self._preemption_watcher.requested else 0, False),
        )
        try:
            while self.args.eval_steps is None or totals.steps < self.args.eval_steps:
                raw = next(it, None)
                if raw is None:
                    break
                self._eval_step(raw.to(self.device, non_blocking=True), it.last_was_padding, totals)
        finally:
            it.close()  # eval_steps may cut the window short: stop its read-ahead
        return it.state

    def _eval_step(self, batch: Batch, is_pad: bool, totals: _EvalTotals) -> None:
        self.hooks.fire("after_data", self, batch)
        self.hooks.fire("before_eval_step", self)
        loss, outputs = self._forward(batch)
        totals.steps += 1
        if not is_pad:
            # Two host syncs per batch (device syncs on CUDA), on purpose: `num_real_rows()`
            # counts the rows with weight > 0, so that each batch's loss counts by the rows that
            # carry data; `.item()` brings the batch's loss to the host, where the pass sums in
            # float64 for the gang's host-side all-reduce at the end. Acceptable in evaluation:
            # there is no backward or optimizer step to overlap with the next batch, and each
            # fetch already waits on an all-reduce across ranks. (A training step keeps its
            # loss on the device; hooks read it every log_steps.)
            n = batch.num_real_rows()
            totals.loss_sum += float(loss.float().item()) * n
            totals.rows += n
        micro = [MicroBatchOutput(batch, loss.detach(), outputs)]
        self.hooks.fire("after_eval_step", self, StepOutput(totals.steps, loss.detach(), micro, is_pad))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _require(ds: WindowedDataset | None, name: str) -> WindowedDataset:
        if ds is None:
            raise ValueError(f"`{name}` is None; pass it to Trainer(...) to use this method.")
        return ds


class _DirectRuns:
    """The Trainer's entry points as they run a job (``Runs``); in test mode the smoke test
    (``recsys_trainer.smoke.SmokeTest.around``) drives these instead."""

    def __init__(self, trainer: Trainer) -> None:
        self._t = trainer

    def train(self) -> None:
        with self._t._top_level():
            self._t._train(with_eval=False)

    def train_and_evaluate(self) -> None:
        with self._t._top_level():
            self._t._train(with_eval=True)

    def evaluate(self) -> dict[str, float]:
        t = self._t
        with t._top_level():
            eval_ds = t._require(t.eval_dataset, "eval_dataset")
            t.vocabularies.build(t.train_dataset)  # unless restored or built already
            return t._evaluate(eval_ds, None)

    @torch.no_grad()
    def predict(self, ds: WindowedDataset, options: PredictOptions, filesystem: Any,
                max_windows: int | None = None, max_batches: int | None = None) -> PredictSummary:
        t = self._t
        with t._top_level():
            t.vocabularies.build(t.train_dataset)
            t.state.mode = "predict"
            t.model.eval()
            return predict(t._forward, ds, t.gang, t.device, options, filesystem,
                           max_windows=max_windows, max_batches=max_batches,
                           batch_check=t._batch_check)


# The hooks' contract, checked: mypy holds ``Trainer`` to ``TrainerView`` structurally here, so a
# member renamed or retyped on one side and not the other fails the type check, not a user's hook.
_TRAINER_IS_A_VIEW: type[TrainerView] = Trainer


__all__ = ["Trainer"]
