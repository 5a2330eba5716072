"""The save pipeline: snapshot, stage, write, commit, and the one save in flight.

The steps of a save (see ``checkpoint.manager``'s docstring for the whole picture):

* ``take_snapshot``: what a save of a step writes: the tensors (live), this rank's extra state
  (serialised now), the manifest's base and the ``SaveStats`` being filled in;
* ``Stager``: the copy of the tensors into reusable CPU buffers (async saves only);
* ``write_checkpoint``: DCP writes every rank's shards, every rank writes its extra file, then
  rank 0 ``commit``s (``args.json``, the ``COMMITTED`` marker, the index), on every path with
  the same collectives on the manager's gang;
* ``SaveQueue``: the writer thread and the (at most one) ``PendingSave``: submit, poll, wait,
  and wait with a deadline (the preemption save).

Rotation after a commit is not here: it is the manager's (``checkpoint.rotation`` decides).
Everything here takes the gang, the lock and the components as arguments.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

from recsys_trainer import storage
from recsys_trainer.checkpoint import contents, layout, writer
from recsys_trainer.checkpoint.errors import CheckpointError, describe_failure, only_os_errors
from recsys_trainer.checkpoint.lock import LeaseLock, OutputDirLock
from recsys_trainer.distributed import Gang
from recsys_trainer.storage import Location

# The manager's logger: users filter and read these messages under that name.
logger = logging.getLogger("recsys_trainer.checkpoint.manager")


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
class PendingSave:
    """A save submitted and not yet waited for (its future returns the manifest)."""

    step: int
    path: str
    future: cf.Future[dict[str, Any]]
    stats: SaveStats
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Snapshot:
    """What a save of ``step`` writes, taken on the main thread (see ``take_snapshot``)."""

    step: int
    tensors: dict[str, Any]
    """The live tensors (not copied: ``Stager.stage`` copies them for an async save)."""
    extra: bytes
    """This rank's extra state, serialised at the snapshot."""
    base: dict[str, Any]
    """The manifest's fields known before the write."""
    stats: SaveStats
    started: float
    """``time.perf_counter()`` at the start of the snapshot."""


def take_snapshot(components: contents.Components, key_filter: contents.KeyFilter, *,
                  gang: Gang, step: int, path: str,
                  last_metrics: dict[str, float], run_args: dict[str, Any]) -> Snapshot:
    """What a save of ``step`` to ``path`` writes: the tensors (live), this rank's extra state
    (serialised now), the manifest's base, its stats and start."""
    t0 = time.perf_counter()
    tensors = contents.tensor_state(components, key_filter)
    extra = contents.serialize(contents.extra_state(
        components, rank=gang.rank, world_size=gang.world_size,
        manager_state={}, args=run_args))
    counters = contents.counters(components)
    base = {
        "step": step,
        "epoch": counters["epoch"],
        "world_size": gang.world_size,
        "trainer_state": counters,
        "metrics": dict(last_metrics),
        "args": dict(run_args),
    }
    return Snapshot(step, tensors, extra, base, SaveStats(step=step, path=path, blocked_s=0.0),
                    t0)


