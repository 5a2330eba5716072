"""Write a log of timed behaviour sequences as hourly parquet windows, with a planted next-item
signal that needs both the **order** of the history and the **time** of the events, and the
oracle's hit rate: the data that tells a time-aware sequential model (HSTU) from one that reads
the order only (SASRec).

    python -m recsys_trainer.data.generators.sequences_synthetic --out data/sequences --hours 6

Each row is one user's history and the next event: ``hist_item`` (the past items, oldest first,
at most ``max_len``) with ``hist_ts`` (their times, in seconds), ``item`` (the next item, the
target) with ``ts`` (its time: in serving, the request's), ``label`` (always 1) and ``row_id``.
The rows' ``ts`` fall in their window's hour. Layout: ``OUT/dt=YYYY-MM-DD/hour=HH/
part-0.parquet``; ``OUT/_signal.json`` holds the oracle's figures.

The planted process (``SequenceSignal``), event after event:

* every item belongs to one of ``num_clusters`` categories, has a popularity within it and in
  the whole corpus (Zipf over random orders), and a **successor** in its category (a random
  cycle through the category: "the next episode");
* events come in sessions: the gap to the next event is short (exponential, mean
  ``short_gap`` seconds) within a session, and long (log-uniform from 2 hours to 7 days) with
  probability ``new_session``;
* **within a session** the next item is the last item's successor (``follow``), else a popular
  item of the last item's category;
* **after a break** the user turns to another topic: a popular item of the category after the
  last item's (a fixed cycle of categories; ``switch``), else a popular item of the corpus;
* a row's number of events (its history and the target) follows a power law
  (``length_exponent``), so histories hold 0 to ``max_len`` items.

So the next item depends on the last item (the order) *and* on how long ago it was (the time of
the event to predict, ``ts``, against the history's times): a model blind to the times must
spread its ranking over both regimes. ``_signal.json`` holds the oracle's HitRate@K and
NDCG@K (it knows the process: the best any model can reach on average) and those of the oracle
without the times (it knows the process but not the gap: the best a time-blind model can
reach), for the last window (``oracle``, ``oracle_without_time``) and per window.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from recsys_trainer.data.generators.generated import write_signal, write_whole, written_once
from recsys_trainer.data.inputs import SequenceFeature
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.dynamic import ID_SPACE

SESSION_BREAK = 1800
"""Seconds: a gap at least this long starts a new session (the short gaps' exponential tail
reaches it with probability e^(-1800 / short_gap); the long gaps start at 2 hours)."""



def power_law_lengths(rng: np.random.Generator, rows: int, max_len: int, exponent: float,
                      minimum: int = 1) -> np.ndarray:
    """``rows`` lengths in ``[minimum, max_len]`` with ``P(n) ~ n^-exponent``."""
    n = np.arange(minimum, max_len + 1, dtype=np.float64)
    p = n ** -exponent
    return rng.choice(n.astype(np.int64), size=rows, p=p / p.sum())


def _zipf_shares(size: int, rng: np.random.Generator, exponent: float = 1.0) -> np.ndarray:
    shares = 1.0 / np.arange(1, size + 1) ** exponent
    return (shares / shares.sum())[rng.permutation(size)]


@dataclass(frozen=True)
class SequenceSignal:
    """The hidden parameters of the process (module docstring), fixed by ``seed``."""

    item_cluster: np.ndarray  # [num_items]
    cluster_share: np.ndarray  # [num_items] popularity within the category (sums to 1 per category)
    global_share: np.ndarray  # [num_items] popularity in the corpus
    successor: np.ndarray  # [num_items] the next item of the category's cycle
    next_cluster: np.ndarray  # [num_clusters] the category after a break
    max_len: int
    follow: float
    switch: float
    new_session: float
    short_gap: float
    length_exponent: float

    @property
    def num_items(self) -> int:
        return len(self.item_cluster)

    @property
    def num_clusters(self) -> int:
        return len(self.next_cluster)

    @staticmethod
    def make(seed: int = 11, num_items: int = 2000, num_clusters: int = 20, max_len: int = 50,
             follow: float = 0.7, switch: float = 0.9, new_session: float = 0.5,
             short_gap: float = 120.0, length_exponent: float = 1.0) -> SequenceSignal:
        if num_items < 2 * num_clusters or num_clusters < 2 or max_len < 1:
            raise ValueError(f"need num_items >= 2 * num_clusters, num_clusters >= 2 and max_len "
                             f">= 1, but they are {num_items}, {num_clusters} and {max_len}.")
        for name, v in (("follow", follow), ("switch", switch), ("new_session", new_session)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"`{name}` must be a probability in [0, 1], but is {v!r}.")
        rng = np.random.default_rng(seed)
        cluster = np.concatenate([np.repeat(np.arange(num_clusters), 2),
                                  rng.integers(0, num_clusters, num_items - 2 * num_clusters)])
        rng.shuffle(cluster)
        share = np.zeros(num_items)
        successor = np.zeros(num_items, dtype=np.int64)
        for c in range(num_clusters):
            members = np.flatnonzero(cluster == c)
            share[members] = _zipf_shares(len(members), rng)
            cycle = rng.permutation(members)
            successor[cycle] = np.roll(cycle, -1)
        topics = rng.permutation(num_clusters)
        next_cluster = np.zeros(num_clusters, dtype=np.int64)
        next_cluster[topics] = np.roll(topics, -1)  # a cycle: never the same category
        return SequenceSignal(
            item_cluster=cluster, cluster_share=share, global_share=_zipf_shares(num_items, rng),
            successor=successor, next_cluster=next_cluster,
            max_len=max_len, follow=follow, switch=switch, new_session=new_session,
            short_gap=short_gap, length_exponent=length_exponent)

    # ------------------------------------------------------------------ the process

    def _popular(self, clusters: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One item of each given category, by its popularity there."""
        out = np.empty(len(clusters), dtype=np.int64)
        for c in np.unique(clusters):
            where = np.flatnonzero(clusters == c)
            members = np.flatnonzero(self.item_cluster == c)
            out[where] = rng.choice(members, size=len(where), p=self.cluster_share[members])
        return out

    def _next(self, last: np.ndarray, long_gap: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The next item after ``last`` (-1: no event yet) given the gap's regime."""
        out = rng.choice(self.num_items, size=len(last), p=self.global_share)
        has = last >= 0
        cat = self.item_cluster[np.maximum(last, 0)]
        u = rng.random(len(last))
        stay = has & ~long_gap
        follow = stay & (u < self.follow)
        out[follow] = self.successor[last[follow]]
        same = stay & ~follow
        out[same] = self._popular(cat[same], rng)
        switch = has & long_gap & (u < self.switch)
        out[switch] = self._popular(self.next_cluster[cat[switch]], rng)
        return out

    def sample(self, rows: int, rng: np.random.Generator, end_times: np.ndarray,
               ) -> dict[str, np.ndarray]:
        """``rows`` histories and their next events; the next event of row ``r`` is at
        ``end_times[r]``."""
        # The events of a row (its history, then the target) follow the power law.
        steps = power_law_lengths(rng, rows, self.max_len + 1, self.length_exponent)
        lengths = steps - 1
        width = int(steps.max())
        items = np.full((rows, width), -1, dtype=np.int64)
        gaps = np.zeros((rows, width))
        long_gap = np.zeros((rows, width), dtype=bool)
        last = np.full(rows, -1, dtype=np.int64)
        for i in range(width):
            live = np.flatnonzero(steps > i)
            brk = rng.random(len(live)) < self.new_session
            gap = np.where(brk, np.exp(rng.uniform(np.log(7200.0), np.log(7 * 86400.0), len(live))),
                           rng.exponential(self.short_gap, len(live)))
            long_gap[live, i] = gap >= SESSION_BREAK
            gaps[live, i] = gap
            items[live, i] = self._next(last[live], long_gap[live, i], rng)
            last[live] = items[live, i]
        # Times: the target at end_times, each earlier event its gaps before.
        rows_idx = np.arange(rows)
        after = np.cumsum(gaps[:, ::-1], axis=1)[:, ::-1]  # sum of gaps from event i+1 on
        shifted = np.concatenate([after[:, 1:], np.zeros((rows, 1))], axis=1)
        times = end_times[:, None] - np.floor(shifted - shifted[rows_idx, lengths][:, None])
        mask = np.arange(width)[None, :] < lengths[:, None]
        return {"lengths": lengths, "hist_ids": items[mask], "hist_ts": times[mask].astype(np.int64),
                "item": items[rows_idx, lengths], "ts": end_times.astype(np.int64),
                "long_gap": long_gap[rows_idx, lengths]}

    # ------------------------------------------------------------------ the oracle

    def next_probability(self, last: np.ndarray, long_gap: np.ndarray | None) -> np.ndarray:
        """``[rows, num_items]``: the probability of each item as the next one after ``last``
        (-1: none), knowing the gap's regime, or (``long_gap=None``) not knowing it."""
        n = len(last)
        has = last >= 0
        cat = self.item_cluster[np.maximum(last, 0)]
        members = self.item_cluster[None, :]
        stay = (1 - self.follow) * np.where(members == cat[:, None], self.cluster_share[None, :], 0.0)
        stay[np.arange(n), self.successor[np.maximum(last, 0)]] += self.follow
        nxt = self.next_cluster[cat]
        brk = self.switch * np.where(members == nxt[:, None], self.cluster_share[None, :], 0.0)
        brk += (1 - self.switch) * self.global_share[None, :]
        if long_gap is None:
            p = (1 - self.new_session) * stay + self.new_session * brk
        else:
            p = np.where(long_gap[:, None], brk, stay)
        return np.where(has[:, None], p, self.global_share[None, :])


def oracle_metrics(signal: SequenceSignal, ev: dict[str, np.ndarray], ks: Sequence[int] = (1, 10, 50),
                   know_time: bool = True, chunk: int = 4096) -> dict[str, float]:
    """The oracle's HitRate@K (one target per row: recall) and NDCG@K on these rows, ranking
    the corpus by the true next-item probability (``know_time=False``: not knowing the gap)."""
    lengths, hist = ev["lengths"], ev["hist_ids"]
    ends = np.cumsum(lengths)
    last = np.where(lengths > 0, hist[np.maximum(ends - 1, 0)], -1)
    target = ev["item"]
    ranks = np.zeros(len(target), dtype=np.int64)
    for lo in range(0, len(target), chunk):
        hi = min(len(target), lo + chunk)
        p = signal.next_probability(last[lo:hi], ev["long_gap"][lo:hi] if know_time else None)
        pt = p[np.arange(hi - lo), target[lo:hi]]
        ranks[lo:hi] = (p > pt[:, None] * (1 + 1e-12)).sum(1)
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"recall@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float((hit / np.log2(ranks + 2)).mean())
    return out


def write_dataset(out: str | os.PathLike[str], hours: int = 6, rows_per_hour: int = 20_000,
                  seed: int = 0, signal: SequenceSignal | None = None,
                  start: dt.datetime = dt.datetime(2026, 11, 20), row_group_size: int = 8192,
                  ks: Sequence[int] = (1, 10, 50)) -> dict[str, Any]:
    """Write ``hours`` hourly windows under ``out`` and ``_signal.json`` (returned)."""
    if hours < 1 or rows_per_hour < 1:
        raise ValueError(f"`hours` and `rows_per_hour` must be >= 1, but are {hours} and {rows_per_hour}.")
    sig = signal if signal is not None else SequenceSignal.make()
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_window: dict[str, Any] = {}
    first_row = 0
    for h in range(hours):
        t = start + dt.timedelta(hours=h)
        t0 = int(t.replace(tzinfo=dt.timezone.utc).timestamp())
        ends = np.sort(t0 + rng.integers(0, 3600, rows_per_hour))
        ev = sig.sample(rows_per_hour, rng, ends)
        offsets = np.r_[0, np.cumsum(ev["lengths"])].astype(np.int32)
        n = rows_per_hour
        table = pa.table({
            "row_id": pa.array(np.arange(first_row, first_row + n, dtype=np.int64)),
            "label": pa.array(np.ones(n, dtype=np.int64)),
            "item": pa.array(ev["item"]),
            "ts": pa.array(ev["ts"]),
            "hist_item": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ev["hist_ids"])),
            "hist_ts": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ev["hist_ts"])),
        })
        part = root / f"dt={t:%Y-%m-%d}" / f"hour={t:%H}"
        part.mkdir(parents=True, exist_ok=True)
        write_whole(part / "part-0.parquet", table, row_group_size)
        per_window[f"dt={t:%Y-%m-%d}/hour={t:%H}"] = {
            "rows": n, "mean_history": float(ev["lengths"].mean()),
            "oracle": oracle_metrics(sig, ev, ks),
            "oracle_without_time": oracle_metrics(sig, ev, ks, know_time=False)}
        first_row += n
    last = per_window[list(per_window)[-1]]
    meta: dict[str, Any] = {
        "hours": hours, "rows": first_row, "seed": seed, "num_items": sig.num_items,
        "num_clusters": sig.num_clusters, "max_len": sig.max_len, "follow": sig.follow,
        "switch": sig.switch, "new_session": sig.new_session, "short_gap": sig.short_gap,
        "length_exponent": sig.length_exponent, "oracle": last["oracle"],
        "oracle_without_time": last["oracle_without_time"], "per_window": per_window}
    write_signal(root, meta)
    return meta


