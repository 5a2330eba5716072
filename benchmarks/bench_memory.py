"""Bytes per id: what a hashed and a dynamic table hold per row, by precision and dim, checked
against the process's measured memory growth.

    python benchmarks/bench_memory.py [--quick] [--slots 200000] [--dims 8 16 64 128]

For each table kind (``hashed``: an ``EmbeddingBagCollection`` table; ``dynamic``: a
``DynamicTable`` with the defaults), precision (``fp32``, ``fp16``, ``bf16``) and dim, the bytes
per row (slot) of each part, from the tables' own tensors after training
(``recsys_trainer.dynamic.table_memory`` for the dynamic table, FBGEMM's weights and optimizer
state for the hashed one): ``rows`` (the weights), ``optimizer`` (row-wise Adagrad's one float32
per row), ``id map`` (the sorted int64 ids and their slots), ``policy`` (``decayed_lfu``'s count
and last access per slot), ``history`` (the ids without a row held for the next pass, and their
counts), ``index`` (the bucket index of lookups of 1,024 ids or more, built here: batches of
16,384 ids).

**Measured**: each configuration runs in a fresh process at ``--slots`` and at twice as many,
each building a one-table DLRM sharded by ``shard_model`` (world size 1) and training it on
batches of random raw ids until its history has been full; the process's resident memory
(``VmRSS``) grows by ``G(slots)`` from before the model is built to after training. ``G(2n) -
G(n)`` over ``n`` is what one more slot costs the process, whatever the fixed costs (torchrec's
planner, the dense layers, the 8 KB table of shard boundaries): it is compared with the
accounted bytes per slot (``measured / accounted``). glibc's malloc is told to map large
blocks (``MALLOC_MMAP_THRESHOLD_``) so that freed memory leaves the process.

bf16 tables do not train on CPU (FBGEMM 1.8.0's CPU kernel has none, and the trainer refuses
them by name): on CPU their row is accounted (2 bytes per value, as fp16), not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from typing import Any

KINDS = ("hashed", "dynamic")
DTYPES = ("fp32", "fp16", "bf16")
BATCH_IDS = 16_384


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def worker(kind: str, dtype: str, dim: int, slots: int, steps: int) -> dict[str, Any]:
    """One configuration in this (fresh) process: memory growth and the accounted parts."""
    import torch
    import torch.distributed as dist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_trainer.batch import Batch
    from recsys_trainer.dynamic import ID_SPACE, DynamicTable, id_maps, table_memory
    from recsys_trainer.models import DLRMClassifier
    from recsys_trainer.optimizers import SparseOptimizer
    from recsys_trainer.sharding import shard_model

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    before = _rss_bytes()
    spec = DynamicTable(num_slots=slots) if kind == "dynamic" else None
    model = DLRMClassifier(["x"], 1, num_embeddings=ID_SPACE if spec else slots,
                           embedding_dim=dim, dense_arch=(dim,), over_arch=(8, 1),
                           dynamic=spec, embedding_dtype=dtype)
    dmp = shard_model(model, SparseOptimizer("rowwise_adagrad", lr=0.05), torch.device("cpu"))
    # Enough distinct ids that the dynamic table's history fills (and is coalesced) and its
    # map fills; each batch is large enough to build the bucket index. The same number of
    # steps at both sizes (the step's own allocations then cancel out).
    space = ID_SPACE - 1 if spec else slots
    for _ in range(steps):
        ids = torch.randint(0, space, (BATCH_IDS,), generator=g)
        # Half the ids are repeats of a smaller set, so that some reach admission.
        ids[: BATCH_IDS // 2] = ids[: BATCH_IDS // 2] % max(1, slots // 2)
        kjt = KeyedJaggedTensor(keys=["x"], values=ids,
                                lengths=torch.ones(BATCH_IDS, dtype=torch.int32))
        batch = Batch(dense=torch.rand(BATCH_IDS, 1), sparse=kjt,
                      labels=(torch.rand(BATCH_IDS, generator=g) < 0.3).float())
        loss, _ = dmp(batch)
        loss.backward()
    after = _rss_bytes()
    if spec:
        parts = next(iter(table_memory(dmp).values()))
        maps = id_maps(dmp)
        parts["passes"] = maps[0].counters["passes"]
        parts["dropped"] = maps[0].counters["dropped"]
    else:
        parts = _hashed_parts(dmp)
    dist.destroy_process_group()
    return {"growth": after - before, "parts": parts}


def _hashed_parts(dmp: Any) -> dict[str, int]:
    """The hashed table's weights and fused optimizer state (this rank's shards), in bytes."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    def nbytes(t: Any) -> int:
        if isinstance(t, ShardedTensor):
            return sum(int(s.tensor.nbytes) for s in t.local_shards())
        return int(t.nbytes)

    rows = sum(nbytes(v) for k, v in dmp.state_dict().items()
               if ".embedding_bags." in k and k.endswith(".weight"))
    state = dmp.fused_optimizer.state_dict()["state"]
    optim = sum(nbytes(v) for entry in state.values() for v in entry.values()
                if isinstance(v, ShardedTensor | torch.Tensor))
    return {"rows": rows, "optimizer": optim}


