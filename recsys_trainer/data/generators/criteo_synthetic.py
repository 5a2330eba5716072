"""Write a Criteo-schema click log as hourly parquet windows, with a planted learnable signal.

    python -m recsys_trainer.data.generators.criteo_synthetic --out data/criteo --hours 12 --rows-per-hour 50000

Schema (as in the Criteo 1TB / Kaggle logs): ``label`` (int 0/1), ``I1..I13`` (non-negative
integer counts, ~5% nulls), ``C1..C26`` (8-hex-digit categorical strings, Zipf-distributed
popularity, vocabularies from 50 to 40,000 values), plus ``row_id`` (int64, unique across the
dataset, for exactly-once checks). Layout: ``OUT/dt=YYYY-MM-DD/hour=HH/part-0.parquet``.

The signal: every categorical value has a hidden score ~ N(0, strength^2); the click
probability is ``sigmoid(bias + sum of the row's 26 scores + w . log1p(I))``. ``OUT/_signal.json``
records the AUC of the true probabilities on the generated rows (``oracle_auc``): no model can
beat it on average, and a model that learns the scores approaches it.

With ``--behaviour`` (``write_dataset(..., behaviour=BehaviourSignal.make())``) each row also
gets a user's recent behaviour and a second label, for sequence and multi-task models:

* ``hist_item`` (``list<int64>``, 1 to ``max_len`` past item ids, most recent last) and ``item``
  (int64, the candidate item shown), ids in ``[0, num_items)``. Every item belongs to one of
  ``num_categories`` hidden categories; a row's user has two interest categories that most of
  the history comes from. The candidate repeats a history item (20%), is a new item from an
  interest category (40%) or any item (40%).
* The click logit gains ``repeat_w * [item in hist_item] + category_w * (share of hist_item in
  the item's category)`` plus a score per item. The candidate alone says nothing about the
  first two terms (every item is equally likely to be a repeat): only a model that relates the
  candidate to the history (target attention) can use them.
* ``like`` (int 0/1): a liked row is a clicked row the user also liked, with probability
  ``sigmoid(like_bias + like_w * (sum of the 26 categorical scores) + item's like score)``. It
  is rare and shares the click's structure, so a model trained on both labels learns ``like``
  from far more positives than one trained on ``like`` alone.

``_signal.json`` then also holds ``oracle_auc_per_label`` (``{"label": ..., "like": ...}``) and
``like_rate``. Without ``--behaviour`` the files are exactly as before (same seed, same bytes).

With ``--crosses`` (``write_dataset(..., crosses=CrossSignal.make())``) the click logit also
holds planted **feature crosses**, for explicit-cross models (DCN-v2): each cross is a tuple of
categorical columns (two or three); every value of a column belongs to one of ``groups`` hidden
groups, and the cross adds ``table[g_1, ..., g_k]`` for the row's groups, a table centred along
every axis with equal weight per group. The groups are not equally frequent under the columns'
Zipf values (shares about 0.36, 0.25, 0.21, 0.19), so a cross is *nearly* a pure interaction:
single columns carry 3.8% of the crosses' variance as main effects (measured over 400,000 rows
of the default signals); the rest only a model that multiplies the columns' embeddings
together, to the cross's degree, can learn. ``_signal.json`` then records the crosses and the
oracle AUC of the probabilities with them (what no model can beat) and without them
(``oracle_auc_without_crosses``: about what a model blind to the crosses can reach; one that
learnt the crosses' main effects too would reach 0.786 where it is 0.784, oracle 0.855).
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
import torch

from recsys_trainer.data.generators.generated import write_signal, write_whole, written_once
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.metrics import weighted_auc

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_COLUMNS = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
SPARSE_COLUMNS = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]


def vocab_sizes(max_vocab: int = 40_000) -> list[int]:
    """Vocabulary per categorical column: a log-spaced spread like Criteo's (tiny to large)."""
    return [int(v) for v in np.geomspace(50, max_vocab, NUM_SPARSE).round()]