class Stager:
    """The copy of an async save's tensors into CPU buffers allocated once (ideally before the
    first save, see ``prepare``) and reused by later saves: a memcpy into memory already
    faulted in."""

    def __init__(self) -> None:
        self.buffers = writer.StagingBuffers()
        self._cache: dict[str, Any] | None = None  # fallback (unsupported tensor types)

    def prepare(self, tensors: dict[str, Any]) -> None:
        """Allocate (and page-fault) the buffers for ``tensors`` on a helper thread: it takes
        seconds for big tables, better spent while the loop trains than inside the first
        save."""
        self.buffers.prepare(tensors, background=True)

    def wait_prepared(self) -> None:
        """Join the helper thread of ``prepare`` (if any)."""
        self.buffers.wait_prepared()

    def stage(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """``tensors`` copied into the reused buffers."""
        try:
            return self.buffers.stage(tensors)
        except TypeError:  # e.g. DTensor: torch's generic staging below
            pass
        if self._cache is not None:
            try:
                return _copy_state_dict(tensors, self._cache)
            except Exception:  # noqa: BLE001 - structure changed: rebuild the buffers
                self._cache = None
        self._cache = _create_cpu_state_dict(tensors, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(tensors, self._cache)


def write_checkpoint(loc: Location, tensors: dict[str, Any], extra: bytes, base: dict[str, Any],
                     *, gang: Gang, lock: OutputDirLock | LeaseLock, output_dir: str,
                     threads: int) -> dict[str, Any]:
    """Write and commit one checkpoint (all ranks; collectives on ``gang``); returns its
    manifest. ``threads``: DCP writer threads (and files) per rank; ``lock``: ``output_dir``'s,
    checked on rank 0 for a lease taken over.

    Every rank runs the same collectives on every path, failures included: a rank that fails
    locally reports it at the next collective instead of raising past it (the other ranks
    would wait there until the group's timeout, and the group's later collectives would be
    out of step). DCP itself makes every rank raise when one rank fails inside it."""
    rank, step, path = gang.rank, base["step"], loc.url
    local_error: str | None = None
    if rank == 0:
        try:
            if lock.lost:
                raise CheckpointError(
                    f"{lock.lost}: another job is saving into {output_dir!r}; "
                    "this job stops saving there. Use one output_dir per job.",
                    path=output_dir, kind="locked")
            if storage.is_dir(loc) and not layout.is_committed(loc):
                storage.remove_tree(loc)  # a crashed earlier attempt at this step
            storage.make_dir(loc)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            local_error = f"{type(e).__name__}: {e}"
    # Instead of a barrier: the directory exists (or every rank learns it does not).
    raise_if_any(gang.all_gather_object(local_error), step, path)
    threads = max(1, threads)
    # CRC32s are computed while DCP writes (helper threads overlap them with the write
    # syscalls), so there is no read-back pass; each DCP thread fsyncs its own file once.
    with cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-crc") as crc:
        dcp_writer = writer.HashingFileSystemWriter(loc, thread_count=threads, pool=crc,
                                                 sync_files=True)
        dcp.save(tensors, storage_writer=dcp_writer, process_group=gang.group)
    # dcp.save returned on every rank only after rank 0 wrote .metadata, i.e. after every
    # rank's shards were written and fsynced.
    files: dict[str, Any] = {}
    try:
        extra_name = contents.extra_file_name(rank)
        storage.write_bytes(loc.join(extra_name), extra)
        mine = [extra_name] + [n for n in storage.list_names(loc)
                               if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
        if rank == 0:
            mine.append(".metadata")
        digests = dcp_writer.digests
        digests[extra_name] = (len(extra), zlib.crc32(extra))
        for n in mine:  # anything written other than through the writer: hash it from disk
            if n not in digests:
                digests[n] = storage.digest(loc.join(n))
        files = {n: {"size": digests[n][0], "crc32": digests[n][1]} for n in mine}
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error = f"{type(e).__name__}: {e}"
    gathered = gang.all_gather_object((files, local_error))
    manifest: dict[str, Any] = {}
    errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err is not None]
    error: str | None = "; ".join(errors) if errors else None
    if rank == 0 and error is None:
        try:
            manifest = commit(loc, base, [part for part, _ in gathered])
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"{type(e).__name__}: {e}"
    # Every rank learns whether the commit happened (no rank hangs if rank 0 failed).
    error, manifest = gang.broadcast_object((error, manifest))
    if error is not None:
        raise CheckpointError(f"committing checkpoint step {step} at {path!r} failed: {error}",
                              step=step, path=path, kind="save_failed")
    return manifest


def raise_if_any(errors: list[str | None], step: int, path: str) -> None:
    """Raise a ``save_failed`` ``CheckpointError`` naming every rank whose entry is an error."""
    bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if bad:
        raise CheckpointError(f"saving checkpoint step {step} at {path!r} failed: "
                              + "; ".join(bad), step=step, path=path, kind="save_failed")


def commit(loc: Location, base: dict[str, Any], gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0, after every rank's files are known complete: ``args.json``, then the marker
    (the last object of the checkpoint), then the index."""
    files: dict[str, Any] = {}
    for part in gathered:
        files.update(part)
    # Locally, args.json's fsync of the directory also makes every rank's file entries
    # durable (their files were fsynced by the writers) before the marker exists.
    storage.write_bytes(loc.join("args.json"),
                       (json.dumps(base["args"], indent=2, sort_keys=True) + "\n").encode())
    manifest = {
        "format_version": layout.FORMAT_VERSION,
        **{k: v for k, v in base.items() if k != "args"},
        "commit_time": time.time(),
        "files": files,
    }
    storage.write_bytes(loc.join(layout.MARKER),
                       (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    parent = storage.parent(loc)
    if parent.is_local:
        # The step directory's own entry in output_dir must be durable before rotation may
        # delete older checkpoints: otherwise a power loss could leave neither.
        storage.fsync_dir(parent.path)
    try:
        layout.write_index(parent, layout.list_committed(parent))
    except OSError as e:  # the index is informational; the marker is what counts
        logger.warning("could not update %s: %s", parent.join(layout.INDEX).url, e)
    return manifest


class SaveQueue:
    """The writer thread and the save in flight (at most one), and the stats of every save
    that committed (``history``)."""

    def __init__(self) -> None:
        self._executor: cf.ThreadPoolExecutor | None = None
        self.pending: PendingSave | None = None
        self.history: list[SaveStats] = []

    def submit(self, snap: Snapshot, path: str, write: Callable[[], dict[str, Any]]) -> PendingSave:
        """Run ``write`` (returning the manifest) on the writer thread as the pending save of
        ``snap``; the loop's blocked time is counted up to now."""
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        future = self._executor.submit(write)
        snap.stats.blocked_s = time.perf_counter() - snap.started
        self.pending = PendingSave(snap.step, path, future, snap.stats, started=snap.started)
        return self.pending

    def run_here(self, snap: Snapshot, path: str, write: Callable[[], dict[str, Any]]) -> None:
        """Run ``write`` on this thread (a blocking save) and make it the pending save: its
        failure is raised, and its commit recorded, by ``wait`` as for an async one."""
        pending = PendingSave(snap.step, path, cf.Future(), snap.stats, started=snap.started)
        try:
            pending.future.set_result(write())
        except BaseException as e:
            pending.future.set_exception(e)
        snap.stats.blocked_s = time.perf_counter() - snap.started
        self.pending = pending

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self.pending is not None and not self.pending.future.done()

    def committed_unseen(self) -> bool:
        """Whether the pending save finished and succeeded (``wait`` would not block or raise).

        A *failed* save is left pending: the next save or the end of training (steps every rank
        reaches together) raises it. Ranks see their writer threads finish at different steps;
        raising at a poll would stop one rank while the others train on and wait for it in
        their next collective."""
        pending = self.pending
        return pending is not None and pending.future.done() and pending.future.exception() is None

    def wait(self) -> PendingSave | None:
        """Block until the pending save (if any) is committed; returns it (its stats complete
        and in ``history``), or None when there was none. A failed save raises
        ``CheckpointError`` here (the previous checkpoint is intact)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
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
        stats = pending.stats
        stats.total_s = time.perf_counter() - pending.started
        stats.num_bytes = sum(int(f["size"]) for f in manifest.get("files", {}).values())
        self.history.append(stats)
        logger.info("checkpoint step %d committed at %s (%.1f MB, loop blocked %.3fs, total %.2fs)",
                    stats.step, stats.path, stats.num_bytes / 1e6, stats.blocked_s, stats.total_s)
        return pending

    @staticmethod
    def await_commit(pending: PendingSave, deadline: float, what: str) -> None:
        """Wait for ``pending`` to finish (not to be waited for) until ``deadline``
        (``time.perf_counter()``); a ``CheckpointError`` with ``kind="deadline"`` after."""
        try:
            pending.future.exception(timeout=max(0.0, deadline - time.perf_counter()))
        except cf.TimeoutError:
            raise CheckpointError(
                f"{what} ({pending.path!r}) did not commit in time: it ran "
                f"{time.perf_counter() - pending.started:.1f} s. It is never loaded unless it "
                "commits; the last committed checkpoint stays the newest.",
                step=pending.step, path=pending.path, kind="deadline") from None

    def shutdown(self) -> None:
        """Stop the writer thread (after ``wait``); a later ``submit`` starts a new one."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
