"""Where a dynamic table's step time goes: five models' steps on the same batches, interleaved.

    python benchmarks/bench_dynamic_step.py [--rounds 8] [--quick]
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_dynamic_step.py   # 2 ranks
    python benchmarks/bench_dynamic_step.py --batch-size 8192 --slots 100000 --ids 1000000

The DLRM of ``bench_dynamic.py`` (dim 16, tables ``user`` and ``item``, fused row-wise Adagrad
0.05, Adam 3e-3), 512 rows per rank and step, ``ChurnStream`` batches of 20,000 users and
items (each rank its own); ``--slots``/``--ids``/``--batch-size`` scale it (the hashed table
keeps 2,850/1,600 rows per slot):

- ``hashed``: ids hashed into 2,850 rows, an ``EmbeddingBagCollection`` (the baseline: the
  planner's sharding, FBGEMM's pooled lookup);
- ``mc``: a dynamic table (1,600 slots) whose map does nothing (no mixing, no counting, no
  pass, slot = id mod slots): torchrec's managed-collision pooled path
  (``ManagedCollisionEmbeddingBagCollection``, row-wise) with our ``DynamicShardedMaps`` (which
  at 1 rank skips the route of the ids to their rank: an all-to-all with itself that the
  hashed table's ``EmbeddingBagCollection`` still does);
- ``no_pass``: the default ``DynamicTable``, its passes stopped after the warm-up window (its
  map full, as ``dynamic``'s: a table that never had a pass holds no id, and every lookup reads
  its one fallback row, which makes the lookup and the optimizer's row updates cheaper), its
  history made large enough that it is never coalesced (a pass would empty it);
- ``dynamic``: the default ``DynamicTable`` (a pass every 2,048 rows);
- ``unpooled``: the default table on the former lookup path (``pooled_lookup=False``: the
  unpooled ``ManagedCollisionEmbeddingCollection``, pooled after).

Step time is measured per step as process CPU time (what the step costs; other processes on a
loaded host inflate wall time, not this) and wall time; the models take turns every ``--chunk``
batches, ``--rounds`` times over 2 windows of 40 batches. Printed: mean and median ratios to
``hashed``, and the differences between neighbours: torchrec's managed-collision pooled path
(``mc`` - ``hashed``), the map's per-forward work (``no_pass`` - ``mc``), the passes (``dynamic``
- ``no_pass``), and what the pooled lookup saves (``unpooled`` - ``dynamic``). Rank 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from typing import Any

import torch
from bench_dynamic import hashed, make, train_step
from torchrec.sparse.jagged_tensor import JaggedTensor

import recsys_trainer.dynamic as dynamic
from recsys_trainer import Trainer, shutdown
from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.id_stream import ChurnStream
from recsys_trainer.dynamic.id_map import _resize_history

DIM, SLOTS, HASHED_ROWS = 16, 1600, 2850
MODELS = ("hashed", "mc", "no_pass", "dynamic", "unpooled")


def make_mc(out: str, slots: int = SLOTS) -> Trainer:
    """A dynamic table whose map does no work: torchrec's managed-collision path alone."""
    t = make(slots, dynamic.DynamicTable(num_slots=slots, eviction_interval_rows=2**62), out)
    for m in dynamic.mc_modules(t.model).values():
        mm: Any = m

        def rows(ids: torch.Tensor, batch_rows: int = 0, out: torch.Tensor | None = None,
                 mm: Any = mm) -> torch.Tensor:
            return torch.add(ids.remainder(mm._zch_size), mm._output_global_offset, out=out)

        def remap(features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True,
                  write_weights: torch.Tensor | None = None, rows: Any = rows,
                  ) -> dict[str, JaggedTensor]:
            return {k: JaggedTensor(values=rows(f.values()), lengths=f.lengths())
                    for k, f in features.items()}

        mm.profile = lambda features: features
        mm.remap = remap
        mm.forward_rows = rows  # the short path's (DynamicShardedMaps)
        mm._input_hash_func = lambda ids, size: ids
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--batch-size", type=int, default=512, help="rows per rank and step")
    ap.add_argument("--slots", type=int, default=SLOTS,
                    help="slots per dynamic table (the hashed table: 2,850/1,600 as many rows, "
                         "its equal bytes at the default)")
    ap.add_argument("--ids", type=int, default=20_000, help="users, and items, in the stream")
    ap.add_argument("--out", default="output/bench_dynamic_step")
    a = ap.parse_args()
    if a.quick:
        a.rounds = 2
    torch.set_flush_denormal(True)
    rank = int(os.environ.get("RANK", "0"))
    stream = ChurnStream(windows=3, num_users=a.ids, num_items=a.ids, seed=0)
    slots, hashed_rows = a.slots, a.slots * HASHED_ROWS // SLOTS
    raw = [stream.window(w, 40, a.batch_size, seed=1 + 10 * rank) for w in range(3)]
    hashed_ids = [hashed(w, hashed_rows) for w in raw]
    trainers: dict[str, tuple[Trainer, list[list[Batch]]]] = {
        "hashed": (make(hashed_rows, None, f"{a.out}/hashed"), hashed_ids),
        "mc": (make_mc(f"{a.out}/mc", slots), raw),
        "no_pass": (make(slots, dynamic.DynamicTable(num_slots=slots), f"{a.out}/no_pass"), raw),
        "dynamic": (make(slots, dynamic.DynamicTable(num_slots=slots), f"{a.out}/dynamic"), raw),
        "unpooled": (make(slots, dynamic.DynamicTable(num_slots=slots, pooled_lookup=False),
                          f"{a.out}/unpooled"), raw),
    }
    for t, data in trainers.values():  # warm-up: the first window (the maps fill)
        for b in data[0]:
            train_step(t, b)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for m in dynamic.mc_modules(trainers["no_pass"][0].model).values():
        m._settings = dataclasses.replace(m._settings, interval_rows=2**62)  # no more passes
        # A pass empties the history; without passes it would fill and be coalesced at every
        # forward, a cost that belongs to neither the map's forward nor the passes: room for
        # every id the timed steps can record.
        _resize_history(m, a.rounds * 80 * a.batch_size * world)
    wall: dict[str, list[float]] = {k: [] for k in MODELS}
    cpu: dict[str, list[float]] = {k: [] for k in MODELS}
    load = os.getloadavg()[0]
    for _ in range(a.rounds):
        for w in (1, 2):
            for lo in range(0, 40, a.chunk):
                for k, (t, data) in trainers.items():
                    for b in data[w][lo:lo + a.chunk]:
                        c0 = time.process_time()
                        wall[k].append(train_step(t, b))
                        cpu[k].append(time.process_time() - c0)
    if rank == 0:
        def ratio(d: dict[str, list[float]], k: str, f: Any) -> float:
            return float(f(d[k]) / f(d["hashed"]))

        print(f"# bench_dynamic_step\n\n{platform.machine()}, {os.cpu_count()} cores, "
              f"{torch.get_num_threads()} threads, {world} rank(s), {slots} slots, {a.ids} ids, "
              f"{a.batch_size} rows per rank "
              f"and step, load average {load:.1f} "
              f"(start) {os.getloadavg()[0]:.1f} (end); {len(cpu['hashed'])} steps per model\n")
        print("| model | CPU ms/step mean | CPU x hashed (mean / median) | wall x hashed "
              "(mean / median) |\n|---|---|---|---|")
        for k in MODELS:
            print(f"| {k} | {1e3 * statistics.fmean(cpu[k]):.2f} | "
                  f"{ratio(cpu, k, statistics.fmean):.3f} / {ratio(cpu, k, statistics.median):.3f} | "
                  f"{ratio(wall, k, statistics.fmean):.3f} / {ratio(wall, k, statistics.median):.3f} |")
        parts = (("managed-collision pooled path (mc - hashed)", "mc", "hashed"),
                 ("the map per forward (no_pass - mc)", "no_pass", "mc"),
                 ("passes (dynamic - no_pass)", "dynamic", "no_pass"),
                 ("the former unpooled path (unpooled - dynamic)", "unpooled", "dynamic"))
        print("\n| where the extra CPU time goes (x hashed, means) | |\n|---|---|")
        for name, hi, lo in parts:
            print(f"| {name} | {ratio(cpu, hi, statistics.fmean) - ratio(cpu, lo, statistics.fmean):+.3f} |")
    shutdown()


if __name__ == "__main__":
    main()
