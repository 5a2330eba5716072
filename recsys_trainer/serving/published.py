"""The published location: where a training job publishes its model as it trains, and where a
server follows it. This module owns the format; ``hooks/publish.py`` writes it, a follower
reads it.

Layout under LOCATION (a local path or a URL such as ``s3://bucket/prefix``)::

    bases/<name>/      full serving artifacts, as ``export_for_serving`` writes them
    deltas/<name>/     delta artifacts, as ``export_delta`` writes them; the deltas a pointer
                       names apply in order: the first to its base, each next one to the
                       state the previous one produced (a delta's manifest names the content
                       hash it applies to, ``base.content_hash``, and the one it produces,
                       ``target.content_hash``)
    LATEST             the pointer (JSON, below), written LAST and atomically (local: a
                       temporary file and a rename; object store: one PUT). It only ever names
                       artifacts that are committed (their ``COMMITTED`` marker exists).

``LATEST``::

    {"format": "recsys_trainer.published", "version": 1,
     "sequence": 7,                      # +1 per publish (a follower skips what it has)
     "base": "bases/<name>",
     "deltas": ["deltas/<name>", ...],   # ordered
     "step": 1200,                       # the training step of the newest state
     "content_hash": "<sha256 hex>",     # the full export's content hash after the last delta
     "window": "dt=.../hour=05",         # newest train window the model reflects, or null
     "window_time": 1764270000.0,        # unix time that window landed (its _SUCCESS), or null
     "published_at": 1764270042.5}       # unix time of this publish

Names are this writer's (``artifact_name``): ``<sequence:010d>-s<step>-<6 hex>`` for a base
and ``<base name>.<sequence:010d>-s<step>-<6 hex>`` for a delta, so which base a delta belongs
to is in its name (rotation plans from a listing alone). A reader must not rely on the names:
it follows the pointer.

Rotation (``plan_rotation``) keeps the current pointer's base and the K-1 bases before it, and
the deltas each kept base's chain needs; everything else under ``bases/`` and ``deltas/`` that
this writer named is deleted (names of another form are left alone). A follower that read an
older pointer has time to finish: it is at most K-1 bases behind before its chain goes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from recsys_trainer import storage
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving.manifest import ArtifactError

logger = logging.getLogger(__name__)

FORMAT = "recsys_trainer.published"
VERSION = 1
"""Bumped when a reader of the previous version would misread a pointer."""
LATEST = "LATEST"
BASES = "bases"
DELTAS = "deltas"

_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_STAMP = r"(\d{10})-s(\d+)-([0-9a-f]{6})"
_BASE_NAME = re.compile(rf"^{_STAMP}$")
_DELTA_NAME = re.compile(rf"^({_STAMP})\.{_STAMP}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")


class PublishedError(ArtifactError):
    """A published location that cannot be followed: its ``LATEST`` is corrupt, of another
    format or version, or names something that is not there. The message names the location
    (and the field)."""


@dataclass(frozen=True)
class Pointer:
    """What ``LATEST`` says: the base, the ordered deltas over it, and what the model after the
    last delta is (step, content hash, the newest window it reflects and when that landed).

    ``base`` and ``deltas`` are relative to the location (``bases/<name>``,
    ``deltas/<name>``)."""

    sequence: int
    base: str
    deltas: tuple[str, ...]
    step: int
    content_hash: str
    window: str | None = None
    window_time: float | None = None
    published_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        _check_pointer_fields(self, "Pointer")

    def to_json(self) -> str:
        """The pointer as ``LATEST``'s JSON text (keys in the documented order)."""
        return json.dumps({
            "format": FORMAT, "version": VERSION, "sequence": self.sequence, "base": self.base,
            "deltas": list(self.deltas), "step": self.step, "content_hash": self.content_hash,
            "window": self.window, "window_time": self.window_time,
            "published_at": self.published_at,
        }, indent=1)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any], where: str = LATEST) -> Pointer:
        """The pointer in ``data`` (``LATEST``'s text, or its parsed JSON object); a
        ``PublishedError`` naming ``where`` and the field when it is not a valid one."""
        raw: Any = data
        if isinstance(data, str | bytes):
            try:
                raw = json.loads(data)
            except (UnicodeDecodeError, ValueError) as e:
                raise PublishedError(f"the published pointer {where!r} is not JSON ({e}); it "
                                     "is corrupt (LATEST is written whole or not at all, so "
                                     "something else wrote it).") from None
        if not isinstance(raw, Mapping):
            raise PublishedError(f"the published pointer {where!r} is not a JSON object.")
        if raw.get("format") != FORMAT:
            raise PublishedError(f"the published pointer {where!r} has format "
                                 f"{raw.get('format')!r}, not {FORMAT!r}.")
        version = raw.get("version")
        if version != VERSION:
            newer = isinstance(version, int) and not isinstance(version, bool) and version > VERSION
            raise PublishedError(
                f"the published pointer {where!r} has version {version!r}; this reader reads "
                f"{VERSION}" + (" (a newer writer wrote it: upgrade the follower)." if newer
                                else "."))
        missing = [k for k in ("sequence", "base", "deltas", "step", "content_hash", "window",
                               "window_time", "published_at") if k not in raw]
        if missing:
            raise PublishedError(f"the published pointer {where!r} lacks the field(s) {missing}.")
        deltas = raw["deltas"]
        if not isinstance(deltas, list):
            raise PublishedError(f"field 'deltas' of the published pointer {where!r} must be a "
                                 f"list of 'deltas/<name>', but is {deltas!r}.")
        try:
            return cls(sequence=raw["sequence"], base=raw["base"], deltas=tuple(deltas),
                       step=raw["step"], content_hash=raw["content_hash"], window=raw["window"],
                       window_time=raw["window_time"], published_at=raw["published_at"])
        except PublishedError as e:
            raise PublishedError(str(e).replace("Pointer", f"the published pointer {where!r}",
                                                1)) from None


