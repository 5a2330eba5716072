"""Write a Criteo-schema click log as hourly parquet windows, with a planted learnable signal.

    python -m recsys_trainer.data.criteo_synthetic --out data/criteo --hours 12 --rows-per-hour 50000

Schema (as in the Criteo 1TB / Kaggle logs): ``label`` (int 0/1), ``I1..I13`` (non-negative
integer counts, ~5% nulls), ``C1..C26`` (8-hex-digit categorical strings, Zipf-distributed
popularity, vocabularies from 50 to 40,000 values), plus ``row_id`` (int64, unique across the
dataset, for exactly-once checks). Layout: ``OUT/dt=YYYY-MM-DD/hour=HH/part-0.parquet``.

The signal: every categorical value has a hidden score ~ N(0, strength^2); the click
probability is ``sigmoid(bias + sum of the row's 26 scores + w . log1p(I))``. ``OUT/_signal.json``
records the AUC of the true probabilities on the generated rows (``oracle_auc``): no model can
beat it on average, and a model that learns the scores approaches it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_trainer.data.features import DenseFeature, FeatureSpec, SparseFeature
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


def generate_hour(signal: CriteoSignal, rows: int, rng: np.random.Generator,
                  first_row_id: int) -> tuple[pa.Table, np.ndarray]:
    """One hour of rows and their true click probabilities."""
    counts = np.floor(rng.lognormal(mean=1.0, sigma=1.2, size=(rows, NUM_DENSE)))
    logit = np.full(rows, signal.bias, dtype=np.float64)
    logit += np.log1p(counts) @ signal.dense_w
    cols: dict[str, pa.Array] = {}
    for c, name in enumerate(SPARSE_COLUMNS):
        v = len(signal.vocab[c])
        idx = (rng.zipf(1.2, size=rows) - 1) % v
        logit += signal.scores[c][idx]
        cols[name] = pa.array(signal.vocab[c][idx], type=pa.string())
    p = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(rows) < p).astype(np.int64)
    nulls = rng.random((rows, NUM_DENSE)) < 0.05
    table = {"row_id": pa.array(np.arange(first_row_id, first_row_id + rows, dtype=np.int64)),
             "label": pa.array(label)}
    for j, name in enumerate(DENSE_COLUMNS):
        table[name] = pa.array(counts[:, j].astype(np.int64), mask=nulls[:, j])
    table.update(cols)
    return pa.table(table), p


def write_dataset(out: str | os.PathLike[str], hours: int = 12, rows_per_hour: int = 50_000,
                  seed: int = 0, signal_seed: int = 2024, row_group_size: int = 8192,
                  start: dt.datetime = dt.datetime(2026, 11, 20)) -> dict[str, float]:
    """Write ``hours`` hourly windows under ``out``; returns (and writes) ``_signal.json``."""
    if hours < 1 or rows_per_hour < 1:
        raise ValueError(f"`hours` and `rows_per_hour` must be >= 1, but are {hours} and {rows_per_hour}.")
    root = Path(out)
    signal = CriteoSignal.make(signal_seed)
    rng = np.random.default_rng(seed)
    probs, labels = [], []
    for h in range(hours):
        t = start + dt.timedelta(hours=h)
        part = root / f"dt={t:%Y-%m-%d}" / f"hour={t:%H}"
        part.mkdir(parents=True, exist_ok=True)
        table, p = generate_hour(signal, rows_per_hour, rng, first_row_id=h * rows_per_hour)
        tmp = part / "part-0.parquet.tmp"
        pq.write_table(table, tmp, row_group_size=row_group_size)
        tmp.replace(part / "part-0.parquet")  # a reader never sees a half-written file
        probs.append(p)
        labels.append(table.column("label").to_numpy())
    p_all, y_all = np.concatenate(probs), np.concatenate(labels)
    meta = {"hours": hours, "rows_per_hour": rows_per_hour, "ctr": float(y_all.mean()),
            "oracle_auc": weighted_auc(torch.from_numpy(p_all), torch.from_numpy(y_all), torch.ones(len(y_all))), "seed": seed, "signal_seed": signal_seed}
    (root / "_signal.json").write_text(json.dumps(meta, indent=1))
    return meta


def criteo_features(num_embeddings: int = 50_000) -> FeatureSpec:
    """The FeatureSpec for these files: counts log-free as floats (nulls -> 0), strings hashed."""
    return FeatureSpec(
        labels=["label"],
        dense=[DenseFeature(column=c) for c in DENSE_COLUMNS],
        sparse=[SparseFeature(name=c, num_embeddings=num_embeddings) for c in SPARSE_COLUMNS],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hours", type=int, default=12)
    ap.add_argument("--rows-per-hour", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    meta = write_dataset(a.out, a.hours, a.rows_per_hour, a.seed)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
