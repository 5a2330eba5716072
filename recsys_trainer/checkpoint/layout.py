"""On-disk layout of checkpoints, the commit marker and the index (retention: ``rotation``).

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

Where a checkpoint lives is a ``storage.Location`` (any function here also takes a path or URL
and resolves it). Files are written with ``storage.write_bytes``: on a local filesystem they
are made durable with fsync and published with an atomic rename. On object storage (``s3://``...)
there is no rename, but an object appears whole or not at all when its upload completes: each
file is written once under its final name, and ``COMMITTED`` is the last object written, so the
protocol is the same.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.checkpoint.rotation import (  # re-exported: their home before rotation.py
    RetentionPolicy as RetentionPolicy,
)
from recsys_trainer.checkpoint.rotation import (
    select_to_delete as select_to_delete,
)
from recsys_trainer.storage import (
    Location,
    Where,
    basename,
    digest,
    exists,
    is_dir,
    list_names,
    locate,
    parent,
    read_bytes,
    write_bytes,
)

logger = logging.getLogger(__name__)

MARKER = "COMMITTED"
KEEP_FILE = "KEEP"
INDEX = "checkpoints.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


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
    location: Location | None = field(default=None, compare=False, repr=False)
    """Where it is (``path`` is its URL or local path, for messages and for users)."""

    @property
    def where(self) -> Location:
        return self.location if self.location is not None else locate(self.path)


def read_manifest(ckpt_dir: Where) -> dict[str, Any] | None:
    """The commit manifest of ``ckpt_dir``, or None if it is not committed (or unreadable)."""
    try:
        raw = read_bytes(locate(ckpt_dir).join(MARKER))
        data = json.loads(raw) if raw is not None else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "step" in data else None


def is_committed(ckpt_dir: Where) -> bool:
    return read_manifest(ckpt_dir) is not None


def _info(loc: Location, manifest: dict[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(
        step=int(manifest["step"]),
        path=loc.url,
        commit_time=float(manifest.get("commit_time", 0.0)),
        world_size=int(manifest.get("world_size", 1)),
        epoch=int(manifest.get("epoch", 0)),
        keep=exists(loc.join(KEEP_FILE)),
        metrics={k: float(v) for k, v in (manifest.get("metrics") or {}).items()},
        location=loc,
    )


def _step_dirs(output_dir: Where) -> list[tuple[int, Location]]:
    loc = locate(output_dir)
    sel = pafs.FileSelector(loc.path, allow_not_found=True, recursive=False)
    out = []
    for entry in loc.filesystem.get_file_info(sel):
        name = posixpath.basename(entry.path.rstrip("/"))
        step = parse_step(name)
        if step is not None and entry.type == pafs.FileType.Directory:
            out.append((step, loc.join(name)))
    return sorted(out, key=lambda x: x[0])


def list_committed(output_dir: Where) -> list[CheckpointInfo]:
    """Committed checkpoints under ``output_dir``, oldest first (by step, numerically)."""
    out: list[CheckpointInfo] = []
    for step, loc in _step_dirs(output_dir):
        manifest = read_manifest(loc)
        if manifest is not None and int(manifest["step"]) == step:
            out.append(_info(loc, manifest))
    return out


def list_incomplete(output_dir: Where) -> list[Location]:
    """Checkpoint directories under ``output_dir`` without a commit marker."""
    return [loc for _, loc in _step_dirs(output_dir) if not is_committed(loc)]


def latest_committed(output_dir: Where) -> CheckpointInfo | None:
    found = list_committed(output_dir)
    return found[-1] if found else None


def info_of(ckpt_dir: Where) -> CheckpointInfo:
    """The ``CheckpointInfo`` of a committed checkpoint directory; ``CheckpointError`` if it is
    missing or was never committed."""
    loc = locate(ckpt_dir)
    if not is_dir(loc):
        raise CheckpointError(f"checkpoint directory {loc.url!r} does not exist.", path=loc.url,
                              kind="missing")
    manifest = read_manifest(loc)
    if manifest is None:
        raise CheckpointError(
            f"checkpoint {loc.url!r} has no {MARKER} marker: its save never completed (or the "
            f"marker is unreadable); it cannot be loaded. Resume from an older committed "
            f"checkpoint (see {INDEX} in the output directory).",
            path=loc.url, kind="incomplete",
        )
    return _info(loc, manifest)


UNUSABLE_ADVICE = (
    "This checkpoint cannot be loaded. Load an older one by its path (resume_from="
    "'<output_dir>/step_<N>'; the committed ones are listed in " + INDEX + "), or resume with "
    "resume_from='auto', which falls back to the newest checkpoint that verifies (and, in a run "
    "that saves, moves this one aside for inspection); or move this directory out of the output "
    "directory.")
"""What to do about a committed checkpoint whose files fail verification."""


def verify_files(ckpt_dir: Where, manifest: dict[str, Any], checksums: bool = True) -> None:
    """Check every file the manifest lists: present, same size, and (optionally) same CRC32.

    Raises ``CheckpointError`` naming the first file at fault.
    """
    step = manifest.get("step")
    loc = locate(ckpt_dir)
    names = sorted((manifest.get("files") or {}).items())
    # One listing gives every size (one request on object storage, not one per file).
    sizes = {posixpath.basename(i.path): i.size for i in loc.filesystem.get_file_info(
        pafs.FileSelector(loc.path, allow_not_found=True)) if i.type == pafs.FileType.File}
    for name, meta in names:
        path = loc.join(name).url
        if name not in sizes:
            raise CheckpointError(
                f"checkpoint step {step}: file {path!r} is missing: its {MARKER} manifest lists "
                f"it, so it was deleted or lost after the checkpoint was committed. "
                f"{UNUSABLE_ADVICE}", step=step, path=path, kind="corrupt")
        if sizes[name] != meta["size"]:
            raise CheckpointError(
                f"checkpoint step {step}: file {path!r} is {sizes[name]} bytes, but "
                f"{meta['size']} were written (truncated or overwritten). {UNUSABLE_ADVICE}",
                step=step, path=path, kind="corrupt",
            )
    if not checksums:
        return
    # On object storage every read waits for the server: fetch the files concurrently (zlib and
    # pyarrow's reads release the GIL). Locally one file at a time, as the disk prefers.
    with_crc = [(n, m) for n, m in names if "crc32" in m]
    workers = 1 if loc.is_local else min(8, max(1, len(with_crc)))
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-verify") as pool:
        crcs = list(pool.map(lambda nm: digest(loc.join(nm[0]))[1], with_crc))
    for (name, meta), crc in zip(with_crc, crcs, strict=True):
        path = loc.join(name).url
        if crc != meta["crc32"]:
            raise CheckpointError(
                f"checkpoint step {step}: file {path!r} fails its CRC32 check (corrupt). "
                f"{UNUSABLE_ADVICE}", step=step, path=path, kind="corrupt",
            )


def write_index(output_dir: Where, infos: Sequence[CheckpointInfo]) -> None:
    """Rewrite ``checkpoints.json``: the committed checkpoints, newest last (informational;
    readers trust the markers, not this file)."""
    doc = {
        "format_version": FORMAT_VERSION,
        "latest": basename(infos[-1].where) if infos else None,
        "checkpoints": [
            {"step": i.step, "dir": basename(i.where), "epoch": i.epoch,
             "world_size": i.world_size, "keep": i.keep, "metrics": i.metrics,
             "committed_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(i.commit_time))}
            for i in infos
        ],
    }
    # Informational (readers trust the markers): atomic, but not worth two fsyncs per save.
    write_bytes(locate(output_dir).join(INDEX), (json.dumps(doc, indent=2) + "\n").encode(),
                durable=False)


def resolve_checkpoint(where: Where, what: str) -> CheckpointInfo:
    """A committed checkpoint named by ``where``: a checkpoint directory (``step_<N>``, or any
    directory with a marker), or an output directory (its newest committed checkpoint).
    ``what`` names the setting in errors (e.g. "`resume_from`")."""
    loc = locate(where)
    if parse_step(basename(loc)) is not None or exists(loc.join(MARKER)):
        return info_of(loc)
    if not is_dir(loc):
        raise CheckpointError(f"{what} is {loc.url!r}, which does not exist.", path=loc.url,
                              kind="missing")
    found = latest_committed(loc)
    if found is None:
        raise CheckpointError(f"{what} is {loc.url!r}, which holds no committed checkpoint.",
                              path=loc.url, kind="missing")
    return found


# ---------------------------------------------------------------------------- reader leases

READING_PREFIX = "READING."
READ_LEASE_MAX_AGE_S = 24 * 3600.0
"""A reader lease older than this is ignored (a reader on another host that died)."""


@contextmanager
def reading(where: Where) -> Iterator[None]:
    """Mark a checkpoint as being read while the block runs: rotation (of any job) skips a
    checkpoint with a live ``READING.<host>.<pid>.<id>`` object in it. Best effort: a reader
    that may not write there reads without one (with a warning). After the lease is written,
    the marker is checked again, so a rotation that got there first is an error naming the
    checkpoint rather than files vanishing mid-read."""
    loc = locate(where)
    lease = loc.join(f"{READING_PREFIX}{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        write_bytes(lease, json.dumps({"time": time.time()}).encode(), durable=False)
    except OSError as e:
        logger.warning("cannot mark %s as being read (%s): a rotation by a job saving there could "
                       "delete it while it is read", loc.url, e)
        lease = None  # type: ignore[assignment]
    try:
        if lease is not None and not is_committed(loc):
            raise CheckpointError(f"checkpoint {loc.url!r} was rotated away (or never committed) "
                                  "before it could be read; use a newer one.", path=loc.url,
                                  kind="missing")
        yield
    finally:
        if lease is not None:
            try:
                lease.filesystem.delete_file(lease.path)
            except OSError as e:
                logger.warning("could not remove the read lease %s: %s", lease.url, e)


def has_readers(where: Where) -> bool:
    """Whether a live reader lease is in the checkpoint (see ``reading``)."""
    loc = locate(where)
    for name in list_names(loc):
        if not name.startswith(READING_PREFIX):
            continue
        parts = name[len(READING_PREFIX):].rsplit(".", 2)
        if len(parts) == 3 and parts[0] == socket.gethostname() and parts[1].isdigit():
            try:
                os.kill(int(parts[1]), 0)
            except ProcessLookupError:
                continue  # a reader on this host that is gone
            except PermissionError:
                pass
        try:
            raw = read_bytes(loc.join(name))
            age = time.time() - float(json.loads(raw or b"{}").get("time", 0.0))
        except (OSError, ValueError, AttributeError):
            age = 0.0
        if age < READ_LEASE_MAX_AGE_S:
            return True
    return False


QUARANTINE_INFIX = ".unverified-"
"""``step_00000030.unverified-<time>``: a committed checkpoint that failed verification when a
run resumed, moved out of the ``step_<N>`` names (so it is never listed, loaded, rotated or
mistaken for the step a run is about to save) and kept for inspection."""


def quarantine(where: Where, reason: str) -> Location:
    """Move a checkpoint directory to ``<name>.unverified-<time>`` beside it and write the reason
    into it (``UNVERIFIED.txt``); returns the new location. Locally one rename. Object storage
    has no directory rename: each object is moved (a server-side copy and a delete), the
    ``COMMITTED`` marker last, so an interrupted move leaves the original still listed and
    failing verification (the next resume moves the rest) rather than half a checkpoint that
    reads as incomplete and is cleaned up."""
    loc = locate(where)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = parent(loc).join(f"{basename(loc)}{QUARANTINE_INFIX}{stamp}")
    n = 1
    while exists(dest):
        dest = parent(loc).join(f"{basename(loc)}{QUARANTINE_INFIX}{stamp}.{n}")
        n += 1
    fs = loc.filesystem
    if loc.is_local:
        fs.move(loc.path, dest.path)
    else:
        sel = pafs.FileSelector(loc.path, recursive=True, allow_not_found=True)
        files = [i.path for i in fs.get_file_info(sel) if i.type == pafs.FileType.File]
        marker = loc.join(MARKER).path
        base = loc.path.rstrip("/") + "/"
        for src in sorted(files, key=lambda f: f == marker):  # the marker last
            fs.move(src, dest.join(src[len(base):]).path)
    write_bytes(dest.join("UNVERIFIED.txt"), (reason.rstrip() + "\n").encode(), durable=False)
    return dest


def remove_checkpoint(where: Where) -> bool:
    """Delete a checkpoint directory: the marker first, so a half-deleted directory reads as
    incomplete and is never loaded. A failure is logged, not raised; returns success."""
    loc = locate(where)
    try:
        marker = loc.join(MARKER)
        if exists(marker):
            loc.filesystem.delete_file(marker.path)
        if loc.is_local:
            shutil.rmtree(loc.path)
        else:
            loc.filesystem.delete_dir(loc.path)
        return True
    except OSError as e:
        logger.warning("could not delete checkpoint %s: %s (will retry at the next rotation)",
                       loc.url, e)
        return False