@dataclass(frozen=True)
class CriteoSignal:
    """The hidden parameters (fixed by ``seed``, so every rank and window shares them)."""

    vocab: list[np.ndarray]  # per column: the value strings
    scores: list[np.ndarray]  # per column: the hidden score of each value
    dense_w: np.ndarray
    bias: float

    @staticmethod
    def make(seed: int = 2024, strength: float = 0.3, max_vocab: int = 40_000) -> CriteoSignal:
        rng = np.random.default_rng(seed)
        vocab, scores = [], []
        for c, v in enumerate(vocab_sizes(max_vocab)):
            # Distinct 8-hex strings per column (a salted hash of the index, like Criteo's).
            codes = (np.arange(v, dtype=np.uint64) * np.uint64(0x9E3779B1) + np.uint64(c * 7919 + 1)) & np.uint64(0xFFFFFFFF)
            vocab.append(np.array([f"{int(x):08x}" for x in codes], dtype=object))
            scores.append(rng.normal(0.0, strength, size=v).astype(np.float32))
        dense_w = rng.normal(0.0, 0.15, size=NUM_DENSE).astype(np.float32)
        return CriteoSignal(vocab=vocab, scores=scores, dense_w=dense_w, bias=-1.6)


@dataclass(frozen=True)
class BehaviourSignal:
    """The hidden parameters of the behaviour columns and the ``like`` label (see the module
    docstring); fixed by ``seed`` like ``CriteoSignal``."""

    max_len: int
    item_category: np.ndarray  # [num_items] category of each item
    category_items: list[np.ndarray]  # per category: its items
    item_score: np.ndarray  # [num_items] the candidate's own click score
    item_like_score: np.ndarray  # [num_items] the candidate's own like score
    repeat_w: float
    category_w: float
    like_bias: float
    like_w: float

    @property
    def num_items(self) -> int:
        return len(self.item_category)

    @staticmethod
    def make(seed: int = 2025, num_items: int = 2000, num_categories: int = 40, max_len: int = 50,
             repeat_w: float = 2.0, category_w: float = 2.5) -> BehaviourSignal:
        if num_items < num_categories or num_categories < 2 or max_len < 1:
            raise ValueError(
                f"need num_items >= num_categories >= 2 and max_len >= 1, but num_items is "
                f"{num_items}, num_categories {num_categories}, max_len {max_len}.")
        rng = np.random.default_rng(seed)
        # Every category gets at least one item (a permutation), the rest at random.
        cat = np.concatenate([rng.permutation(num_categories),
                              rng.integers(0, num_categories, num_items - num_categories)])
        return BehaviourSignal(
            max_len=max_len, item_category=cat,
            category_items=[np.flatnonzero(cat == c) for c in range(num_categories)],
            item_score=rng.normal(0.0, 0.3, num_items).astype(np.float32),
            item_like_score=rng.normal(0.0, 0.3, num_items).astype(np.float32),
            repeat_w=repeat_w, category_w=category_w, like_bias=-3.5, like_w=1.5)

    def sample(self, rows: int, rng: np.random.Generator) -> tuple[dict[str, pa.Array], np.ndarray]:
        """``item`` and ``hist_item`` columns, and the click-logit term they plant."""
        n_cat = len(self.category_items)
        interest = np.stack([rng.integers(0, n_cat, rows), rng.integers(0, n_cat, rows)], 1)
        lens = rng.integers(1, self.max_len + 1, rows)
        owner = np.repeat(np.arange(rows), lens)  # the row of each history item
        hist = self._from_categories(interest[owner, rng.integers(0, 2, len(owner))], rng)
        anywhere = rng.random(len(owner)) < 0.3
        hist[anywhere] = rng.integers(0, self.num_items, int(anywhere.sum()))
        offsets = np.concatenate([[0], np.cumsum(lens)])
        kind = rng.random(rows)
        item = rng.integers(0, self.num_items, rows)  # any item (40%)
        new = kind < 0.6
        item[new] = self._from_categories(interest[new, rng.integers(0, 2, int(new.sum()))], rng)
        repeat = kind < 0.2
        pick = offsets[:-1][repeat] + (rng.random(int(repeat.sum())) * lens[repeat]).astype(np.int64)
        item[repeat] = hist[pick]
        # The planted target-attention term, per row, over its own history.
        is_repeat = np.zeros(rows)
        np.maximum.at(is_repeat, owner, (hist == item[owner]).astype(np.float64))
        same_cat = np.bincount(owner, self.item_category[hist] == self.item_category[item[owner]],
                               minlength=rows) / lens
        # Centred (the terms' mean is ~1.1) so the click rate stays near the plain log's.
        term = (self.repeat_w * is_repeat + self.category_w * same_cat + self.item_score[item]
                - 1.1)
        cols = {"item": pa.array(item.astype(np.int64)),
                "hist_item": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                      pa.array(hist.astype(np.int64)))}
        return cols, term

    def _from_categories(self, cats: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One uniformly chosen item of each given category."""
        sizes = np.array([len(c) for c in self.category_items])
        pos = (rng.random(len(cats)) * sizes[cats]).astype(np.int64)
        flat = np.concatenate(self.category_items)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        return flat[starts[cats] + pos]


@dataclass(frozen=True)
class CrossSignal:
    """Planted feature crosses of the click logit (see the module docstring); fixed by
    ``seed``. ``columns``: per cross, the indices of its categorical columns (0 is ``C1``);
    ``tables``: per cross, its centred table over the columns' value groups."""

    columns: tuple[tuple[int, ...], ...]
    groups: int
    tables: tuple[np.ndarray, ...]

    @staticmethod
    def make(seed: int = 2026, columns: Sequence[Sequence[int]] = ((0, 1), (2, 3), (4, 5, 6)),
             groups: int = 4, strength: float = 1.0) -> CrossSignal:
        cols = tuple(tuple(int(c) for c in cross) for cross in columns)
        if groups < 2 or not cols or any(
                len(c) < 2 or len(set(c)) != len(c) or not all(0 <= i < NUM_SPARSE for i in c)
                for c in cols):
            raise ValueError(
                f"each cross must name 2 or more distinct columns in [0, {NUM_SPARSE}) and "
                f"`groups` must be >= 2, but the crosses are {columns!r} and groups {groups}.")
        rng = np.random.default_rng(seed)
        tables = []
        for cross in cols:
            t = rng.normal(0.0, strength, size=(groups,) * len(cross))
            for axis in range(t.ndim):  # centred along every axis: no lower-order part
                t = t - t.mean(axis=axis, keepdims=True)
            tables.append(t)
        return CrossSignal(columns=cols, groups=groups, tables=tuple(tables))

    def term(self, idx: Sequence[np.ndarray]) -> np.ndarray:
        """The crosses' logit term of rows whose value index per column is ``idx[c]``."""
        out = np.zeros(len(idx[0]), dtype=np.float64)
        for cross, table in zip(self.columns, self.tables, strict=True):
            out += table[tuple(idx[c] % self.groups for c in cross)]
        return out


def generate_hour(signal: CriteoSignal, rows: int, rng: np.random.Generator,
                  first_row_id: int, behaviour: BehaviourSignal | None = None,
                  behaviour_rng: np.random.Generator | None = None,
                  crosses: CrossSignal | None = None,
                  ) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """One hour of rows and the true probability of each label column (``label``, and ``like``
    with ``behaviour``). ``behaviour_rng`` draws the behaviour columns: the other columns are
    the same with and without them. ``crosses`` add their term to the click logit (no random
    draw: every column is as without them); the probability without it is returned as
    ``label_without_crosses``."""
    counts = np.floor(rng.lognormal(mean=1.0, sigma=1.2, size=(rows, NUM_DENSE)))
    logit = np.full(rows, signal.bias, dtype=np.float64)
    logit += np.log1p(counts) @ signal.dense_w
    cols: dict[str, pa.Array] = {}
    shared = np.zeros(rows, dtype=np.float64)  # the categorical scores, which `like` reuses
    indices = []
    for c, name in enumerate(SPARSE_COLUMNS):
        v = len(signal.vocab[c])
        idx = (rng.zipf(1.2, size=rows) - 1) % v
        indices.append(idx)
        logit += signal.scores[c][idx]
        shared += signal.scores[c][idx]
        cols[name] = pa.array(signal.vocab[c][idx], type=pa.string())
    if behaviour is not None:
        brng = behaviour_rng if behaviour_rng is not None else np.random.default_rng()
        seq_cols, term = behaviour.sample(rows, brng)
        logit += term
    without = None
    if crosses is not None:
        without = 1.0 / (1.0 + np.exp(-logit))
        logit += crosses.term(indices)
    p = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(rows) < p).astype(np.int64)
    nulls = rng.random((rows, NUM_DENSE)) < 0.05
    table = {"row_id": pa.array(np.arange(first_row_id, first_row_id + rows, dtype=np.int64)),
             "label": pa.array(label)}
    probs = {"label": p}
    if without is not None:
        probs["label_without_crosses"] = without
    if behaviour is not None:
        item = seq_cols["item"].to_numpy()
        q = 1.0 / (1.0 + np.exp(-(behaviour.like_bias + behaviour.like_w * shared
                                  + behaviour.item_like_score[item])))
        table["like"] = pa.array((label == 1) & (brng.random(rows) < q)).cast(pa.int64())
        probs["like"] = p * q
    for j, name in enumerate(DENSE_COLUMNS):
        table[name] = pa.array(counts[:, j].astype(np.int64), mask=nulls[:, j])
    table.update(cols)
    if behaviour is not None:
        table.update(seq_cols)
    return pa.table(table), probs


