"""On-disk layout of checkpoints, the commit marker, the index, and retention (pure functions).

::

    output_dir/
        checkpoints.json            # human-readable index of committed checkpoints (rank 0)
        step_00000120/              # one directory per checkpoint, named by global step
            .metadata               # torch.distributed.checkpoint (DCP) metadata (rank 0)
            __0_0.distcp ...        # DCP shards: rank r writes __r_0 .. __r_{threads-1}
            rank_00000.pt ...       # per-rank non-tensor state (counters, RNG, data, hooks)
            args.json               # the TrainingArguments used (human-readable)
            COMMITTED               # commit marker + manifest; written last, by rank 0 only,
                                    # after every rank finished writing
            KEEP                    # optional: never rotate this checkpoint away

A directory without ``COMMITTED`` is incomplete: it is never loaded, and rank 0 removes it.
Everything here is computed from what is on disk, so it survives restarts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from recsys_trainer.checkpoint.errors import CheckpointError

logger = logging.getLogger(__name__)

MARKER = "COMMITTED"
KEEP_FILE = "KEEP"
INDEX = "checkpoints.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    """``step_00000120`` for step 120 (zero-padded for listings; parsed numerically)."""
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint directory name, or None if the name is not one."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as read from its manifest."""

    step: int
    path: str
    commit_time: float
    world_size: int
    epoch: int = 0
    keep: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def file_digest(path: str) -> tuple[int, int]:
    """``(size, crc32)`` of a file. zlib releases the GIL on large buffers, so several files can
    be hashed in parallel threads."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while True:
            buf = f.read(_CHUNK)
            if not buf:
                break
            crc = zlib.crc32(buf, crc)
            size += len(buf)
    return size, crc


def atomic_write_text(path: str, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half.
    ``durable``: fsync the file and its directory (not needed for informational files)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    """Make a rename/creation in ``path`` durable (best effort: not every FS supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def probe_writable(directory: str) -> str | None:
    """None if this process can create ``directory`` and write, fsync and remove a file in it;
    else what failed (e.g. "OSError: [Errno 30] Read-only file system: '...'"). Run at the start
    of training, so a directory that cannot take checkpoints fails the job before any work is
    lost rather than at the first save."""
    probe = os.path.join(directory, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe\n")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def read_manifest(ckpt_dir: str) -> dict[str, Any] | None:
    """The commit manifest of ``ckpt_dir``, or None if it is not committed (or unreadable)."""
    try:
        with open(os.path.join(ckpt_dir, MARKER), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "step" in data else None


def is_committed(ckpt_dir: str) -> bool:
    return read_manifest(ckpt_dir) is not None


def _info(path: str, manifest: dict[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(
        step=int(manifest["step"]),
        path=path,
        commit_time=float(manifest.get("commit_time", 0.0)),
        world_size=int(manifest.get("world_size", 1)),
        epoch=int(manifest.get("epoch", 0)),
        keep=os.path.exists(os.path.join(path, KEEP_FILE)),
        metrics={k: float(v) for k, v in (manifest.get("metrics") or {}).items()},
    )


def list_committed(output_dir: str) -> list[CheckpointInfo]:
    """Committed checkpoints under ``output_dir``, oldest first (by step, numerically)."""
    out: list[CheckpointInfo] = []
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return out
    for name in names:
        step = parse_step(name)
        path = os.path.join(output_dir, name)
        if step is None or not os.path.isdir(path):
            continue
        manifest = read_manifest(path)
        if manifest is not None and int(manifest["step"]) == step:
            out.append(_info(path, manifest))
    return sorted(out, key=lambda i: i.step)


def list_incomplete(output_dir: str) -> list[str]:
    """Checkpoint directories under ``output_dir`` without a commit marker."""
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names):
        path = os.path.join(output_dir, name)
        if parse_step(name) is not None and os.path.isdir(path) and not is_committed(path):
            out.append(path)
    return out


def latest_committed(output_dir: str) -> CheckpointInfo | None:
    found = list_committed(output_dir)
    return found[-1] if found else None


def info_of(ckpt_dir: str) -> CheckpointInfo:
    """The ``CheckpointInfo`` of a committed checkpoint directory; ``CheckpointError`` if it is
    missing or was never committed."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir!r} does not exist.", path=ckpt_dir,
                              kind="missing")
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        raise CheckpointError(
            f"checkpoint {ckpt_dir!r} has no {MARKER} marker: its save never completed (or the "
            f"marker is unreadable); it cannot be loaded. Resume from an older committed "
            f"checkpoint (see {INDEX} in the output directory).",
            path=ckpt_dir, kind="incomplete",
        )
    return _info(ckpt_dir, manifest)


def verify_files(ckpt_dir: str, manifest: dict[str, Any], checksums: bool = True) -> None:
    """Check every file the manifest lists: present, same size, and (optionally) same CRC32.

    Raises ``CheckpointError`` naming the first file at fault.
    """
    step = manifest.get("step")
    for name, meta in sorted((manifest.get("files") or {}).items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint step {step}: file {path!r} is missing.",
                                  step=step, path=path, kind="corrupt")
        size = os.path.getsize(path)
        if size != meta["size"]:
            raise CheckpointError(
                f"checkpoint step {step}: file {path!r} is {size} bytes, but {meta['size']} were "
                f"written (truncated or overwritten). Delete this checkpoint directory to fall "
                f"back to an older one.", step=step, path=path, kind="corrupt",
            )
        if checksums and "crc32" in meta:
            _, crc = file_digest(path)
            if crc != meta["crc32"]:
                raise CheckpointError(
                    f"checkpoint step {step}: file {path!r} fails its CRC32 check (corrupt). "
                    f"Delete this checkpoint directory to fall back to an older one.",
                    step=step, path=path, kind="corrupt",
                )


def write_index(output_dir: str, infos: Sequence[CheckpointInfo]) -> None:
    """Rewrite ``checkpoints.json``: the committed checkpoints, newest last (informational;
    readers trust the markers, not this file)."""
    doc = {
        "format_version": FORMAT_VERSION,
        "latest": os.path.basename(infos[-1].path) if infos else None,
        "checkpoints": [
            {"step": i.step, "dir": os.path.basename(i.path), "epoch": i.epoch,
             "world_size": i.world_size, "keep": i.keep, "metrics": i.metrics,
             "committed_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(i.commit_time))}
            for i in infos
        ],
    }
    # Informational (readers trust the markers): atomic, but not worth two fsyncs per save.
    atomic_write_text(os.path.join(output_dir, INDEX), json.dumps(doc, indent=2) + "\n",
                      durable=False)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints survive rotation.

    Keeps the ``max_to_keep`` newest; in addition (not counted against it) the ones marked
    ``KEEP``, the best by ``keep_best_metric`` (``keep_best_mode`` "min" or "max"; only
    checkpoints that recorded the metric compete), and one per ``keep_every_n_hours`` of commit
    time (the oldest of each period).
    """

    max_to_keep: int = 5
    keep_every_n_hours: float | None = None
    keep_best_metric: str | None = None
    keep_best_mode: Literal["min", "max"] = "min"


def select_to_delete(
    infos: Iterable[CheckpointInfo], policy: RetentionPolicy, protected_steps: Iterable[int] = ()
) -> list[CheckpointInfo]:
    """The checkpoints rotation deletes (pure). Never the newest, never a protected step (e.g.
    the one resumed from), never one marked keep, never the best."""
    ordered = sorted(infos, key=lambda i: i.step)
    if not ordered:
        return []
    keep: set[int] = {i.step for i in ordered[-policy.max_to_keep:]}
    keep.add(ordered[-1].step)
    keep.update(protected_steps)
    keep.update(i.step for i in ordered if i.keep)
    metric = policy.keep_best_metric
    if metric is not None:
        scored = [i for i in ordered if metric in i.metrics and not math.isnan(i.metrics[metric])]
        if scored:
            sign = 1.0 if policy.keep_best_mode == "min" else -1.0
            best = min(scored, key=lambda i: (sign * i.metrics[metric], -i.step))
            keep.add(best.step)
    if policy.keep_every_n_hours is not None:
        period = policy.keep_every_n_hours * 3600.0
        last: float | None = None
        for i in ordered:
            if last is None or i.commit_time >= last + period:
                keep.add(i.step)
                last = i.commit_time
    return [i for i in ordered if i.step not in keep]


def remove_checkpoint(path: str) -> bool:
    """Delete a checkpoint directory: the marker first, so a half-deleted directory reads as
    incomplete and is never loaded. A failure is logged, not raised; returns success."""
    try:
        marker = os.path.join(path, MARKER)
        if os.path.exists(marker):
            os.remove(marker)
        shutil.rmtree(path)
        return True
    except OSError as e:
        logger.warning("could not delete checkpoint %s: %s (will retry at the next rotation)", path, e)
        return False
