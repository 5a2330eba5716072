"""Write a user-item interaction log as hourly parquet windows, with planted affinities and an
oracle Recall@K: the data of retrieval (candidate generation) models.

    python -m recsys_trainer.data.generators.interactions_synthetic --out data/interactions --hours 8

Each row is one interaction (an event) in time order: ``user_id`` and ``segment`` (user
features), ``item`` (the item interacted with) and its ``item_cat``, ``hist_item`` (the user's
previous items, oldest first, at most ``max_len``) and ``hist_item_cat`` (their categories,
aligned with ``hist_item``: a sequential model's history side feature), ``ts`` (the event's global order), ``label``
(always 1: a retrieval log holds positives only) and ``row_id``. Layout:
``OUT/dt=YYYY-MM-DD/hour=HH/part-0.parquet``; ``OUT/_items.parquet`` is the item catalog
(``item_id``, ``item_cat``) and ``OUT/_signal.json`` the oracle's metrics.

The planted structure (``InteractionSignal``):

* every item belongs to one of ``num_clusters`` categories (``item_cat``, observed)
  and has a popularity within it (Zipf over a random order of its items);
* every user has two interest categories, chosen with weights 0.6 and 0.3 (0.1: any category);
  the first is a fixed function of the user's ``segment`` (observed), the second is hidden;
* users act in sessions (``session_length`` events on average, starting at random times in a
  window, events close together: a time-ordered batch holds a few users' sessions); within a
  session the next item's category repeats the previous item's with probability
  ``stickiness`` (a sequential signal: the order of the history matters), else it is drawn
  from the user's interests; the item is drawn by popularity within the category.

The oracle knows all of it: the probability of every item as the next one given the user and
their last item. Ranking the corpus by it maximises the expected hits, so its Recall@K (over
the rows of a window, one target per row) is the best a model can reach on average;
``_signal.json`` holds it per window and for the last one (``oracle``), with and without the
history excluded. A model without the history's order (a two-tower's pooled history) can use
the interests and popularity but only part of the stickiness.
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
from recsys_trainer.data.inputs import SequenceFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec

INTEREST_WEIGHTS = (0.6, 0.3)
"""The weights of a user's two interest categories; the rest (0.1) is any category."""