def write_dataset(out: str | os.PathLike[str], hours: int = 12, rows_per_hour: int = 50_000,
                  seed: int = 0, signal_seed: int = 2024, row_group_size: int = 8192,
                  start: dt.datetime = dt.datetime(2026, 11, 20),
                  behaviour: BehaviourSignal | None = None,
                  crosses: CrossSignal | None = None) -> dict[str, Any]:
    """Write ``hours`` hourly windows under ``out``; returns (and writes) ``_signal.json``.

    ``behaviour``: also write the ``item``/``hist_item`` columns and the ``like`` label;
    ``crosses``: plant feature crosses in the click (see the module docstring). None for both
    writes exactly the files of earlier versions."""
    if hours < 1 or rows_per_hour < 1:
        raise ValueError(f"`hours` and `rows_per_hour` must be >= 1, but are {hours} and {rows_per_hour}.")
    root = Path(out)
    signal = CriteoSignal.make(signal_seed)
    rng = np.random.default_rng(seed)
    brng = np.random.default_rng([seed, 1])  # the behaviour columns' own stream
    probs: dict[str, list[np.ndarray]] = {}
    labels: dict[str, list[np.ndarray]] = {}
    for h in range(hours):
        t = start + dt.timedelta(hours=h)
        part = root / f"dt={t:%Y-%m-%d}" / f"hour={t:%H}"
        part.mkdir(parents=True, exist_ok=True)
        table, p = generate_hour(signal, rows_per_hour, rng, first_row_id=h * rows_per_hour,
                                 behaviour=behaviour, behaviour_rng=brng, crosses=crosses)
        write_whole(part / "part-0.parquet", table, row_group_size)
        for name, prob in p.items():
            probs.setdefault(name, []).append(prob)
            column = "label" if name == "label_without_crosses" else name
            labels.setdefault(name, []).append(table.column(column).to_numpy())
    oracle = {}
    for name in probs:
        p_all, y_all = np.concatenate(probs[name]), np.concatenate(labels[name])
        oracle[name] = weighted_auc(torch.from_numpy(p_all), torch.from_numpy(y_all),
                                    torch.ones(len(y_all)))
    y_click = np.concatenate(labels["label"])
    meta: dict[str, Any] = {
        "hours": hours, "rows_per_hour": rows_per_hour, "ctr": float(y_click.mean()),
        "oracle_auc": oracle["label"], "seed": seed, "signal_seed": signal_seed}
    if crosses is not None:
        meta.update(crosses=[[SPARSE_COLUMNS[c] for c in cross] for cross in crosses.columns],
                    cross_groups=crosses.groups,
                    oracle_auc_without_crosses=oracle["label_without_crosses"])
    if behaviour is not None:
        meta.update(oracle_auc_per_label={k: v for k, v in oracle.items()
                                          if k != "label_without_crosses"},
                    like_rate=float(np.concatenate(labels["like"]).mean()),
                    num_items=behaviour.num_items, max_len=behaviour.max_len)
    write_signal(root, meta)
    return meta