def sequence_features(meta: dict[str, Any], *, times: bool = True) -> FeatureSpec:
    """The FeatureSpec for these files (``meta``: their ``_signal.json``): ``item`` and
    ``hist_item`` (its last ``max_len``), then with ``times`` the event times ``hist_ts`` (as
    long as ``hist_item``) and ``ts``: integers no table reads (an HSTU model's time features;
    a SASRec model reads no times)."""
    n_items, max_len = int(meta["num_items"]), int(meta["max_len"])
    sequence = [SequenceFeature(name="item", num_embeddings=n_items),
                SequenceFeature(name="hist_item", num_embeddings=n_items, max_len=max_len)]
    if times:
        sequence += [SequenceFeature(name="hist_ts", num_embeddings=ID_SPACE, max_len=max_len),
                     SequenceFeature(name="ts", num_embeddings=ID_SPACE)]
    return FeatureSpec(labels=["label"], sequence=sequence)


def ensure_dataset(root: str | os.PathLike[str], hours: int, rows_per_hour: int,
                   signal: SequenceSignal | None = None, **kwargs: Any) -> dict[str, Any]:
    """The dataset at ``root``'s ``_signal.json``, rank 0 writing it first if it is missing
    (``generated.written_once``: join the job first). An existing dataset is reused as it is."""
    return written_once(root, lambda: write_dataset(root, hours=hours, rows_per_hour=rows_per_hour,
                                                    signal=signal, **kwargs),
                        f"{hours} hourly sequence windows x {rows_per_hour} rows")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hours", type=int, default=6)
    ap.add_argument("--rows-per-hour", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-items", type=int, default=2000)
    ap.add_argument("--max-len", type=int, default=50)
    a = ap.parse_args(argv)
    meta = write_dataset(a.out, a.hours, a.rows_per_hour, a.seed,
                         signal=SequenceSignal.make(num_items=a.num_items, max_len=a.max_len))
    print(json.dumps({k: v for k, v in meta.items() if k != "per_window"}))


__all__ = ["SESSION_BREAK", "SequenceSignal", "ensure_dataset", "main", "oracle_metrics",
           "power_law_lengths", "sequence_features", "write_dataset"]


if __name__ == "__main__":
    main()
