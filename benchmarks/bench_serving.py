"""Serving: the exported model's ``Scorer`` against the eager model, in one process.

    python benchmarks/bench_serving.py [--quick] [--aot-inductor] [--reps 200]

The bundled example's model (examples/train_dlrm.py: DLRM, 13 dense, 26 hashed string
features, 50,000 rows x dim 16 per table) is trained on Criteo-like windows (world size 1),
exported, and scored from raw rows (a ``pyarrow.Table`` of the request's columns):

* **latency**: p50/p99 of ``Scorer.score`` for 1, 16 and 512 rows (each call decodes, looks
  up and runs the dense program), with where the time goes (decode / lookup / dense program,
  medians at each size);
* **throughput at 512 rows**: scorer rows/s against the eager model (``trainer.model``, as
  ``predict`` runs it: ``FeatureSpec.decode`` + forward) on the same rows, interleaved, and
  against the eager forward alone (rows decoded beforehand): same process, ratios per round;
* **quantized tables**: AUC on the next window's rows with float32, int8 and int4 tables, and
  the tables' size ratio, for the DLRM and for the DIN example (examples/train_din.py);
* with ``--aot-inductor``: the AOTInductor build of the dense program (its compile time, or
  why it failed) and its latency.

Timings on a shared host move by +-15%: read the ratios, which are taken within one round.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from statistics import median
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.generators.criteo_synthetic import (
    SPARSE_COLUMNS,
    BehaviourSignal,
    CriteoSignal,
    behaviour_features,
    criteo_features,
    generate_hour,
)
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.metrics import weighted_auc
from recsys_trainer.models import DINClassifier, DLRMClassifier
from recsys_trainer.serving import Scorer, export_for_serving

NUM_EMB, DIM = 50_000, 16


def write_windows(root: str, rows: int, hours: int, din: bool) -> list[str]:
    signal = CriteoSignal.make()
    behaviour = BehaviourSignal.make(num_items=2000, max_len=50) if din else None
    rng, brng = np.random.default_rng(0), np.random.default_rng([0, 1])
    out = []
    os.makedirs(root, exist_ok=True)
    for h in range(hours):
        table, _ = generate_hour(signal, rows, rng, first_row_id=h * rows, behaviour=behaviour,
                                 behaviour_rng=brng)
        path = os.path.join(root, f"hour={h:02d}.parquet")
        pq.write_table(table, path, row_group_size=8192)
        out.append(path)
    return out


def train(kind: str, root: str, windows: list[str]) -> Trainer:
    torch.manual_seed(0)
    if kind == "dlrm":
        spec = criteo_features(NUM_EMB)
        model: torch.nn.Module = DLRMClassifier(
            SPARSE_COLUMNS, 13, NUM_EMB, DIM, dense_arch=(64, DIM), over_arch=(64, 32, 1),
            dense_log1p=True)
    else:
        spec = behaviour_features(NUM_EMB, num_items=2000, max_len=50)
        model = DINClassifier(SPARSE_COLUMNS, 13, num_items=2000, max_len=50,
                              num_embeddings=NUM_EMB, embedding_dim=DIM, dense_arch=(64, DIM),
                              over_arch=(64, 32, 1), dense_log1p=True)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=os.path.join(root, f"ckpt_{kind}"), log_steps=10**6,
                               seed=0, pipeline="none"),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=1024),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False,
    )
    trainer.train()
    return trainer


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def latency(scorer: Scorer, rows: pa.Table, sizes: tuple[int, ...], reps: int) -> list[list[Any]]:
    out = []
    n = rows.num_rows
    for size in sizes:
        times, parts = [], {"decode": [], "lookup": [], "dense": []}
        for r in range(reps):
            batch = rows.slice((r * size) % max(n - size, 1), size)
            t0 = time.perf_counter()
            scorer.score(batch)
            times.append(time.perf_counter() - t0)
        for r in range(min(reps, 50)):  # where the time goes, measured separately
            batch = rows.slice((r * size) % max(n - size, 1), size)
            t0 = time.perf_counter()
            table = scorer._table(batch)
            chunk = scorer._decode_spec.decode_chunk(table)
            t1 = time.perf_counter()
            inputs = scorer.inputs(batch)  # decode again + lookups
            t2 = time.perf_counter()
            with torch.inference_mode():
                scorer._program(*inputs)
            t3 = time.perf_counter()
            del chunk
            parts["decode"].append(t1 - t0)
            parts["lookup"].append(max((t2 - t1) - (t1 - t0), 0.0))
            parts["dense"].append(t3 - t2)
        out.append([size, f"{pct(times, 50) * 1e3:.2f}", f"{pct(times, 99) * 1e3:.2f}",
                    f"{size / pct(times, 50):,.0f}",
                    " / ".join(f"{median(parts[k]) * 1e3:.2f}" for k in ("decode", "lookup", "dense"))])
    return out


def throughput(scorer: Scorer, trainer: Trainer, rows: pa.Table, size: int, rounds: int,
               ) -> list[str]:
    """Per round, in one process: the scorer from raw rows vs the eager model's decode +
    forward (what predict runs), and the scorer's lookups + dense program on inputs built
    beforehand vs the eager forward on batches decoded beforehand. Medians of the rates and
    of the per-round ratios."""
    spec = trainer.train_dataset.features  # type: ignore[union-attr]
    batches = [rows.slice(i, size) for i in range(0, rows.num_rows - size + 1, size)][:20]
    decoded = [spec.decode(b) for b in batches]
    chunks = [scorer._decode_spec.decode_chunk(scorer._table(b)) for b in batches]
    model = trainer.model
    model.eval()
    rates: dict[str, list[float]] = {k: [] for k in ("s", "e", "sm", "em", "r", "rm")}
    n = size * len(batches)
    with torch.no_grad():  # as predict runs it (FBGEMM's CPU lookup has no inference-mode kernel)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for b in batches:
                scorer.score(b)
            t1 = time.perf_counter()
            for b in batches:
                model(spec.decode(b))
            t2 = time.perf_counter()
            for c in chunks:
                with torch.inference_mode():
                    scorer._program(*scorer._inputs_of(c))
            t3 = time.perf_counter()
            for d in decoded:
                model(d)
            t4 = time.perf_counter()
            s, e, sm, em = n / (t1 - t0), n / (t2 - t1), n / (t3 - t2), n / (t4 - t3)
            for k, v in (("s", s), ("e", e), ("sm", sm), ("em", em), ("r", s / e), ("rm", sm / em)):
                rates[k].append(v)
    m = {k: median(v) for k, v in rates.items()}
    return [f"{m['s']:,.0f}", f"{m['e']:,.0f}", f"{m['r']:.2f}x", f"{m['sm']:,.0f}",
            f"{m['em']:,.0f}", f"{m['rm']:.2f}x"]


def quantized_auc(trainer: Trainer, root: str, kind: str, rows: pa.Table) -> list[list[Any]]:
    labels = torch.from_numpy(rows.column("label").to_numpy().astype(np.float32))
    out = []
    base_size = None
    for q in (None, "int8", "int4"):
        path = os.path.join(root, f"art_{kind}_{q or 'f32'}")
        export_for_serving(trainer, path, quantize=q)
        scores = torch.from_numpy(Scorer(path).score(rows))
        auc = weighted_auc(scores, labels, torch.ones(len(labels)))
        size = os.path.getsize(os.path.join(path, "tables.safetensors"))
        base_size = base_size or size
        out.append([kind, q or "float32", f"{auc:.5f}", f"{size / 1e6:.1f}", f"{size / base_size:.3f}"])
    base_auc = float(out[0][2])
    for r in out:
        r.insert(3, f"{float(r[2]) - base_auc:+.5f}")
    return out


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller data, fewer repetitions")
    p.add_argument("--aot-inductor", action="store_true", help="also build and time AOTInductor")
    p.add_argument("--reps", type=int, default=300, help="calls per latency size")
    p.add_argument("--rows", type=int, default=40_000, help="rows per window")
    a = p.parse_args()
    rows_per, reps, rounds = (8000, 60, 3) if a.quick else (a.rows, a.reps, 5)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    root = tempfile.mkdtemp(prefix="bench_serving_")
    load = os.getloadavg()
    print(f"# Serving benchmark\n\n{platform.node()}: {os.cpu_count()} cores, torch "
          f"{torch.__version__}, 1 intra-op thread, load average {load[0]:.1f} at start; "
          f"{rows_per} rows per window.\n")

    windows = write_windows(os.path.join(root, "dlrm"), rows_per, 3, din=False)
    trainer = train("dlrm", root, windows)
    art = os.path.join(root, "art")
    t0 = time.perf_counter()
    export_for_serving(trainer, art, aot_inductor=a.aot_inductor)
    export_s = time.perf_counter() - t0
    scorer = Scorer(art)
    rows = pq.read_table(windows[-1]).drop_columns(["row_id"])  # eager decoding needs the label
    print(f"DLRM example exported in {export_s:.1f} s"
          + (" (with the AOTInductor build)" if a.aot_inductor else "") + ".\n")
    print("## Latency of `Scorer.score` (raw rows in, probabilities out)\n")
    print(table(["rows", "p50 ms", "p99 ms", "rows/s at p50", "decode / lookup / dense ms (medians)"],
                latency(scorer, rows, (1, 16, 512), reps)))
    print("\n## Throughput at 512 rows, same process, same rows\n")
    print(table(["scorer (raw rows) rows/s", "eager decode + forward rows/s", "ratio",
                 "scorer lookup + dense rows/s", "eager forward rows/s", "ratio"],
                [throughput(scorer, trainer, rows, 512, rounds)]))
    if a.aot_inductor:
        aoti = scorer.manifest["program"]["aot_inductor"]
        print(f"\n## AOTInductor\n\nbuilt: {aoti['file'] is not None}; error: {aoti['error']}\n")
        if aoti["file"]:
            fast = Scorer(art, aot_inductor=True)
            print(table(["rows", "p50 ms", "p99 ms", "rows/s at p50", "decode / lookup / dense ms"],
                        latency(fast, rows, (1, 16, 512), reps)))
    eval_rows = pq.read_table(windows[-1])
    print("\n## Quantized tables: AUC on the next window, tables' size\n")
    results = quantized_auc(trainer, root, "dlrm", eval_rows)
    din_windows = write_windows(os.path.join(root, "din"), rows_per, 3, din=True)
    din = train("din", root, din_windows)
    results += quantized_auc(din, root, "din", pq.read_table(din_windows[-1]))
    print(table(["model", "tables", "AUC", "AUC change", "tables MB", "size ratio"], results))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} (other jobs share this host).")


if __name__ == "__main__":
    main()