def criteo_features(num_embeddings: int = 50_000) -> FeatureSpec:
    """The FeatureSpec for these files: counts log-free as floats (nulls -> 0), strings hashed."""
    return FeatureSpec(
        labels=["label"],
        dense=[DenseFeature(column=c) for c in DENSE_COLUMNS],
        sparse=[SparseFeature(name=c, num_embeddings=num_embeddings) for c in SPARSE_COLUMNS],
    )


def behaviour_features(num_embeddings: int = 50_000, *, num_items: int = 2000, max_len: int = 50,
                       labels: Sequence[str] = ("label",), sequence: bool = True) -> FeatureSpec:
    """The FeatureSpec for files written with ``behaviour``: ``criteo_features`` plus the items.

    ``sequence=True``: ``item`` (the candidate, one id per row) and ``hist_item`` (its last
    ``max_len`` ids) as sequence features, for an ``EmbeddingCollection`` whose one table both
    read (``models.DINClassifier``). ``sequence=False``: no history, ``item`` as a
    pooled sparse feature (what a DLRM without the sequence sees). ``labels``: ``("label",)``,
    ``("like",)`` or both (``[B, 2]``, for a multi-task model)."""
    base = criteo_features(num_embeddings)
    if not sequence:
        return FeatureSpec(labels=list(labels), dense=base.dense, sparse=[
            *base.sparse, SparseFeature(name="item", num_embeddings=num_items)])
    return FeatureSpec(labels=list(labels), dense=base.dense, sparse=base.sparse, sequence=[
        SequenceFeature(name="item", num_embeddings=num_items),
        SequenceFeature(name="hist_item", num_embeddings=num_items, max_len=max_len)])