@dataclass(frozen=True)
class InteractionSignal:
    """The hidden parameters, fixed by ``seed`` (every rank and window shares them)."""

    item_cluster: np.ndarray  # [num_items] category of each item
    item_share: np.ndarray  # [num_items] probability of the item within its category
    user_segment: np.ndarray  # [num_users] observed segment
    user_interest: np.ndarray  # [num_users, 2] interest categories
    stickiness: float
    max_len: int

    @property
    def num_items(self) -> int:
        return len(self.item_cluster)

    @property
    def num_users(self) -> int:
        return len(self.user_segment)

    @property
    def num_clusters(self) -> int:
        return int(self.item_cluster.max()) + 1

    @property
    def num_segments(self) -> int:
        return int(self.user_segment.max()) + 1

    @staticmethod
    def make(seed: int = 7, num_users: int = 4000, num_items: int = 5000, num_clusters: int = 50,
             popularity_exponent: float = 1.0, stickiness: float = 0.5, max_len: int = 50,
             ) -> InteractionSignal:
        if num_items < num_clusters or num_clusters < 2 or num_users < 1 or max_len < 1:
            raise ValueError(
                f"need num_items >= num_clusters >= 2, num_users >= 1 and max_len >= 1, but "
                f"num_items is {num_items}, num_clusters {num_clusters}, num_users {num_users}, "
                f"max_len {max_len}.")
        if not 0.0 <= stickiness < 1.0:
            raise ValueError(f"`stickiness` must be in [0, 1), but is {stickiness!r}.")
        rng = np.random.default_rng(seed)
        cluster = np.concatenate([rng.permutation(num_clusters),
                                  rng.integers(0, num_clusters, num_items - num_clusters)])
        share = np.zeros(num_items)
        for c in range(num_clusters):
            members = rng.permutation(np.flatnonzero(cluster == c))
            w = 1.0 / np.arange(1, len(members) + 1) ** popularity_exponent
            share[members] = w / w.sum()
        # The segment names the first interest through a fixed permutation (learnable, not free).
        segment = rng.integers(0, num_clusters, num_users)
        first = rng.permutation(num_clusters)[segment]
        second = (first + rng.integers(1, num_clusters, num_users)) % num_clusters  # != first
        return InteractionSignal(item_cluster=cluster, item_share=share, user_segment=segment,
                                 user_interest=np.stack([first, second], 1),
                                 stickiness=stickiness, max_len=max_len)

    def interest(self, users: np.ndarray) -> np.ndarray:
        """``[n, num_clusters]`` each user's category distribution (without stickiness)."""
        theta = np.full((len(users), self.num_clusters), (1.0 - sum(INTEREST_WEIGHTS)) / self.num_clusters)
        rows = np.arange(len(users))
        for j, w in enumerate(INTEREST_WEIGHTS):
            theta[rows, self.user_interest[users, j]] += w
        return theta

    def next_item_probability(self, users: np.ndarray, last_items: np.ndarray) -> np.ndarray:
        """``[n, num_items]``: the probability of each item as the user's next one, given
        their last item (-1: none yet)."""
        theta = self.interest(users)
        has_last = last_items >= 0
        rows = np.flatnonzero(has_last)
        theta[has_last] *= 1.0 - self.stickiness
        theta[rows, self.item_cluster[last_items[has_last]]] += self.stickiness
        return theta[:, self.item_cluster] * self.item_share[None, :]

    def sample_items(self, clusters: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One item of each given category, drawn by popularity."""
        order = np.argsort(self.item_cluster, kind="stable")
        cum = np.cumsum(self.item_share[order])  # within-category shares, category-major
        starts = np.searchsorted(self.item_cluster[order], np.arange(self.num_clusters))
        base = np.r_[0.0, cum][starts]  # the cumulative share before each category
        u = base[clusters] + rng.random(len(clusters)) * (1.0 - 1e-12)
        pos = np.searchsorted(cum, u, side="right")
        ends = np.r_[starts[1:], len(order)]
        return order[np.minimum(pos, ends[clusters] - 1)]


class _UserState:
    """Each user's last ``max_len`` items (a ring per user) while the log is written."""

    def __init__(self, num_users: int, max_len: int) -> None:
        self.items = np.full((num_users, max_len), -1, dtype=np.int64)
        self.count = np.zeros(num_users, dtype=np.int64)
        self.max_len = max_len

    def history(self, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, ids)``: the users' histories, oldest first, concatenated."""
        n = np.minimum(self.count[users], self.max_len)
        cols = (self.count[users][:, None] - n[:, None] + np.arange(self.max_len)[None, :]) % self.max_len
        ids = self.items[users[:, None], cols]
        keep = np.arange(self.max_len)[None, :] < n[:, None]
        return n, ids[keep]

    def last(self, users: np.ndarray) -> np.ndarray:
        idx = (self.count[users] - 1) % self.max_len
        return np.where(self.count[users] > 0, self.items[users, idx], -1)

    def push(self, users: np.ndarray, items: np.ndarray) -> None:
        self.items[users, self.count[users] % self.max_len] = items
        self.count[users] += 1


def generate_window(signal: InteractionSignal, state: _UserState, rows: int, rng: np.random.Generator,
                    session_length: float, session_spread: float) -> dict[str, np.ndarray]:
    """About ``rows`` events (whole sessions), in time order: user, item, history, time."""
    n_sessions = max(1, min(signal.num_users, int(round(rows / session_length))))
    users = rng.choice(signal.num_users, n_sessions, replace=False)  # one session per user
    lengths = 1 + rng.poisson(session_length - 1, n_sessions)
    start = rng.random(n_sessions)
    gaps = rng.exponential(session_spread / session_length, (n_sessions, int(lengths.max())))
    ev_user, ev_item, ev_time, h_len, h_ids = [], [], [], [], []
    for step in range(int(lengths.max())):
        active = np.flatnonzero(lengths > step)
        u = users[active]
        last = state.last(u)
        theta = signal.interest(u)
        cum = np.cumsum(theta, axis=1)
        drawn = (cum < rng.random(len(u))[:, None] * cum[:, -1:]).sum(1)
        sticky = (rng.random(len(u)) < signal.stickiness) & (last >= 0)
        clusters = np.where(sticky, signal.item_cluster[np.maximum(last, 0)], drawn)
        items = signal.sample_items(np.minimum(clusters, signal.num_clusters - 1), rng)
        n, ids = state.history(u)
        ev_user.append(u)
        ev_item.append(items)
        ev_time.append(start[active] + gaps[active, : step + 1].sum(1))
        h_len.append(n)
        h_ids.append(ids)
        state.push(u, items)
    # Events in time order; each event's history travels with it.
    time = np.concatenate(ev_time)
    order = np.argsort(time, kind="stable")
    lens = np.concatenate(h_len)
    offsets = np.r_[0, np.cumsum(lens)]
    flat = np.concatenate(h_ids)
    new_lens = lens[order]
    new_starts = np.r_[0, np.cumsum(new_lens)[:-1]]
    gather = np.repeat(offsets[:-1][order] - new_starts, new_lens) + np.arange(int(new_lens.sum()))
    return {"user": np.concatenate(ev_user)[order], "item": np.concatenate(ev_item)[order],
            "hist_lengths": new_lens, "hist_ids": flat[gather].astype(np.int64), "time": time[order]}


def oracle_ranks(signal: InteractionSignal, users: np.ndarray, items: np.ndarray,
                 hist_lengths: np.ndarray, hist_ids: np.ndarray, exclude_history: bool = False,
                 chunk: int = 8192) -> np.ndarray:
    """The 0-based rank of each event's item in the oracle's ranking of the corpus (by the true
    next-item probability; with ``exclude_history``, among the items not in the history, and
    ``num_items`` when the item itself is in the history). Counted per category by binary
    search on its sorted shares, so ``O(rows x categories)``, not ``O(rows x items)``."""
    offsets = np.r_[0, np.cumsum(hist_lengths)]
    last = np.where(hist_lengths > 0, hist_ids[np.maximum(offsets[1:] - 1, 0)], -1)
    cats = signal.item_cluster
    sorted_shares = [np.sort(signal.item_share[cats == c]) for c in range(signal.num_clusters)]
    ranks = np.zeros(len(users), dtype=np.int64)
    for lo in range(0, len(users), chunk):
        hi = min(len(users), lo + chunk)
        theta = signal.interest(users[lo:hi])
        has_last = last[lo:hi] >= 0
        theta[has_last] *= 1.0 - signal.stickiness
        theta[np.flatnonzero(has_last), cats[last[lo:hi][has_last]]] += signal.stickiness
        rows = np.arange(hi - lo)
        p_target = theta[rows, cats[items[lo:hi]]] * signal.item_share[items[lo:hi]]
        above = np.zeros(hi - lo, dtype=np.int64)
        for c, shares in enumerate(sorted_shares):
            # Items of category c whose probability theta[:, c] * share exceeds the target's
            # (the relative margin keeps rounding from counting the target, or an exact tie).
            bound = p_target / theta[:, c] * (1.0 + 1e-9)
            above += len(shares) - np.searchsorted(shares, bound, side="right")
        if exclude_history:
            seg = slice(offsets[lo], offsets[hi])
            h_rows = np.repeat(rows, hist_lengths[lo:hi])
            h_ids = hist_ids[seg]
            # Each distinct history item once: drop repeats within a row.
            key = np.unique(h_rows * signal.num_items + h_ids)
            h_rows, h_ids = key // signal.num_items, key % signal.num_items
            p_hist = theta[h_rows, cats[h_ids]] * signal.item_share[h_ids]
            above -= np.bincount(h_rows[p_hist > p_target[h_rows] * (1.0 + 1e-9)], minlength=hi - lo)
            seen = np.zeros(hi - lo, dtype=bool)
            seen[h_rows[h_ids == items[lo:hi][h_rows]]] = True
            above[seen] = signal.num_items
        ranks[lo:hi] = above
    return ranks


def oracle_metrics(signal: InteractionSignal, users: np.ndarray, items: np.ndarray,
                   hist_lengths: np.ndarray, hist_ids: np.ndarray, ks: Sequence[int] = (10, 50, 100),
                   exclude_history: bool = False) -> dict[str, float]:
    """The oracle's Recall@K and NDCG@K on these events (one target per row: recall = hit
    rate), from ``oracle_ranks``."""
    r = oracle_ranks(signal, users, items, hist_lengths, hist_ids, exclude_history)
    out = {}
    for k in ks:
        hit = r < k
        out[f"recall@{k}"] = float(hit.mean()) if len(r) else 0.0
        out[f"ndcg@{k}"] = float((hit / np.log2(r + 2)).mean()) if len(r) else 0.0
    return out


def write_dataset(out: str | os.PathLike[str], hours: int = 8, rows_per_hour: int = 40_000,
                  seed: int = 0, signal: InteractionSignal | None = None,
                  session_length: float = 10.0, session_spread: float = 0.01,
                  start: dt.datetime = dt.datetime(2026, 11, 20), row_group_size: int = 8192,
                  ks: Sequence[int] = (10, 50, 100)) -> dict[str, Any]:
    """Write ``hours`` hourly windows under ``out``, the item catalog and ``_signal.json``
    (returned). ``signal``: the planted parameters (default ``InteractionSignal.make()``)."""
    if hours < 1 or rows_per_hour < 1:
        raise ValueError(f"`hours` and `rows_per_hour` must be >= 1, but are {hours} and {rows_per_hour}.")
    if session_length < 1:
        raise ValueError(f"`session_length` must be >= 1, but is {session_length!r}.")
    sig = signal if signal is not None else InteractionSignal.make()
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    state = _UserState(sig.num_users, sig.max_len)
    per_window: dict[str, Any] = {}
    first_row = 0
    for h in range(hours):
        t = start + dt.timedelta(hours=h)
        ev = generate_window(sig, state, rows_per_hour, rng, session_length, session_spread)
        n = len(ev["user"])
        offsets = np.r_[0, np.cumsum(ev["hist_lengths"])].astype(np.int32)
        table = pa.table({
            "row_id": pa.array(np.arange(first_row, first_row + n, dtype=np.int64)),
            "ts": pa.array(np.arange(first_row, first_row + n, dtype=np.int64)),
            "label": pa.array(np.ones(n, dtype=np.int64)),
            "user_id": pa.array(ev["user"].astype(np.int64)),
            "segment": pa.array(sig.user_segment[ev["user"]].astype(np.int64)),
            "item": pa.array(ev["item"].astype(np.int64)),
            "item_cat": pa.array(sig.item_cluster[ev["item"]].astype(np.int64)),
            "hist_item": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ev["hist_ids"])),
            "hist_item_cat": pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(sig.item_cluster[ev["hist_ids"]].astype(np.int64))),
        })
        part = root / f"dt={t:%Y-%m-%d}" / f"hour={t:%H}"
        part.mkdir(parents=True, exist_ok=True)
        write_whole(part / "part-0.parquet", table, row_group_size)
        per_window[f"dt={t:%Y-%m-%d}/hour={t:%H}"] = {
            "rows": n,
            "oracle": oracle_metrics(sig, ev["user"], ev["item"], ev["hist_lengths"], ev["hist_ids"], ks),
            "oracle_exclude_history": oracle_metrics(sig, ev["user"], ev["item"], ev["hist_lengths"],
                                                     ev["hist_ids"], ks, exclude_history=True),
        }
        first_row += n
    catalog = pa.table({"item_id": pa.array(np.arange(sig.num_items, dtype=np.int64)),
                        "item_cat": pa.array(sig.item_cluster.astype(np.int64))})
    write_whole(root / "_items.parquet", catalog)
    last = per_window[list(per_window)[-1]]
    meta: dict[str, Any] = {
        "hours": hours, "rows": first_row, "seed": seed, "num_users": sig.num_users,
        "num_items": sig.num_items, "num_clusters": sig.num_clusters,
        "num_segments": sig.num_segments, "max_len": sig.max_len, "stickiness": sig.stickiness,
        "session_length": session_length, "oracle": last["oracle"],
        "oracle_exclude_history": last["oracle_exclude_history"], "per_window": per_window}
    write_signal(root, meta)
    return meta


