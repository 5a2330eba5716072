"""Where windows come from: a partitioned directory, a list of globs, a callable, or a stream.

A ``Window`` is an id and its files. Sources give windows in training order:

* ``partitioned_windows(root)``: every leaf directory under ``root`` holding data files, e.g.
  ``dt=2019-11-24/hour=05/``, ordered by partition values (numbers compare as numbers).
* ``glob_windows(["/data/2019-11-24-00/*.parquet", ...])``: one window per glob, in list order.

Roots, globs and markers may be local paths or URLs (``s3://``, ``gs://``, ``hdfs://``,
``file://``, fsspec schemes): listing goes through ``recsys_trainer.storage`` (pyarrow.fs), and
every function takes ``filesystem=`` for an explicitly configured one.
* any callable returning windows (e.g. ``lambda: partitioned_windows(root)[1:]``).
* ``StreamingWindows(discover, ...)``: waits for windows that appear later. A wait can be ended
  by a stop request (``stop=``, a preemption signal under the Trainer): ``WaitInterrupted``.

A glob matching nothing, or a partition with no data files and no ``_SUCCESS`` (or ready
marker), is skipped with a warning; a partition marked complete but empty is a window of 0 rows.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from recsys_trainer import storage
from recsys_trainer.distributed import Gang

logger = logging.getLogger("recsys_trainer.data")

DATA_SUFFIXES = (".parquet", ".pq", ".csv", ".csv.gz")
SUCCESS_MARKER = "_SUCCESS"
"""The file Spark and Hadoop jobs write into a partition they have committed."""

STOP_CHECK_INTERVAL_S = 0.2
"""While a stream sleeps between polls, how often it asks whether a stop was requested."""


class WaitInterrupted(Exception):
    """A stop was requested (under the Trainer: a preemption signal on some rank) while a stream
    waited for its next window. Raised on every rank of the gang at the same heartbeat (see
    ``agreed_windows``), so the Trainer stops every rank as for a signal at a batch fetch."""


@dataclass(frozen=True)
class Window:
    """One ordered unit of data: an id (e.g. ``"dt=2019-11-24/hour=05"``) and its files."""

    id: str
    files: tuple[str, ...]
    landed_at: float | None = field(default=None, compare=False)
    """When the window landed (unix time), if its source records it: for a partition, the
    modification time of its ready marker (``_SUCCESS``), from the same listing."""


def _sort_key(rel: str) -> tuple[tuple[int, int | str], ...]:
    parts = []
    for part in rel.split("/"):
        value = part.split("=", 1)[-1]
        parts.append((0, int(value)) if re.fullmatch(r"-?\d+", value) else (1, value))
    return tuple(parts)  # type: ignore[arg-type]


def _hidden(name: str) -> bool:
    return name.startswith(("_", "."))


def partitioned_windows(
    root: str,
    *,
    suffixes: Sequence[str] = DATA_SUFFIXES,
    ready_marker: str | None = None,
    filesystem: pafs.FileSystem | None = None,
) -> list[Window]:
    """Windows of a partitioned directory (``root/k1=v1/k2=v2/*.parquet``), in partition order.

    Args:
        root: the directory: a local path, ``file://``, ``s3://bucket/prefix``, ``gs://``,
            ``hdfs://`` or any fsspec URL (see ``recsys_trainer.storage``).
        suffixes: file name endings that count as data (files starting with ``_`` or ``.`` never).
        ready_marker: if set (e.g. ``"_SUCCESS"``), a partition is a window only once this file
            exists in it: the writer's signal that the partition is complete (streaming).
        filesystem: a ``pyarrow.fs`` filesystem to list ``root`` in (instead of the one its URL
            and the environment select).

    Window files are ``root`` joined with their relative paths (URLs for a URL ``root``): the
    reader resolves them the same way. Directories starting with ``_`` or ``.`` (e.g.
    ``_temporary``) are not partitions and are not searched.

    A partition without data files is a window of no files (0 rows) when it holds the
    ``ready_marker`` (``_SUCCESS`` when none is set): an hour without traffic keeps its place,
    so train and eval listings of the same partitions pair up. Without the marker it is skipped
    with a warning (a writer may not have written its files yet).

    A window's ``landed_at`` is its marker's modification time (``ready_marker``, else
    ``_SUCCESS``), None when it has none.
    """
    loc = storage.resolve(root, filesystem)
    info = storage.file_info(loc)
    if info.type != pafs.FileType.Directory:
        storage.check_bucket(loc)
        raise FileNotFoundError(f"window root {root!r} is not a directory.")
    base = loc.path.rstrip("/")
    files: dict[str, list[str]] = {}  # partition (relative) -> file names
    marker = ready_marker or SUCCESS_MARKER
    landed: dict[str, float] = {}  # partition (relative) -> its marker's mtime
    subdirs: set[str] = set()  # partitions that have a non-hidden sub-directory
    for entry in storage.list_tree(loc):
        parts = entry.path[len(base):].strip("/").split("/")
        if any(_hidden(p) for p in parts[:-1]):
            continue  # inside a hidden directory
        if entry.type == pafs.FileType.Directory:
            if _hidden(parts[-1]):
                continue
            files.setdefault("/".join(parts), [])
            for i in range(len(parts)):
                subdirs.add("/".join(parts[:i]))
        else:
            files.setdefault("/".join(parts[:-1]), []).append(parts[-1])
            if parts[-1] == marker and entry.mtime_ns is not None:
                landed["/".join(parts[:-1])] = entry.mtime_ns / 1e9
            for i in range(len(parts) - 1):
                subdirs.add("/".join(parts[:i]))
    out: list[Window] = []
    for rel in sorted((r for r in files if r and r not in subdirs), key=_sort_key):
        names = files[rel]
        if ready_marker is not None and ready_marker not in names:
            continue
        data = sorted(n for n in names if n.endswith(tuple(suffixes)) and not _hidden(n))
        if not data:
            # Marked complete but empty (an hour with no traffic): an empty window, so that
            # train and eval listings of the same partitions stay aligned. Unmarked, it may
            # still be being written: a stream must find it again later.
            if marker in names:
                logger.warning("window %s (%s) has no data files; it is a window of 0 rows",
                               rel, loc.join(rel).url)
                out.append(Window(rel, (), landed.get(rel)))
            else:
                logger.warning("window %s (%s) has no data files and no %s; skipping it", rel,
                               loc.join(rel).url, marker)
            continue
        out.append(Window(rel, tuple(loc.join(*rel.split("/"), n).url for n in data),
                          landed.get(rel)))
    return out


def glob_windows(patterns: Sequence[str] | Mapping[str, str], *,
                 filesystem: pafs.FileSystem | None = None) -> list[Window]:
    """One window per glob pattern, in order (a mapping gives ``{window_id: pattern}``).

    Local patterns follow ``glob.glob``; a URL pattern (``s3://bucket/dt=*/hour=0[0-5]/*.parquet``)
    is matched per path component against a listing of the part before its first wildcard
    (``*``, ``?``, ``[...]`` within a component, ``**`` for any number of components).
    """
    items = list(patterns.items()) if isinstance(patterns, Mapping) else [(p, p) for p in patterns]
    out: list[Window] = []
    for wid, pattern in items:
        files = _glob(pattern, filesystem)
        if not files:
            logger.warning("window %s: pattern %r matches no files; skipping it", wid, pattern)
            continue
        out.append(Window(wid, tuple(files)))
    return out


def _glob(pattern: str, filesystem: pafs.FileSystem | None) -> list[str]:
    if filesystem is None and not storage.scheme_of(pattern):
        return sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    parts = pattern.split("/")
    first = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))
    if first == len(parts):  # no wildcard: the file itself
        loc = storage.resolve(pattern, filesystem)
        return [pattern] if storage.file_info(loc).type == pafs.FileType.File else []
    prefix = "/".join(parts[:first])
    loc = storage.resolve(prefix, filesystem)
    if storage.file_info(loc).type != pafs.FileType.Directory:
        storage.check_bucket(loc)
        return []
    base = loc.path.rstrip("/")
    rest = parts[first:]
    matched = []
    for entry in storage.list_tree(loc):
        rel = entry.path[len(base):].strip("/").split("/")
        if entry.type == pafs.FileType.File and _match(rel, rest):
            matched.append(loc.join(*rel).url)
    return sorted(matched)


def _match(parts: list[str], pattern: list[str]) -> bool:
    """Whether path components match pattern components (``**``: any number of them)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _match(parts[1:], pattern[1:])


class StreamingWindows:
    """Windows that may appear later: poll ``discover()`` until the end of the stream.

    ``discover()`` returns every window available *now*, in order (e.g.
    ``lambda: partitioned_windows(root, ready_marker="_SUCCESS")``). New windows are yielded as
    they appear; the stream ends when ``end_marker`` exists (checked *before* the final discovery,
    so every window written before the marker is included). Under the Trainer only rank 0 polls
    and the other ranks receive its windows (``agreed_windows``), so all ranks see the same
    windows even when their listings lag. If nothing new appears for ``timeout_s`` seconds the
    iteration raises ``TimeoutError`` rather than ending quietly: ranks polling at slightly
    different times could otherwise disagree on the last window.

    A window that appears *out of order* (its id sorts before one already yielded, by discovery
    order) is logged and ignored: training has moved past it.

    ``end_marker`` may be a path or URL (``s3://bucket/prefix/_END``); ``filesystem`` is the
    ``pyarrow.fs`` filesystem to look for it in (default: the one its URL selects). On object
    storage, ``discover`` is typically ``lambda: partitioned_windows("s3://...",
    ready_marker="_SUCCESS")``: one listing of the prefix per poll.
    """

    def __init__(
        self,
        discover: Callable[[], Iterable[Window]],
        *,
        end_marker: str | Callable[[], bool],
        poll_interval_s: float = 30.0,
        timeout_s: float = 3600.0,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"`poll_interval_s` must be > 0, but is {poll_interval_s!r}.")
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s` must be > 0, but is {timeout_s!r}.")
        self.discover = discover
        self.end_marker = end_marker
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.filesystem = filesystem

    def _ended(self) -> bool:
        if callable(self.end_marker):
            return bool(self.end_marker())
        return storage.exists(self.end_marker, self.filesystem)

    def __iter__(self) -> Iterator[Window]:
        return (w for w in self.polls() if w is not None)

    def polls(self, stop: Callable[[], bool] | None = None) -> Iterator[Window | None]:
        """Like iterating, plus a ``None`` after every discovery that found nothing new (just
        before sleeping ``poll_interval_s``): a heartbeat that lets rank 0 tell the other ranks,
        which wait for its listing, that the stream is still waiting.

        ``stop``: asked every ``STOP_CHECK_INTERVAL_S`` while sleeping; when it says True the
        sleep ends and another heartbeat follows at once, for the consumer to end the iteration
        (``resolve_windows`` / ``agreed_windows`` raise ``WaitInterrupted``). Only the first
        such stop cuts a sleep short."""
        interrupted = False
        yielded: list[str] = []
        seen: set[str] = set()
        last_new = time.monotonic()
        while True:
            ended = self._ended()
            current = list(self.discover())
            order = {w.id: i for i, w in enumerate(current)}
            last_pos = order.get(yielded[-1], -1) if yielded else -1
            for w in current:
                if w.id in seen:
                    continue
                seen.add(w.id)
                if order[w.id] < last_pos:
                    logger.warning("window %s appeared after later windows were trained; ignored", w.id)
                    continue
                yielded.append(w.id)
                last_new = time.monotonic()
                yield w
            if ended:
                return
            if time.monotonic() - last_new > self.timeout_s:
                raise TimeoutError(
                    f"no new window and no end marker {self.end_marker!r} for {self.timeout_s}s "
                    f"(last window: {yielded[-1] if yielded else None}); write the end marker "
                    "when the stream ends, or raise StreamingWindows(timeout_s=...)."
                )
            yield None
            if _sleep(self.poll_interval_s, None if interrupted else stop):
                interrupted = True
                yield None  # at once: the consumer acts on the stop now, not a poll later


def _sleep(seconds: float, stop: Callable[[], bool] | None) -> bool:
    """Sleep ``seconds``, in slices that ask ``stop``; True when a stop cut it short."""
    if stop is None:
        time.sleep(seconds)
        return False
    deadline = time.monotonic() + seconds
    while not stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(STOP_CHECK_INTERVAL_S, left))
    return True


WindowSource = str | Sequence[str] | Sequence[Window] | Callable[[], Iterable[Window]] | StreamingWindows
"""What a windowed dataset accepts: a partitioned root directory, a list of globs, a list of
``Window``, a callable returning windows, or ``StreamingWindows``."""


def resolve_windows(source: WindowSource, *, heartbeats: bool = False,
                    filesystem: pafs.FileSystem | None = None,
                    stop: Callable[[], bool] | None = None) -> Iterator[Window | None]:
    """Iterate the windows of any ``WindowSource`` (lazily for streams and callables).

    ``heartbeats=True``: a stream also yields ``None`` each time it polls without finding a
    new window (see ``StreamingWindows.polls``); no other source yields ``None``.
    ``filesystem``: where a root or glob strings are listed (default: as their URLs select).
    ``stop``: asked while a stream waits (``StreamingWindows.polls``); without heartbeats a
    stop seen at a heartbeat raises ``WaitInterrupted`` here (with them, the consumer decides).
    """
    if isinstance(source, str):
        yield from partitioned_windows(source, filesystem=filesystem)
    elif isinstance(source, StreamingWindows):
        for w in source.polls(stop):
            if w is not None or heartbeats:
                yield w
            elif stop is not None and stop():
                raise WaitInterrupted(_interrupted(source))
    elif callable(source):
        yield from source()
    else:
        items = list(source)
        if all(isinstance(x, Window) for x in items):
            yield from items  # type: ignore[misc]
        elif all(isinstance(x, str) for x in items):
            yield from glob_windows(items, filesystem=filesystem)  # type: ignore[arg-type]
        else:
            raise TypeError("a window list must hold only Window objects or only glob strings.")


def describe_source(source: WindowSource) -> str:
    """A stable description of a source for the dataset's resume fingerprint."""
    if isinstance(source, str):
        return f"partitioned:{source if storage.scheme_of(source) else os.path.abspath(source)}"
    if isinstance(source, StreamingWindows) or callable(source):
        return f"callable:{getattr(source, '__qualname__', type(source).__name__)}"
    items: list[object] = list(source)
    return ",".join(x.id if isinstance(x, Window) else str(x) for x in items)


def _interrupted(source: WindowSource) -> str:
    return (f"a stop was requested while {describe_source(source)!r} waited for its next "
            "window")


def agreed_windows(source: WindowSource, gang: Gang | None,
                   filesystem: pafs.FileSystem | None = None,
                   stop: Callable[[], bool] | None = None,
                   on_wait: Callable[[], None] | None = None) -> Iterator[Window]:
    """The windows of ``source`` *as rank 0 lists them*, on every rank of ``gang``.

    Listings of shared storage can differ between ranks (a lagging NFS or object-store
    listing): a window empty on one rank only, a file visible to one rank only. Ranks that
    list independently then disagree on what a window holds, which reads rows twice or never,
    or leaves one rank waiting in a collective for another that skipped the window. So rank 0
    alone lists, and every window (id and files) reaches the other ranks in one broadcast;
    a file that another rank then cannot open is a ``DataError`` naming it. A failure to list
    on rank 0 is raised on every rank. While a stream waits for new windows, rank 0 sends a
    heartbeat after every poll (``StreamingWindows.poll_interval_s`` must stay below the
    process group's collective timeout).

    ``stop`` (the Trainer's "a preemption signal arrived on this rank"): at every heartbeat all
    ranks, which all reach it together, take the max of their ``stop()`` in one all-reduce;
    if any rank is stopping, every rank raises ``WaitInterrupted``. Rank 0 asks its own
    ``stop`` while it sleeps between polls and heartbeats at once when it says True, so a
    signal on rank 0 ends the wait within ``STOP_CHECK_INTERVAL_S``, one on another rank at
    the next heartbeat (within ``poll_interval_s``).

    ``on_wait`` (the Trainer's "wait" resume point): run at every heartbeat after the stop
    check, on every rank at the same heartbeat (with one rank too), while nothing is left to
    train: the Trainer finishes the checkpoint in flight there. The next poll waits for it.

    Without a gang, or with one rank, the windows are ``resolve_windows(source, filesystem=...,
    stop=...)``'s, and each heartbeat runs ``on_wait``.
    """
    if gang is None or gang.world_size == 1:
        for polled in resolve_windows(source, heartbeats=True, filesystem=filesystem, stop=stop):
            if polled is not None:
                yield polled
            elif stop is not None and stop():
                raise WaitInterrupted(_interrupted(source))
            elif on_wait is not None:
                on_wait()
        return
    listing = resolve_windows(source, heartbeats=True, filesystem=filesystem, stop=stop) \
        if gang.rank == 0 else None
    failure: Exception | None = None
    while True:
        message: tuple[str, Any] = ("end", None)
        if listing is not None:
            try:
                w = next(listing, _END)
                message = ("end", None) if w is _END else ("wait", None) if w is None else ("window", w)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the others
                message = ("error", f"{type(exc).__name__}: {exc}")
                failure = exc
        kind, payload = gang.broadcast_object(message, src=0)
        if kind == "window":
            yield payload
        elif kind == "wait":
            # Every rank is here (the heartbeat reaches all): the collective is matched. It
            # runs with no ``stop`` too, so ranks never disagree on whether it runs.
            if gang.all_reduce_max([int(stop is not None and bool(stop()))])[0]:
                raise WaitInterrupted(_interrupted(source))
            if on_wait is not None:
                on_wait()
        elif kind == "end":
            return
        elif kind == "error":
            if failure is not None:
                raise failure
            raise RuntimeError(
                f"rank 0 could not list the windows of {describe_source(source)!r}: {payload} "
                "(every rank reads rank 0's listing; see rank 0's log)."
            )


_END = object()
