"""Event-time windows over a partitioned log: which window each row belongs to, when a window
closes, and which of its rows each rank trains. Pure functions and plain data, no Kafka.

**Windows.** Window ``W`` (an int) covers event times ``[W * window_s, (W + 1) * window_s)``
(aligned to the Unix epoch); a row's own window is ``V = floor(t / window_s)``.

**Ranges.** A partition's *watermark* after a message is the largest event time of the
partition's messages so far. Window ``W`` closes in partition ``p`` after the first message that
takes the watermark to ``end(W) + allowed_lateness_s``: ``hi_p(W)`` is the offset after it (or,
when the partition was idle or at its end as the job closed ``W``, the partition's read
position then: recorded, since it depends on timing). The messages of ``p`` in
``[hi_p(W - 1), hi_p(W))`` are *window W's range*: their close window ``C = W``. A message is
in the range of the window open when it was read (its own rows never make it late), so a
message of many rows (an Arrow batch) that spans a window's end is split by event time.

**Assignment.** A row goes to window ``A = max(V, C)``: a row of a window still open is trained
in its own window (a row read early, ``V > C``, waits for its window), and a row whose window
had closed when it was read (``V < C``, *late*) is trained in the window that was open then
(``late_rows="train"``) or dropped and counted (``"drop"``). Because the ranges are recorded,
any reader of the log decides every row's window alike, at any time: the owner of the partition
as it reads ahead, and any rank re-reading a span later (``in_window``: only ``hi_p(W - 1)`` and
``hi_p(W)`` are needed).

**Plans.** When the job closes a window with rows, every rank holds its ``WindowPlan``: per
partition a ``Span`` (rows, the first offset holding one, the range, index points to seek to).
Each rank trains the rows of the partitions it owns (``owner``: it read them as they arrived),
when every rank has at least ``OWNER_CUT_MIN_SHARE`` of an even share; otherwise a window's rows,
ordered by (partition, offset, row), are cut like a parquet window's, into ``world_size``
contiguous shares whose sizes differ by at most one row (``share``), each rank's partitions
together. Every rank takes the same number of batches (``batch_sizes``: a smaller share's
batches are smaller, and a rank with no row left gets zero-weight padding), so no row is left
unread when the ranks agree to stop. A job that changed its world size in the middle of a window replays
each earlier part's cut (``Segment``) and shares out the rows no earlier rank consumed.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa

INDEX_EVERY_ROWS = 2048
"""A span's index has a point (an offset to start reading at) about every this many rows."""

LatePolicy = Literal["train", "drop"]


@dataclass(frozen=True)
class Clock:
    """The window arithmetic of one source: ``window_s`` long, closing ``lateness_s`` after
    their end."""

    window_s: float
    lateness_s: float

    def window_of(self, t: np.ndarray) -> np.ndarray:
        """The window of each event time (seconds since the epoch)."""
        return np.floor(np.asarray(t, dtype=np.float64) / self.window_s).astype(np.int64)

    def open_at(self, watermark: float) -> int:
        """The first window still open at ``watermark``: every earlier window ``W`` has
        ``end(W) + lateness <= watermark``."""
        return math.floor((watermark - self.lateness_s) / self.window_s)

    def start(self, window: int) -> float:
        return window * self.window_s

    def end(self, window: int) -> float:
        return (window + 1) * self.window_s

    def name(self, window: int) -> str:
        """The window's id: its start as UTC ISO time (milliseconds when not whole seconds)."""
        start = self.start(window)
        t = datetime.datetime.fromtimestamp(start, tz=datetime.timezone.utc)
        if float(start).is_integer():
            return t.strftime("%Y-%m-%dT%H:%M:%SZ")
        return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


