"""Offline scoring throughput: ``Trainer.predict`` rows/s against ``Trainer.evaluate`` rows/s.

    python benchmarks/bench_predict.py [--quick] [--rows 200000] [--reps 3]

Both run on the same parquet windows (Criteo-like: 13 dense, 26 hashed sparse columns, plus a
``request_id`` and a string ``user_id`` passed through), the same dataset spec and the same
model (DLRM, 26 tables, world size 1, no hooks). evaluate reads, decodes, runs the forward and
sums the loss; predict does the same and also turns the outputs into probabilities and writes
them with the passthrough columns as parquet (one file per window, committed by its marker),
into a fresh directory each round. After a warm-up of each, the two alternate ``--reps`` times
(the order flips every round); the predict/evaluate ratio is taken per round and its median
reported. The ratio is the cost of writing the scores: 1.0 means writing is free.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from statistics import median

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.predict import read_predictions

NUM_DENSE, NUM_SPARSE = 13, 26


def write_data(root: str, rows: int, windows: int) -> None:
    rng = np.random.default_rng(0)
    per_window = rows // windows
    rid = 0
    for w in range(windows):
        d = os.path.join(root, f"hour={w:02d}")
        os.makedirs(d, exist_ok=True)
        ids = np.arange(rid, rid + per_window, dtype=np.int64)
        rid += per_window
        cols: dict[str, pa.Array] = {
            "request_id": pa.array(ids),
            "user_id": pa.array([f"user-{u}" for u in rng.integers(0, 100_000, per_window)]),
            "label": pa.array(rng.integers(0, 2, per_window).astype(np.float32)),
        }
        for i in range(NUM_DENSE):
            cols[f"I{i + 1}"] = pa.array(rng.exponential(5, per_window).astype(np.float32))
        for i in range(NUM_SPARSE):
            cols[f"C{i + 1}"] = pa.array(((rng.zipf(1.3, per_window) - 1) % 1_000_000).astype(np.int64))
        pq.write_table(pa.table(cols), os.path.join(d, "part-0.parquet"), row_group_size=65536)


def spec(num_embeddings: int) -> FeatureSpec:
    return FeatureSpec(
        labels=["label"], dense=[f"I{i + 1}" for i in range(NUM_DENSE)],
        sparse=[SparseFeature(name=f"C{i + 1}", num_embeddings=num_embeddings, hash=True)
                for i in range(NUM_SPARSE)],
        passthrough=["request_id", "user_id"],
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="48k rows, 2 rounds")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--num-embeddings", type=int, default=100_000)
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.reps = 48_000, 2
    torch.set_flush_denormal(True)
    tmp = tempfile.mkdtemp(prefix="bench_predict_")
    try:
        data = os.path.join(tmp, "data")
        write_data(data, a.rows, a.windows)
        fs = spec(a.num_embeddings)

        def dataset() -> ParquetWindowDataset:
            return ParquetWindowDataset(data, fs, batch_size=a.batch_size)

        model = DLRMClassifier(fs.sparse_names, NUM_DENSE, a.num_embeddings, embedding_dim=a.embedding_dim,
                               dense_arch=(512, 256), over_arch=(512, 256, 1))
        trainer = Trainer(model, TrainingArguments(output_dir=os.path.join(tmp, "ckpt"), resume_from=None),
                          eval_dataset=dataset(), sparse_optimizer=SparseOptimizer("rowwise_adagrad"),
                          add_logger_hook=False)
        rows = a.windows * (a.rows // a.windows)

        def run_evaluate() -> float:
            t0 = time.perf_counter()
            n = trainer.evaluate()["num_samples"]
            assert n == rows, n
            return rows / (time.perf_counter() - t0)

        outs = iter(range(1_000_000))

        def run_predict() -> float:
            out = os.path.join(tmp, f"scores-{next(outs)}")
            t0 = time.perf_counter()
            summary = trainer.predict(dataset(), out)
            took = time.perf_counter() - t0
            assert summary.rows_written == rows, summary
            shutil.rmtree(out)
            return rows / took

        run_evaluate(), run_predict()  # warm-up: page cache, first-touch of the tables
        ev, pr, ratios = [], [], []
        for r in range(a.reps):
            if r % 2 == 0:
                e, q = run_evaluate(), run_predict()
            else:
                q, e = run_predict(), run_evaluate()
            ev.append(e)
            pr.append(q)
            ratios.append(q / e)
        # What a consumer reads back (one round, outside the timing): every row once.
        check = os.path.join(tmp, "check")
        trainer.predict(dataset(), check)
        got = read_predictions(check)
        assert got.num_rows == rows and len(set(got["request_id"].to_pylist())) == rows
        print("## predict: offline scoring vs evaluate\n")
        print(f"{rows:,} rows in {a.windows} windows, batch {a.batch_size}, DLRM 26 tables x "
              f"{a.num_embeddings:,} x {a.embedding_dim}, world size 1, {os.cpu_count()} cores "
              f"({platform.machine()}), {a.reps} rounds; predict writes 2 passthrough columns + 1 "
              "probability per row.\n")
        print("| | median rows/s | best rows/s | ratio to evaluate (median of rounds) |")
        print("|---|---|---|---|")
        print(f"| evaluate | {median(ev):,.0f} | {max(ev):,.0f} | 1.00 |")
        print(f"| predict | {median(pr):,.0f} | {max(pr):,.0f} | {median(ratios):.2f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
