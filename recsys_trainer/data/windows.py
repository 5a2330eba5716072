"""Where windows come from: a partitioned directory, a list of globs, a callable, or a stream.

A ``Window`` is an id and its files. Sources give windows in training order:

* ``partitioned_windows(root)``: every leaf directory under ``root`` holding data files, e.g.
  ``dt=2019-11-24/hour=05/``, ordered by partition values (numbers compare as numbers).
* ``glob_windows(["/data/2019-11-24-00/*.parquet", ...])``: one window per glob, in list order.
* any callable returning windows (e.g. ``lambda: partitioned_windows(root)[1:]``).
* ``StreamingWindows(discover, ...)``: waits for windows that appear later.

Missing or empty windows (a glob matching nothing, a partition with no data files) are skipped
with a warning; they never reach the Trainer.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recsys_trainer.distributed import Gang

logger = logging.getLogger("recsys_trainer.data")

DATA_SUFFIXES = (".parquet", ".pq", ".csv", ".csv.gz")


@dataclass(frozen=True)
class Window:
    """One ordered unit of data: an id (e.g. ``"dt=2019-11-24/hour=05"``) and its files."""

    id: str
    files: tuple[str, ...]


def _sort_key(rel: str) -> tuple[tuple[int, int | str], ...]:
    parts = []
    for part in rel.split("/"):
        value = part.split("=", 1)[-1]
        parts.append((0, int(value)) if re.fullmatch(r"-?\d+", value) else (1, value))
    return tuple(parts)  # type: ignore[arg-type]


def _data_files(directory: str, suffixes: Sequence[str]) -> list[str]:
    return sorted(
        os.path.join(directory, f) for f in os.listdir(directory)
        if f.endswith(tuple(suffixes)) and not f.startswith(("_", "."))
    )


def partitioned_windows(
    root: str,
    *,
    suffixes: Sequence[str] = DATA_SUFFIXES,
    ready_marker: str | None = None,
) -> list[Window]:
    """Windows of a partitioned directory (``root/k1=v1/k2=v2/*.parquet``), in partition order.

    Args:
        root: the directory.
        suffixes: file name endings that count as data (files starting with ``_`` or ``.`` never).
        ready_marker: if set (e.g. ``"_SUCCESS"``), a partition is a window only once this file
            exists in it: the writer's signal that the partition is complete (streaming).
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"window root {root!r} is not a directory.")
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(("_", "."))]
        if dirnames:
            continue  # not a leaf partition
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if rel == ".":
            continue
        if ready_marker is not None and ready_marker not in filenames:
            continue
        found.append((rel, dirpath))
    out: list[Window] = []
    for rel, dirpath in sorted(found, key=lambda x: _sort_key(x[0])):
        files = _data_files(dirpath, suffixes)
        if not files:
            logger.warning("window %s (%s) has no data files; skipping it", rel, dirpath)
            continue
        out.append(Window(rel, tuple(files)))
    return out


def glob_windows(patterns: Sequence[str] | Mapping[str, str]) -> list[Window]:
    """One window per glob pattern, in order (a mapping gives ``{window_id: pattern}``)."""
    items = list(patterns.items()) if isinstance(patterns, Mapping) else [(p, p) for p in patterns]
    out: list[Window] = []
    for wid, pattern in items:
        files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
        if not files:
            logger.warning("window %s: pattern %r matches no files; skipping it", wid, pattern)
            continue
        out.append(Window(wid, tuple(files)))
    return out


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
    """

    def __init__(
        self,
        discover: Callable[[], Iterable[Window]],
        *,
        end_marker: str | Callable[[], bool],
        poll_interval_s: float = 30.0,
        timeout_s: float = 3600.0,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"`poll_interval_s` must be > 0, but is {poll_interval_s!r}.")
        if timeout_s <= 0:
            raise ValueError(f"`timeout_s` must be > 0, but is {timeout_s!r}.")
        self.discover = discover
        self.end_marker = end_marker
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s

    def _ended(self) -> bool:
        if callable(self.end_marker):
            return bool(self.end_marker())
        return os.path.exists(self.end_marker)

    def __iter__(self) -> Iterator[Window]:
        return (w for w in self.polls() if w is not None)

    def polls(self) -> Iterator[Window | None]:
        """Like iterating, plus a ``None`` after every discovery that found nothing new (just
        before sleeping ``poll_interval_s``): a heartbeat that lets rank 0 tell the other ranks,
        which wait for its listing, that the stream is still waiting."""
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
            time.sleep(self.poll_interval_s)


WindowSource = str | Sequence[str] | Sequence[Window] | Callable[[], Iterable[Window]] | StreamingWindows
"""What a windowed dataset accepts: a partitioned root directory, a list of globs, a list of
``Window``, a callable returning windows, or ``StreamingWindows``."""


def resolve_windows(source: WindowSource, *, heartbeats: bool = False) -> Iterator[Window | None]:
    """Iterate the windows of any ``WindowSource`` (lazily for streams and callables).

    ``heartbeats=True``: a stream also yields ``None`` each time it polls without finding a
    new window (see ``StreamingWindows.polls``); no other source yields ``None``.
    """
    if isinstance(source, str):
        yield from partitioned_windows(source)
    elif isinstance(source, StreamingWindows):
        yield from (source.polls() if heartbeats else source)
    elif callable(source):
        yield from source()
    else:
        items = list(source)
        if all(isinstance(x, Window) for x in items):
            yield from items  # type: ignore[misc]
        elif all(isinstance(x, str) for x in items):
            yield from glob_windows(items)  # type: ignore[arg-type]
        else:
            raise TypeError("a window list must hold only Window objects or only glob strings.")


def describe_source(source: WindowSource) -> str:
    """A stable description of a source for the dataset's resume fingerprint."""
    if isinstance(source, str):
        return f"partitioned:{os.path.abspath(source)}"
    if isinstance(source, StreamingWindows) or callable(source):
        return f"callable:{getattr(source, '__qualname__', type(source).__name__)}"
    items: list[object] = list(source)
    return ",".join(x.id if isinstance(x, Window) else str(x) for x in items)


def agreed_windows(source: WindowSource, gang: Gang | None) -> Iterator[Window]:
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

    Without a gang, or with one rank, this is ``resolve_windows(source)``.
    """
    if gang is None or gang.world_size == 1:
        yield from (w for w in resolve_windows(source) if w is not None)
        return
    listing = resolve_windows(source, heartbeats=True) if gang.rank == 0 else None
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
