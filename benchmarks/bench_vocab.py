"""Vocabularies vs hashing: eval AUC at the same table sizes, and the reader's cost.

    python benchmarks/bench_vocab.py [--quick] [--hours 6] [--rows-per-hour 30000] [--reps 5]

Data: the Criteo-schema click log of ``recsys_trainer.data.generators.criteo_synthetic`` (26 string
categoricals with 50 to 40,000 distinct values, Zipf popularity, a planted score per value), in
a temporary directory.

* **AUC**: a DLRM (world size 1) trained on hours 0..H-2 and evaluated on hour H-1, once per way
  of mapping the categoricals to rows, every table the same size, ``V + 1`` rows for a column of
  ``V`` values: ``hashed`` (the default for strings: values share rows by the hash), ``vocab``
  (the column's values as a list: one row each), ``from_data`` (``VocabFromData()``: the values
  seen in hour 0, the others on the OOV row). ``hashed 4x`` (4V rows) shows what hashing needs to
  come close. Same seed, same data, same steps; only the mapping differs.
* **Reader**: ``ParquetWindowDataset`` decoding every row (hashed vs vocab), against raw
  ``pyarrow.parquet.read_table`` of the same columns, in alternating rounds; the ratios are per
  round (this host is noisy).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from statistics import median

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.generators.criteo_synthetic import (
    DENSE_COLUMNS,
    SPARSE_COLUMNS,
    CriteoSignal,
    write_dataset,
)
from recsys_trainer.data.inputs import DenseFeature, SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.vocab import VocabFromData
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.models import DLRMClassifier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import quiet_torchrec  # noqa: E402


def spec(mode: str, sizes: list[int], vocabs: list[list[str]]) -> FeatureSpec:
    """The Criteo spec with each categorical mapped by ``mode`` into ``sizes[c]`` rows."""
    def feature(c: int) -> SparseFeature:
        name, n = SPARSE_COLUMNS[c], sizes[c]
        if mode == "vocab":
            return SparseFeature(name=name, num_embeddings=n, vocab=vocabs[c])
        if mode == "from_data":
            return SparseFeature(name=name, num_embeddings=n, vocab=VocabFromData())
        return SparseFeature(name=name, num_embeddings=n * (4 if mode == "hashed_4x" else 1))

    return FeatureSpec(labels=["label"], dense=[DenseFeature(column=c) for c in DENSE_COLUMNS],
                       sparse=[feature(c) for c in range(len(SPARSE_COLUMNS))])


def train_auc(root: str, fs: FeatureSpec, batch_size: int, out: str) -> tuple[float, float, int]:
    """(eval AUC on the last hour, train seconds, steps) of a DLRM trained on the others."""
    windows = partitioned_windows(root)
    torch.manual_seed(0)
    model = DLRMClassifier(SPARSE_COLUMNS, len(DENSE_COLUMNS), [s.num_embeddings for s in fs.sparse],
                           embedding_dim=16, dense_arch=(64, 16), over_arch=(64, 32, 1),
                           dense_log1p=True)
    metrics = MetricReportHook(metrics=["auc"], per_window=False)
    trainer = Trainer(model, TrainingArguments(output_dir=out, log_steps=10_000, seed=0),
                      train_dataset=ParquetWindowDataset(windows[:-1], fs, batch_size=batch_size),
                      eval_dataset=ParquetWindowDataset(windows[-1:], fs, batch_size=4096),
                      dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-3), None),
                      sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
                      hooks=[metrics], add_logger_hook=False)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    auc = float(trainer.evaluate()["auc"])
    return auc, seconds, trainer.state.global_step


def read_rate(root: str, fs: FeatureSpec, batch_size: int) -> float:
    ds = ParquetWindowDataset(root, fs, batch_size=batch_size)
    t0 = time.perf_counter()
    rows = sum(b.batch_size for w in ds.window_ids() for b in ds.iter_window(w))
    return rows / (time.perf_counter() - t0)


def raw_rate(files: list[str], columns: list[str]) -> float:
    t0 = time.perf_counter()
    rows = sum(pq.read_table(f, columns=columns).num_rows for f in files)
    return rows / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 hours x 10,000 rows, 3 rounds")
    p.add_argument("--hours", type=int, default=6)
    p.add_argument("--rows-per-hour", type=int, default=30_000)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--reps", type=int, default=5, help="alternating reader rounds (0: none)")
    p.add_argument("--seed", type=int, default=0, help="the data's seed (the planted signal is fixed)")
    p.add_argument("--modes", nargs="*", default=["hashed", "vocab", "from_data", "hashed_4x"])
    a = p.parse_args()
    if a.quick:
        a.hours, a.rows_per_hour, a.reps = 4, 10_000, 3
    torch.set_flush_denormal(True)
    quiet_torchrec()
    signal = CriteoSignal.make()
    vocabs = [[str(v) for v in vs] for vs in signal.vocab]
    sizes = [len(v) + 1 for v in vocabs]
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "data")
        meta = write_dataset(root, hours=a.hours, rows_per_hour=a.rows_per_hour, seed=a.seed)
        print(f"## Vocabulary vs hashing ({a.hours} hours x {a.rows_per_hour} rows, seed {a.seed}, "
              f"tables of V+1 rows, {sum(sizes)} rows in all; oracle AUC "
              f"{json.dumps(round(meta['oracle_auc'], 4))})\n")
        print("| mapping | table rows | eval AUC (last hour) | train s | steps |")
        print("|---|---|---|---|---|")
        for mode in a.modes:
            fs = spec(mode, sizes, vocabs)
            auc, secs, steps = train_auc(root, fs, a.batch_size, os.path.join(tmp, f"out_{mode}"))
            rows = sum(s.num_embeddings for s in fs.sparse)
            print(f"| {mode} | {rows} | {auc:.5f} | {secs:.1f} | {steps} |", flush=True)

        if a.reps == 0:
            return
        files = sorted(glob.glob(os.path.join(root, "*", "*", "*.parquet")))
        hashed, vocab = spec("hashed", sizes, vocabs), spec("vocab", sizes, vocabs)
        raw_rate(files, hashed.columns())
        read_rate(root, hashed, 2048)
        read_rate(root, vocab, 2048)
        rates: dict[str, list[float]] = {"raw": [], "hashed": [], "vocab": []}
        order = ["raw", "hashed", "vocab"]
        for rep in range(a.reps):
            for which in (order if rep % 2 == 0 else order[::-1]):
                rates[which].append(raw_rate(files, hashed.columns()) if which == "raw" else
                                    read_rate(root, hashed if which == "hashed" else vocab, 2048))
        per_round = [v / h for v, h in zip(rates["vocab"], rates["hashed"], strict=True)]
        print(f"\n## Reader: 26 string columns hashed vs looked up in their vocabularies "
              f"({len(files)} files, {a.hours * a.rows_per_hour} rows, {a.reps} rounds)\n")
        print("| reader | median rows/s | best rows/s | / raw (median of rounds) |")
        print("|---|---|---|---|")
        for which in order:
            ratio = median(r / w for r, w in zip(rates[which], rates["raw"], strict=True))
            print(f"| {which} | {median(rates[which]):,.0f} | {max(rates[which]):,.0f} | {ratio:.2f}x |")
        print(f"\nvocab / hashed per round: {', '.join(f'{x:.2f}' for x in per_round)} "
              f"(median {median(per_round):.2f}x)")
        chunk = pq.read_table(files[0], columns=hashed.columns()).slice(0, 16_384)
        times = decode_times(chunk, {"hashed": hashed, "vocab": vocab}, 30)
        print(f"\nDecode only (`decode_chunk` of {chunk.num_rows} rows, 26 string keys, 30 interleaved "
              "runs, minimum): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
              + f"; vocab / hashed time {times['vocab'] / times['hashed']:.2f}x")


def decode_times(table: pa.Table, specs: dict[str, FeatureSpec], runs: int) -> dict[str, float]:
    """Minimum seconds of ``decode_chunk`` per spec, the specs interleaved run by run (the
    minimum is what the code costs; load from other jobs only adds to it)."""
    best = {k: float("inf") for k in specs}
    for fs in specs.values():
        fs.decode_chunk(table, 2048)  # warm-up: each vocabulary's entry array is built once
    for _ in range(runs):
        for k, fs in specs.items():
            t0 = time.perf_counter()
            fs.decode_chunk(table, 2048)
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    main()
