"""The Kafka source's window rules without a broker (recsys_trainer.data.kafka.windowing): every
row of a simulated log lands in exactly one window whatever the timing of the closes, a span
read again picks the same rows, and every rank's share of a window covers its rows once at any
sequence of world sizes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from recsys_trainer.data.kafka.windowing import (
    Clock,
    PartitionLog,
    PartitionStatus,
    Run,
    Span,
    batch_sizes,
    closable,
    in_window,
    range_in,
    share,
    steps_for,
)


def _log(rng: np.random.Generator, n: int, window_s: float, jitter: float,
         t0: float = 1000.0) -> list[tuple[int, np.ndarray]]:
    """A partition's messages: (offset, event times of its rows), times roughly increasing
    with ``jitter`` seconds out of order; some messages hold several rows, a few none."""
    out, t = [], t0
    for offset in range(n):
        t += rng.exponential(window_s / 8)
        rows = int(rng.choice([0, 1, 1, 1, 3]))
        out.append((offset, t + rng.uniform(-jitter, 0.2 * jitter, rows)))
    return out


def _simulate(seed: int, late: str) -> None:
    rng = np.random.default_rng(seed)
    clock = Clock(window_s=10.0, lateness_s=float(rng.choice([0.0, 3.0, 25.0])))
    logs = {p: _log(rng, 120, clock.window_s, jitter=float(rng.choice([0, 5, 30])))
            for p in range(3)}
    start = int(rng.choice([0, 1])) and 101  # sometimes a start window (rows before: skipped)
    start_window = start or None
    parts = {p: PartitionLog(p, clock, late, frontier=0,  # type: ignore[arg-type]
                             start_window=start_window) for p in logs}
    read = dict.fromkeys(logs, 0)
    closed: int | None = None if start_window is None else start_window - 1
    assigned: dict[tuple[int, int, int], int] = {}  # (partition, offset, row) -> window
    times: dict[tuple[int, int, int], float] = {}
    spans: dict[int, dict[int, Span]] = {}
    dropped = before = 0
    while True:
        for p in logs:  # read a random number of messages per partition
            k = int(rng.integers(0, 12))
            chunk = logs[p][read[p]:read[p] + k]
            if chunk:  # one run of the messages read together
                ts = np.concatenate([t for _, t in chunk])
                r = np.concatenate([np.arange(len(t)) for _, t in chunk])
                parts[p].add(Run.of(clock, [o for o, _ in chunk], [len(t) for _, t in chunk],
                                    ts, pa.table({"t": ts, "r": r})))
            read[p] = min(read[p] + k, len(logs[p]))
        finished = all(read[p] == len(logs[p]) for p in logs)
        idle = {p for p in logs if rng.random() < 0.15}  # timing: some partitions idle now
        statuses = [PartitionStatus(p, parts[p].crossed, parts[p].first_window(),
                                    parts[p].last_window(), p in idle and not finished,
                                    finished and read[p] == len(logs[p])) for p in logs]
        got = closable(statuses, closed, None)
        if got is None:
            if finished and all(s.first_window is None for s in statuses):
                break
            continue
        first, last = got
        rounds = {p: parts[p].close(first, last) for p in logs}
        for p, c in rounds.items():
            dropped += sum(c.late_dropped.values())
            before += c.before_start
            for w, bucket in c.windows.items():
                assert first <= w <= last
                for part in bucket.parts:
                    t = part.table.column("t").to_numpy()  # the rows given to w
                    r = part.table.column("r").to_numpy()
                    offs = np.repeat(part.offsets, part.counts)
                    for i in range(part.rows):
                        key = (p, int(offs[i]), int(r[i]))
                        assert key not in assigned, f"row {key} in two windows"
                        assigned[key] = w
                        times[key] = float(t[i])
            for w in range(first, last + 1):
                lo, hi = range_in(c.lo, c.hi, c.bounds, first, w)
                b = c.windows.get(w)
                spans.setdefault(w, {})[p] = Span(b.rows if b else 0, b.first if b else -1,
                                                  lo, hi, b.index() if b else ())
        closed = last
    # Every row is in exactly one window, dropped as late, or before the start.
    total = sum(len(ts) for log in logs.values() for _, ts in log)
    assert len(assigned) + dropped + before == total
    for key, w in assigned.items():
        own = int(clock.window_of(np.array([times[key]]))[0])
        assert w >= own, "a row trained before its own window"
        assert start_window is None or own >= start_window
    # Reading a span again (only its range and the row's own window) gives the same rows.
    for w, by_p in spans.items():
        for p, span in by_p.items():
            again = []
            for offset, ts in logs[p]:
                if offset >= span.hi:
                    break
                mask = in_window(w, span, offset, clock.window_of(ts), late,  # type: ignore[arg-type]
                                 start_window)
                again.extend((p, offset, int(i)) for i in np.flatnonzero(mask))
            assert sorted(again) == sorted(k for k, v in assigned.items() if k[0] == p and v == w)
            if span.rows:
                assert len(again) == span.rows and again[0][1] == span.first


@pytest.mark.parametrize("seed", range(12))
def test_every_row_of_a_simulated_log_lands_in_one_window_whatever_the_timing_and_a_reread_agrees(
        seed: int) -> None:
    _simulate(seed, "train" if seed % 2 else "drop")


def test_a_row_read_before_its_window_closes_waits_for_it_and_a_late_row_joins_the_open_window(
        ) -> None:
    clock = Clock(window_s=10.0, lateness_s=0.0)
    log = PartitionLog(0, clock, "train", frontier=0)
    ts = np.array([1.0, 12.0, 3.0, 25.0])  # 12 arrives early; 3 after 12
    log.add(Run.of(clock, range(4), [1] * 4, ts, pa.table({"t": ts})))
    c = log.close(0, 1)  # the message at 25 closes windows 0 and 1
    # 12 took the watermark past window 0's end: 3, read after it, is late (trained in window
    # 1); 12 itself is window 0's range but waits for its own window, 1; 25 waits for 2.
    rows = {w: [t for p in b.parts for t in p.table.column("t").to_pylist()]
            for w, b in c.windows.items()}
    assert rows == {0: [1.0], 1: [12.0, 3.0]}
    assert c.late_trained == {1: 1} and c.hi == 4 and c.range_of(0) == (0, 2)
    assert log.deferred_state() == {2: (3, 1)} and log.pending == []


def test_with_lateness_a_row_a_little_late_still_lands_in_its_own_window() -> None:
    clock = Clock(window_s=10.0, lateness_s=5.0)
    log = PartitionLog(0, clock, "drop", frontier=0)
    ts = np.array([1.0, 12.0, 3.0, 16.0])
    for offset in range(4):  # one message at a time
        log.add(Run.of(clock, [offset], [1], ts[offset:offset + 1],
                       pa.table({"t": ts[offset:offset + 1]})))
    c = log.close(0, 0)  # 16 >= end(0) + 5 closes window 0
    assert sorted(t for p in c.windows[0].parts for t in p.table.column("t").to_pylist()) == [
        1.0, 3.0]
    assert log.deferred_state() == {1: (1, 2)}  # 12 and 16 wait for window 1 (from offset 1)
    assert c.late_dropped == {}


def test_an_idle_partition_holds_no_window_open_and_all_idle_close_only_what_was_passed() -> None:
    s = lambda p, crossed, idle=False, fin=False, first=5, last=9: PartitionStatus(  # noqa: E731
        p, crossed, first, last, idle, fin)
    assert closable([s(0, 7), s(1, None)], 4, None) is None  # partition 1 has not moved
    assert closable([s(0, 7), s(1, None, idle=True, first=None)], 4, None) == (5, 7)
    assert closable([s(0, 7, idle=True), s(1, 6, idle=True)], 4, None) == (5, 7)
    assert closable([s(0, 7), s(1, 6)], 4, 5) == (5, 5)  # end_window
    assert closable([s(0, 7, fin=True, last=12), s(1, 6, fin=True, last=11)], 4, None) == (5, 12)
    # The first window: the earliest row, once every partition has one or is idle.
    assert closable([s(0, 7, first=3), s(1, None, first=None)], None, None) is None
    assert closable([s(0, 7, first=3), s(1, 6, first=2)], None, None) == (2, 6)


@pytest.mark.parametrize("rows,steps,bs", [(500, 6, 100), (501, 6, 100), (3, 4, 10),
                                           (0, 2, 8), (64, 8, 8), (1, 1, 1)])
def test_a_rank_takes_as_many_batches_as_every_other_and_each_row_once(rows: int, steps: int,
                                                                        bs: int) -> None:
    sizes = batch_sizes(rows, steps, bs)
    assert len(sizes) == steps and sum(sizes) == rows and all(0 <= n <= bs for n in sizes)


@pytest.mark.parametrize("seed", range(20))
def test_shares_cover_a_window_once_across_changes_of_world_size(seed: int) -> None:
    rng = np.random.default_rng(seed)
    spans = {p: Span(int(rng.integers(0, 60)), 0, 0, 1) for p in range(int(rng.integers(1, 5)))}
    bs = int(rng.integers(1, 9))
    segments: list[tuple[int, int]] = []
    trained: list[tuple[int, int]] = []
    for _ in range(int(rng.integers(0, 3))):  # earlier parts: a world size, some batches
        w = int(rng.integers(1, 5))
        shares = [share(spans, segments, w, r, bs) for r in range(w)]
        assert len({len(s.sizes) for s in shares}) == 1  # the same steps on every rank
        k = int(rng.integers(0, len(shares[0].sizes) + 1))
        for s in shares:
            _take_rows(s, k, trained)
        segments.append((w, k))
    w = int(rng.integers(1, 6))
    shares = [share(spans, segments, w, r, bs) for r in range(w)]
    assert len({len(s.sizes) for s in shares}) == 1
    assert max(s.sizes[0] for s in shares) >= 1 if shares[0].sizes else True
    for s in shares:
        _take_rows(s, len(s.sizes), trained)
    expected = sorted((p, i) for p, sp in spans.items() for i in range(sp.rows))
    assert sorted(trained) == expected
    # Resuming a rank from its batch k reads exactly what the rest of its batches read.
    if shares[0].sizes:
        k = len(shares[0].sizes) // 2
        later = share(spans, segments, w, 0, bs, skip_batches=k)
        assert later.sizes == shares[0].sizes[k:]


def _take_rows(s: object, batches: int, out: list[tuple[int, int]]) -> None:
    rows = sum(s.sizes[:batches])  # type: ignore[attr-defined]
    for p, a, b in s.intervals:  # type: ignore[attr-defined]
        n = min(b - a, rows)
        out.extend((p, i) for i in range(a, a + n))
        rows -= n
        if rows == 0:
            break


def test_window_ids_are_utc_starts() -> None:
    assert Clock(60.0, 0).name(28333333) == "2023-11-14T22:13:00Z"
    assert Clock(0.5, 0).name(3) == "1970-01-01T00:00:01.500Z"
    assert steps_for([0, 0], 4) == 0
