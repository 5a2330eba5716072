"""DIN-style target attention over a planted behaviour sequence, against a DLRM without it.

    python examples/train_din.py                                        (one process)
    torchrun --standalone --nproc_per_node=2 examples/train_din.py

If ``--data`` holds no dataset yet, rank 0 writes one (``python -m
recsys_trainer.data.generators.criteo_synthetic --behaviour``): the Criteo-schema log plus a
candidate ``item`` and the user's ``hist_item`` list, where the click depends on whether the
candidate repeats a history item and on the share of the history in its category. Both models
train on hour t and evaluate on hour t+1 through TorchRec's ``TrainPipelineSparseDist``:

- ``din``: ``models.DINClassifier``, the 26 categoricals pooled, the candidate and the
  history (last ``--max-len`` items) looked up in one shared item table, attention-pooled;
- ``dlrm``: ``models.DLRMClassifier`` with the same categoricals and the candidate ``item`` as
  a pooled feature, but no history: the planted attention term is out of its reach.

At the end it prints each model's eval AUC per window, the margin and the oracle AUC.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from recsys_trainer import (
    SparseOptimizer,
    Trainer,
    TrainingArguments,
    seed_everything,
    setup_logging,
    shutdown,
)
from recsys_trainer.data.generators.criteo_synthetic import (
    SPARSE_COLUMNS,
    BehaviourSignal,
    behaviour_features,
    ensure_dataset,
)
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.distributed import init_distributed
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.models import DINClassifier, DLRMClassifier


def common_arguments(description: str, output_dir: str) -> argparse.ArgumentParser:
    """The flags both behaviour examples share (data, sizes, pipeline)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/criteo_behaviour",
                   help="dataset directory (written with --behaviour if missing)")
    p.add_argument("--hours", type=int, default=6, help="hourly windows to generate")
    p.add_argument("--rows-per-hour", type=int, default=30_000)
    p.add_argument("--max-len", type=int, default=50, help="longest history written and read")
    p.add_argument("--batch-size", type=int, default=512, help="rows per rank per step")
    p.add_argument("--num-embeddings", type=int, default=20_000, help="rows per categorical table")
    p.add_argument("--log-steps", type=int, default=100)
    p.add_argument("--pipeline", choices=["none", "sparse_dist"], default="sparse_dist")
    p.add_argument("--output-dir", default=output_dir)
    return p


def prepare(a: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """Join the job, have rank 0 write the dataset if missing; its metadata and windows."""
    init_distributed()
    meta = ensure_dataset(a.data, a.hours, a.rows_per_hour,
                          behaviour=BehaviourSignal.make(max_len=a.max_len))
    return meta, partitioned_windows(a.data)


def fit(name: str, model: nn.Module, spec: FeatureSpec, windows: list[Any],
        a: argparse.Namespace) -> tuple[Trainer, list[dict[str, float]]]:
    """Train on window t, evaluate on window t+1; the eval metrics of every window."""
    metrics = MetricReportHook(metrics=["auc", "logloss"], per_window=False)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=f"{a.output_dir}/{name}", log_steps=a.log_steps,
                               pipeline=a.pipeline),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=a.batch_size),
        eval_dataset=ParquetWindowDataset(windows[1:], spec, batch_size=4 * a.batch_size),
        dense_optimizers=(lambda params: torch.optim.Adam(params, lr=2e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        hooks=[metrics],
    )
    trainer.train_and_evaluate()
    return trainer, [r.values for r in metrics.reports if r.scope == "eval"]


def report(what: str, aucs: dict[str, list[float]], oracle: float, trainer: Trainer) -> None:
    """Print each model's eval AUC per window, the last window's margin (first model minus
    second) and the oracle, on rank 0."""
    if not trainer.is_rank_zero:
        return
    for name, values in aucs.items():
        print(f"{name:5s} eval {what} per window: " + " ".join(f"{v:.3f}" for v in values))
    final = {name: values[-1] for name, values in aucs.items() if values}
    line = ", ".join(f"{n} {v:.4f}" for n, v in final.items())
    if len(final) == 2:
        first, second = final.values()
        line += f", margin {first - second:+.4f}"
    print(f"final eval {what}: {line} (oracle {oracle:.4f}) after {trainer.state.global_step} "
          f"steps per model on {trainer.world_size} rank(s)")


def main() -> None:
    p = common_arguments(__doc__, "output/train_din")
    p.add_argument("--models", nargs="+", choices=["din", "dlrm"], default=["din", "dlrm"])
    a = p.parse_args()
    setup_logging()
    meta, windows = prepare(a)
    num_items = meta["num_items"]
    results: dict[str, list[dict[str, float]]] = {}
    trainer = None
    for name in a.models:
        # The dense towers are initialised here, before the Trainer exists (which seeds with
        # args.seed, 0 in fit()): seed first, so every run starts from the same model.
        seed_everything(0)
        model: nn.Module
        if name == "din":
            model = DINClassifier(SPARSE_COLUMNS, 13, num_items=num_items, max_len=a.max_len,
                                  num_embeddings=a.num_embeddings, embedding_dim=16,
                                  dense_arch=(64, 16), over_arch=(64, 32, 1), dense_log1p=True)
        else:
            model = DLRMClassifier([*SPARSE_COLUMNS, "item"], 13, a.num_embeddings, 16,
                                   dense_arch=(64, 16), over_arch=(64, 32, 1), dense_log1p=True)
        spec = behaviour_features(a.num_embeddings, num_items=num_items, max_len=a.max_len,
                                  sequence=name == "din")
        trainer, results[name] = fit(name, model, spec, windows, a)
    if trainer is not None:
        report("AUC", {n: [e["auc"] for e in evals] for n, evals in results.items()},
               meta["oracle_auc"], trainer)
    shutdown()


if __name__ == "__main__":
    main()
