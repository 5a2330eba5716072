"""Scaling: Trainer step time as tables grow (1e5 -> 1e7 rows) and as the batch grows; peak memory.

    python benchmarks/bench_scaling.py [--quick] [--rows 100000 1000000 10000000]
                                       [--batch-sizes 512 2048 8192]

One rank (world size 1, DMP + fused row-wise Adagrad, flush-denormal on), the benchmark DLRM with
--num-tables tables of --embedding-dim. Each configuration runs in its own process, so its peak
resident memory (``ru_maxrss``) is its own. Step time should stay flat as tables grow (the work per
step is the lookups, not the table size); per-sample time should fall as the batch grows until
the cores are saturated. Tables of 1e7 rows x 32 x 4 tables are 5.1 GB of float32: keep the
default row sweep for a machine with that much free memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dlrm, make_batches, markdown_table, peak_rss_mib, quiet_torchrec  # noqa: E402


def worker(a: argparse.Namespace) -> dict[str, Any]:
    """Train one configuration; returns step time, throughput and memory."""
    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.distributed import shutdown

    quiet_torchrec()
    rss_before = peak_rss_mib()
    batches = make_batches(a.distinct_batches, a.batch_size, a.num_tables, a.num_rows, seed=0)
    torch.manual_seed(0)
    t_build = time.perf_counter()
    trainer = Trainer(
        model=dlrm(a.num_tables, a.num_rows, a.embedding_dim),
        args=TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench_scaling_"),
                               train_epoch=10**9, train_steps=a.warmup, log_steps=10**9,
                               resume_from=None),
        train_dataset=batches,
        dense_optimizers=(lambda params: torch.optim.Adam(params, lr=1e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False,
    )
    build_s = time.perf_counter() - t_build
    trainer.train()  # warmup
    trainer.args.train_steps = a.warmup + a.steps
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    result = {
        "num_rows": a.num_rows, "batch_size": a.batch_size, "build_s": build_s,
        "step_ms": 1000 * seconds / a.steps, "samples_per_s": a.steps * a.batch_size / seconds,
        "table_mib": a.num_tables * a.num_rows * a.embedding_dim * 4 / 2**20,
        "peak_rss_mib": peak_rss_mib(), "rss_before_mib": rss_before,
    }
    shutdown()
    return result


def run_config(a: argparse.Namespace, num_rows: int, batch_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
               f"--num-rows={num_rows}", f"--batch-size={batch_size}",
               f"--num-tables={a.num_tables}", f"--embedding-dim={a.embedding_dim}",
               f"--warmup={a.warmup}", f"--steps={a.steps}", f"--distinct-batches={a.distinct_batches}"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-5000:]}")
        with open(out) as f:
            return dict(json.load(f))


def report(by_rows: list[dict[str, Any]], by_batch: list[dict[str, Any]], a: argparse.Namespace) -> str:
    def rows_of(results: list[dict[str, Any]], ref: dict[str, Any], key: str) -> list[list[Any]]:
        return [[
            f"{r['num_rows']:,}", r["batch_size"], f"{r['step_ms']:.1f}",
            f"{r[key] / ref[key]:.2f}", f"{r['samples_per_s']:,.0f}", f"{r['table_mib']:,.0f}",
            f"{r['peak_rss_mib']:,.0f}", f"{r['build_s']:.1f}",
        ] for r in results]

    header = ["rows/table", "batch", "step ms", "{}", "samples/s", "tables MiB", "peak RSS MiB",
              "build s"]
    parts = [
        "## Scaling (1 rank)",
        "",
        f"{a.num_tables} tables x {a.embedding_dim} dims, row-wise Adagrad + Adam, {a.steps} steps "
        f"after {a.warmup} warmup, each configuration in its own process.",
        "",
    ]
    if by_rows:
        h = [c.format(f"x step ms at {by_rows[0]['num_rows']:,} rows") for c in header]
        parts += ["Table size (should stay flat):", "",
                  markdown_table(h, rows_of(by_rows, by_rows[0], "step_ms")), ""]
    if by_batch:
        h = [c.format(f"x samples/s at batch {by_batch[0]['batch_size']}") for c in header]
        parts += ["Batch size:", "", markdown_table(h, rows_of(by_batch, by_batch[0], "samples_per_s"))]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="rows up to 1e6, batches up to 2048, fewer steps")
    p.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--rows-batch-size", type=int, default=2048, help="batch of the row sweep")
    p.add_argument("--batch-rows", type=int, default=100_000, help="rows/table of the batch sweep")
    p.add_argument("--num-tables", type=int, default=4)
    p.add_argument("--embedding-dim", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--distinct-batches", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--num-rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        with open(a.out, "w") as f:
            json.dump(worker(a), f)
        return
    if a.quick:
        a.rows = [r for r in a.rows if r <= 1_000_000]
        a.batch_sizes = [b for b in a.batch_sizes if b <= 2048]
        a.steps, a.warmup = min(a.steps, 10), min(a.warmup, 3)
    by_rows = [run_config(a, n, a.rows_batch_size) for n in a.rows]
    by_batch = [run_config(a, a.batch_rows, b) for b in a.batch_sizes]
    print(report(by_rows, by_batch, a))


if __name__ == "__main__":
    main()
