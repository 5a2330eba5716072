"""``CheckpointManager``: when to save, how to save (per-rank concurrent, async, atomic commit),
which checkpoints to keep, and how to resume.

It works on a mapping of named ``Stateful`` components (``attach``; what each holds:
``checkpoint.contents``) and a ``Gang`` for its control collectives; it never sees a Trainer.

A save, step by step (the only guarantee a reader relies on is the last line)::

    main thread:   drain the previous save (at most one in flight)
                   before_save_checkpoint hooks
                   snapshot: copy every tensor into a CPU staging buffer (reused across saves,
                             pre-allocated on a helper thread at train start),
                             serialise this rank's extra state          <- the loop is blocked
    writer thread: rank 0 removes a stale uncommitted dir of the same step; all-gather of
                   errors (instead of a barrier: a failure on any rank fails every rank)
                   DCP writes each rank's shards with ``save_concurrency_per_rank`` threads
                   (one fsync per file), CRC32s computed while writing; rank 0 writes
                   .metadata; each rank writes its extra file; all-gather of the file lists
                   (or of each rank's error)
                   rank 0 writes args.json, then COMMITTED (atomic rename), the index;
                   broadcast "committed"; rank 0 rotates old checkpoints
    main thread:   (at the next step, the next save, the end, or an exception)
                   after_save_checkpoint hooks

All collectives of a save run on the manager's own gang (by default a dedicated gloo group), so
the writer thread never interleaves with the training loop's collectives. A synchronous save (``async_save=False``) runs the same
writer code on the main thread without the staging copy (DCP writes from zero-copy views of
the live tensors).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from recsys_trainer.args import (
    ModelBankSource,
    ReshardDataPosition,
    TrainingArguments,
    model_bank_sources,
)
from recsys_trainer.checkpoint import contents, layout, writer
from recsys_trainer.checkpoint.errors import CheckpointError, describe_failure, only_os_errors
from recsys_trainer.checkpoint.lock import lock_for
from recsys_trainer.checkpoint.model_bank import warm_start
from recsys_trainer.distributed import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    FakeGang,
    Gang,
    ProcessGroupGang,
    new_gloo_group,
)
from recsys_trainer.dynamic import lookup_path_hint
from recsys_trainer.storage import Location, resolve

logger = logging.getLogger(__name__)

CheckpointListener = Callable[[str, str], None]
"""``(event, path)`` for ``before_save_checkpoint``, ``after_save_checkpoint`` and
``after_load_checkpoint`` (the Trainer forwards them to its hooks)."""


@dataclass
class SaveStats:
    """Timings of one save (for logs and benchmarks)."""

    step: int
    path: str
    blocked_s: float
    """Time the training loop was blocked (snapshot, plus the whole write when synchronous)."""
    total_s: float = 0.0
    """From the start of the save to its commit."""
    num_bytes: int = 0
    """Bytes written by all ranks (from the manifest)."""


@dataclass
class _Pending:
    step: int
    path: str
    future: cf.Future[dict[str, Any]]
    stats: SaveStats
    started: float = field(default_factory=time.perf_counter)


class CheckpointManager:
    """Saves, rotates and restores checkpoints of named ``Stateful`` components.

    Args:
        output_dir: where ``step_<N>/`` directories and ``checkpoints.json`` live: a local path
            or a URL (``s3://bucket/prefix``, ``gs://``, ``hdfs://``...; see docs/checkpoint.md,
            "Object storage").
        save_steps / save_every_n_rows / save_every_n_windows / save_every_n_epochs: periodic
            triggers (rows: the ``rows_seen`` counter, the same on every rank).
        save_end: save when training ends (once: not again if that step was just saved).
        max_to_keep: committed checkpoints kept by rotation (plus the protected ones, see
            ``layout.RetentionPolicy``).
        save_concurrency_per_rank: DCP ``FileSystemWriter`` threads (and files) per rank.
        async_save: snapshot on the main thread, write in a background thread.
        resume_from: ``"auto"`` (newest committed checkpoint in ``output_dir``), a checkpoint
            directory, an output directory (its newest), or None (fresh start).
        model_bank: warm-start sources, applied only when nothing is resumed.
        params_not_save / save_filter_fn: parameters left out of checkpoints.
        keep_every_n_hours / keep_best_metric / keep_best_mode: extra retention.
        verify_checksums: check every file's CRC32 before loading (sizes are always checked).
        reshard_data_position: what to do with a mid-window data position when the world size
            changed (``"error"``, ``"restart_window"``, ``"next_window"``).
        gang: the control collectives of saves and loads; by default (at ``attach``) a new gloo
            group over all ranks, or a ``FakeGang`` without ``torch.distributed``.
        collective_timeout_s: how long the default gang's collectives wait for other ranks.
        filesystem: a ``pyarrow.fs.FileSystem`` that ``output_dir`` (and paths given to
            ``save``, ``load`` and ``resume_from``) are paths in, instead of resolving them.
        lease_ttl_s: on object storage, how long ``output_dir``'s lease outlives its last
            renewal (renewed every quarter of it; see ``checkpoint.lock.LeaseLock``).

    The Trainer builds one with ``from_args`` unless given one, and ``attach``es its components.
    Public methods own the guards (drain, idempotency) and dispatch to ``_`` methods.
    """

    def __init__(
        self,
        output_dir: str,
        *,
        save_steps: int | None = None,
        save_every_n_rows: int | None = None,
        save_every_n_windows: int | None = None,
        save_every_n_epochs: int | None = None,
        save_end: bool = False,
        max_to_keep: int = 5,
        save_concurrency_per_rank: int = 4,
        async_save: bool = True,
        resume_from: str | None = "auto",
        model_bank: Sequence[ModelBankSource | dict[str, Any]] | None = None,
        params_not_save: Sequence[str] | None = None,
        save_filter_fn: Callable[[str], bool] | None = None,
        keep_every_n_hours: float | None = None,
        keep_best_metric: str | None = None,
        keep_best_mode: Literal["min", "max"] = "min",
        verify_checksums: bool = True,
        reshard_data_position: ReshardDataPosition = "error",
        gang: Gang | None = None,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        filesystem: pafs.FileSystem | None = None,
        lease_ttl_s: float = 60.0,
    ) -> None:
        self.output_dir = output_dir
        self._filesystem = filesystem
        self._out = self._locate(output_dir)
        self.save_steps = save_steps
        self.save_every_n_rows = save_every_n_rows
        self.save_every_n_windows = save_every_n_windows
        self.save_every_n_epochs = save_every_n_epochs
        self.save_end = save_end
        self.save_concurrency_per_rank = save_concurrency_per_rank
        self.async_save = async_save
        self.resume_from = resume_from
        self.model_bank = model_bank_sources(model_bank)
        self.key_filter = contents.KeyFilter(params_not_save, save_filter_fn)
        self.policy = layout.RetentionPolicy(max_to_keep, keep_every_n_hours, keep_best_metric,
                                             keep_best_mode)
        self.verify_checksums = verify_checksums
        self.reshard_data_position = reshard_data_position
        self._gang = gang
        self.collective_timeout_s = collective_timeout_s
        self._lock = lock_for(self._out, lease_ttl_s)
        self._components: contents.Components = {}
        self._listener: CheckpointListener = lambda _event, _path: None
        self._run_args: dict[str, Any] = {}
        self._executor: cf.ThreadPoolExecutor | None = None
        self._pending: _Pending | None = None
        self._staging = writer.StagingBuffers()
        self._staging_cache: dict[str, Any] | None = None  # fallback (unsupported tensor types)
        self._resumed_step: int | None = None
        self._resume_done = False
        self._rows_at_last_step = 0  # rows_seen after the previous step (set again by resume)
        self.windows_done = 0
        """Train windows finished in this run (saved; drives ``save_every_n_windows``)."""
        self.last_metrics: dict[str, float] = {}
        """The latest evaluation metrics (recorded in the next checkpoint's manifest)."""
        self._warned_best_missing = False
        self.history: list[SaveStats] = []
        """Stats of every committed save of this manager."""

    @classmethod
    def from_args(cls, args: TrainingArguments, gang: Gang | None = None) -> CheckpointManager:
        """Build from ``TrainingArguments`` (fields of the same names)."""
        return cls(
            args.output_dir,
            save_steps=args.save_steps,
            save_every_n_rows=args.save_every_n_rows,
            save_every_n_windows=args.save_every_n_windows,
            save_every_n_epochs=args.save_every_n_epochs,
            save_end=args.save_end,
            max_to_keep=args.max_to_keep,
            save_concurrency_per_rank=args.save_concurrency_per_rank,
            async_save=args.async_save,
            resume_from=args.resume_from,
            model_bank=args.model_bank,
            params_not_save=args.params_not_save,
            save_filter_fn=args.save_filter_fn,
            keep_every_n_hours=args.keep_every_n_hours,
            keep_best_metric=args.keep_best_metric,
            keep_best_mode=args.keep_best_mode,
            reshard_data_position=args.reshard_data_position,
            gang=gang,
            collective_timeout_s=args.collective_timeout_s,
        )

    def attach(self, components: contents.Components, *,
               run_args: dict[str, Any] | None = None,
               listener: CheckpointListener | None = None) -> None:
        """Save and restore ``components`` from now on (all ranks call this together: the
        default gang's group is created here). ``run_args`` is recorded in every checkpoint
        (``args.json``); ``listener`` hears the checkpoint events."""
        if self._gang is None:
            # A dedicated gloo group: the writer thread's collectives must never interleave with
            # the training loop's on the default group (new_group is collective: all ranks).
            self._gang = ProcessGroupGang(new_gloo_group(self.collective_timeout_s)) \
                if dist.is_initialized() else FakeGang()
        self._components = components
        self._run_args = dict(run_args or {})
        if listener is not None:
            self._listener = listener

    def _locate(self, path: str | Location) -> Location:
        if isinstance(path, Location):
            return path
        return resolve(path, self._filesystem) if self._filesystem is not None \
            else layout.locate(path)

    @property
    def gang(self) -> Gang:
        if self._gang is None:
            raise RuntimeError("the CheckpointManager is not attached to any state yet; call "
                               "attach(components) first (the Trainer does).")
        return self._gang

    def record_metrics(self, metrics: dict[str, Any]) -> None:
        """Remember the latest evaluation metrics (the next checkpoint records them, for
        ``keep_best_metric``)."""
        self.last_metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        metric = self.policy.keep_best_metric
        if metric is not None and metric not in self.last_metrics and not self._warned_best_missing:
            # Not an error: an evaluation may lack the metric now and then; but a name that never
            # matches (a typo, or "auc" on a multi-task run) would silently keep no best.
            self._warned_best_missing = True
            per_task = sorted(k for k in self.last_metrics if k.startswith(f"{metric}/"))
            logger.warning(
                "keep_best_metric %r is not in the evaluation metrics %s, so no checkpoint is "
                "kept as the best by it%s.", metric, sorted(self.last_metrics),
                f"; with several tasks each metric is reported per task: use one of {per_task}"
                if per_task else "")

    # ------------------------------------------------------------------ triggers (the loop's)

    def resume(self, *, mode: contents.RestoreMode = "training") -> layout.CheckpointInfo | None:
        """Restore the state ``resume_from`` names (by default the newest committed checkpoint
        in ``output_dir`` that verifies), or else warm-start from the model bank; returns the
        checkpoint restored. All ranks call it together.

        ``mode="training"`` restores everything (``load``) and runs once (later calls return
        None: a second ``train()`` continues from memory). ``mode="scoring"`` restores only what
        scoring needs (``contents.scoring_components``: the model and the components that
        declare it, and the step counter), never a dataset position, optimizer, RNG or hook
        state, so the data may be configured differently from training's; it does not count as
        the training resume, and does nothing once that has happened (the model in memory is
        then the newest)."""
        gang = self.gang
        if mode == "scoring":
            if self._resume_done:
                return None
            source = self._choose_source(may_quarantine=False)
            if source is not None:
                logger.info("loading the model of %s (step %d) for scoring", source.path,
                            source.step)
                self._load_and_notify(source, mode="scoring",
                                      verified=self.resume_from == "auto")
            elif self.model_bank:
                warm_start(self._components, self.model_bank, gang)
            return source
        self._claim_output_dir()
        if self._resume_done:
            return None
        self._resume_done = True
        if gang.rank == 0 and self._pending is None:
            for loc in layout.list_incomplete(self._out):
                logger.warning("removing incomplete checkpoint %s (its save never committed)",
                               loc.url)
                try:
                    layout.remove_tree(loc)
                except OSError as e:  # it is never loaded anyway; try again at the next start
                    logger.warning("could not remove %s: %s", loc.url, e)
        # Only a run that saves here holds output_dir's lock, and only its own saves would
        # collide with a bad checkpoint left under a step name.
        source = self._choose_source(may_quarantine=self.will_save())
        if source is not None:
            logger.info("resuming from %s (step %d)", source.path, source.step)
            self._load_and_notify(source, mode="training", verified=self.resume_from == "auto")
            self._resumed_step = source.step
        elif self.model_bank:
            warm_start(self._components, self.model_bank, gang)
        self._check_no_foreign_checkpoints(source)
        self._prepare_staging()
        self._rows_at_last_step = contents.counters(self._components).get("rows_seen", 0)
        return source

    def _choose_source(self, may_quarantine: bool) -> layout.CheckpointInfo | None:
        """The checkpoint to restore, the same on every rank (or a ``CheckpointError`` on every
        rank). An explicit ``resume_from`` is taken as it is (its load verifies it, strictly).
        ``"auto"`` tries the committed checkpoints newest first: every rank verifies the
        candidate's files (sizes and CRC32s, as a load would) and one collective decides, so
        ranks never pick different ones; one that fails on any rank is skipped with a warning
        naming it and why, and with ``may_quarantine`` rank 0 moves it aside
        (``layout.quarantine``): left under its step name, this run's own save of that step
        would be skipped as already committed. Checkpoints that exist but none verifies are an
        error, never a silent fresh start."""
        if self.resume_from != "auto":
            source = self._resolve_resume_source()
            self._verify_everywhere(source, verify=False)  # only the agreement on the step
            return source
        candidates = layout.list_committed(self._out)
        skipped: list[tuple[layout.CheckpointInfo, str]] = []
        for info in [*reversed(candidates), None]:
            failures = self._verify_everywhere(info)
            if info is None:
                break
            if not failures:
                # Moved aside only now that there is one to fall back to: with none, a restart
                # must meet the same error, not an output_dir that looks empty.
                for bad, why in skipped:
                    moved = self._quarantine(bad, why) if may_quarantine else None
                    logger.warning(
                        "checkpoint step %d at %s fails verification, so it is not resumed "
                        "from: %s. %s", bad.step, bad.path, why,
                        f"It is kept for inspection at {moved}." if moved else
                        "It is left where it is (this run does not save into its directory).")
                if skipped:
                    logger.warning("resuming from %s (step %d), the newest checkpoint that "
                                   "verifies", info.path, info.step)
                return info
            # The facts only: the advice in the message is for a load that has no fallback.
            skipped.append((info, "; ".join(
                f"rank {r}: {msg.replace(layout.UNUSABLE_ADVICE, '').strip().rstrip('.')}"
                for r, msg, _, _ in failures)))
        if not skipped:
            return None
        raise CheckpointError(
            f"no committed checkpoint in {self.output_dir!r} verifies, so there is nothing to "
            f"resume from: {'; '.join(f'step {i.step} ({why})' for i, why in skipped)}. Repair "
            "them, or move them out of the output directory to start from scratch there (or "
            "use another output_dir).", path=self.output_dir, kind="corrupt")

    def _verify_everywhere(self, info: layout.CheckpointInfo | None,
                           verify: bool = True) -> list[tuple[int, str, str | None, str]]:
        """Every rank checks ``info``'s files (with ``verify``); one collective makes every rank
        agree that they all look at the same step and learn which ranks found it bad. Returns
        ``[(rank, message, path, kind)]`` of the failures (empty: usable everywhere)."""
        gang = self.gang
        step = info.step if info is not None else -1
        error: CheckpointError | None = None
        if info is not None and verify:
            try:
                manifest = layout.read_manifest(info.where)
                if manifest is None:
                    raise CheckpointError(
                        f"checkpoint step {step} at {info.path!r} lost its {layout.MARKER} "
                        "marker after it was listed (rotated away by another job?).",
                        step=step, path=info.path, kind="missing")
                layout.verify_files(info.where, manifest, checksums=self.verify_checksums)
            except CheckpointError as e:
                error = e
            except OSError as e:  # a read that fails is as bad as a wrong checksum
                error = CheckpointError(f"checkpoint step {step}: reading {info.path!r} "
                                        f"failed: {e}", step=step, path=info.path, kind="corrupt")
        # max and -min of the step in one all-reduce: a disagreement is seen on every rank.
        high, neg_low, failed = gang.all_reduce_max([step, -step, int(error is not None)])
        if high != -neg_low:
            raise CheckpointError(
                f"ranks disagree on the checkpoint to resume from (this rank sees step {step}, "
                f"others between {-neg_low} and {high}); is {self.output_dir!r} on a filesystem "
                "shared by all ranks?", step=high, path=self.output_dir, kind="mismatch")
        if not failed:
            return []
        mine = None if error is None else (str(error), error.path, error.kind)
        return [(r, *g) for r, g in enumerate(gang.all_gather_object(mine)) if g is not None]

    def _quarantine(self, info: layout.CheckpointInfo, why: str) -> str:
        """Rank 0 moves a checkpoint that failed verification aside; every rank learns where to
        (or the error, raised on every rank: left in place it would shadow this run's save)."""
        gang = self.gang
        moved: str | None = None
        error: str | None = None
        if gang.rank == 0:
            try:
                moved = layout.quarantine(info.where, f"step {info.step} failed verification "
                                          f"when a run resumed: {why}").url
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = f"{type(e).__name__}: {e}"
        moved, error = gang.broadcast_object((moved, error))
        if error is not None or moved is None:
            raise CheckpointError(
                f"checkpoint step {info.step} at {info.path!r} fails verification ({why}), and "
                f"moving it out of the way failed: {error}. Move it out of {self.output_dir!r} "
                "by hand (this run would otherwise skip its own save of that step as already "
                "committed), or resume from another checkpoint by path.",
                step=info.step, path=info.path, kind="corrupt")
        return moved

    def _claim_output_dir(self) -> None:
        """At the start of training, when this run will save: ``output_dir`` must be writable on
        every rank (a probe file) and not in use by another job (rank 0 takes its lock, see
        ``checkpoint.lock``; released when training ends). Every rank learns the outcome, so all
        stop together before anything is trained instead of failing at the first save."""
        if not self.will_save():
            return
        gang = self.gang
        problem = layout.probe_writable(self._out)
        holder = None
        if problem is None and gang.rank == 0:
            try:
                holder = self._lock.acquire(gang.world_size)
            except OSError as e:
                problem = f"{type(e).__name__}: {e}"
        reports = gang.all_gather_object((socket.gethostname(), problem, holder))
        unwritable = [f"rank {r} (host {h}): {p}" for r, (h, p, _) in enumerate(reports) if p]
        holders = [x for _, _, x in reports if x]
        if not unwritable and not holders:
            return
        self._lock.release()
        if unwritable:
            raise CheckpointError(
                f"`output_dir` {self.output_dir!r} is not writable: {'; '.join(unwritable)}. "
                "Checkpoints could not be saved there, so training did not start. "
                + ("Fix its permissions or mount" if self._out.is_local else
                   "Fix the bucket name, the credentials or the endpoint (AWS_* environment "
                   "variables, or the filesystem's own config)")
                + ", or choose another output_dir.",
                path=self.output_dir, kind="unwritable")
        how = ("an OS file lock that ends with that process, however it ends: it cannot go "
               "stale") if self._out.is_local else \
            ("a lease object that its job renews; it expires by itself when that job is gone")
        raise CheckpointError(
            f"`output_dir` {self.output_dir!r} is in use by {holders[0]}. Two jobs saving into "
            "one output_dir skip each other's steps as already saved and resume from each "
            "other's state. Wait for that job to end, or use another output_dir. (Its lock, "
            f"{self._lock.path}, is {how}.)", path=self.output_dir, kind="locked")

    def will_save(self) -> bool:
        """Whether this run saves checkpoints (any save trigger is set)."""
        triggers = (self.save_steps, self.save_every_n_rows, self.save_every_n_windows,
                    self.save_every_n_epochs)
        return self.save_end or any(t is not None for t in triggers)

    def _check_no_foreign_checkpoints(self, source: layout.CheckpointInfo | None) -> None:
        """Refuse to save into an ``output_dir`` that holds committed checkpoints of another
        trajectory at or after this run's start step (a fresh start or a roll-back next to
        newer checkpoints): this run's save of such a step would be skipped as already done,
        and a restart with ``resume_from="auto"`` would load the other run's state. (With
        ``"auto"`` the source is the newest, so this never fires.) Same answer on every rank:
        the ranks agreed on ``source`` and read the same directory."""
        if not self.will_save():
            return
        start = contents.counters(self._components)["global_step"]
        foreign = [i.step for i in layout.list_committed(self._out)
                   if i.step >= start and not (source is not None and
                                               layout.same_place(i.where, source.where))]
        if foreign:
            # Under torchrun --max-restarts a restarted attempt meets its own earlier attempt's
            # checkpoints here, and every restart would fail the same way.
            restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
            hint = (f" Under torchrun --max-restarts={restarts} a restarted attempt must resume "
                    "from them: set `resume_from` to \"auto\" (the default)."
                    if self.resume_from is None and restarts not in ("", "0") else "")
            raise CheckpointError(
                f"`output_dir` {self.output_dir!r} holds committed checkpoints at steps "
                f"{foreign}, at or after step {start} where this run starts (resume_from="
                f"{self.resume_from!r}); this run's saves of those steps would be skipped, and a "
                f"restart would resume from them instead of from this run. Move them out of "
                f"`output_dir`, or use another `output_dir`.{hint}",
                step=start, path=self.output_dir, kind="mismatch")

    def _prepare_staging(self) -> None:
        """Async saves copy into staging buffers; allocating (and page-faulting) them takes
        seconds for big tables, so do it now, on a helper thread, while the loop trains, instead
        of inside the first save. Only when this run will save asynchronously."""
        if not self.async_save or not self.will_save():
            return
        try:
            self._staging.prepare(contents.tensor_state(self._components, self.key_filter),
                                  background=True)
        except Exception as e:  # noqa: BLE001 - an optimisation: the first save allocates
            logger.warning("could not pre-allocate checkpoint staging buffers: %s", e)

    def on_step_end(self) -> None:
        """After each optimizer step: commit a finished async save; ``save_steps`` or
        ``save_every_n_rows``."""
        self._poll()
        if self.save_steps is None and self.save_every_n_rows is None:
            return  # no step or row trigger: skip reading the counters after every step
        counters = contents.counters(self._components)
        rows, rows_before = counters.get("rows_seen", 0), self._rows_at_last_step
        self._rows_at_last_step = rows
        n = self.save_every_n_rows
        if (self.save_steps is not None and counters["global_step"] % self.save_steps == 0) or (
                n is not None and rows // n > rows_before // n):
            self.save()

    def on_window_end(self) -> None:
        """After a train window is finished (its resume position moved on)."""
        self.windows_done += 1
        n = self.save_every_n_windows
        if n is not None and self.windows_done % n == 0:
            self.save()

    def on_epoch_end(self) -> None:
        """After an epoch is finished (the epoch counter moved on)."""
        n = self.save_every_n_epochs
        if n is not None and contents.counters(self._components)["epoch"] % n == 0:
            self.save()

    def on_train_end(self) -> None:
        """When training ends normally: ``save_end``, then wait for the save to commit."""
        if self.save_end:
            self.save()
        self.wait()
        self._lock.release()

    def close(self) -> None:
        """Drain the in-flight save (its commit hooks fire) and stop the writer thread. Safe to
        call more than once; a later save starts a new writer thread."""
        try:
            self.wait()
        finally:
            self._lock.release()
            self._staging.wait_prepared()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    # ------------------------------------------------------------------ public API

    def save(self, path: str | None = None, *, blocking: bool | None = None) -> str:
        """Save a checkpoint of the attached components at their current step; returns its
        directory (all ranks call this together).

        ``path`` defaults to ``output_dir/step_<global_step>``. ``blocking`` defaults to
        ``not async_save``. Saving a step that is already committed (or in flight) is a no-op.
        """
        self.gang  # noqa: B018 - raises when nothing is attached
        step = int(contents.counters(self._components)["global_step"])
        loc = self._locate(path) if path else self._out.join(layout.step_dir_name(step))
        path = loc.url
        if self._pending is not None and self._pending.path == path:
            return path
        self.wait()
        if layout.is_committed(loc):
            logger.info("checkpoint %s is already committed; not saving step %d again", path, step)
            return path
        blocking = (not self.async_save) if blocking is None else blocking
        self._save(step, loc, blocking)
        return path

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; fire ``after_save_checkpoint``.
        A failed save raises ``CheckpointError`` here (the previous checkpoint is intact)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            manifest = pending.future.result()
        except CheckpointError:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            error = CheckpointError(
                f"saving checkpoint step {pending.step} to {pending.path!r} failed: "
                f"{describe_failure(e)}. The last committed checkpoint is kept; this directory "
                "is never loaded and is removed at the next start.",
                step=pending.step, path=pending.path, kind="save_failed")
            # A full disk or a read-only mount is said in full above: DCP's per-rank
            # tracebacks would only bury it.
            raise error from (None if only_os_errors(e) else e)
        self._committed(pending, manifest)

    def load(self, path: str, *, strict: bool = True,
             mode: contents.RestoreMode = "training") -> None:
        """Restore everything a checkpoint holds into the attached components: tables and their
        fused optimizer state, dense parameters, dense optimizer, lr scheduler, counters, data
        position, RNG, hook states. Works across world sizes and sharding plans (the data
        position is remapped per ``reshard_data_position``). ``mode="scoring"``: only what
        scoring needs (see ``resume``). Every file is verified first, on every rank; a file
        that fails is a ``CheckpointError`` on every rank. All ranks call this together."""
        self._load_and_notify(layout.info_of(self._locate(path)), mode=mode, strict=strict,
                              verified=False, path=path)

    def save_within(self, seconds: float) -> str:
        """Save the current step and wait for its commit, all within ``seconds`` (a preemption's
        grace period); returns its directory. All ranks call this together.

        The in-flight save (if any) is drained first. This step is then written from the live
        tensors (the loop is stopped: no staging copy) on the writer thread while this thread
        watches the clock. A ``CheckpointError`` with ``kind="deadline"`` when time runs out: the
        write may still be going on, but it commits only if it finishes, and a checkpoint
        without its commit is never loaded, so the previous one stays the newest. The caller
        should then end the process (the writer thread holds collectives of the manager's gang).
        """
        deadline = time.perf_counter() + seconds
        self.gang  # noqa: B018 - raises when nothing is attached
        if self._pending is not None:
            self._await(self._pending, deadline, "the save in flight")
            self.wait()
        step = int(contents.counters(self._components)["global_step"])
        loc = self._out.join(layout.step_dir_name(step))
        if layout.is_committed(loc):
            return loc.url
        tensors, extra, base, stats, t0 = self._snapshot(step, loc)
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        future = self._executor.submit(self._write, loc, writer.exact_views(tensors), extra, base)
        pending = self._pending = _Pending(step, loc.url, future, stats, started=t0)
        self._await(pending, deadline, f"the save of step {step}")
        stats.blocked_s = time.perf_counter() - t0
        self.wait()
        return loc.url

    def _await(self, pending: _Pending, deadline: float, what: str) -> None:
        try:
            pending.future.exception(timeout=max(0.0, deadline - time.perf_counter()))
        except cf.TimeoutError:
            raise CheckpointError(
                f"{what} ({pending.path!r}) did not commit in time: it ran "
                f"{time.perf_counter() - pending.started:.1f} s. It is never loaded unless it "
                "commits; the last committed checkpoint stays the newest.",
                step=pending.step, path=pending.path, kind="deadline") from None

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._pending is not None and not self._pending.future.done()

    # ------------------------------------------------------------------ internals: save

    def _save(self, step: int, loc: Location, blocking: bool) -> None:
        path = loc.url
        tensors, extra, base, stats, t0 = self._snapshot(step, loc)
        if blocking:
            pending = _Pending(step, path, cf.Future(), stats, started=t0)
            try:
                # The loop is blocked: DCP may write straight from the live tensors (exact views
                # spare it a clone of every table that is a view of a fused buffer).
                pending.future.set_result(self._write(loc, writer.exact_views(tensors), extra,
                                                      base))
            except BaseException as e:
                pending.future.set_exception(e)
            stats.blocked_s = time.perf_counter() - t0
            self._pending = pending
            self.wait()
            return
        # Snapshot: the loop mutates the live tensors in place from the next step on.
        staged = self._stage(tensors)
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        future = self._executor.submit(self._write, loc, staged, extra, base)
        stats.blocked_s = time.perf_counter() - t0
        self._pending = _Pending(step, path, future, stats, started=t0)

    def _snapshot(self, step: int, loc: Location) -> tuple[dict[str, Any], bytes, dict[str, Any],
                                                            SaveStats, float]:
        """``before_save_checkpoint``, then what a save of ``step`` writes: the tensors (live),
        this rank's extra state (serialised now), the manifest's base, its stats and start."""
        path = loc.url
        self._listener("before_save_checkpoint", path)
        t0 = time.perf_counter()
        gang, comps = self.gang, self._components
        tensors = contents.tensor_state(comps, self.key_filter)
        extra = contents.serialize(contents.extra_state(
            comps, rank=gang.rank, world_size=gang.world_size,
            manager_state={"windows_done": self.windows_done}, args=self._run_args))
        counters = contents.counters(comps)
        base = {
            "step": step,
            "epoch": counters["epoch"],
            "world_size": gang.world_size,
            "trainer_state": counters,
            "metrics": dict(self.last_metrics),
            "args": dict(self._run_args),
        }
        return tensors, extra, base, SaveStats(step=step, path=path, blocked_s=0.0), t0

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Copy every tensor into CPU buffers allocated once (ideally before the first save, see
        ``_prepare_staging``) and reused by later saves: a memcpy into memory already faulted
        in."""
        try:
            return self._staging.stage(tensors)
        except TypeError:  # e.g. DTensor: torch's generic staging below
            pass
        if self._staging_cache is not None:
            try:
                return _copy_state_dict(tensors, self._staging_cache)
            except Exception:  # noqa: BLE001 - structure changed: rebuild the buffers
                self._staging_cache = None
        self._staging_cache = _create_cpu_state_dict(tensors, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(tensors, self._staging_cache)

    def _write(self, loc: Location, tensors: dict[str, Any], extra: bytes,
               base: dict[str, Any]) -> dict[str, Any]:
        """Write and commit one checkpoint (all ranks; collectives on the manager's gang).

        Every rank runs the same collectives on every path, failures included: a rank that fails
        locally reports it at the next collective instead of raising past it (the other ranks
        would wait there until the group's timeout, and the group's later collectives would be
        out of step). DCP itself makes every rank raise when one rank fails inside it."""
        gang = self.gang
        rank, step, path = gang.rank, base["step"], loc.url
        local_error: str | None = None
        if rank == 0:
            try:
                if self._lock.lost:
                    raise CheckpointError(
                        f"{self._lock.lost}: another job is saving into {self.output_dir!r}; "
                        "this job stops saving there. Use one output_dir per job.",
                        path=self.output_dir, kind="locked")
                if layout.is_dir(loc) and not layout.is_committed(loc):
                    layout.remove_tree(loc)  # a crashed earlier attempt at this step
                layout.make_dir(loc)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                local_error = f"{type(e).__name__}: {e}"
        # Instead of a barrier: the directory exists (or every rank learns it does not).
        self._raise_if_any(gang.all_gather_object(local_error), step, path)
        threads = max(1, self.save_concurrency_per_rank)
        # CRC32s are computed while DCP writes (helper threads overlap them with the write
        # syscalls), so there is no read-back pass; each DCP thread fsyncs its own file once.
        with cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-crc") as crc:
            storage = writer.HashingFileSystemWriter(loc, thread_count=threads, pool=crc,
                                                     sync_files=True)
            dcp.save(tensors, storage_writer=storage, process_group=gang.group)
        # dcp.save returned on every rank only after rank 0 wrote .metadata, i.e. after every
        # rank's shards were written and fsynced.
        files: dict[str, Any] = {}
        try:
            extra_name = contents.extra_file_name(rank)
            layout.write_bytes(loc.join(extra_name), extra)
            mine = [extra_name] + [n for n in layout.list_names(loc)
                                   if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
            if rank == 0:
                mine.append(".metadata")
            digests = storage.digests
            digests[extra_name] = (len(extra), zlib.crc32(extra))
            for n in mine:  # anything written other than through the writer: hash it from disk
                if n not in digests:
                    digests[n] = layout.digest(loc.join(n))
            files = {n: {"size": digests[n][0], "crc32": digests[n][1]} for n in mine}
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            local_error = f"{type(e).__name__}: {e}"
        gathered = gang.all_gather_object((files, local_error))
        manifest: dict[str, Any] = {}
        errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err is not None]
        error: str | None = "; ".join(errors) if errors else None
        if rank == 0 and error is None:
            try:
                manifest = self._commit(loc, base, [part for part, _ in gathered])
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error = f"{type(e).__name__}: {e}"
        # Every rank learns whether the commit happened (no rank hangs if rank 0 failed).
        error, manifest = gang.broadcast_object((error, manifest))
        if error is not None:
            raise CheckpointError(f"committing checkpoint step {step} at {path!r} failed: {error}",
                                  step=step, path=path, kind="save_failed")
        if rank == 0 and layout.same_place(layout.parent(loc), self._out):
            self._rotate(just_committed=step)
        return manifest

    @staticmethod
    def _raise_if_any(errors: list[str | None], step: int, path: str) -> None:
        bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if bad:
            raise CheckpointError(f"saving checkpoint step {step} at {path!r} failed: "
                                  + "; ".join(bad), step=step, path=path, kind="save_failed")

    def _commit(self, loc: Location, base: dict[str, Any],
                gathered: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0, after every rank's files are known complete: ``args.json``, then the marker
        (the last object of the checkpoint), then the index."""
        files: dict[str, Any] = {}
        for part in gathered:
            files.update(part)
        # Locally, args.json's fsync of the directory also makes every rank's file entries
        # durable (their files were fsynced by the writers) before the marker exists.
        layout.write_bytes(loc.join("args.json"),
                           (json.dumps(base["args"], indent=2, sort_keys=True) + "\n").encode())
        manifest = {
            "format_version": layout.FORMAT_VERSION,
            **{k: v for k, v in base.items() if k != "args"},
            "commit_time": time.time(),
            "files": files,
        }
        layout.write_bytes(loc.join(layout.MARKER),
                           (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        parent = layout.parent(loc)
        if parent.is_local:
            # The step directory's own entry in output_dir must be durable before rotation may
            # delete older checkpoints: otherwise a power loss could leave neither.
            layout.fsync_dir(parent.path)
        try:
            layout.write_index(parent, layout.list_committed(parent))
        except OSError as e:  # the index is informational; the marker is what counts
            logger.warning("could not update %s: %s", parent.join(layout.INDEX).url, e)
        return manifest

    def _rotate(self, just_committed: int) -> None:
        """Delete what the retention policy lets go. Never the checkpoint just committed, even
        when ``output_dir`` holds newer steps (e.g. from an earlier run this one did not resume
        from): it is this run's latest state. A failure is logged; the commit stands."""
        try:
            infos = layout.list_committed(self._out)
            protected = {s for s in (self._resumed_step, just_committed) if s is not None}
            doomed = [i for i in layout.select_to_delete(infos, self.policy, protected)
                      if not layout.has_readers(i.where)]  # never under a reader
        except Exception as e:  # noqa: BLE001 - rotation tries again after the next commit
            logger.warning("checkpoint rotation failed: %s", e)
            return
        deleted = False
        for info in doomed:
            logger.info("rotating out checkpoint %s", info.path)
            deleted |= layout.remove_checkpoint(info.where)
        if deleted:
            try:
                layout.write_index(self._out, layout.list_committed(self._out))
            except OSError as e:
                logger.warning("could not update the checkpoint index: %s", e)

    def _poll(self) -> None:
        """Finish a completed async save without blocking (fires its hooks on this thread).

        A *failed* save is left pending: the next save or the end of training (steps every rank
        reaches together) raises it. Ranks see their writer threads finish at different steps;
        raising here would stop one rank while the others train on and wait for it in their
        next collective."""
        pending = self._pending
        if pending is not None and pending.future.done() and pending.future.exception() is None:
            self.wait()

    def _committed(self, pending: _Pending, manifest: dict[str, Any]) -> None:
        stats = pending.stats
        stats.total_s = time.perf_counter() - pending.started
        stats.num_bytes = sum(int(f["size"]) for f in manifest.get("files", {}).values())
        self.history.append(stats)
        logger.info("checkpoint step %d committed at %s (%.1f MB, loop blocked %.3fs, total %.2fs)",
                    stats.step, stats.path, stats.num_bytes / 1e6, stats.blocked_s, stats.total_s)
        self._listener("after_save_checkpoint", pending.path)

    # ------------------------------------------------------------------ internals: load

    def _resolve_resume_source(self) -> layout.CheckpointInfo | None:
        src = self.resume_from
        if src is None:
            return None
        if src == "auto":
            return layout.latest_committed(self._out)
        return layout.resolve_checkpoint(self._locate(src), "`resume_from`")

    def _load_and_notify(self, info: layout.CheckpointInfo, *, mode: contents.RestoreMode,
                         verified: bool, strict: bool = True, path: str | None = None) -> None:
        self.wait()
        with layout.reading(info.where):
            if not verified:
                failures = self._verify_everywhere(info)
                if failures:
                    rank, msg, bad, kind = failures[0]
                    seen = "" if self.gang.world_size == 1 else \
                        f" (found by rank{'s' if len(failures) > 1 else ''} " \
                        f"{', '.join(str(f[0]) for f in failures)})"
                    raise CheckpointError(msg + seen, step=info.step, path=bad, kind=kind)
            self._load_read(info, strict, mode)
        self._listener("after_load_checkpoint", path if path is not None else info.path)

    def _load_read(self, info: layout.CheckpointInfo, strict: bool,
                   mode: contents.RestoreMode) -> None:
        path, step, loc = info.path, info.step, info.where
        gang = self.gang
        # Scoring restores a subset; the counters component is read either way (below).
        comps = self._components if mode == "training" else {
            k: self._components[k] for k in contents.scoring_components(self._components)}
        same_world = info.world_size == gang.world_size
        src_rank = gang.rank if same_world else 0
        extra = contents.load_extra(loc.join(contents.extra_file_name(src_rank)), step)

        contents.init_optimizer_state(comps)
        target = contents.tensor_state(comps, lambda _k: True)
        saved = set(writer.storage_reader(loc).read_metadata().state_dict_metadata)
        self._check_keys(target, saved, path, step, strict)
        target = self._restrict_to_checkpoint(target, saved)
        try:
            dcp.load(target, storage_reader=writer.storage_reader(loc), process_group=gang.group)
        except Exception as e:
            raise CheckpointError(f"loading checkpoint step {step} from {path!r} failed: {e}",
                                  step=step, path=path, kind="load_failed") from e
        # DCP loaded in place into tensors that share storage with the model and optimizers;
        # load_state_dict makes that explicit for modules whose state_dict returns copies.
        contents.load_model_state(comps, target["model"])

        ts = dict(extra[contents.COUNTERS])
        if mode == "scoring":
            contents.apply_extra(comps, extra, same_world=same_world)
            # Which model this is (logs and metrics name its step); not where training was.
            contents.set_counters(self._components,
                                  {k: ts[k] for k in contents.MODEL_COUNTERS if k in ts})
            logger.info("loaded the model of checkpoint step %d from %s for scoring (%s)", step,
                        path, ", ".join(sorted(comps)))
            return
        if not same_world:
            ts = self._remap_position(ts, info)
            if extra["train_dataset"]:
                logger.warning("world size changed (%d -> %d): the train dataset's own state is "
                               "not restored; the data position comes from the trainer counters",
                               info.world_size, gang.world_size)
        contents.apply_extra(comps, extra, same_world=same_world)
        comps[contents.COUNTERS].load_state_dict(ts)
        self.windows_done = int(extra["manager"].get("windows_done", 0))
        logger.info("loaded checkpoint step %d from %s (saved with world size %d)", step, path,
                    info.world_size)

    def _check_keys(self, target: dict[str, Any], saved: set[str], path: str, step: int,
                    strict: bool) -> None:
        """Strict loading: every state the trainer has must be in the checkpoint, unless this
        run's filters leave it out of checkpoints, and the checkpoint holds nothing else."""
        missing = [f"model.{k}" for k in target["model"]
                   if f"model.{k}" not in saved and self.key_filter(k)]
        for pk, entry in target["optim"]["state"].items():
            if not self.key_filter(contents.optim_param_name(pk)):
                continue
            missing.extend(f"optim.state.{pk}.{sk}" for sk in entry
                           if f"optim.state.{pk}.{sk}" not in saved)
        if missing and strict:
            raise CheckpointError(
                f"checkpoint step {step} at {path!r} lacks {len(missing)} entries this trainer "
                f"has, e.g. {missing[:5]}; is it from another model? (Use the model bank to "
                f"initialise from a different model.){lookup_path_hint(missing, saved)}",
                step=step, path=path, kind="mismatch")
        # Model keys only: every rank's model state dict names every table (sharded tensors),
        # but a rank's fused optimizer state holds only its own shards' entries.
        have = {f"model.{k}" for k in target["model"]}
        unexpected = sorted(k for k in saved if k.startswith("model.") and k not in have)
        if unexpected and strict:
            raise CheckpointError(
                f"checkpoint step {step} at {path!r} holds {len(unexpected)} entries this "
                f"trainer does not have, e.g. {unexpected[:5]}; is it from another model? (Use "
                f"the model bank to initialise from a different model.)", step=step, path=path,
                kind="mismatch")

    @staticmethod
    def _restrict_to_checkpoint(target: dict[str, Any], saved: set[str]) -> dict[str, Any]:
        model = {k: v for k, v in target["model"].items() if f"model.{k}" in saved}
        optim_state = {}
        for pk, entry in target["optim"]["state"].items():
            kept = {k: v for k, v in entry.items() if f"optim.state.{pk}.{k}" in saved}
            if kept:
                optim_state[pk] = kept
        # A rank whose tables all have a stateless optimizer (SGD) holds no optimizer state;
        # DCP reads an empty "optim" mapping there as a missing key "optim.".
        return {"model": model, "optim": {"state": optim_state}} if optim_state else {"model": model}

    def _remap_position(self, ts: dict[str, Any], info: layout.CheckpointInfo) -> dict[str, Any]:
        """Map the data position of a checkpoint saved with another world size.

        At a window boundary (no batch of the window trained) the position is the same for any
        world size. Mid-window, each rank's batch count refers to its own shard of the window,
        which does not exist at the new world size: follow ``reshard_data_position``.
        """
        ts = dict(ts)
        ts["rows_unread"] = 0
        if ts["batches_in_window"] == 0:
            return ts
        policy = self.reshard_data_position
        if policy == "error":
            raise CheckpointError(
                f"checkpoint step {info.step} was saved with world size {info.world_size} in the "
                f"middle of train window {ts['window_index']} ({ts['window_id']!r}, after "
                f"{ts['batches_in_window']} batches per rank); this run has world size "
                f"{self.gang.world_size}, so that position does not exist. Either resume with "
                f"{info.world_size} ranks, resume from a checkpoint taken at a window boundary "
                f"(save_every_n_windows), or set reshard_data_position='restart_window' (re-read "
                f"the window: some rows twice) or 'next_window' (skip the rest of it).",
                step=info.step, path=info.path, kind="reshard")
        logger.warning("world size changed %d -> %d mid-window: %s", info.world_size,
                       self.gang.world_size, policy)
        if policy == "next_window":
            ts["window_index"] += 1
        ts["batches_in_window"] = 0
        return ts