def _check_pointer_fields(p: Pointer, where: str) -> None:
    def bad(name: str, want: str) -> PublishedError:
        return PublishedError(f"field {name!r} of {where} must be {want}, but is "
                              f"{getattr(p, name)!r}.")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_time(v: Any) -> bool:
        return is_int(v) or (isinstance(v, float) and math.isfinite(v))

    if not is_int(p.sequence) or p.sequence < 0:
        raise bad("sequence", "an integer >= 0")
    if not isinstance(p.base, str) or not _is_ref(p.base, BASES):
        raise bad("base", "'bases/<name>' (a name of letters, digits, '.', '_', '-')")
    if not isinstance(p.deltas, tuple) or not all(
            isinstance(d, str) and _is_ref(d, DELTAS) for d in p.deltas):
        raise bad("deltas", "a list of 'deltas/<name>'")
    if len(set(p.deltas)) != len(p.deltas):
        raise bad("deltas", "a list of distinct deltas")
    if not is_int(p.step) or p.step < 0:
        raise bad("step", "an integer >= 0")
    if not isinstance(p.content_hash, str) or not _HASH.match(p.content_hash):
        raise bad("content_hash", "a sha256 hex digest (64 lowercase hex digits)")
    if p.window is not None and not isinstance(p.window, str):
        raise bad("window", "a string or null")
    if p.window_time is not None and not is_time(p.window_time):
        raise bad("window_time", "a unix time (a number) or null")
    if not is_time(p.published_at):
        raise bad("published_at", "a unix time (a number)")


def _is_ref(ref: str, kind: str) -> bool:
    head, _, name = ref.partition("/")
    return head == kind and bool(_COMPONENT.match(name)) and ".." not in name


# ------------------------------------------------------------------------ names

def artifact_name(sequence: int, step: int, base: str | None = None) -> str:
    """A fresh name for the artifact first published by pointer ``sequence`` at ``step``: a
    base's when ``base`` is None, else a delta's over the base named ``base`` (its name, without
    ``bases/``). A random suffix keeps a retried publish from meeting a half-written one."""
    stamp = f"{sequence:010d}-s{step}-{secrets.token_hex(3)}"
    return stamp if base is None else f"{base}.{stamp}"


def _name_of(ref: str) -> str:
    return ref.partition("/")[2]


def _sequence_of_base(name: str) -> int | None:
    m = _BASE_NAME.match(name)
    return int(m.group(1)) if m else None


def _base_of_delta(name: str) -> str | None:
    m = _DELTA_NAME.match(name)
    return m.group(1) if m else None


# ------------------------------------------------------------------------ locations

