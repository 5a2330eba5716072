"""Checkpoint benchmark: save throughput vs the disk, loop blocking (async vs sync), restore time.

For each table size it builds a Trainer (one process, world size 1) whose model has one big
embedding table (``rows x dim``, fused row-wise Adagrad) plus a small DLRM, trains 2 steps, then:

* measures the sequential write bandwidth of the output directory in the same run (``dd``-like:
  1 MiB writes of as many bytes as the checkpoint, then fsync);
* saves synchronously (the loop is blocked for the whole save);
* saves asynchronously twice (the first allocates the staging buffers, the second reuses them):
  the loop is blocked only for the snapshot;
* restores the last checkpoint into the same trainer.

Goals (issue 4): async blocks the loop for at most 20% of a sync save; save throughput is at
least 0.6x the measured disk bandwidth.

Usage: python benchmarks/bench_checkpoint.py [--rows 1e5 1e6 1e7] [--dim 16] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time

import torch

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.checkpoint import CheckpointManager
from recsys_trainer.data.synthetic import synthetic_batches
from recsys_trainer.models import DLRMClassifier


def disk_bandwidth(directory: str, num_bytes: int) -> float:
    """Sequential write MB/s of ``directory``: 1 MiB writes, then fsync (as a checkpoint does)."""
    path = os.path.join(directory, "bandwidth.probe")
    block = os.urandom(1 << 20)
    n = max(1, num_bytes >> 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return n * (1 << 20) / dt / 1e6


def bench(rows: int, dim: int, root: str, threads: int) -> dict[str, float]:
    out = os.path.join(root, f"rows_{rows}")
    shutil.rmtree(out, ignore_errors=True)
    feats = ["big", "s0", "s1"]
    torch.manual_seed(0)
    model = DLRMClassifier(feats, 4, [rows, 1000, 1000], embedding_dim=dim, dense_arch=(32,),
                           over_arch=(32, 1))
    data = synthetic_batches(2, 256, feats, 4, 1000, seed=0)
    trainer = Trainer(
        model, TrainingArguments(output_dir=out, train_steps=2, log_steps=1000, resume_from=None,
                                 save_concurrency_per_rank=threads),
        train_dataset=data, sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False,
    )
    trainer.train()
    mgr = trainer.checkpointer
    assert isinstance(mgr, CheckpointManager)

    def save(step: int, blocking: bool) -> tuple[float, float, int]:
        trainer.state.global_step = step
        mgr.save(trainer, blocking=blocking)
        mgr.wait()
        s = mgr.history[-1]
        return s.blocked_s, s.total_s, s.num_bytes

    sync_blocked, sync_total, nbytes = save(10, True)
    bw = disk_bandwidth(out, nbytes)
    async1_blocked, async1_total, _ = save(11, False)
    async2_blocked, async2_total, _ = save(12, False)
    t0 = time.perf_counter()
    mgr.load(trainer, os.path.join(out, "step_00000012"))
    restore = time.perf_counter() - t0
    mgr.close()
    shutil.rmtree(out, ignore_errors=True)
    mb = nbytes / 1e6
    return {
        "rows": rows, "dim": dim, "checkpoint_MB": round(mb, 1), "disk_MBps": round(bw, 1),
        "sync_save_s": round(sync_total, 3), "sync_MBps": round(mb / sync_total, 1),
        "sync_vs_disk": round(mb / sync_total / bw, 2),
        "async_blocked_first_s": round(async1_blocked, 3),
        "async_blocked_s": round(async2_blocked, 3), "async_total_s": round(async2_total, 3),
        "async_blocked_vs_sync": round(async2_blocked / sync_total, 3),
        "async_MBps": round(mb / async2_total, 1), "restore_s": round(restore, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=float, nargs="+", default=[1e5, 1e6, 1e7])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--threads", type=int, default=4, help="save_concurrency_per_rank")
    p.add_argument("--dir", default=None, help="output directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    logging.getLogger().setLevel(logging.ERROR)
    root = a.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    os.makedirs(root, exist_ok=True)
    results = [bench(int(r), a.dim, root, a.threads) for r in a.rows]
    cols = list(results[0])
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(str(r[c]) for c in cols))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
