"""Dynamic vs hashed tables on a churny stream: AUC at equal rows and at equal bytes, step time.

    python benchmarks/bench_dynamic.py [--quick] [--seeds 0 1 2] [--slots 1600] [--dim 16]
        [--dtype fp32|fp16] [--set eviction_interval=100 ...]   # DynamicTable fields

Data (``recsys_trainer.data.generators.id_stream.ChurnStream``): windows ("hours") of rows with a
``user`` id (20k ids, Zipf 1.05, stable) and an ``item`` id (20k ids that appear and fade:
each is born at a random time and its popularity decays over about a window), all uniform
random 63-bit ids, each with a planted effect on the click logit; the stream's seed draws
the ids, their effects and the rows. About 10x more distinct ids reach each table than it has
slots. Protocol (streaming): train on window ``w``, then score a held-out sample of window
``w + 1`` (rows never trained on); AUC pooled over those samples. The oracle AUC scores the same
rows by their true logit.

Models: the bundled DLRM (dim ``--dim``, 16 by default, tables stored in ``--dtype``, fused
row-wise Adagrad lr 0.05, Adam 3e-3 on the dense part), one process, batch 512:

- ``dynamic``: ``DynamicTable(num_slots=--slots, **--set)``;
- ``hashed_rows``: ids hashed into ``--slots`` rows (same rows);
- ``hashed_bytes``: ids hashed into as many rows as fit in the dynamic table's **bytes**
  (``recsys_trainer.dynamic.table_memory``, measured after the dynamic model's first step: the
  rows and their optimizer state, the id map with the policy's per-slot metadata, the id
  history as allocated, the bucket index if built), at ``itemsize * dim + 4`` bytes per
  hashed row (weights in ``--dtype``, row-wise Adagrad's float32).
  With ``--full``, also ``hashed_large`` (2 x ``--ids`` rows per table, few collisions: the
  reference for rows whose ids the dynamic table does not hold).

``non_resident``: the AUC on the eval rows whose user or item id had no row in the dynamic
table (it read a fallback row), for every model on those same rows.

Step time: the dynamic and the equal-bytes hashed model train interleaved (alternating every
``--chunk`` batches); mean and median over every step after the first window, eviction passes
included, as wall time and as process CPU time (what the step itself costs: other processes on
a shared host inflate wall time, much less this). The machine's load average is printed:
compare ratios from one run, not absolute times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments, shutdown
from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.id_stream import ChurnStream
from recsys_trainer.data.hashing import stable_hash_ints
from recsys_trainer.dynamic import (
    BOOKKEEPING,
    MEMORY_PARTS,
    DynamicTable,
    end_window,
    is_resident,
    table_memory,
    table_stats,
)
from recsys_trainer.metrics import weighted_auc
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.table_dtypes import TORCH_DTYPES

FEATS = ("user", "item")


def hashed(batches: list[Batch], rows: int) -> list[Batch]:
    """The batches with every id replaced by ``stable_hash_ints(id) % rows`` (the data layer's
    hashing of a bounded table)."""
    out = []
    for b in batches:
        v = stable_hash_ints(b.sparse.values().numpy()) % np.uint64(rows)
        kjt = KeyedJaggedTensor(keys=b.sparse.keys(), values=torch.from_numpy(v.astype(np.int64)),
                                lengths=b.sparse.lengths(), stride=b.sparse.stride())
        out.append(Batch(dense=b.dense, sparse=kjt, labels=b.labels))
    return out


def make(rows: int, spec: DynamicTable | None, out: str, dim: int = 16,
         dtype: str = "fp32") -> Trainer:
    torch.manual_seed(0)
    model = DLRMClassifier(list(FEATS), 4, num_embeddings=rows, embedding_dim=dim,
                           dense_arch=(32,), over_arch=(32, 1), dynamic=spec,
                           embedding_dtype=dtype)
    return Trainer(model=model, args=TrainingArguments(output_dir=out, log_steps=10**9),
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
                   add_logger_hook=False)


def train_step(t: Trainer, b: Batch) -> float:
    t0 = time.perf_counter()
    loss, _ = t.model(b)
    loss.backward()
    t.optimizer.step()
    t.optimizer.zero_grad()
    return time.perf_counter() - t0


def predict(t: Trainer, batches: list[Batch]) -> torch.Tensor:
    t.model.eval()
    with torch.no_grad():
        out = torch.cat([t.model(b)[1] for b in batches])
    t.model.train()
    return out


def parse_sets(items: list[str]) -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(DynamicTable)}
    out: dict[str, Any] = {}
    for item in items:
        key, _, text = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {item!r}: DynamicTable has no field {key!r}")
        value: Any = text
        for cast in (int, float):
            try:
                value = cast(text)
                break
            except ValueError:
                pass
        booleans = {"true": True, "false": False}
        out[key] = None if text == "None" else booleans.get(text.lower(), value)
    return out


def run_seed(a: argparse.Namespace, seed: int, spec: DynamicTable) -> dict[str, Any]:
    stream = ChurnStream(windows=a.windows, num_users=a.ids, num_items=a.ids, seed=seed)
    train = [stream.window(w, a.batches, a.batch_size, seed=1) for w in range(a.windows)]
    held_out = [stream.window(w, a.eval_batches, a.batch_size, seed=2) for w in range(1, a.windows)]
    out = os.path.join(a.out, f"seed{seed}")
    dyn = make(spec.num_slots, spec, out + "/d", a.dim, a.dtype)
    first = train[0][0]
    times: dict[str, list[float]] = {"dynamic": [train_step(dyn, first)], "hashed_bytes": []}
    cpu: dict[str, list[float]] = {"dynamic": [], "hashed_bytes": []}
    mem = table_memory(dyn.model)
    dyn_bytes = max(m["total"] for m in mem.values())
    per_row = TORCH_DTYPES[a.dtype].itemsize * a.dim + 4
    rows = {"dynamic": spec.num_slots, "hashed_rows": spec.num_slots,
            "hashed_bytes": dyn_bytes // per_row}
    if a.full:
        rows["hashed_large"] = 2 * a.ids
    trainers = {"dynamic": dyn, **{k: make(r, None, f"{out}/{k}", a.dim, a.dtype)
                                   for k, r in rows.items() if k != "dynamic"}}
    timed = ("dynamic", "hashed_bytes")
    preds: dict[str, list[torch.Tensor]] = {k: [] for k in trainers}
    resident: list[torch.Tensor] = []
    for w in range(a.windows):
        data = {k: train[w] if k == "dynamic" else hashed(train[w], rows[k]) for k in trainers}
        start = 1 if w == 0 else 0  # the dynamic model already trained batch 0
        for k in trainers:
            if k not in timed:
                for b in data[k]:
                    train_step(trainers[k], b)
        for lo in range(0, a.batches, a.chunk):
            for k in timed:
                first_b = max(lo, start) if k == "dynamic" else lo
                for b in data[k][first_b:lo + a.chunk]:
                    c0 = time.process_time()
                    dt = train_step(trainers[k], b)
                    if w > 0:  # the first window is warm-up
                        times[k].append(dt)
                        cpu[k].append(time.process_time() - c0)
        end_window(dyn.model)
        if w + 1 < a.windows:
            ev = held_out[w]
            for k, t in trainers.items():
                preds[k].append(predict(t, ev if k == "dynamic" else hashed(ev, rows[k])))
            ids = torch.cat([b.sparse.values().view(2, -1) for b in ev], dim=1)
            res = is_resident(dyn.model, {"t_user": ids[0], "t_item": ids[1]})
            resident.append(res["t_user"] & res["t_item"])
    evals = [b for ws in held_out for b in ws]
    y = torch.cat([b.labels for b in evals])
    ones = torch.ones_like(y)
    truth = torch.cat([b.passthrough["logit"] for b in evals])
    res_all = torch.cat(resident)
    nr = ~res_all
    result: dict[str, Any] = {
        "seed": seed, "rows": rows,
        "distinct_ids": {f: len({int(v) for ws in train for b in ws for v in b.sparse[f].values()})
                         for f in FEATS},
        "bytes": {"dynamic": dyn_bytes, "hashed_bytes": rows["hashed_bytes"] * per_row,
                  "hashed_rows": rows["hashed_rows"] * per_row},
        "dynamic_memory": mem[sorted(mem)[0]],
        "auc": {k: weighted_auc(torch.cat(p), y, ones) for k, p in preds.items()},
        "oracle_auc": weighted_auc(truth, y, ones),
        "non_resident_share": float(nr.float().mean()),
        "non_resident_auc": {k: weighted_auc(torch.cat(p)[nr], y[nr], ones[nr])
                             for k, p in preds.items()},
        "oracle_non_resident_auc": weighted_auc(truth[nr], y[nr], ones[nr]),
        "step_ms_mean": {k: 1e3 * statistics.fmean(v) for k, v in times.items()},
        "step_ms_median": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "step_cpu_ms_mean": {k: 1e3 * statistics.fmean(v) for k, v in cpu.items()},
        "step_cpu_ms_median": {k: 1e3 * statistics.median(v) for k, v in cpu.items()},
        "stats": table_stats(dyn.model),
    }
    end_mem = table_memory(dyn.model)
    result["dynamic_bytes_at_end"] = max(m["total"] for m in end_mem.values())
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    def ms(values: list[float]) -> str:
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{mean:.4f} ± {sd:.4f}"

    out: dict[str, Any] = {}
    for k in results[0]["auc"]:
        out[f"auc {k}"] = ms([r["auc"][k] for r in results])
        out[f"non-resident auc {k}"] = ms([r["non_resident_auc"][k] for r in results])
    out["oracle auc"] = ms([r["oracle_auc"] for r in results])
    out["dynamic - hashed_bytes"] = ms([r["auc"]["dynamic"] - r["auc"]["hashed_bytes"]
                                       for r in results])
    out["dynamic - hashed_rows"] = ms([r["auc"]["dynamic"] - r["auc"]["hashed_rows"]
                                      for r in results])
    out["step mean dynamic/hashed"] = ms([r["step_ms_mean"]["dynamic"]
                                         / r["step_ms_mean"]["hashed_bytes"] for r in results])
    out["step median dynamic/hashed"] = ms([r["step_ms_median"]["dynamic"]
                                           / r["step_ms_median"]["hashed_bytes"] for r in results])
    for stat in ("mean", "median"):
        out[f"step CPU {stat} dynamic/hashed"] = ms([r[f"step_cpu_ms_{stat}"]["dynamic"]
                                                    / r[f"step_cpu_ms_{stat}"]["hashed_bytes"]
                                                    for r in results])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 6 windows of 16 batches")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--slots", type=int, default=1600, help="rows of each dynamic table")
    ap.add_argument("--ids", type=int, default=20_000, help="users, and items, in the stream")
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--batches", type=int, default=40, help="train batches per window")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches per window")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--dim", type=int, default=16, help="embedding dim of every table")
    ap.add_argument("--dtype", default="fp32", choices=sorted(TORCH_DTYPES),
                    help="precision of every table (bf16: CUDA only)")
    ap.add_argument("--chunk", type=int, default=10)
    ap.add_argument("--full", action="store_true", help="also a hashed table of 2 x --ids rows")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="DynamicTable fields for the dynamic model")
    ap.add_argument("--json", action="store_true", help="print every seed's figures as JSON")
    ap.add_argument("--out", default="output/bench_dynamic")
    a = ap.parse_args()
    if a.quick:
        a.seeds, a.windows, a.batches, a.ids = a.seeds[:1], 6, 16, 8_000
        a.slots = min(a.slots, 640)
    torch.set_flush_denormal(True)
    spec = DynamicTable(num_slots=a.slots, **parse_sets(a.set))
    load = os.getloadavg()
    results = [run_seed(a, s, spec) for s in a.seeds]
    head = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
                       f"threads, load average {load[0]:.1f} (start) "
                       f"{os.getloadavg()[0]:.1f} (end)",
            "embedding_dim": a.dim, "dtype": a.dtype,
            "dynamic": {k: v for k, v in dataclasses.asdict(spec).items()},
            "stream": {"windows": a.windows, "batches_per_window": a.batches,
                       "batch_size": a.batch_size, "ids": a.ids, "seeds": a.seeds}}
    if a.json:
        print(json.dumps({**head, "seeds": results}, indent=1, default=str))
    print(f"# bench_dynamic\n\n{head['machine']}; embedding dim {a.dim}, {a.dtype}; dynamic table: "
          f"{head['dynamic']}; stream: {head['stream']}\n")
    print("| seed | distinct ids (user/item) | dynamic bytes | hashed_bytes rows | AUC dynamic | "
          "AUC hashed_bytes | AUC hashed_rows | oracle | non-resident rows | non-resident AUC "
          "dynamic / hashed_bytes | step ms mean d/h | median d/h |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['seed']} | {r['distinct_ids']['user']}/{r['distinct_ids']['item']} | "
              f"{r['bytes']['dynamic']:,} | {r['rows']['hashed_bytes']:,} | "
              f"{r['auc']['dynamic']:.4f} | {r['auc']['hashed_bytes']:.4f} | "
              f"{r['auc']['hashed_rows']:.4f} | {r['oracle_auc']:.4f} | "
              f"{r['non_resident_share']:.1%} | {r['non_resident_auc']['dynamic']:.4f} / "
              f"{r['non_resident_auc']['hashed_bytes']:.4f} | "
              f"{r['step_ms_mean']['dynamic']:.1f}/{r['step_ms_mean']['hashed_bytes']:.1f} | "
              f"{r['step_ms_median']['dynamic']:.1f}/{r['step_ms_median']['hashed_bytes']:.1f} |")
    mem = results[0]["dynamic_memory"]
    slots = spec.num_slots
    print(f"\ndynamic table bytes per slot (seed {results[0]['seed']}, after the first step): "
          + ", ".join(f"{k} {mem[k] / slots:.2f}" for k in MEMORY_PARTS)
          + f"; bookkeeping {sum(mem[k] for k in BOOKKEEPING) / slots:.2f}")
    print("\n| summary (mean ± sd over seeds) | |\n|---|---|")
    for k, v in summary(results).items():
        print(f"| {k} | {v} |")
    shutdown()


if __name__ == "__main__":
    main()