def interaction_features(meta: dict[str, Any], *, user_features: bool = True,
                         item_side_features: bool = True,
                         history_side_features: bool = False) -> FeatureSpec:
    """The FeatureSpec for these files (``meta``: their ``_signal.json``).

    Sequence keys in the order the retrieval models read them: ``item``, ``hist_item`` (the
    last ``max_len`` items), then ``item_cat`` with ``item_side_features`` (a model with
    ``item_side_features={"item_cat": ...}``), then ``hist_item_cat`` (the history items'
    categories, as long as ``hist_item``) with ``history_side_features`` (a ``SASRecModel``
    with side features); ``user_features``: ``user_id`` and ``segment`` in ``Batch.sparse``."""
    if history_side_features and not item_side_features:
        raise ValueError("history_side_features=True needs item_side_features=True: the model reads "
                         "item_cat (the candidate's) before hist_item_cat (the history's).")
    n_items, max_len = int(meta["num_items"]), int(meta["max_len"])
    n_cats = int(meta["num_clusters"])
    sequence = [SequenceFeature(name="item", num_embeddings=n_items),
                SequenceFeature(name="hist_item", num_embeddings=n_items, max_len=max_len)]
    if item_side_features:
        sequence.append(SequenceFeature(name="item_cat", num_embeddings=n_cats))
    if history_side_features:
        sequence.append(SequenceFeature(name="hist_item_cat", num_embeddings=n_cats, max_len=max_len))
    sparse = [SparseFeature(name="user_id", num_embeddings=int(meta["num_users"])),
              SparseFeature(name="segment", num_embeddings=int(meta["num_segments"]))] if user_features else []
    return FeatureSpec(labels=["label"], sparse=sparse, sequence=sequence)


