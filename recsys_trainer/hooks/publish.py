"""``PublishHook``: publish the model to a serving location while it trains (online learning).

During ``train()`` the hook publishes to LOCATION (a path or URL; the format is
``recsys_trainer.serving.published``): a full artifact first, then a delta per period (every N
train windows, N steps and/or N seconds: the run's one period rule, ``recsys_trainer.periods``),
a new full artifact every ``full_every`` deltas or
when a delta would exceed ``max_delta_fraction`` of its base's bytes, and after each publish
the ``LATEST`` pointer, written last; then old bases and deltas are rotated away
(``keep_bases``).

How a publish runs, and what it costs the training loop::

    every rank, at a resume point where a period is due (``on_resume_point``):
        trainer.request_save("publish")  the CheckpointHook saves this step at the end of the
                                       resume point, with its own periods' save; with
                                       ``async_save`` (the default) only its snapshot blocks
    rank 0, when that checkpoint commits (``after_save_checkpoint``, which the CheckpointHook
    fires: at the next step, or, on a stream that waits for its next window, at the wait's first
    heartbeat, the ``"wait"`` resume point where it waits for the commit):
        take a read lease on it        so checkpoint rotation keeps it while it is read
        send its path and its newest window's landing time (``WindowedDataset.landed_at``) to
        the publisher process (a ``PublishJob`` on a pipe)
    rank 0's publisher process (``background=True``; started at ``before_train``):
        build the full export of the checkpoint, or the delta against the previous published
        state (kept as a full export in a local staging directory), locally; upload it under
        bases/ or deltas/ (manifest, files, COMMITTED last); write LATEST; rotate; report back
        (a ``PublishRecord``)

The loop is blocked only by the save's snapshot and rank 0's lease and pipe write
(``PublishRecord.blocked_s`` measures them; docs/online.md has the figures). The publisher is
a separate process, not a thread: ``torch.export`` patches ``nn.Module.__call__`` process-wide
while it traces, which breaks a forward running meanwhile on the training thread. It exports
the committed checkpoint, not the live model, so what it publishes is exactly a step the job
can resume from. It needs the architecture as an unsharded module (tables on the ``meta``
device are enough): ``model=``, or, by default, one derived at ``before_train`` from the
Trainer's model (``serving.exporting.model_parts.skeleton``: a CPU copy of its dense part, its
sharded or unsharded ``EmbeddingBagCollection`` / ``EmbeddingCollection`` tables rebuilt on
``meta``; dynamic and managed-collision tables cannot be rebuilt from their sharded form: pass
``model=``). The publisher imports that module's classes, so they must be importable (not
defined in ``__main__``); it starts with this process's ``sys.path``.

A publish that fails (the store is down, a disk is full, the publisher died) logs a
``PublishError`` naming the location and the cause and is tried again at the next period,
from the newest checkpoint; it never stops training, and ``LATEST`` only ever names committed
artifacts (a failed publish may leave a committed artifact no pointer names: rotation removes
it). Sequence numbers of failed publishes are not reused, so a pointer's ``sequence`` grows by
one per publish or more. When publishes fall behind, the publisher skips to the newest
checkpoint sent (the skipped ones are recorded as ``superseded``).

A preemption (SIGTERM/SIGINT, ``recsys_trainer.preemption``) publishes the step saved for it:
rank 0 hands that checkpoint over at ``on_preempt`` and waits for its report until
``PREEMPT_EXIT_MARGIN_S`` before the end of ``preemption_grace_s`` (the other ranks wait with it).
The publisher runs in a session of its own, so the signal a terminal or torchrun's agent sends to
the job's process group does not end it; it ends when the training process does.

After a restart (of the job or of the publisher) the publisher reads the location's pointer,
continues its sequence, and publishes a new base first (the state after the last delta is
not stored anywhere as a full export).

All ranks take part in the save (its collectives); only rank 0 exports, uploads and rotates
(from the checkpoint: no collectives). With ``every_n_seconds`` and several ranks, the ranks
agree at every step and window end (``periods.Trigger``: one one-int all-reduce, due when any
rank's clock says so).

With ``every_eviction_pass`` the hook also publishes after each admission/eviction pass of the
model's dynamic tables: it reads the tables' last-pass step at every step's resume point.

This module is when to publish and what to do with a report; the pipe to the publisher process
(both ends, the job and the report) is ``serving/exporting/publisher_client.py``, the publisher
itself (build, upload, point, rotate) ``serving/exporting/publisher.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs
from torch import nn

from recsys_trainer import dynamic, torchrec_compat
from recsys_trainer.checkpoint import layout
from recsys_trainer.hooks.base import Hook, ResumePoint, SaveRequest, TrainerView
from recsys_trainer.periods import Trigger
from recsys_trainer.serving.exporting.model_parts import skeleton
from recsys_trainer.serving.exporting.publisher import Publisher
from recsys_trainer.serving.exporting.publisher_client import (
    PublisherClient,
    PublishJob,
    PublishRecord,
    save_init,
)

if TYPE_CHECKING:
    from recsys_trainer.preemption import Preemption

logger = logging.getLogger(__name__)

PREEMPT_EXIT_MARGIN_S = 2.0
"""At a preemption, the publish of the stopped step must be reported this long before the end of
``preemption_grace_s`` (the rest is the exit's, before the launcher's SIGKILL)."""


class PublishError(RuntimeError):
    """A publish that failed; logged (``PublishError: ...``) and retried at the next period."""


def _positive(name: str, value: Any, kind: type | tuple[type, ...] = int, *,
              allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not isinstance(value, kind) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"`{name}` must be a positive number, but is {value!r}.")


# ---------------------------------------------------------------------- the hook

class PublishHook(Hook):
    """Publish the model to ``location`` while it trains (see the module docstring).

    Args:
        location: where to publish: a local path or a URL (``s3://bucket/prefix``).
        every_n_windows / every_n_steps / every_n_seconds / every_eviction_pass: the periods
            (at least one); a publish is due when any of them is: after every N-th train window
            of this run, every N-th step, or the first step or window end N seconds after the
            last publish (``recsys_trainer.periods``). ``every_n_event_seconds``: after the
            train window that crosses every N seconds of event time (an event-time source such
            as a Kafka topic). ``every_eviction_pass``: after
            every admission/eviction pass of the model's dynamic tables (at the end of the step
            that ran it), so serving drops the evicted ids and scores the admitted ones. Training's end always publishes its last step,
            and so does a stop for a preemption (within the grace period).
        full_every: a new base after this many deltas on one base.
        max_delta_fraction: a new base instead of a delta whose bytes exceed this fraction of
            the base's.
        keep_bases: bases kept by rotation (with the deltas their chains need).
        background: publish from a separate process (False: on the training thread, which
            then blocks for the whole publish; for debugging).
        filesystem: a ``pyarrow.fs`` filesystem ``location`` is a path in.
        model: the unsharded architecture for the export (default: derived from the Trainer's
            model; needed for dynamic and managed-collision tables).
        staging_dir: a local directory for the previous published state (a full export);
            default: a temporary directory, removed at the end.
        quantize / activation / output_names: as ``export_for_serving``'s.
        final_timeout_s: at the end of training, how long to wait for the last publish.

    Publishes are exports of committed checkpoints in ``output_dir``: the hook asks the
    Trainer's ``CheckpointHook`` for a save at each publish (``trainer.request_save``), whether
    or not ``args`` sets save periods of its own. Keep ``async_save`` (the default) so that the
    loop blocks only for the snapshot. ``records`` lists every publish (rank 0), ``last_error``
    the last failure, ``publisher_pid`` the publisher process.
    """

    requests_saves = True  # every publish is of a checkpoint it asks for

    def __init__(self, location: str, *, every_n_windows: int | None = None,
                 every_n_steps: int | None = None, every_n_seconds: float | None = None,
                 every_eviction_pass: bool = False, every_n_event_seconds: float | None = None,
                 full_every: int = 10, max_delta_fraction: float = 0.5, keep_bases: int = 3,
                 background: bool = True, filesystem: pafs.FileSystem | None = None,
                 model: nn.Module | None = None, staging_dir: str | None = None,
                 quantize: str | None = None, activation: str = "sigmoid",
                 output_names: list[str] | None = None, final_timeout_s: float = 600.0) -> None:
        if not isinstance(location, str | os.PathLike) or not os.fspath(location):
            raise ValueError(f"`location` must be a path or URL, but is {location!r}.")
        if every_n_windows is None and every_n_steps is None and every_n_seconds is None \
                and not every_eviction_pass and every_n_event_seconds is None:
            raise ValueError("PublishHook needs a period: every_n_windows, every_n_steps, "
                             "every_n_seconds, every_n_event_seconds or every_eviction_pass.")
        if not isinstance(every_eviction_pass, bool):
            raise ValueError(f"`every_eviction_pass` must be true or false, but is "
                             f"{every_eviction_pass!r}.")
        self._trigger = Trigger.of({"every_n_windows": (every_n_windows, "windows"),
                                    "every_n_steps": (every_n_steps, "steps"),
                                    "every_n_seconds": (every_n_seconds, "seconds"),
                                    "every_n_event_seconds": (every_n_event_seconds,
                                                              "event_seconds")})
        _positive("full_every", full_every)
        _positive("keep_bases", keep_bases)
        _positive("max_delta_fraction", max_delta_fraction, (int, float))
        _positive("final_timeout_s", final_timeout_s, (int, float))
        self.location = os.fspath(location)
        self.every_n_windows = every_n_windows
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.every_eviction_pass = every_eviction_pass
        self.every_n_event_seconds = every_n_event_seconds
        self._id_maps: list[Any] = []
        self._pass_steps: tuple[int, ...] = ()
        self.full_every = full_every
        self.max_delta_fraction = float(max_delta_fraction)
        self.keep_bases = keep_bases
        self.background = background
        self.filesystem = filesystem
        self.model = model
        self.staging_dir = staging_dir
        self.quantize = quantize
        self.activation = activation
        self.output_names = output_names
        self.final_timeout_s = float(final_timeout_s)
        self.records: list[PublishRecord] = []
        """Every publish this run, in order (rank 0; other ranks record nothing)."""
        self.last_error: PublishError | None = None
        self._client: PublisherClient | None = None
        self._reset()

    def in_smoke_test(self, directory: str) -> None:
        # The smoke test's publishes must not reach the followers of the real location.
        smoke_location = f"{directory.rstrip('/')}/published"
        logger.info("smoke test: PublishHook publishes to %s instead of %s", smoke_location,
                    self.location)
        self.location, self.filesystem = smoke_location, None

    @property
    def publisher_pid(self) -> int | None:
        """The publisher process's pid (rank 0, ``background=True``, while one runs); None
        otherwise."""
        return self._client.pid if self._client is not None else None

    def _reset(self) -> None:
        self._trigger.restart_clock()
        self._last_window: str | None = None
        self._last_requested_step = -1
        # checkpoint -> (its save, newest train window, when that window landed)
        self._wanted: dict[str, tuple[SaveRequest, str | None, float | None]] = {}
        self._inflight: dict[str, tuple[PublishJob, contextlib.ExitStack]] = {}  # + read lease
        self._init_path: str | None = None
        self._stage: str | None = None
        self._own_stage = False
        self._local: Publisher | None = None
        self._trained = False
        self._preempt_deadline: float | None = None  # monotonic; set at a "preempt" point

    # ------------------------------------------------------------------ events

    def before_train(self, trainer: TrainerView) -> None:
        self._stop_publisher(0.0)
        self._reset()
        self._id_maps = dynamic.id_maps(trainer.model)
        self._pass_steps = dynamic.pass_steps(self._id_maps)
        if self.every_eviction_pass and not self._pass_steps:
            raise ValueError("PublishHook(every_eviction_pass=True): the model has no dynamic "
                             "tables, so there are no eviction passes to publish after; use "
                             "every_n_windows / every_n_steps / every_n_seconds.")
        if trainer.rank != 0:
            return
        live = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
        assert isinstance(live, nn.Module)
        model = self.model if self.model is not None else skeleton(live)
        ds = trainer.train_dataset
        spec = getattr(ds, "features", None)
        if spec is None:
            raise ValueError("PublishHook: the train dataset has no FeatureSpec (`features`), "
                             "which the serving artifact needs.")
        try:
            if self.staging_dir is None:
                self._stage, self._own_stage = tempfile.mkdtemp(prefix="recsys-publish-"), True
            else:
                os.makedirs(self.staging_dir, exist_ok=True)
                self._stage = self.staging_dir
        except OSError as e:
            raise PublishError(
                f"PublishHook cannot make its local staging directory "
                f"({self.staging_dir or tempfile.gettempdir()!r}: {e}); it builds each export "
                "there before the upload: give `staging_dir=` a writable directory with room "
                "for two exports.") from e
        init = {"location": self.location, "filesystem": self.filesystem,
                "stage": self._stage, "model": model, "spec": spec,
                "full_every": self.full_every, "max_delta_fraction": self.max_delta_fraction,
                "keep_bases": self.keep_bases, "quantize": self.quantize,
                "activation": self.activation, "output_names": self.output_names}
        if not self.background:
            self._local = Publisher(**init)
            return
        self._init_path = os.path.join(self._stage, "publisher-init.pt")
        # The publisher process receives the architecture pickled: dynamic tables' managed-
        # collision modules carry a load hook pickle cannot name, replaced by an equal one.
        torchrec_compat.picklable_load_hooks(model)
        try:
            save_init(self._init_path, init)
        except OSError as e:  # a full or read-only staging directory, named
            raise PublishError(f"PublishHook cannot write {self._init_path!r}: {e}; give "
                               "`staging_dir=` a writable directory with room for two "
                               "exports.") from e
        except (AttributeError, TypeError, pickle.PicklingError) as e:
            raise PublishError(
                f"PublishHook cannot hand the model's architecture ({type(model).__name__}) to "
                f"its publisher process: it does not pickle ({e}). Make the module picklable "
                "(no lambdas or local functions in its attributes or hooks), or publish in "
                "this process with PublishHook(background=False).") from e
        self._start_publisher()

    def after_window(self, trainer: TrainerView, window_id: str) -> None:
        if trainer.state.mode == "train":
            self._last_window = window_id

    def on_resume_point(self, trainer: TrainerView, point: ResumePoint) -> None:
        if trainer.rank == 0:
            self._poll()
        step = trainer.state.global_step
        if point == "preempt":  # the CheckpointHook saves this step; on_preempt publishes it
            self._note_grace(trainer)
            return
        if point not in ("step", "window", "epoch", "end") or step == self._last_requested_step:
            return  # "wait": the CheckpointHook's commit hands the save over (after_save_...)
        if point == "end":
            due = True
        else:
            # Windows: the run's count (checkpointed), so a resumed run publishes after the same
            # windows as one never stopped.
            due = self._trigger.due(point, trainer.state, gang=trainer.gang)
        if point == "step" and self.every_eviction_pass:
            # A pass changed which ids have rows (the same on every rank: passes run at step
            # ends): serving should drop the evicted ids and learn the admitted ones.
            passes = dynamic.pass_steps(self._id_maps)
            due = due or passes != self._pass_steps
            self._pass_steps = passes
        if due:
            self._request(trainer, step)

    def after_save_checkpoint(self, trainer: TrainerView, path: str) -> None:
        if trainer.rank == 0 and path.rstrip("/") in self._wanted:
            self._submit(trainer, path.rstrip("/"))

    def after_train(self, trainer: TrainerView) -> None:
        self._trained = True
        if trainer.rank == 0:
            self.wait(self.final_timeout_s)

    def _note_grace(self, trainer: TrainerView) -> None:
        """Every rank, at the "preempt" point: when the grace period ends (from the first
        signal on any rank: the ranks agree on the longest time since one)."""
        p, grace = trainer.preemption, trainer.args.preemption_grace_s
        if p is None or grace is None:
            return
        since_ms = int(1000 * p.seconds_to_stop)
        if trainer.world_size > 1:
            since_ms = trainer.gang.all_reduce_max([since_ms])[0]
        self._preempt_deadline = time.monotonic() + grace - since_ms / 1000

    def on_preempt(self, trainer: TrainerView, preemption: Preemption) -> None:
        """Publish the step saved for the preemption, waiting for it within what is left of
        the grace period; the other ranks wait with rank 0 (one of them exiting first makes
        torchrun stop the job, rank 0 and its publish with it)."""
        if preemption.save_still_running or self._preempt_deadline is None:
            return  # the process ends at once
        if trainer.rank == 0:
            self._publish_preempted(trainer, preemption)
        if trainer.world_size > 1:
            trainer.gang.barrier()

    def _publish_preempted(self, trainer: TrainerView, p: Preemption) -> None:
        assert self._preempt_deadline is not None
        if p.committed and p.checkpoint is not None and p.step != self._last_requested_step:
            path = p.checkpoint.rstrip("/")
            self._last_requested_step = p.step
            saved = SaveRequest("preemption", p.step, path, committed=True)
            self._wanted[path] = (saved, self._last_window,
                                  self._landed_at(trainer, self._last_window))
            self._submit(trainer, path)
        budget = min(self.final_timeout_s,
                     self._preempt_deadline - PREEMPT_EXIT_MARGIN_S - time.monotonic())
        if self._inflight and not self.wait(max(budget, 0.0)):
            logger.warning("PublishHook: the publish of step %d was not reported within the "
                           "preemption grace period; LATEST still names an earlier one", p.step)

    def end(self, trainer: TrainerView) -> None:
        if trainer.rank != 0:
            return
        # After an exception nothing waits: a publisher stopped mid-publish leaves no pointer
        # naming a partial artifact. After a preemption on_preempt has waited already.
        preempted, self._preempt_deadline = self._preempt_deadline is not None, None
        self._stop_publisher(0.5 if preempted else self.final_timeout_s if self._trained else 0.0)
        for _, lease in self._inflight.values():
            lease.close()
        self._inflight.clear()
        if self._own_stage and self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)

    # ------------------------------------------------------------------ the hand-over

    def _request(self, trainer: TrainerView, step: int) -> None:
        """Every rank: ask for the save of this step (the CheckpointHook's, at the end of this
        resume point); rank 0 hands it over when it has committed."""
        self._last_requested_step = step
        self._trigger.restart_clock()  # every_n_seconds counts from the last publish
        saved = trainer.request_save("publish")
        if trainer.rank != 0:
            return
        path = saved.path.rstrip("/")
        self._wanted[path] = (saved, self._last_window,
                              self._landed_at(trainer, self._last_window))
        if saved.committed:
            self._submit(trainer, path)  # committed before: no commit event follows

    @staticmethod
    def _landed_at(trainer: TrainerView, window: str | None) -> float | None:
        """When the train dataset says ``window`` landed (the pointer's ``window_time``)."""
        ds = trainer.train_dataset
        return ds.landed_at(window) if ds is not None and window is not None else None

    def _submit(self, trainer: TrainerView, path: str) -> None:
        """Rank 0: take a read lease on the committed checkpoint ``path`` and hand it to the
        publisher."""
        if path in self._inflight or path not in self._wanted:
            return
        t0 = time.perf_counter()
        saved, window, window_time = self._wanted.pop(path)
        job = PublishJob(path, saved.step, window, window_time, saved.blocked_s)
        lease = contextlib.ExitStack()
        try:
            lease.enter_context(layout.reading(path))
        except Exception as e:  # noqa: BLE001 - rotated away already: the next period retries
            self._take(PublishRecord.unpublished(job, "failed", f"{type(e).__name__}: {e}"))
            return
        self._inflight[path] = (job, lease)
        if self._local is not None:
            job = dataclasses.replace(job, blocked_s=saved.blocked_s + time.perf_counter() - t0)
            self._take(self._local.publish(job))
            return
        if self._client is None or not self._client.running:
            self._start_publisher()
        assert self._client is not None
        job = dataclasses.replace(job, blocked_s=saved.blocked_s + time.perf_counter() - t0)
        try:
            self._client.send(job)
        except OSError as e:  # the publisher died: restarted at the next period
            self._take(PublishRecord.unpublished(job, "failed",
                                                 f"the publisher process is gone ({e})"))

    # ------------------------------------------------------------------ the publisher's life

    def _start_publisher(self) -> None:
        assert self._init_path is not None
        self._client = PublisherClient(self._init_path, on_arrival=self._log_on_arrival)
        self._client.start()

    def _log_on_arrival(self, record: PublishRecord) -> None:
        """On the client's reader thread: a failure is logged as it arrives (the training
        thread takes reports in only at its resume points and events)."""
        if record.kind == "failed":
            _log_failure(_failure(self.location, record))

    def _stop_publisher(self, timeout: float) -> None:
        client = self._client
        if client is None:
            return
        if timeout > 0:
            self.wait(timeout)
        self._client = None
        client.close(timeout)
        for record in client.reports():
            self._take(record, logged=True)

    def _poll(self) -> None:
        """Take in what the publisher reported (non-blocking)."""
        client = self._client
        if client is None:
            return
        for record in client.reports():
            self._take(record, logged=True)
        code = client.exit_code()
        if code is not None:
            self._client = None
            for job, _ in list(self._inflight.values()):
                self._take(PublishRecord.unpublished(
                    job, "failed", f"the publisher process exited with code {code}"))

    def _take(self, record: PublishRecord, *, logged: bool = False) -> None:
        """What to do with a report: release its lease, record it, log it (a failure only when
        not ``logged`` as it arrived)."""
        held = self._inflight.pop(str(record.checkpoint or ""), None)
        if held is not None:
            held[1].close()
        self.records.append(record)
        if record.kind == "failed":
            err = _failure(self.location, record)
            self.last_error = err
            if not logged:
                _log_failure(err)
            return
        if record.kind == "superseded":
            # A reader of the log expecting a publish per window must see why one is absent.
            logger.info("not publishing step %d (window %s): a newer checkpoint was handed to "
                        "the publisher before it began, and is published instead",
                        record.step, record.window)
            return
        self.last_error = None
        logger.info("published %s %s (step %d, window %s, %.2f MB) to %s in %.2f s; the loop "
                    "was blocked %.1f ms", record.kind, record.ref, record.step, record.window,
                    record.bytes / 1e6, self.location, record.seconds, 1e3 * record.blocked_s)
        if record.rotation_error:
            logger.warning("PublishHook: rotating %s failed (%s); trying again after the next "
                           "publish", self.location, record.rotation_error)

    def wait(self, timeout: float | None = None) -> bool:
        """Rank 0: wait until every publish sent has been reported; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._poll()
            if not self._inflight:
                return True
            if self._client is None:
                return not self._inflight
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("PublishHook: %d publish(es) still running after %.0f s",
                               len(self._inflight), timeout)
                return False
            time.sleep(0.05)


def _failure(location: str, record: PublishRecord) -> PublishError:
    return PublishError(f"publishing step {record.step} to {location} failed: {record.error}")


def _log_failure(err: PublishError) -> None:
    logger.error("PublishError: %s; LATEST is unchanged; trying again at the next period", err)


__all__ = ["PublishError", "PublishHook"]