# ---------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Span:
    """One partition's rows of one window.

    ``rows``: how many; ``first``: the offset of the first message holding one (-1: none);
    ``lo``/``hi``: the window's range in the partition (``hi_p(W - 1)``, ``hi_p(W)``: no
    message at or after ``hi`` holds a row of it); ``index``: ``(offset, rows before it)``
    points, ascending, the first at ``first``."""

    rows: int
    first: int
    lo: int
    hi: int
    index: tuple[tuple[int, int], ...] = ()

    def seek(self, row: int) -> tuple[int, int]:
        """Where to start reading for the span's row ``row``: an index point ``(offset, rows of
        the span before it)`` at or before it."""
        best = (self.first, 0)
        for offset, before in self.index:
            if before > row:
                break
            best = (offset, before)
        return best

    def to_json(self) -> list[Any]:
        return [self.rows, self.first, self.lo, self.hi, [list(p) for p in self.index]]

    @staticmethod
    def from_json(raw: Sequence[Any]) -> Span:
        rows, first, lo, hi, index = raw
        return Span(int(rows), int(first), int(lo), int(hi),
                    tuple((int(o), int(b)) for o, b in index))


@dataclass(frozen=True)
class WindowPlan:
    """A closed window with rows, as every rank holds it: its number, its position among the
    source's windows (``index``: the Trainer's ``window_index``), and a ``Span`` per
    partition (partitions without rows of it included: their range still matters)."""

    number: int
    index: int
    spans: Mapping[int, Span]
    late_trained: int = 0
    late_dropped: int = 0
    closed_at: float = 0.0
    """Wall time (unix) when the job closed it."""

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.spans.values())

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "index": self.index,
                "spans": {str(p): s.to_json() for p, s in sorted(self.spans.items())},
                "late_trained": self.late_trained, "late_dropped": self.late_dropped,
                "closed_at": self.closed_at}

    @staticmethod
    def from_json(raw: Mapping[str, Any]) -> WindowPlan:
        return WindowPlan(int(raw["number"]), int(raw["index"]),
                          {int(p): Span.from_json(s) for p, s in raw["spans"].items()},
                          int(raw["late_trained"]), int(raw["late_dropped"]),
                          float(raw["closed_at"]))


def in_window(window: int, span: Span, offsets: np.ndarray | int, v: np.ndarray,
              late: LatePolicy, start_window: int | None = None) -> np.ndarray:
    """Which rows (their messages' ``offsets``, their own windows ``v``) belong to ``window``,
    whose range in their partition is ``[span.lo, span.hi)``: rows of its range whose window
    is ``window`` (and earlier ones, late, with ``late="train"``), and rows of earlier ranges
    whose own window is ``window`` (read early). Rows before ``start_window`` (the source's
    ``start_time``) belong to none."""
    offsets = np.asarray(offsets)
    in_range = (offsets >= span.lo) & (offsets < span.hi)
    own = v <= window if late == "train" else v == window
    mask = (in_range & own) | ((offsets < span.lo) & (v == window))
    if start_window is not None:
        mask &= v >= start_window
    return np.asarray(mask)


# ---------------------------------------------------------------------- one partition's log


@dataclass
class Run:
    """Messages of one partition read together, in offset order: each message's offset, its
    row count (0 for a message skipped as undecodable) and largest event time (-inf: no row);
    every row's own window ``v``; the rows (``table``, kept for the rank that trains them) or
    None."""

    offsets: np.ndarray
    rows: np.ndarray
    max_time: np.ndarray
    v: np.ndarray
    table: Any = None

    @staticmethod
    def of(clock: Clock, offsets: Sequence[int] | np.ndarray, rows: Sequence[int] | np.ndarray,
           times: np.ndarray, table: Any = None) -> Run:
        """A run from each message's offset and row count and every row's event time."""
        rows_ = np.asarray(rows, dtype=np.int64)
        times = np.asarray(times, dtype=np.float64)
        max_time = np.full(len(rows_), -math.inf)
        has = rows_ > 0
        if has.any():
            starts = np.concatenate([[0], np.cumsum(rows_)[:-1]])
            max_time[has] = np.maximum.reduceat(times, starts[has])
        return Run(np.asarray(offsets, dtype=np.int64), rows_, max_time, clock.window_of(times),
                   table)

    def __len__(self) -> int:
        return len(self.offsets)

    def split(self, k: int) -> tuple[Run, Run]:
        """Messages ``[:k]`` and ``[k:]``."""
        r = int(self.rows[:k].sum())
        head_t = tail_t = None
        if self.table is not None:
            head_t, tail_t = self.table.slice(0, r), self.table.slice(r)
        return (Run(self.offsets[:k], self.rows[:k], self.max_time[:k], self.v[:r], head_t),
                Run(self.offsets[k:], self.rows[k:], self.max_time[k:], self.v[r:], tail_t))