def ensure_dataset(root: str | os.PathLike[str], hours: int, rows_per_hour: int,
                   behaviour: BehaviourSignal | None = None,
                   crosses: CrossSignal | None = None) -> dict[str, Any]:
    """The dataset at ``root``'s ``_signal.json``, rank 0 writing the dataset first if it is
    missing (``generated.written_once``: join the job first). An existing dataset is reused as
    it is: delete it to change its size or its behaviour columns."""
    meta = written_once(root, lambda: write_dataset(root, hours=hours, rows_per_hour=rows_per_hour,
                                                    behaviour=behaviour, crosses=crosses),
                        f"{hours} hourly windows x {rows_per_hour} rows")
    if crosses is not None and "crosses" not in meta:
        raise ValueError(f"{root} holds a dataset without planted crosses; delete it or pass "
                         "another directory.")
    if behaviour is not None and "oracle_auc_per_label" not in meta:
        raise ValueError(f"{root} holds a dataset without the behaviour columns (item, hist_item, "
                         "like); delete it or pass another directory.")
    return meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hours", type=int, default=12)
    ap.add_argument("--rows-per-hour", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--behaviour", action="store_true",
                    help="add the item/hist_item behaviour columns and the `like` label")
    ap.add_argument("--max-len", type=int, default=50, help="longest hist_item list (--behaviour)")
    ap.add_argument("--num-items", type=int, default=2000, help="item ids (--behaviour)")
    ap.add_argument("--crosses", action="store_true",
                    help="plant feature crosses in the click: C1 x C2, C3 x C4, C5 x C6 x C7")
    a = ap.parse_args(argv)
    behaviour = (BehaviourSignal.make(num_items=a.num_items, max_len=a.max_len)
                 if a.behaviour else None)
    meta = write_dataset(a.out, a.hours, a.rows_per_hour, a.seed, behaviour=behaviour,
                         crosses=CrossSignal.make() if a.crosses else None)
    print(json.dumps(meta))


__all__ = ["BehaviourSignal", "CriteoSignal", "CrossSignal", "DENSE_COLUMNS", "NUM_DENSE", "NUM_SPARSE",
           "SPARSE_COLUMNS", "behaviour_features", "criteo_features", "ensure_dataset",
           "generate_hour", "main", "vocab_sizes", "write_dataset"]


if __name__ == "__main__":
    main()
