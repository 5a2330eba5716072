"""Quality of a hashed table vs a dynamic table at equal memory, and the step-time ratio.

    python benchmarks/bench_dynamic.py [--rows 2000] [--ids-per-row 5] [--steps 600] [--seed 3]
        [--hashed-rows N]   # default: as many rows as fit in the dynamic table's bytes
        [--first-batch-rows N]  # the first training batch has only N rows (a partial hour)

Data: ``recsys_trainer.data.id_stream.IdStream``: 2 sparse features, each with
``rows * ids_per_row`` distinct raw ids (Zipf 1.05) and a planted per-id effect on the click
logit, 4 noise dense features. Both models are the bundled DLRM (dim 16) with ``rows`` rows per
table, fused row-wise Adagrad, Adam on the dense part, one process:

- ``hashed``: ids hashed into ``--hashed-rows`` rows (``stable_hash_ints(id) % rows``, what the
  data layer does); ids share rows. By default it gets the dynamic table's *bytes*: a dynamic
  slot also carries 4 int64 of id map and policy state, and each table a history of the ids seen
  between passes (``eviction_interval x batch x 1.25`` ids and their counts, the size a full
  first batch gives it), so at equal bytes the hashed table has more rows (``table_bytes``).
- ``dynamic``: ``DynamicTable(num_slots=rows)``: the most valuable ids (DistanceLFU) get their
  own row, the rest read the shared default row.

Both train on the same batches and are evaluated on the same held-out batches (eval AUC). The
step time is the median over the timed steps after a warm-up, measured interleaved (the two
trainers alternate per chunk of steps), so drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments, shutdown
from recsys_trainer.batch import Batch
from recsys_trainer.data.features import stable_hash_ints
from recsys_trainer.data.id_stream import IdStream
from recsys_trainer.dynamic import DynamicTable, table_stats
from recsys_trainer.metrics import weighted_auc
from recsys_trainer.models import DLRMClassifier

FEATS = ("user", "item")


def hashed(batches: list[Batch], rows: int) -> list[Batch]:
    out = []
    for b in batches:
        v = stable_hash_ints(b.sparse.values().numpy()) % np.uint64(rows)
        kjt = KeyedJaggedTensor(keys=b.sparse.keys(), values=torch.from_numpy(v.astype(np.int64)),
                                lengths=b.sparse.lengths(), stride=b.sparse.stride())
        out.append(Batch(dense=b.dense, sparse=kjt, labels=b.labels))
    return out


def table_bytes(rows: int, dim: int, dynamic: bool, interval: int, batch: int) -> int:
    """Bytes one table holds for training: fp32 rows plus the row-wise Adagrad value, and for a
    dynamic table its per-slot id map and policy buffers and its id history."""
    per_row = 4 * dim + 4
    if not dynamic:
        return rows * per_row
    return rows * (per_row + 4 * 8) + int(interval * batch * 1.25) * 2 * 8


def make(kind: str, rows: int, interval: int, out: str) -> Trainer:
    torch.manual_seed(0)
    dyn = DynamicTable(num_slots=rows, eviction_interval=interval) if kind == "dynamic" else None
    model = DLRMClassifier(list(FEATS), 4, num_embeddings=rows, embedding_dim=16,
                           dense_arch=(32,), over_arch=(32, 1), dynamic=dyn)
    return Trainer(model=model, args=TrainingArguments(output_dir=out, log_steps=10**9),
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
                   add_logger_hook=False)


def step_fn(t: Trainer) -> Any:
    model = t.model

    def step(b: Batch) -> None:
        loss, _ = model(b)
        loss.backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
    return step


def auc(t: Trainer, batches: list[Batch]) -> float:
    t.model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for b in batches:
            _, logits = t.model(b)
            preds.append(logits)
            labels.append(b.labels)
    t.model.train()
    p, y = torch.cat(preds), torch.cat(labels)
    return weighted_auc(p, y, torch.ones_like(y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--ids-per-row", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--eval-batches", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--out", default="output/bench_dynamic")
    ap.add_argument("--seed", type=int, default=3, help="of the id stream's planted effects")
    ap.add_argument("--hashed-rows", type=int, default=None,
                    help="rows of the hashed table (default: equal bytes to the dynamic table)")
    ap.add_argument("--first-batch-rows", type=int, default=None,
                    help="cut the first training batch to this many rows (a short first batch)")
    a = ap.parse_args()
    torch.set_flush_denormal(True)
    dyn_bytes = table_bytes(a.rows, 16, True, a.interval, a.batch_size)
    hashed_rows = a.hashed_rows or dyn_bytes // table_bytes(1, 16, False, 0, 0)
    stream = IdStream(FEATS, int(a.rows * a.ids_per_row), strength=1.0, seed=a.seed)
    train = stream.batches(a.steps, a.batch_size, seed=1)
    if a.first_batch_rows is not None:
        train[0] = stream.batches(1, a.first_batch_rows, seed=0)[0]
    held_out = stream.batches(a.eval_batches, a.batch_size, seed=2)
    trainers = {"hashed": make("hashed", hashed_rows, a.interval, a.out + "/h"),
                "dynamic": make("dynamic", a.rows, a.interval, a.out + "/d")}
    data = {"hashed": hashed(train, hashed_rows), "dynamic": train}
    evals = {"hashed": hashed(held_out, hashed_rows), "dynamic": held_out}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    steps = {k: step_fn(t) for k, t in trainers.items()}
    for lo in range(0, a.steps, a.chunk):
        for k in trainers:
            for b in data[k][lo:lo + a.chunk]:
                t0 = time.perf_counter()
                steps[k](b)
                if lo >= a.chunk:  # the first chunk is warm-up
                    times[k].append(time.perf_counter() - t0)
    res: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "rows": {"dynamic": a.rows, "hashed": hashed_rows}, "seed": a.seed,
        "table_bytes": {"dynamic": dyn_bytes,
                        "hashed": table_bytes(hashed_rows, 16, False, a.interval, a.batch_size)},
        "distinct_ids_per_feature": stream.num_ids, "steps": a.steps,
        "batch_size": a.batch_size, "first_batch_rows": a.first_batch_rows,
        "auc": {k: round(auc(t, evals[k]), 4) for k, t in trainers.items()},
        "median_step_ms": {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()},
        "dynamic_tables": table_stats(trainers["dynamic"].model),
    }
    res["step_time_ratio_dynamic_over_hashed"] = round(
        res["median_step_ms"]["dynamic"] / res["median_step_ms"]["hashed"], 3)
    print(json.dumps(res, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