@dataclass
class Part:
    """Rows of one window from a run of messages: the offsets of the messages holding some, how
    many each, and the rows (``table``) or None."""

    offsets: np.ndarray
    counts: np.ndarray
    table: Any = None

    @property
    def rows(self) -> int:
        return int(self.counts.sum())

    @property
    def first(self) -> int:
        return int(self.offsets[0])


@dataclass
class Bucket:
    """A partition's rows of one window collected so far (in offset order)."""

    parts: list[Part] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def first(self) -> int:
        return self.parts[0].first if self.parts else -1

    @property
    def cached(self) -> bool:
        """Whether every row's decoded table is held (else the span is read again)."""
        return all(p.table is not None for p in self.parts)

    def drop_tables(self) -> int:
        freed = sum(_nbytes(p.table) for p in self.parts)
        for p in self.parts:
            p.table = None
        return freed

    def index(self) -> tuple[tuple[int, int], ...]:
        """``(offset, rows before it)`` points: the first message, then about every
        ``INDEX_EVERY_ROWS`` rows."""
        if not self.parts:
            return ()
        offsets = np.concatenate([p.offsets for p in self.parts])
        counts = np.concatenate([p.counts for p in self.parts])
        before = np.cumsum(counts) - counts
        block = before // INDEX_EVERY_ROWS
        pick = np.flatnonzero(np.concatenate([[True], block[1:] > block[:-1]]))
        return tuple((int(offsets[i]), int(before[i])) for i in pick)


def _nbytes(table: Any) -> int:
    return int(getattr(table, "nbytes", 0) or 0)


@dataclass
class Closed:
    """What closing windows ``first..last`` did in one partition: ``bounds`` (for each close
    window whose range holds a message, the offset the range starts at: a range ends where
    the next one starts, the last at ``hi``), the rows of each window now complete (with
    rows), the late rows per close window, and the offsets assigned: ``[lo, hi)``."""

    first: int
    lo: int
    hi: int
    bounds: list[tuple[int, int]]
    windows: dict[int, Bucket]
    late_trained: dict[int, int]
    late_dropped: dict[int, int]
    before_start: int = 0
    """Rows skipped as earlier than the source's ``start_time``."""

    def range_of(self, window: int) -> tuple[int, int]:
        """``(hi_p(window - 1), hi_p(window))`` for a window closed in this round."""
        return range_in(self.lo, self.hi, self.bounds, self.first, window)


def range_in(lo: int, hi: int, bounds: Sequence[tuple[int, int]], first: int,
             window: int) -> tuple[int, int]:
    """``(hi_p(window - 1), hi_p(window))`` of a window closed in a round that closed
    ``first..``, assigned the partition's offsets ``[lo, hi)`` and found ``bounds``
    (``Closed``)."""
    def hi_of(w: int) -> int:
        if w < first:
            return lo
        for c, start in bounds:
            if c > w:
                return start
        return hi
    return hi_of(window - 1), hi_of(window)


