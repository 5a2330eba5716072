"""Half-precision tables: how many updates rounding takes away, as a row is trained longer.

    python benchmarks/bench_precision.py [--quick] [--steps 20000] [--dtype fp16]

FBGEMM's CPU kernel rounds a half-precision table's update to nearest (its stochastic rounding is
CUDA only: ``table_precision.rounds_stochastically`` probes it, printed first). An update
smaller than half a unit in the last place of the weight then leaves the weight unchanged.
Row-wise Adagrad's steps shrink as a row's squared gradients add up, so the rows trained most
(the frequent ids) are the first to lose updates.

Two table-batched modules of ``--rows`` rows x ``--dim`` (row-wise Adagrad, lr ``--lr``), one in
``--dtype`` and one in float32 from the same start, train on the same Zipf(1.05) ids, 512 a
step, each id regressed towards its row's fixed target plus noise (sd ``--noise``, as click
labels are noisy: the gradients do not vanish as the rows converge). At each checkpoint (a
doubling of the steps) a float32 twin of the half-precision state (weights widened, the same
momentum) takes the next step beside it: an element whose float32 value moves but whose
half-precision value does not had its update rounded away. Printed: that share of the updated
elements, all rows and the rows visited >= 10,000 times; and what it costs: each table's
distance to the targets (RMS over the rows visited so far, and over the 100 most visited),
half precision against float32.

Then the step: one table-batched module of ``--speed-tables`` tables x ``--speed-rows`` rows x
``--speed-dim`` in float32 and one in ``--dtype`` (the same fused row-wise Adagrad), a forward
and a backward (the fused update) of batches of 2,048 rows, one Zipf id per table and row;
the two alternate, ``--speed-rounds`` rounds of 10 steps each. Printed: the median and the
fastest round's step time, and the half-precision one as a multiple of float32's (the fastest
rounds are the least disturbed by other jobs on a shared host).
"""

from __future__ import annotations

import argparse
import os
import platform

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from recsys_trainer.table_precision import rounds_stochastically


def tbe(rows: int, dim: int, lr: float, dtype: str) -> SplitTableBatchedEmbeddingBagsCodegen:
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weights_precision=SparseType(dtype),
        learning_rate=lr, eps=1e-8, stochastic_rounding=True)


def step(m: SplitTableBatchedEmbeddingBagsCodegen, ids: torch.Tensor,
         labels: torch.Tensor) -> None:
    out = m(ids, torch.arange(ids.numel() + 1))
    ((out.float() - labels) ** 2).sum().mul(0.5).backward()