def _root(location: str | os.PathLike[str] | storage.Location,
          filesystem: pafs.FileSystem | None) -> storage.Location:
    if isinstance(location, storage.Location):
        return location
    return storage.resolve(location, filesystem)


def artifact_location(location: str | os.PathLike[str] | storage.Location, ref: str,
                      filesystem: pafs.FileSystem | None = None) -> storage.Location:
    """Where the artifact ``ref`` (``bases/<name>`` or ``deltas/<name>``) of the location is."""
    if not (_is_ref(ref, BASES) or _is_ref(ref, DELTAS)):
        raise PublishedError(f"{ref!r} is not 'bases/<name>' or 'deltas/<name>'.")
    return _root(location, filesystem).join(*ref.split("/"))


def chain(location: str | os.PathLike[str] | storage.Location, pointer: Pointer,
          filesystem: pafs.FileSystem | None = None,
          ) -> tuple[storage.Location, list[storage.Location]]:
    """The base and the ordered deltas ``pointer`` names, as locations: load the base with
    ``Scorer``, then ``apply_delta`` each delta in order."""
    root = _root(location, filesystem)
    return (artifact_location(root, pointer.base),
            [artifact_location(root, d) for d in pointer.deltas])


# ------------------------------------------------------------------------ the pointer

def read_pointer(location: str | os.PathLike[str] | storage.Location,
                 filesystem: pafs.FileSystem | None = None) -> Pointer | None:
    """The pointer ``LATEST`` of ``location``, or None when nothing was published there yet.
    A corrupt one raises ``PublishedError`` naming it; a store that cannot be reached raises
    ``storage.StorageError`` (kind ``unreachable``, ``denied``, ``missing_bucket``)."""
    root = _root(location, filesystem)
    loc = root.join(LATEST)
    try:
        with storage.open_input_stream(loc) as f:
            data = bytes(f.read())
    except FileNotFoundError:
        return None
    except storage.StorageError as e:
        if e.kind == "not_found":
            return None
        raise
    return Pointer.from_json(data, loc.url)


def is_committed(location: str | os.PathLike[str] | storage.Location, ref: str,
                 filesystem: pafs.FileSystem | None = None) -> bool:
    """Whether the artifact ``ref`` (``bases/<name>`` or ``deltas/<name>``) has its
    ``COMMITTED`` marker under ``location``."""
    marker = artifact_location(_root(location, filesystem), ref).join(mf.MARKER)
    return storage.file_info(marker).type == pafs.FileType.File


def write_pointer(location: str | os.PathLike[str] | storage.Location, pointer: Pointer,
                  filesystem: pafs.FileSystem | None = None, *, check: bool = True) -> None:
    """Write ``pointer`` as ``LATEST`` of ``location``, whole or not at all (local: a
    temporary file, fsync, rename, directory fsync; object store: one PUT). With ``check``
    (the default), first make sure that every artifact it names is committed: a
    ``PublishedError`` naming the first one that is not, and ``LATEST`` is left as it was."""
    root = _root(location, filesystem)
    if check:
        for ref in (pointer.base, *pointer.deltas):
            if not is_committed(root, ref):
                raise PublishedError(f"the pointer would name {ref!r} of {root.url!r}, which is "
                                     "not a committed artifact (no COMMITTED marker); LATEST "
                                     "was not written.")
    loc = root.join(LATEST)
    with storage.errors_named(loc.url, "write"):
        storage.make_dir(root)
        storage.write_bytes(loc, pointer.to_json().encode())


# ------------------------------------------------------------------------ rotation