class PartitionLog:
    """The owner's view of one partition: messages read but not yet assigned to a window
    (``pending``), how far the log is assigned (``frontier``, and the watermark before it),
    and the rows read early for windows still open (``deferred``)."""

    def __init__(self, partition: int, clock: Clock, late: LatePolicy, *, frontier: int,
                 watermark: float = -math.inf,
                 deferred: Mapping[int, tuple[int, int]] | None = None,
                 start_window: int | None = None) -> None:
        self.partition = partition
        self.clock = clock
        self.late = late
        self.start_window = start_window
        """Rows of earlier windows (before the source's ``start_time``) are never assigned."""
        self.frontier = frontier
        self.frontier_watermark = watermark
        self.watermark = watermark
        self.position = frontier
        """The next offset to read: every message before it is pending or assigned."""
        self.pending: list[Run] = []
        # Rows read early, restored from a checkpoint as one part (first offset, rows)
        # without their table: the span is read again from its first offset.
        self.deferred: dict[int, Bucket] = {
            w: Bucket([Part(np.array([first]), np.array([rows]))])
            for w, (first, rows) in (deferred or {}).items()}

    def add(self, run: Run) -> None:
        """Messages read in order (from ``position`` on)."""
        if not len(run):
            return
        self.pending.append(run)
        self.position = int(run.offsets[-1]) + 1
        top = float(run.max_time.max())
        if top > self.watermark:
            self.watermark = top

    def skip_to(self, offset: int) -> None:
        """No message below ``offset`` remains to be read (a gap in the offsets)."""
        self.position = max(self.position, offset)

    @property
    def crossed(self) -> int | None:
        """The last window this partition's watermark has closed (None: no message yet)."""
        if self.watermark == -math.inf:
            return None
        return self.clock.open_at(self.watermark) - 1

    def last_window(self) -> int | None:
        """The latest own window of a row not yet assigned (pending or read early)."""
        found = [int(r.v.max()) for r in self.pending if len(r.v)]
        found.extend(self.deferred)
        return max(found) if found else None

    def first_window(self) -> int | None:
        """The earliest own window of a row not yet assigned (pending or read early)."""
        found = [int(r.v.min()) for r in self.pending if len(r.v)]
        found.extend(self.deferred)
        return min(found) if found else None

    def close(self, first: int, last: int) -> Closed:
        """Close windows ``first..last`` in this partition: assign every pending message whose
        close window is at most ``last`` (the cut is the first message whose watermark before
        it passes ``last``'s close, whether the partition is idle, finished or neither: an
        idle partition's later messages wait for a later range as a busy one's do), and
        collect the rows of windows ``first..last``; rows of later windows wait in
        ``deferred``. (The message after the one whose watermark
        passes ``last``'s end plus the lateness starts a later range: the same cut either
        way.)"""
        clock = self.clock
        limit = clock.end(last) + clock.lateness_s
        wm = self.frontier_watermark
        lo = self.frontier
        windows: dict[int, Bucket] = {w: self.deferred.pop(w) for w in sorted(self.deferred)
                                      if w <= last}
        late_trained: dict[int, int] = {}
        late_dropped: dict[int, int] = {}
        before_start = 0
        bounds: list[tuple[int, int]] = []
        kept: list[Run] = []  # what stays pending: the runs from the first cut message on
        hi = self.position
        for i, run in enumerate(self.pending):
            # The watermark before each message of the run.
            before = np.maximum.accumulate(np.concatenate([[wm], run.max_time]))[:-1]
            over = np.flatnonzero(before >= limit)
            if len(over):
                head, tail = run.split(int(over[0]))
                kept = [tail, *self.pending[i + 1:]] if len(tail) else self.pending[i + 1:]
                run, before = head, before[:len(head)]
            if len(run):
                before_start += self._assign(run, before, first, last, windows, bounds,
                                             late_trained, late_dropped)
                wm = max(wm, float(run.max_time.max()))
            if len(over):
                hi = int(kept[0].offsets[0]) if kept else self.position
                break
        self.pending = kept
        self.frontier = hi
        self.frontier_watermark = wm
        # A bucket of a window closed earlier cannot gain rows: only [first, last] are new.
        return Closed(first, lo, hi, bounds, {w: b for w, b in windows.items() if b.rows},
                      late_trained, late_dropped, before_start)

    def _assign(self, run: Run, before: np.ndarray, first: int, last: int,
                windows: dict[int, Bucket], bounds: list[tuple[int, int]],
                late_trained: dict[int, int], late_dropped: dict[int, int]) -> int:
        """Give a run's rows their windows (see the module docstring); returns how many were
        before the source's start."""
        clock = self.clock
        with np.errstate(invalid="ignore"):
            natural = np.floor((before - clock.lateness_s) / clock.window_s)
        c = np.where(before == -math.inf, first,
                     np.maximum(first, np.nan_to_num(natural, neginf=first))).astype(np.int64)
        change = np.flatnonzero(np.concatenate([[True], c[1:] != c[:-1]]))
        for j in change:
            if not bounds or bounds[-1][0] != int(c[j]):
                bounds.append((int(c[j]), int(run.offsets[j])))
        if not len(run.v):
            return 0
        msg = np.repeat(np.arange(len(run)), run.rows)
        crow = c[msg]
        a = np.maximum(run.v, crow)
        keep = np.ones(len(a), dtype=bool)
        before_start = 0
        if self.start_window is not None:
            early = run.v < self.start_window
            before_start = int(early.sum())
            keep &= ~early
        late = keep & (run.v < crow)
        if late.any():
            counts = late_dropped if self.late == "drop" else late_trained
            for w, n in zip(*np.unique(crow[late], return_counts=True), strict=True):
                counts[int(w)] = counts.get(int(w), 0) + int(n)
            if self.late == "drop":
                keep &= ~late
        for w in np.unique(a[keep]).tolist():
            mask = keep & (a == w)
            per_msg = np.bincount(msg[mask], minlength=len(run))
            has = per_msg > 0
            table = None
            if run.table is not None:
                table = run.table if mask.all() else run.table.filter(pa.array(mask))
            target = windows if w <= last else self.deferred
            target.setdefault(int(w), Bucket()).parts.append(
                Part(run.offsets[has], per_msg[has], table))
        return before_start

    def deferred_state(self) -> dict[int, tuple[int, int]]:
        """The rows read early, per window: ``(first offset, rows)`` (what a checkpoint
        keeps: after a restart the owner reads from ``frontier`` on, and a span's rows
        before it are read again from its first offset)."""
        return {w: (b.first, b.rows) for w, b in sorted(self.deferred.items())}