def rms(w: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> float:
    return float((w[rows].float() - targets[rows]).pow(2).mean().sqrt())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,000 steps")
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--noise", type=float, default=0.1, help="sd of the label noise")
    ap.add_argument("--speed-tables", type=int, default=26)
    ap.add_argument("--speed-rows", type=int, default=100_000)
    ap.add_argument("--speed-dim", type=int, default=64)
    ap.add_argument("--speed-rounds", type=int, default=20)
    a = ap.parse_args()
    if a.quick:
        a.steps, a.speed_rows, a.speed_rounds = 2_000, 10_000, 6
    torch.set_num_threads(1)
    print(f"# bench_precision\n\n{platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; {a.rows:,} rows x {a.dim}, row-wise Adagrad lr {a.lr}, "
          f"512 Zipf(1.05) ids a step, targets N(0, 0.1^2) per row and value, label noise sd "
          f"{a.noise}; {a.dtype} against float32. FBGEMM's CPU kernel rounds {a.dtype} updates "
          f"stochastically: {rounds_stochastically('cpu', a.dtype)}.\n")
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, a.rows + 1) ** 1.05
    p /= p.sum()
    targets = torch.randn(a.rows, a.dim, generator=g) * 0.1
    half = tbe(a.rows, a.dim, a.lr, a.dtype)
    full = tbe(a.rows, a.dim, a.lr, "fp32")
    with torch.no_grad():
        full.split_embedding_weights()[0].copy_(half.split_embedding_weights()[0].float())
    visits = np.zeros(a.rows, dtype=np.int64)
    checkpoints = {2 ** k for k in range(6, 40)} | {a.steps}
    print(f"| steps | visits of the most visited row | updates lost to rounding: all rows / "
          f"rows visited >= 10k times | RMS to the targets, {a.dtype} / fp32: rows seen | "
          "the 100 most visited rows |")
    print("|---|---|---|---|---|")
    for s in range(1, a.steps + 1):
        ids = torch.from_numpy(rng.choice(a.rows, size=512, p=p))
        labels = targets[ids] + a.noise * torch.randn(512, a.dim, generator=g)
        if s in checkpoints:
            twin = tbe(a.rows, a.dim, a.lr, "fp32")
            with torch.no_grad():
                twin.split_embedding_weights()[0].copy_(half.split_embedding_weights()[0].float())
                twin.split_optimizer_states()[0][0].copy_(half.split_optimizer_states()[0][0])
            w_half = half.split_embedding_weights()[0].float().clone()
            w_twin = twin.split_embedding_weights()[0].clone()
            step(twin, ids, labels)
        step(half, ids, labels)
        step(full, ids, labels)
        if s in checkpoints:
            moved = twin.split_embedding_weights()[0] != w_twin
            lost = moved & (half.split_embedding_weights()[0].float() == w_half)
            head = moved & torch.from_numpy(visits >= 10_000).unsqueeze(1)
            seen = torch.from_numpy(np.nonzero(visits)[0])
            top = torch.from_numpy(np.argsort(-visits)[:100].copy())
            wh, wf = half.split_embedding_weights()[0], full.split_embedding_weights()[0]
            print(f"| {s:,} | {visits.max():,} | "
                  f"{int(lost.sum()) / max(1, int(moved.sum())):.2%} / "
                  f"{int((lost & head).sum()) / max(1, int(head.sum())):.2%} | "
                  f"{rms(wh, targets, seen):.5f} / {rms(wf, targets, seen):.5f} | "
                  f"{rms(wh, targets, top):.5f} / {rms(wf, targets, top):.5f} |", flush=True)
        np.add.at(visits, ids.numpy(), 1)
    speed(a)


def speed(a: argparse.Namespace) -> None:
    """The fused forward and backward of a half-precision table against a float32 one."""
    import statistics
    import time

    rows, tables, dim, batch = a.speed_rows, a.speed_tables, a.speed_dim, 2048
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, rows + 1) ** 1.05
    p /= p.sum()
    batches = [torch.from_numpy(rng.choice(rows, size=(tables, batch), p=p)) for _ in range(10)]
    offsets = torch.arange(tables * batch + 1)
    mods = {}
    for dt in ("fp32", a.dtype):
        mods[dt] = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, weights_precision=SparseType(dt),
            learning_rate=0.01, eps=1e-8)
    rounds: dict[str, list[float]] = {dt: [] for dt in mods}

    def run(m: SplitTableBatchedEmbeddingBagsCodegen) -> float:
        t0 = time.perf_counter()
        for ids in batches:
            # Table-major ids, as a KJT gives them: each table's ids are its rows' own.
            m(ids.reshape(-1), offsets).sum().backward()
        return (time.perf_counter() - t0) / len(batches)

    for m in mods.values():
        run(m)  # warm-up
    for r in range(a.speed_rounds):
        for dt in (list(mods) if r % 2 == 0 else list(mods)[::-1]):
            rounds[dt].append(run(mods[dt]))
    print(f"\nStep of one table-batched module, {tables} tables x {rows:,} x {dim}, batch "
          f"{batch}, row-wise Adagrad, forward + backward, {a.speed_rounds} alternating rounds "
          f"(load average {os.getloadavg()[0]:.1f}):\n")
    print("| precision | median ms | fastest round ms | median x fp32 | fastest x fp32 |")
    print("|---|---|---|---|---|")
    base = (statistics.median(rounds["fp32"]), min(rounds["fp32"]))
    for dt, ts in rounds.items():
        med, best = statistics.median(ts), min(ts)
        print(f"| {dt} | {1e3 * med:.2f} | {1e3 * best:.2f} | {med / base[0]:.3f} | "
              f"{best / base[1]:.3f} |")


if __name__ == "__main__":
    main()
