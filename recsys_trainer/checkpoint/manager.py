"""``CheckpointManager``: how to save (per-rank concurrent, async, atomic commit), which
checkpoints to keep, and how to resume. *When* to save is ``hooks.checkpoint.CheckpointHook``'s
(the Trainer's resume points and the run's periods).

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
    main thread:   (at the next step, while a stream waits, at the next save, the end, or an
                   exception) after_save_checkpoint hooks

All collectives of a save run on the manager's own gang (by default a dedicated gloo group), so
the writer thread never interleaves with the training loop's collectives. A synchronous save (``async_save=False``) runs the same
writer code on the main thread without the staging copy (DCP writes from zero-copy views of
the live tensors).

The manager is a façade: each concern lives in its own module, and this class holds the
configuration and the run's state and composes them:

* ``checkpoint.save_pipeline``: snapshot, staging, write and commit, the save in flight;
* ``checkpoint.rotation``: which checkpoints to delete (a pure function; the deleting is here);
* ``checkpoint.resume``: choosing and verifying the checkpoint to resume from, quarantine, the
  foreign-checkpoint check;
* ``checkpoint.loading``: reading a checkpoint (strict keys, the data position remap);
* ``checkpoint.lock``: the ``output_dir`` lock and ``claim_output_dir``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs
import torch.distributed as dist

from recsys_trainer.args import CheckpointArguments, TrainingArguments, model_bank_sources
from recsys_trainer.checkpoint import contents, layout, loading, resume, rotation, writer
from recsys_trainer.checkpoint.lock import claim_output_dir, lock_for
from recsys_trainer.checkpoint.model_bank import warm_start
from recsys_trainer.checkpoint.save_pipeline import (
    SaveQueue,
    SaveStats,
    Snapshot,
    Stager,
    take_snapshot,
    write_checkpoint,
)
from recsys_trainer.distributed import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    FakeGang,
    Gang,
    ProcessGroupGang,
    new_gloo_group,
)
from recsys_trainer.storage import Location, locate, parent, resolve, same_place

__all__ = ["CheckpointListener", "CheckpointManager", "SaveStats"]

logger = logging.getLogger(__name__)

CheckpointListener = Callable[[str, str], None]
"""``(event, path)`` for ``before_save_checkpoint``, ``after_save_checkpoint`` and
``after_load_checkpoint`` (the Trainer's ``CheckpointHook`` relays them to the hooks)."""


class CheckpointManager:
    """Saves, rotates and restores checkpoints of named ``Stateful`` components.

    Args:
        output_dir: where ``step_<N>/`` directories and ``checkpoints.json`` live: a local path
            or a URL (``s3://bucket/prefix``, ``gs://``, ``hdfs://``...; see docs/checkpoint.md,
            "Object storage").
        settings: the ``CheckpointArguments`` section (``TrainingArguments.checkpoint``): the
            save triggers, retention (``max_to_keep``, ``keep_every_n_hours``,
            ``keep_best_metric``), ``async_save``, ``save_concurrency_per_rank``, what is left
            out (``params_not_save``, ``save_filter_fn``), ``resume_from``, ``model_bank`` and
            ``reshard_data_position``; each documented there. Default: the section's defaults.
        **fields: those settings by name instead (``CheckpointManager(out, save_steps=2)``),
            over ``settings``'s; checked as the section checks them.
        verify_checksums: check every file's CRC32 before loading (sizes are always checked).
        gang: the control collectives of saves and loads; by default (at ``attach``) a new gloo
            group over all ranks, or a ``FakeGang`` without ``torch.distributed``.
        collective_timeout_s: how long the default gang's collectives wait for other ranks.
        filesystem: a ``pyarrow.fs.FileSystem`` that ``output_dir`` (and paths given to
            ``save``, ``load`` and ``resume_from``) are paths in, instead of resolving them.
        lease_ttl_s: on object storage, how long ``output_dir``'s lease outlives its last
            renewal (renewed every quarter of it; see ``checkpoint.lock.LeaseLock``).

    The Trainer builds one with ``from_args`` unless given one, and ``attach``es its components.
    Public methods own the guards (drain, idempotency) and dispatch to ``_`` methods and to the
    concern modules (see the module docstring).
    """

    def __init__(
        self,
        output_dir: str,
        settings: CheckpointArguments | None = None,
        *,
        verify_checksums: bool = True,
        gang: Gang | None = None,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        filesystem: pafs.FileSystem | None = None,
        lease_ttl_s: float = 60.0,
        **fields: Any,
    ) -> None:
        # The settings are the section whole (one declaration of their defaults and checks);
        # `fields` (save_steps=..., max_to_keep=...) are a shorthand for a section of them. A
        # copy: changing the run's arguments afterwards does not change a built manager.
        s = settings if settings is not None else CheckpointArguments()
        self.settings: CheckpointArguments = dataclasses.replace(s, **fields)
        """What, when and how this manager saves (``TrainingArguments.checkpoint``)."""
        self.saves_requested = False
        """Whether a hook of the run asks for saves (``Hook.requests_saves``; the Trainer sets
        it before resuming): the run then saves without a save trigger of its own."""
        s = self.settings
        self.output_dir = output_dir
        self._filesystem = filesystem
        self._out = self._locate(output_dir)
        self.model_bank = model_bank_sources(s.model_bank)
        self.key_filter = contents.KeyFilter(s.params_not_save, s.save_filter_fn)
        self.policy = rotation.RetentionPolicy(s.max_to_keep, s.keep_every_n_hours,
                                               s.keep_best_metric, s.keep_best_mode)
        self.verify_checksums = verify_checksums
        self._gang = gang
        self.collective_timeout_s = collective_timeout_s
        self._lock = lock_for(self._out, lease_ttl_s)
        self._components: contents.Components = {}
        self._listener: CheckpointListener = lambda _event, _path: None
        self._run_args: dict[str, Any] = {}
        self._saves = SaveQueue()
        self._stager = Stager()
        self._resumed_step: int | None = None
        self._resume_done = False
        self.last_metrics: dict[str, float] = {}
        """The latest evaluation metrics (recorded in the next checkpoint's manifest)."""
        self._warned_best_missing = False

    # The settings by their names, read-only: they live in ``settings`` (a copy of the run's
    # section); assigning one of these would otherwise silently change nothing.
    save_steps = property(lambda self: self.settings.save_steps)
    save_every_n_rows = property(lambda self: self.settings.save_every_n_rows)
    save_every_n_windows = property(lambda self: self.settings.save_every_n_windows)
    save_every_n_epochs = property(lambda self: self.settings.save_every_n_epochs)
    save_end = property(lambda self: self.settings.save_end)
    save_concurrency_per_rank = property(lambda self: self.settings.save_concurrency_per_rank)
    async_save = property(lambda self: self.settings.async_save)
    resume_from = property(lambda self: self.settings.resume_from)
    reshard_data_position = property(lambda self: self.settings.reshard_data_position)

    @classmethod
    def from_args(cls, args: TrainingArguments, gang: Gang | None = None) -> CheckpointManager:
        """Build from ``TrainingArguments``: its ``checkpoint`` section whole, its
        ``output_dir`` and ``collective_timeout_s``."""
        return cls(args.output_dir, args.checkpoint, gang=gang,
                   collective_timeout_s=args.collective_timeout_s)

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
            else locate(path)

    @property
    def gang(self) -> Gang:
        """The gang of the manager's control collectives (set by ``attach``)."""
        if self._gang is None:
            raise RuntimeError("the CheckpointManager is not attached to any state yet; call "
                               "attach(components) first (the Trainer does).")
        return self._gang

    @property
    def history(self) -> list[SaveStats]:
        """Stats of every committed save of this manager."""
        return self._saves.history

    @property
    def _staging(self) -> writer.StagingBuffers:
        # The async save's staging buffers; tests read them and benchmarks/bench_checkpoint.py
        # swaps in fresh ones to time a cold save.
        return self._stager.buffers

    @_staging.setter
    def _staging(self, buffers: writer.StagingBuffers) -> None:
        self._stager.buffers = buffers

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

    # ------------------------------------------------------------------ the run's life

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
                                      verified=self.settings.resume_from == "auto")
            elif self.model_bank:
                warm_start(self._components, self.model_bank, gang)
            return source
        if self.will_save():
            claim_output_dir(self._lock, self._out, self.output_dir, gang)
        if self._resume_done:
            return None
        self._resume_done = True
        if gang.rank == 0 and self._saves.pending is None:
            resume.remove_incomplete(self._out)
        # Only a run that saves here holds output_dir's lock, and only its own saves would
        # collide with a bad checkpoint left under a step name.
        source = self._choose_source(may_quarantine=self.will_save())
        if source is not None:
            logger.info("resuming from %s (step %d)", source.path, source.step)
            self._load_and_notify(source, mode="training", verified=self.settings.resume_from == "auto")
            self._resumed_step = source.step
        elif self.model_bank:
            warm_start(self._components, self.model_bank, gang)
        if self.will_save():
            resume.check_no_foreign_checkpoints(
                contents.counters(self._components)["global_step"], source, out=self._out,
                output_dir=self.output_dir, resume_from=self.settings.resume_from)
        self._prepare_staging()
        return source

    def _choose_source(self, may_quarantine: bool) -> layout.CheckpointInfo | None:
        return resume.choose_source(
            self.gang, resume_from=self.settings.resume_from, out=self._out, output_dir=self.output_dir,
            verify_checksums=self.verify_checksums, may_quarantine=may_quarantine,
            locate=self._locate)

    def will_save(self) -> bool:
        """Whether this run saves checkpoints: a save trigger is set, or a hook asks for saves
        (``saves_requested``)."""
        triggers = (self.settings.save_steps, self.settings.save_every_n_rows, self.settings.save_every_n_windows,
                    self.settings.save_every_n_epochs, self.settings.save_every_n_event_seconds)
        return (self.settings.save_end or self.saves_requested
                or any(t is not None for t in triggers))

    def _prepare_staging(self) -> None:
        """Async saves copy into staging buffers; allocating (and page-faulting) them takes
        seconds for big tables, so do it now, on a helper thread, while the loop trains, instead
        of inside the first save. Only when this run will save asynchronously."""
        if not self.settings.async_save or not self.will_save():
            return
        try:
            self._stager.prepare(contents.tensor_state(self._components, self.key_filter))
        except Exception as e:  # noqa: BLE001 - an optimisation: the first save allocates
            logger.warning("could not pre-allocate checkpoint staging buffers: %s", e)

    def poll(self) -> None:
        """Finish a completed async save without blocking: its ``after_save_checkpoint`` fires
        on this thread. A failed one stays pending (``SaveQueue.committed_unseen`` says why):
        it is raised by ``wait``, which the ranks call together."""
        if self._saves.committed_unseen():
            self.wait()

    def finish(self) -> None:
        """When training ends normally: wait for the save in flight to commit, then release
        ``output_dir``'s lock (a later ``resume`` claims it again)."""
        self.wait()
        self._lock.release()

    def close(self) -> None:
        """Drain the in-flight save (its commit hooks fire) and stop the writer thread. Safe to
        call more than once; a later save starts a new writer thread."""
        try:
            self.wait()
        finally:
            self._lock.release()
            self._stager.wait_prepared()
            self._saves.shutdown()

    # ------------------------------------------------------------------ public API

    def save(self, path: str | None = None, *, blocking: bool | None = None) -> str:
        """Save a checkpoint of the attached components at their current step; returns its
        directory (all ranks call this together).

        ``path`` defaults to ``output_dir/step_<global_step>``. ``blocking`` defaults to
        ``not async_save``. Saving a step that is already committed (or in flight) is a no-op.
        """
        self.gang  # noqa: B018 - raises when nothing is attached
        step = int(contents.counters(self._components)["global_step"])
        loc = self._locate(path) if path else self._step_location(step)
        path = loc.url
        pending = self._saves.pending
        if pending is not None and pending.path == path:
            return path
        self.wait()
        if layout.is_committed(loc):
            logger.info("checkpoint %s is already committed; not saving step %d again", path, step)
            return path
        blocking = (not self.settings.async_save) if blocking is None else blocking
        self._save(step, loc, blocking)
        return path

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; fire ``after_save_checkpoint``.
        A failed save raises ``CheckpointError`` here (the previous checkpoint is intact)."""
        committed = self._saves.wait()
        if committed is not None:
            self._listener("after_save_checkpoint", committed.path)

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
        if self._saves.pending is not None:
            SaveQueue.await_commit(self._saves.pending, deadline, "the save in flight")
            self.wait()
        step = int(contents.counters(self._components)["global_step"])
        loc = self._step_location(step)
        if layout.is_committed(loc):
            return loc.url
        snap = self._snapshot(step, loc)
        views = writer.exact_views(snap.tensors)
        pending = self._saves.submit(
            snap, loc.url, lambda: self._write(loc, views, snap.extra, snap.base))
        SaveQueue.await_commit(pending, deadline, f"the save of step {step}")
        snap.stats.blocked_s = time.perf_counter() - snap.started
        self.wait()
        return loc.url

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._saves.in_flight

    def step_path(self, step: int) -> str:
        """The directory ``save()`` commits the checkpoint of ``step`` to
        (``output_dir/step_<N>``)."""
        return self._step_location(step).url

    def is_committed(self, path: str) -> bool:
        """Whether the checkpoint at ``path`` is committed (only committed checkpoints count)."""
        return layout.is_committed(self._locate(path))

    def _step_location(self, step: int) -> Location:
        return self._out.join(layout.step_dir_name(step))

    # ------------------------------------------------------------------ internals: save

    def _save(self, step: int, loc: Location, blocking: bool) -> None:
        path = loc.url
        snap = self._snapshot(step, loc)
        if blocking:
            # The loop is blocked: DCP may write straight from the live tensors (exact views
            # spare it a clone of every table that is a view of a fused buffer).
            self._saves.run_here(snap, path, lambda: self._write(
                loc, writer.exact_views(snap.tensors), snap.extra, snap.base))
            self.wait()
            return
        # Snapshot: the loop mutates the live tensors in place from the next step on.
        staged = self._stage(snap.tensors)
        self._saves.submit(snap, path, lambda: self._write(loc, staged, snap.extra, snap.base))

    def _snapshot(self, step: int, loc: Location) -> Snapshot:
        """``before_save_checkpoint``, then what a save of ``step`` writes
        (``save_pipeline.take_snapshot``)."""
        path = loc.url
        self._listener("before_save_checkpoint", path)
        return take_snapshot(self._components, self.key_filter, gang=self.gang, step=step,
                             path=path, last_metrics=self.last_metrics,
                             run_args=self._run_args)

    def _stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Copy every tensor into CPU buffers allocated once (ideally before the first save, see
        ``_prepare_staging``) and reused by later saves: a memcpy into memory already faulted
        in. (A method of the manager so that a script can count async saves by wrapping it.)"""
        return self._stager.stage(tensors)

    def _write(self, loc: Location, tensors: dict[str, Any], extra: bytes,
               base: dict[str, Any]) -> dict[str, Any]:
        """Write and commit one checkpoint (all ranks; ``save_pipeline.write_checkpoint``), then
        rank 0 rotates ``output_dir`` when the checkpoint is in it. Runs on the writer thread
        for an async save; the lambdas that submit it look it up at call time, so tests can
        wrap ``CheckpointManager._write`` to slow writes down."""
        manifest = write_checkpoint(loc, tensors, extra, base, gang=self.gang, lock=self._lock,
                                    output_dir=self.output_dir,
                                    threads=self.settings.save_concurrency_per_rank)
        if self.gang.rank == 0 and same_place(parent(loc), self._out):
            self._rotate(just_committed=base["step"])
        return manifest

    def _rotate(self, just_committed: int) -> None:
        """Delete what the retention policy lets go (``rotation.select_to_delete`` decides).
        Never the checkpoint just committed, even when ``output_dir`` holds newer steps (e.g.
        from an earlier run this one did not resume from): it is this run's latest state. A
        failure is logged; the commit stands."""
        try:
            infos = layout.list_committed(self._out)
            protected = {s for s in (self._resumed_step, just_committed) if s is not None}
            doomed = [i for i in rotation.select_to_delete(infos, self.policy, protected)
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

    # ------------------------------------------------------------------ internals: load

    def _load_and_notify(self, info: layout.CheckpointInfo, *, mode: contents.RestoreMode,
                         verified: bool, strict: bool = True, path: str | None = None) -> None:
        self.wait()
        with layout.reading(info.where):
            if not verified:
                failures = resume.verify_everywhere(self.gang, info, output_dir=self.output_dir,
                                                    verify_checksums=self.verify_checksums)
                if failures:
                    resume.raise_verification_failure(info, failures, self.gang.world_size)
            loading.load_checkpoint(
                self._components, info, gang=self.gang, strict=strict, mode=mode,
                key_filter=self.key_filter, reshard_data_position=self.settings.reshard_data_position)
        self._listener("after_load_checkpoint", path if path is not None else info.path)