@dataclass(frozen=True)
class PartitionStatus:
    """What the owner of a partition reports at an agreement: the last window its watermark
    has closed (``crossed``), the earliest and latest own window of its rows not yet assigned,
    whether it is idle (read to its end, no message for ``idle_timeout_s``) or finished (at
    the end the source was given)."""

    partition: int
    crossed: int | None
    first_window: int | None
    last_window: int | None
    idle: bool
    finished: bool


def closable(statuses: Sequence[PartitionStatus], closed: int | None,
             end_window: int | None) -> tuple[int, int] | None:
    """The windows the job may close now, ``(first, last)``, or None.

    A window closes once every partition that is neither idle nor finished has closed it.
    When every partition is idle or finished, windows close up to the latest one a
    partition has closed (up to the last window with rows, once every partition is
    finished): an idle partition holds no window open. ``closed`` is the last window closed
    so far (None: the first window is not known yet: the earliest row's window, once every
    partition has a row or is idle or finished). Never beyond ``end_window``."""
    active = [s for s in statuses if not (s.idle or s.finished)]
    if closed is None:
        firsts = [s.first_window for s in statuses if s.first_window is not None]
        if not firsts or any(s.first_window is None for s in active):
            return None
        closed = min(firsts) - 1
    target: int | None
    if active:
        crossed = [s.crossed for s in active]
        target = None if any(c is None for c in crossed) else min(c for c in crossed if c is not None)
    elif all(s.finished for s in statuses):
        lasts = [s.last_window for s in statuses if s.last_window is not None]
        target = max(lasts) if lasts else None
    else:
        crossed_any = [s.crossed for s in statuses if s.crossed is not None]
        target = max(crossed_any) if crossed_any else None
    if target is not None and end_window is not None:
        target = min(target, end_window)
    if target is None or target <= closed:
        return None
    return closed + 1, target


# ---------------------------------------------------------------------- the ranks' shares


def owner(partition: int, world_size: int) -> int:
    """The rank that reads (tracks) a partition as it arrives."""
    return partition % world_size


def partition_order(partitions: Iterable[int], world_size: int) -> list[int]:
    """The order a window's rows are cut in at ``world_size``: each rank's partitions together,
    so that a rank's share is mostly what it read itself."""
    return sorted(partitions, key=lambda p: (owner(p, world_size), p))


