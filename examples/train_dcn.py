"""DCN-v2 on a click log with planted feature crosses, trained window by window.

    python examples/train_dcn.py                                          (one process, ~15 s)
    torchrun --standalone --nproc_per_node=2 examples/train_dcn.py       (scripts/train-example)
    python examples/train_dcn.py --models dcn dlrm                       (against the DLRM)

If ``--data`` holds no dataset yet, rank 0 writes one first (``recsys_trainer.data.generators.
criteo_synthetic --crosses``: the Criteo schema, 13 counts and 26 hashed-string categoricals,
whose click also holds three planted crosses, C1 x C2, C3 x C4 and C5 x C6 x C7, each nearly a
pure interaction (single columns carry 3.8% of their variance); ``_signal.json`` holds the best
AUC possible with and without them). ``DCNClassifier`` builds one vector of the bottom MLP's output and the 26 pooled
embeddings, crosses it explicitly with ``--cross-layers`` DCN-v2 layers (``--cross mixture``:
low-rank experts mixed by gates; ``full``: full-rank weights; torchrec's ``crossnet`` modules),
then the deep MLP; ``train_and_evaluate`` trains on hour t and evaluates on hour t+1. Row-wise
Adagrad updates the tables in backward, Adam the dense layers.
"""

from __future__ import annotations

import argparse
import time

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
    CrossSignal,
    criteo_features,
    ensure_dataset,
)
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.distributed import init_distributed
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.models import DCNClassifier, DLRMClassifier


def build(name: str, a: argparse.Namespace) -> nn.Module:
    """The DCN-v2, or the DLRM of the same width (bottom MLP, tables, top MLP as deep part)."""
    if name == "dlrm":
        return DLRMClassifier(SPARSE_COLUMNS, 13, a.num_embeddings, a.embedding_dim,
                              dense_arch=(64, a.embedding_dim), over_arch=(64, 32, 1),
                              dense_log1p=True)
    return DCNClassifier(SPARSE_COLUMNS, 13, a.num_embeddings, a.embedding_dim,
                         dense_arch=(64, a.embedding_dim), cross=a.cross,
                         num_cross_layers=a.cross_layers, low_rank=a.low_rank,
                         num_experts=a.experts, structure=a.structure, deep_arch=(64, 32),
                         dense_log1p=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/criteo_crosses", help="dataset directory (written if missing)")
    p.add_argument("--hours", type=int, default=4, help="hourly windows to generate")
    p.add_argument("--rows-per-hour", type=int, default=25_000)
    p.add_argument("--models", nargs="+", choices=["dcn", "dlrm"], default=["dcn"])
    p.add_argument("--cross", choices=["full", "low_rank", "mixture"], default="mixture")
    p.add_argument("--cross-layers", type=int, default=3)
    p.add_argument("--low-rank", type=int, default=32)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--structure", choices=["stacked", "parallel"], default="stacked")
    p.add_argument("--batch-size", type=int, default=512, help="rows per rank per step")
    p.add_argument("--num-embeddings", type=int, default=20_000, help="rows per table")
    p.add_argument("--embedding-dim", type=int, default=16)
    p.add_argument("--output-dir", default="output/train_dcn")
    a = p.parse_args()
    setup_logging()
    init_distributed()  # join the job first: rank 0 may write the dataset while the others wait
    meta = ensure_dataset(a.data, a.hours, a.rows_per_hour, crosses=CrossSignal.make())
    windows = partitioned_windows(a.data)
    spec = criteo_features(a.num_embeddings)
    finals: dict[str, float] = {}
    trainer = None
    for name in a.models:
        args = TrainingArguments(output_dir=f"{a.output_dir}/{name}", log_steps=100)
        seed_everything(args.seed)  # the dense layers are initialised here, before the Trainer
        metrics = MetricReportHook(metrics=["auc", "logloss"], per_window=False)
        trainer = Trainer(
            model=build(name, a), args=args,
            # The streaming protocol: train on window t, evaluate on window t+1.
            train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=a.batch_size),
            eval_dataset=ParquetWindowDataset(windows[1:], spec, batch_size=4 * a.batch_size),
            dense_optimizers=(lambda params: torch.optim.Adam(params, lr=1e-3), None),
            sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05), hooks=[metrics])
        t0 = time.perf_counter()
        trainer.train_and_evaluate()
        evals = [r for r in metrics.reports if r.scope == "eval"]
        finals[name] = evals[-1].values["auc"]
        if trainer.is_rank_zero:
            aucs = " ".join(f"{r.values['auc']:.4f}" for r in evals)
            print(f"{name}: eval AUC per window (train t, eval t+1): {aucs} "
                  f"({trainer.state.global_step} steps, {time.perf_counter() - t0:.0f} s)")
    assert trainer is not None
    if trainer.is_rank_zero:
        for name, auc in finals.items():
            print(f"{name:5s} final eval AUC {auc:.4f} ({trainer.world_size} rank(s))")
        print(f"best possible AUC {meta['oracle_auc']:.4f}; without the crosses "
              f"{meta['oracle_auc_without_crosses']:.4f} (the best a model blind to them can do)")
    shutdown()


if __name__ == "__main__":
    main()