def ensure_dataset(root: str | os.PathLike[str], hours: int, rows_per_hour: int,
                   signal: InteractionSignal | None = None, **kwargs: Any) -> dict[str, Any]:
    """The dataset at ``root``'s ``_signal.json``, rank 0 writing the dataset first if it is
    missing (``generated.written_once``: join the job first). An existing dataset is reused as
    it is: delete it to change it."""
    return written_once(root, lambda: write_dataset(root, hours=hours, rows_per_hour=rows_per_hour,
                                                    signal=signal, **kwargs),
                        f"{hours} hourly interaction windows x ~{rows_per_hour} rows")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hours", type=int, default=8)
    ap.add_argument("--rows-per-hour", type=int, default=40_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-users", type=int, default=4000)
    ap.add_argument("--num-items", type=int, default=5000)
    ap.add_argument("--num-clusters", type=int, default=50)
    ap.add_argument("--stickiness", type=float, default=0.5)
    ap.add_argument("--session-length", type=float, default=10.0)
    ap.add_argument("--max-len", type=int, default=50)
    a = ap.parse_args(argv)
    sig = InteractionSignal.make(num_users=a.num_users, num_items=a.num_items,
                                 num_clusters=a.num_clusters, stickiness=a.stickiness,
                                 max_len=a.max_len)
    meta = write_dataset(a.out, a.hours, a.rows_per_hour, a.seed, signal=sig,
                         session_length=a.session_length)
    print(json.dumps({k: v for k, v in meta.items() if k != "per_window"}))


__all__ = ["INTEREST_WEIGHTS", "InteractionSignal", "ensure_dataset", "generate_window",
           "interaction_features", "main", "oracle_metrics", "oracle_ranks", "write_dataset"]


if __name__ == "__main__":
    main()
