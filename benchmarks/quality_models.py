"""Model quality on planted signals, several seeds: the newer model against its baseline at the
same size, data and training budget.

    python benchmarks/quality_models.py hstu [--seeds 0 1 2]     # HSTU vs SASRec (~10 min idle)
    python benchmarks/quality_models.py dcn  [--seeds 0 1 2]     # DCN-v2 vs DLRM (~10 min idle)

**hstu**: the timed-sequence log (``data.generators.sequences_synthetic``: the next item needs
the last item *and* how long ago it was; 2,000 items, histories of 0..50 items with a
power-law length). ``HSTURetrievalModel`` (with the event times, and without them: the same
layers, only the time bias off) against ``SASRecModel``: embedding dim 32, 2 layers, 2 heads,
dropout 0.1, max_len 50, every position a training query, 128 uniform negatives with logQ, the
same optimizers, ``--epochs`` passes over the train windows (the same steps for all), evaluated
on the last window over the whole corpus (HitRate@K = Recall@K: one target per row). The
ceilings: the oracle that knows the process (``oracle``) and the one that knows it but not the
times (``oracle_without_time``: what a time-blind model can reach at best).

**dcn**: the Criteo-schema click log with planted crosses (``criteo_synthetic --crosses``: C1 x
C2, C3 x C4, C5 x C6 x C7, nearly pure interactions: docs/models.md). ``DCNClassifier`` (low-rank mixture and full
rank, stacked) against ``DLRMClassifier``: embedding dim 16, the same bottom MLP (64, 16) and a
deep/top MLP of (64, 32), ``--epochs`` passes over the train windows (default one: the
streaming protocol; a second pass over this log overfits the tables), AUC on the last window.
The ceilings: the AUC of the true probabilities (``oracle_auc``) and of the probabilities
without the crosses (``oracle_auc_without_crosses``: about what a model blind to crosses can
reach).

The data is generated once (``--data``, reused if present); a seed sets the model's
initialisation and the shuffling. Reported, for each study's **headline metric** (printed first
in every line and table: ``recall@10`` for hstu, ``auc`` for dcn; docs/benchmarks.md): every
seed's figure, the mean and the spread (min..max), and the ratio of the newer model's mean to
the baseline's; the other metrics' means and spreads beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows

HSTU_MODELS = ("hstu", "hstu_no_time", "sasrec")
DCN_MODELS = ("dcn_mixture", "dcn_full", "dlrm")


def _fit(model: torch.nn.Module, spec: Any, windows: list[Any], seed: int, epochs: int,
         batch_size: int, hooks: list[Any], lr: float, sparse_lr: float) -> tuple[dict[str, float], float, int]:
    trainer = Trainer(
        model, TrainingArguments(output_dir=tempfile.mkdtemp(prefix="quality_"), log_steps=10**6,
                                 seed=seed, train_epoch=epochs),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=batch_size, shuffle=True,
                                           seed=seed),
        eval_dataset=ParquetWindowDataset(windows[-1:], spec, batch_size=4096),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=lr), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=sparse_lr), hooks=hooks,
        add_logger_hook=False)
    t0 = time.perf_counter()
    trainer.train()
    metrics = trainer.evaluate()
    return metrics, time.perf_counter() - t0, trainer.state.global_step


def hstu(a: argparse.Namespace) -> tuple[list[str], dict[str, dict[int, dict[str, float]]], dict[str, Any]]:
    from recsys_trainer.data.generators.sequences_synthetic import ensure_dataset, sequence_features
    from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
    from recsys_trainer.models import HSTURetrievalModel, SASRecModel

    meta = ensure_dataset(a.data, a.hours, a.rows_per_hour)
    windows = partitioned_windows(a.data)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for seed in a.seeds:
        for name in a.models or HSTU_MODELS:
            torch.manual_seed(seed)
            common = dict(num_items=meta["num_items"], max_len=meta["max_len"], embedding_dim=32,
                          temperature=0.05, num_uniform_negatives=128)
            if name == "sasrec":
                spec = sequence_features(meta, times=False)
                model: torch.nn.Module = SASRecModel(num_layers=2, num_heads=2, dropout=0.1, **common)
            else:
                times = name == "hstu"
                spec = sequence_features(meta, times=times)
                model = HSTURetrievalModel(num_layers=2, num_heads=2, dropout=0.1,
                                           time_feature="hist_ts" if times else None,
                                           query_time_feature="ts" if times else None, **common)
            hook = RetrievalMetricHook(k=(1, 10, 50), log=False)
            m, seconds, steps = _fit(model, spec, windows, seed, a.epochs, 256, [hook], 2e-3, 0.05)
            results.setdefault(name, {})[seed] = {**{k: m[k] for k in ("recall@1", "recall@10", "ndcg@10", "recall@50")},
                                                  "seconds": seconds, "steps": steps}
            print(f"{name} seed {seed}: recall@10 {m['recall@10']:.4f} ndcg@10 {m['ndcg@10']:.4f} "
                  f"({steps} steps, {seconds:.0f} s)", flush=True)
    ceilings = {"oracle": meta["oracle"], "oracle_without_time": meta["oracle_without_time"],
                "mean_history": statistics.mean(w["mean_history"] for w in meta["per_window"].values())}
    return ["recall@10", "ndcg@10", "recall@1", "recall@50"], results, ceilings


def dcn(a: argparse.Namespace) -> tuple[list[str], dict[str, dict[int, dict[str, float]]], dict[str, Any]]:
    from recsys_trainer.data.generators.criteo_synthetic import (
        SPARSE_COLUMNS,
        CrossSignal,
        criteo_features,
        ensure_dataset,
    )
    from recsys_trainer.hooks.metrics import MetricReportHook
    from recsys_trainer.models import DCNClassifier, DLRMClassifier

    meta = ensure_dataset(a.data, a.hours, a.rows_per_hour, crosses=CrossSignal.make())
    windows = partitioned_windows(a.data)
    rows = 20_000
    spec = criteo_features(rows)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for seed in a.seeds:
        for name in a.models or DCN_MODELS:
            torch.manual_seed(seed)
            if name == "dlrm":
                model: torch.nn.Module = DLRMClassifier(
                    SPARSE_COLUMNS, 13, rows, 16, dense_arch=(64, 16), over_arch=(64, 32, 1),
                    dense_log1p=True)
            else:
                model = DCNClassifier(SPARSE_COLUMNS, 13, rows, 16, dense_arch=(64, 16),
                                      cross="mixture" if name == "dcn_mixture" else "full",
                                      num_cross_layers=3, low_rank=32, num_experts=4,
                                      deep_arch=(64, 32), dense_log1p=True)
            hook = MetricReportHook(metrics=["auc", "logloss"], per_window=False)
            m, seconds, steps = _fit(model, spec, windows, seed, a.epochs, 512, [hook], 1e-3, 0.05)
            results.setdefault(name, {})[seed] = {"auc": m["auc"], "logloss": m["logloss"],
                                                  "seconds": seconds, "steps": steps}
            print(f"{name} seed {seed}: auc {m['auc']:.4f} logloss {m['logloss']:.4f} "
                  f"({steps} steps, {seconds:.0f} s)", flush=True)
    ceilings = {"oracle_auc": meta["oracle_auc"],
                "oracle_auc_without_crosses": meta["oracle_auc_without_crosses"]}
    return ["auc", "logloss"], results, ceilings


def report(metrics: list[str], results: dict[str, dict[int, dict[str, float]]],
           ceilings: dict[str, Any], baseline: str) -> str:
    """The markdown table; ``metrics[0]`` is the headline (its column first, its per-seed
    figures and the ratios to ``baseline``)."""
    headline = metrics[0]
    lines = [f"headline: {headline}", "",
             "| model | " + " | ".join(f"{m} (mean, min..max)" for m in metrics)
             + f" | {headline} per seed | s / run |",
             "|---|" + "---|" * (len(metrics) + 2)]
    means: dict[str, dict[str, float]] = {}
    for name, per_seed in results.items():
        cells = []
        for m in metrics:
            vals = [r[m] for r in per_seed.values()]
            means.setdefault(name, {})[m] = statistics.mean(vals)
            cells.append(f"{statistics.mean(vals):.4f} ({min(vals):.4f}..{max(vals):.4f})")
        seeds = ", ".join(f"{s}: {r[headline]:.4f}" for s, r in per_seed.items())
        secs = statistics.mean(r["seconds"] for r in per_seed.values())
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {seeds} | {secs:.0f} |")
    out = "\n".join(lines) + "\n\nceilings: " + json.dumps(ceilings) + "\n"
    if baseline in means:
        for name in means:
            if name != baseline:
                out += (f"{name} / {baseline} ({headline}): "
                        f"{means[name][headline] / means[baseline][headline]:.3f}\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=["hstu", "dcn"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--models", nargs="+", default=None, help="a subset of the study's models")
    p.add_argument("--data", default=None, help="dataset directory (written if missing)")
    p.add_argument("--hours", type=int, default=None)
    p.add_argument("--rows-per-hour", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if a.study == "hstu":
        a.data = a.data or "data/quality_sequences"
        a.hours, a.rows_per_hour, a.epochs = a.hours or 4, a.rows_per_hour or 15_000, a.epochs or 3
        metrics, results, ceilings = hstu(a)
        print(report(metrics, results, ceilings, "sasrec"))
    else:
        a.data = a.data or "data/quality_crosses"
        a.hours, a.rows_per_hour, a.epochs = a.hours or 8, a.rows_per_hour or 25_000, a.epochs or 1
        metrics, results, ceilings = dcn(a)
        print(report(metrics, results, ceilings, "dlrm"))


if __name__ == "__main__":
    main()