def plan_rotation(listed_names: Iterable[str], history: Sequence[Pointer],
                  keep_bases: int) -> list[str]:
    """Which of ``listed_names`` (``bases/<name>`` / ``deltas/<name>``, what the location
    holds) rotation deletes, keeping the last ``keep_bases`` bases and the deltas their chains
    need. Pure: it reads nothing.

    ``history``: pointers this writer published, oldest first; the last is the current one
    (only the current one after a restart is enough). Kept: the current pointer's base and
    deltas; the ``keep_bases - 1`` newest bases before it (by publish sequence: bases named
    by ``history``, and listed bases of this writer's naming published before the current base,
    e.g. by the job before a restart); for each kept base, the deltas ``history`` names with
    it, and, for a base ``history`` does not name, every listed delta of it. Deleted: every
    other listed name of this writer's naming, among them artifacts a failed publish committed
    but no pointer ever named. Names of another form are never deleted. Never deletes what the
    current pointer names."""
    if keep_bases < 1:
        raise ValueError(f"`keep_bases` must be >= 1, but is {keep_bases!r}.")
    if not history:
        return []
    current = max(history, key=lambda p: p.sequence)
    listed = sorted(set(listed_names))
    by_sequence = sorted(history, key=lambda p: p.sequence)
    # When each base was first published: the sequence in its name (this writer's naming),
    # else the first pointer that named it.
    first: dict[str, float] = {}
    for p in by_sequence:
        if p.base not in first:
            seq = _sequence_of_base(_name_of(p.base))
            first[p.base] = float(seq if seq is not None else p.sequence)
    current_seq = first[current.base]
    for r in listed:
        seq = _sequence_of_base(_name_of(r)) if _is_ref(r, BASES) else None
        if r not in first and seq is not None and seq < current_seq:
            first[r] = float(seq)  # published before the current base (before a restart)
    first[current.base] = math.inf  # the current base is the newest, whatever its name says
    order = sorted((b for b in first if first[b] <= current_seq or b == current.base),
                   key=lambda b: (first[b], b))
    kept_bases = order[-keep_bases:]
    keep: set[str] = set(kept_bases)
    for base in kept_bases:
        chains = [p.deltas for p in by_sequence if p.base == base]
        if chains:
            for deltas in chains:
                keep.update(deltas)
        else:
            name = _name_of(base)
            keep.update(r for r in listed if _is_ref(r, DELTAS)
                        and _base_of_delta(_name_of(r)) == name)
    keep.add(current.base)
    keep.update(current.deltas)
    out = []
    for ref in listed:
        if ref in keep:
            continue
        name = _name_of(ref)
        ours = (_is_ref(ref, BASES) and _BASE_NAME.match(name)) or (
            _is_ref(ref, DELTAS) and _DELTA_NAME.match(name))
        if ours:
            out.append(ref)
    return out


def list_artifacts(location: str | os.PathLike[str] | storage.Location,
                   filesystem: pafs.FileSystem | None = None) -> list[str]:
    """``bases/<name>`` and ``deltas/<name>`` of every artifact directory at the location."""
    root = _root(location, filesystem)
    out: list[str] = []
    for kind in (BASES, DELTAS):
        loc = root.join(kind)
        sel = pafs.FileSelector(loc.path, allow_not_found=True, recursive=False)
        with storage.errors_named(loc.url, "list"):
            infos = root.filesystem.get_file_info(sel)
        out += [f"{kind}/{i.base_name}" for i in infos if i.type == pafs.FileType.Directory]
    return sorted(out)


def delete_artifact(location: str | os.PathLike[str] | storage.Location, ref: str,
                    filesystem: pafs.FileSystem | None = None) -> None:
    """Delete one artifact: its ``COMMITTED`` marker first (so that a deletion cut short never
    leaves something that reads as committed), then the rest."""
    loc = artifact_location(location, ref, filesystem)
    fs = loc.filesystem
    with storage.errors_named(loc.url, "delete"):
        marker = loc.join(mf.MARKER)
        if fs.get_file_info(marker.path).type == pafs.FileType.File:
            fs.delete_file(marker.path)
        if fs.get_file_info(loc.path).type != pafs.FileType.NotFound:
            fs.delete_dir(loc.path)


def rotate(location: str | os.PathLike[str] | storage.Location, keep_bases: int,
           pointer: Pointer, filesystem: pafs.FileSystem | None = None, *,
           history: Sequence[Pointer] = ()) -> list[str]:
    """Delete what ``plan_rotation`` plans for the location's listing, ``pointer`` being the
    current one (``history``: earlier pointers this writer published, optional). Returns the
    deleted names. Call it after ``write_pointer``."""
    root = _root(location, filesystem)
    hist = [p for p in history if p.sequence < pointer.sequence] + [pointer]
    doomed = plan_rotation(list_artifacts(root), hist, keep_bases)
    for ref in doomed:
        delete_artifact(root, ref)
    if doomed:
        logger.info("published location %s: rotated away %d artifact(s): %s", root.url,
                    len(doomed), ", ".join(doomed))
    return doomed