def run(kind: str, dtype: str, dim: int, slots: int, steps: int) -> dict[str, Any]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", kind, dtype, str(dim), str(slots), str(steps)],
        env=env, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {dtype} dim {dim} slots {slots} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


PART_NAMES = ("rows", "optimizer", "id_map", "policy", "history", "index")


def accounted_row(kind: str, dtype: str, dim: int, slots: int) -> tuple[dict[str, float], Any]:
    """Per-slot bytes of each part, and the measured growth per slot (None if not built)."""
    if dtype == "bf16":  # refused on CPU: fp16's parts with bf16's (equal) value size
        small, _ = accounted_row(kind, "fp16", dim, slots)
        return small, None
    steps = max(4, -(-8 * slots // BATCH_IDS))  # 4 batches of ids per slot of the larger table
    a, b = run(kind, dtype, dim, slots, steps), run(kind, dtype, dim, 2 * slots, steps)
    per = {k: float(b["parts"].get(k, 0)) / (2 * slots) for k in PART_NAMES}
    measured = (b["growth"] - a["growth"]) / slots
    return per, measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=5, metavar=("KIND", "DTYPE", "DIM", "SLOTS", "STEPS"))
    ap.add_argument("--quick", action="store_true", help="dims 16 and 64, 100,000 slots")
    ap.add_argument("--slots", type=int, default=200_000)
    ap.add_argument("--dims", type=int, nargs="+", default=[8, 16, 64, 128])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.worker:
        kind, dtype, dim, slots, steps = a.worker
        print(json.dumps(worker(kind, dtype, int(dim), int(slots), int(steps))))
        return
    if a.quick:
        a.dims, a.slots = [16, 64], 100_000
    rows: list[dict[str, Any]] = []
    for dim in a.dims:
        for dtype in DTYPES:
            for kind in KINDS:
                per, measured = accounted_row(kind, dtype, dim, a.slots)
                total = sum(per.values())
                rows.append({"kind": kind, "dtype": dtype, "dim": dim, **per, "total": total,
                             "measured": measured})
                print(f"# {kind} {dtype} dim {dim}: {total:.1f} B/slot accounted, "
                      f"measured {'-' if measured is None else f'{measured:.1f}'}",
                      file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
    load = os.getloadavg()[0]
    print(f"# bench_memory\n\n{platform.machine()}, {os.cpu_count()} cores, load average "
          f"{load:.1f}; {a.slots:,} and {2 * a.slots:,} slots per configuration, one table, "
          "row-wise Adagrad, batches of 16,384 random raw ids.\n")
    print("| kind | precision | dim | rows | optimizer | id map | policy | history | index | "
          "**bytes per id** | measured growth per id | measured / accounted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["measured"]
        meas = "not built on CPU" if m is None else f"{m:.1f}"
        ratio = "" if m is None else f"{m / r['total']:.3f}"
        cells = [f"{r[k]:.1f}" if r[k] else "0" for k in PART_NAMES]
        print(f"| {r['kind']} | {r['dtype']} | {r['dim']} | {' | '.join(cells)} | "
              f"**{r['total']:.1f}** | {meas} | {ratio} |")


if __name__ == "__main__":
    main()
