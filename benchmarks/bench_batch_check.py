"""The id check on hand-built batches (``data.batch_check``) against the step it guards.

    python benchmarks/bench_batch_check.py [--quick]

For each shape (rows x ids per feature) and table layout, 26 features: the time of
``BatchCheck.check`` per batch, and, as the baseline measured in the same process on the same
batches, the forward and backward of the benchmark DLRM in plain PyTorch (``common.PlainDLRM``,
64 dims, sparse gradients, no optimizer) on them. Layouts: every table 100k rows (one ``aminmax`` over all ids decides), and 26 sizes
from 1k to 126k with each feature's ids inside its own table (the first pass sees ids above the
smallest table, so each feature gets a look of its own). One thread, the median of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import NUM_DENSE, PlainDLRM, markdown_table, plain_inputs, quiet_torchrec, sparse_names
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.data.batch_check import BatchCheck

TABLES = 26
LAYOUTS = {"alike": [100_000] * TABLES, "varied": [1_000 + 5_000 * i for i in range(TABLES)]}


def batches(rows: int, ids_per_row: int, sizes: list[int], n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        values = torch.cat([torch.randint(0, s, (rows * ids_per_row,), generator=g) for s in sizes])
        lengths = torch.full((TABLES * rows,), ids_per_row, dtype=torch.int32)
        out.append(Batch(dense=torch.randn(rows, NUM_DENSE, generator=g),
                         labels=torch.randint(0, 2, (rows,), generator=g).float(),
                         sparse=KeyedJaggedTensor(keys=sparse_names(TABLES), values=values,
                                                  lengths=lengths, stride=rows)))
    return out


def per_batch_us(fn: Callable[[Batch], object], data: list[Batch], rounds: int) -> float:
    for b in data[:2]:
        fn(b)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b in data:
            fn(b)
        times.append((time.perf_counter() - t0) / len(data) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches and rounds (~30 s)")
    a = p.parse_args()
    quiet_torchrec()
    torch.set_num_threads(1)
    n, rounds = (4, 3) if a.quick else (8, 5)
    rows = []
    for shape in [(512, 1), (2048, 1), (2048, 20)]:
        for layout, sizes in LAYOUTS.items():
            data = batches(*shape, sizes, n)
            check = BatchCheck([(f, f"t_{f}", s) for f, s in zip(sparse_names(TABLES), sizes, strict=True)])
            model = PlainDLRM(TABLES, max(sizes), 64)
            inputs = {id(b): plain_inputs(b) for b in data}

            def step(b: Batch, model: PlainDLRM = model, inputs: dict = inputs) -> None:
                model(*inputs[id(b)]).backward()

            check_us = per_batch_us(check.check, data, rounds)
            step_us = per_batch_us(step, data, max(1, rounds // 2))
            rows.append([f"{shape[0]} x {shape[1]}", layout, f"{check_us:,.0f}",
                         f"{step_us / 1e3:,.1f}", f"{check_us / step_us:.4f}"])
    print("## Id check on hand-built batches\n")
    print(f"{TABLES} features, one thread, median of rounds; the step is the plain-PyTorch DLRM's "
          "forward + backward on the same batch, measured in the same process.\n")
    print(markdown_table(["rows x ids per feature", "tables", "check us", "step ms",
                          "check / step"], rows))


if __name__ == "__main__":
    main()