def batch_sizes(rows: int, steps: int, batch_size: int) -> list[int]:
    """The sizes of a rank's ``steps`` batches over its ``rows`` rows: full batches first,
    then what is left spread over the rest (a 0 is a padding batch: a rank with fewer rows
    than batches). Every rank takes ``steps`` batches: ``steps_for``."""
    if steps == 0:
        return []
    full = min(steps, rows // batch_size)
    while full > 0 and rows - full * batch_size < steps - full:
        full -= 1
    rest, m = rows - full * batch_size, steps - full
    if m == 0:
        return [batch_size] * full
    return [batch_size] * full + [rest // m + (1 if i < rest % m else 0) for i in range(m)]


def steps_for(shares: Sequence[int], batch_size: int) -> int:
    """The batches every rank takes when the largest share has ``max(shares)`` rows."""
    return -(-max(shares, default=0) // batch_size)


Intervals = dict[int, list[tuple[int, int]]]
"""Per partition, the rows of a window (numbered in the partition's span) as ``[a, b)``."""


def _flatten(left: Intervals, order: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(p, a, b) for p in order for a, b in left.get(p, []) if b > a]


def _take(flat: list[tuple[int, int, int]], start: int, stop: int) -> list[tuple[int, int, int]]:
    """The rows ``[start, stop)`` of the flattened intervals."""
    out, pos = [], 0
    for p, a, b in flat:
        n = b - a
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((p, a + lo - pos, a + hi - pos))
        pos += n
    return out


def _remove(left: Intervals, taken: Iterable[tuple[int, int, int]]) -> Intervals:
    out = {p: list(iv) for p, iv in left.items()}
    for p, a, b in taken:
        kept = []
        for x, y in out[p]:
            if b <= x or a >= y:
                kept.append((x, y))
                continue
            if x < a:
                kept.append((x, a))
            if b < y:
                kept.append((b, y))
        out[p] = kept
    return out


@dataclass(frozen=True)
class Share:
    """A rank's part of a window: its rows (``intervals``: (partition, a, b) in reading order)
    and the sizes of its batches from ``skip_batches`` on (every rank has as many)."""

    intervals: list[tuple[int, int, int]]
    sizes: list[int]


OWNER_CUT_MIN_SHARE = 0.75
"""Each rank trains the rows of its own partitions when every rank has at least this part of an
even share of the window (no row crosses to another rank, none is read twice); otherwise the
rows are cut evenly, a rank reading by offset what it does not own."""


def _cut(left: Intervals, world_size: int) -> list[list[tuple[int, int, int]]]:
    """Every rank's rows of what is left of a window at ``world_size``, in reading order: its
    own partitions' (when shares are even enough, ``OWNER_CUT_MIN_SHARE``), else the rows
    in ``partition_order`` cut into contiguous shares differing by at most one row."""
    order = partition_order(left, world_size)
    flat = _flatten(left, order)
    total = sum(b - a for _, a, b in flat)
    own = [[(p, a, b) for p, a, b in flat if owner(p, world_size) == r]
           for r in range(world_size)]
    mean = total / world_size
    if total and min(sum(b - a for _, a, b in x) for x in own) >= OWNER_CUT_MIN_SHARE * mean:
        return own
    cuts = [total * r // world_size for r in range(world_size + 1)]
    return [_take(flat, cuts[r], cuts[r + 1]) for r in range(world_size)]


def share(spans: Mapping[int, Span], segments: Sequence[tuple[int, int]], world_size: int,
          rank: int, batch_size: int, skip_batches: int = 0) -> Share:
    """Rank ``rank``'s share of a window at ``world_size`` after ``segments`` (earlier parts:
    ``(world size, batches per rank)``, each replayed: its cut, and the rows its ranks'
    batches consumed), from its batch ``skip_batches`` on. Every rank takes as many batches
    (``steps_for`` the largest share; ``batch_sizes``)."""
    left: Intervals = {p: [(0, s.rows)] for p, s in spans.items() if s.rows}
    for w, batches in segments:
        shares = _cut(left, w)
        counts = [sum(b - a for _, a, b in x) for x in shares]
        steps = steps_for(counts, batch_size)
        consumed = []
        for x, n in zip(shares, counts, strict=True):
            used = sum(batch_sizes(n, steps, batch_size)[:batches])
            consumed.extend(_take(x, 0, used))
        left = _remove(left, consumed)
    shares = _cut(left, world_size)
    counts = [sum(b - a for _, a, b in x) for x in shares]
    sizes = batch_sizes(counts[rank], steps_for(counts, batch_size), batch_size)
    skipped = sum(sizes[:skip_batches])
    return Share(_take(shares[rank], skipped, counts[rank]), sizes[skip_batches:])
