"""HSTU's jagged step against the same batches padded to their longest row.

    python benchmarks/bench_hstu.py [--quick] [--batch-size 32] [--max-len 1000]

Histories are long-tailed: their lengths follow a power law ``P(n) ~ n^-1.3`` on ``[1, 1000]``
(mean 51, root mean square 145; a batch of 32 rows holds a row longer than 500 more often than
not). The Trainer trains ``HSTURetrievalModel`` (dim 32, 2 layers, 1 head, event times, 128
uniform negatives, 20,000 items) on the same in-memory batches with ``bucket_policy="length"``
(rows bucketed by length, each bucket padded to its power-of-two length: the default) and
``"padded"`` (every row padded to the batch's longest: what a padded implementation costs),
interleaved in rounds. Reported: the step time (median round) and process CPU time of each and
their ratio, and the peak resident memory each adds while training (each in its own process).
Goal: the jagged step at most 0.5x the padded one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from common import markdown_table, peak_rss_mib, quiet_torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.sequences_synthetic import power_law_lengths
from recsys_trainer.models import HSTURetrievalModel

NUM_ITEMS = 20_000
EXPONENT = 1.3
POLICIES = ("length", "padded")


def make_batches(n: int, batch_size: int, max_len: int, seed: int) -> list[Batch]:
    """Rows with a power-law history of items and times, a target item and its time."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lens = power_law_lengths(rng, batch_size, max_len, EXPONENT)
        total = int(lens.sum())
        hist = rng.integers(0, NUM_ITEMS, total)
        ts = 1_800_000_000 + rng.integers(0, 3600, batch_size)
        owner = np.repeat(np.arange(batch_size), lens)
        ago = np.sort(rng.integers(1, 10**6, total))[::-1]  # any decreasing ages will do
        times = ts[owner] - ago
        ones = np.ones(batch_size, dtype=np.int32)
        values = np.concatenate([rng.integers(0, NUM_ITEMS, batch_size), hist, times, ts])
        lengths = np.concatenate([ones, lens, lens, ones]).astype(np.int32)
        out.append(Batch(
            dense=torch.zeros(batch_size, 0), sparse=KeyedJaggedTensor.empty(),
            labels=torch.ones(batch_size),
            sequence=KeyedJaggedTensor(keys=["item", "hist_item", "hist_ts", "ts"],
                                       values=torch.from_numpy(values.astype(np.int64)),
                                       lengths=torch.from_numpy(lengths), stride=batch_size)))
    return out


def trainer_run(policy: str, batches: list[Batch], max_len: int) -> Any:
    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = HSTURetrievalModel(num_items=NUM_ITEMS, max_len=max_len, embedding_dim=32, num_layers=2,
                               num_heads=1, num_uniform_negatives=128, dropout=0.0,
                               bucket_policy=policy)  # type: ignore[arg-type]
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench_hstu_"), train_epoch=10**9,
                               train_steps=1, log_steps=10**9, resume_from=None),
        train_dataset=lambda: itertools.cycle(batches),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05), add_logger_hook=False)

    def run(n: int) -> None:
        trainer.args.train_steps = trainer.state.global_step + n
        trainer.train()

    return run


def timing(a: argparse.Namespace, batches: list[Batch]) -> dict[str, Any]:
    runs = {p: trainer_run(p, batches, a.max_len) for p in POLICIES}
    for p in POLICIES:
        runs[p](a.warmup)
    wall: dict[str, list[float]] = {p: [] for p in POLICIES}
    cpu: dict[str, list[float]] = {p: [] for p in POLICIES}
    for r in range(a.rounds):
        for p in (POLICIES if r % 2 == 0 else POLICIES[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            runs[p](a.steps)
            cpu[p].append(time.process_time() - c0)
            wall[p].append(time.perf_counter() - t0)
    return {p: {"step_s": statistics.median(wall[p]) / a.steps,
                "cpu_step_s": statistics.median(cpu[p]) / a.steps} for p in POLICIES}


def high_water_mib() -> float:
    """This process's peak resident memory, MiB: ``VmHWM`` (``getrusage``'s peak survives an
    ``exec``, so a worker started by a process that has used more would report its parent's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_mib()


def memory_worker(a: argparse.Namespace, batches: list[Batch]) -> dict[str, float]:
    """Peak resident memory added by training steps of one policy (its own process)."""
    run = trainer_run(a.memory_worker, batches, a.max_len)  # built, tables allocated
    before = high_water_mib()
    run(a.steps)
    return {"peak_rss_mib": high_water_mib(), "added_mib": high_water_mib() - before}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1000)
    p.add_argument("--batches", type=int, default=8, help="distinct batches, cycled")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-worker", choices=POLICIES, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.rounds = a.rounds or (2 if a.quick else 4)
    a.steps = a.steps or (4 if a.quick else 8)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    quiet_torchrec()
    batches = make_batches(a.batches, a.batch_size, a.max_len, seed=0)
    if a.memory_worker:
        print(json.dumps(memory_worker(a, batches)))
        return
    lens = [b.sequence["hist_item"].lengths() for b in batches if b.sequence is not None]
    events = [int(x.sum()) for x in lens]
    longest = [int(x.max()) for x in lens]
    print(f"{a.batches} batches of {a.batch_size} rows: events per batch {statistics.mean(events):.0f} "
          f"(mean length {statistics.mean(events) / a.batch_size:.1f}), longest row per batch "
          f"{min(longest)}..{max(longest)}; padded to the longest: "
          f"{statistics.mean(lo * a.batch_size for lo in longest):.0f} tokens per batch")
    t = timing(a, batches)
    mem = {}
    for policy in POLICIES:
        out = subprocess.run([sys.executable, __file__, "--memory-worker", policy, "--batch-size",
                              str(a.batch_size), "--max-len", str(a.max_len), "--batches",
                              str(a.batches), "--steps", str(a.steps)],
                             capture_output=True, text=True, check=True, timeout=1800)
        mem[policy] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [[policy, f"{t[policy]['step_s'] * 1e3:.0f}", f"{t[policy]['cpu_step_s'] * 1e3:.0f}",
             f"{t[policy]['step_s'] / t['padded']['step_s']:.3f}",
             f"{t[policy]['cpu_step_s'] / t['padded']['cpu_step_s']:.3f}",
             f"{mem[policy]['added_mib']:.0f}", f"{mem[policy]['peak_rss_mib']:.0f}"]
            for policy in POLICIES]
    print(markdown_table(["bucket_policy", "step ms", "cpu ms", "step / padded", "cpu / padded",
                          "MiB added while training", "peak RSS MiB"], rows))
    ratio = t["length"]["step_s"] / t["padded"]["step_s"]
    print(f"jagged / padded step time {ratio:.3f} (goal <= 0.5): {'met' if ratio <= 0.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
