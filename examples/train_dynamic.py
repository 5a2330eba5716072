"""Dynamic tables end to end: raw 63-bit user and item ids on hourly parquet partitions, a
DLRM whose ``user`` and ``item`` tables are dynamic and whose ``device`` table is hashed, trained
on hour t and evaluated on hour t+1, then exported for serving.

    python examples/train_dynamic.py                                        (one process)
    torchrun --standalone --nproc_per_node=2 examples/train_dynamic.py

If ``--data`` holds no dataset yet, rank 0 writes one (``python -m
recsys_trainer.data.generators.churn_dataset``): users with power-law popularity and items that
appear and fade within about an hour, each id with a planted effect on the click, about 10x more
distinct ids per table than ``--slots``. After every train window the Trainer logs each dynamic
table's occupancy and the ids admitted, evicted and expired in the window
(``DynamicTableStatsHook``, added automatically). At the end it prints the eval AUC per window
against the oracle's, each dynamic table's memory, and writes the serving artifact (raw id ->
row, the fallback rows and their routing rule; ``recsys_trainer.serving``) under
``--output-dir``/serving. Run again, it resumes from the last checkpoint (a finished run has
nothing left to train).
"""

from __future__ import annotations

import argparse
import os

import torch

from recsys_trainer import (
    SparseOptimizer,
    Trainer,
    TrainingArguments,
    seed_everything,
    setup_logging,
    shutdown,
)
from recsys_trainer.data.generators.churn_dataset import (
    DEVICE_TABLE_ROWS,
    churn_features,
    ensure_churn_dataset,
)
from recsys_trainer.data.generators.id_stream import ChurnStream
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.distributed import init_distributed
from recsys_trainer.dynamic import ID_SPACE, DynamicTable, table_memory
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.serving import export_for_serving


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/churn", help="dataset directory (written if missing)")
    p.add_argument("--hours", type=int, default=8, help="hourly windows to generate")
    p.add_argument("--rows-per-hour", type=int, default=20_480)
    p.add_argument("--ids", type=int, default=20_000, help="users, and items, in the stream")
    p.add_argument("--slots", type=int, default=1600, help="rows of each dynamic table")
    p.add_argument("--batch-size", type=int, default=512, help="rows per rank per step")
    p.add_argument("--pipeline", choices=["none", "sparse_dist"], default="sparse_dist")
    p.add_argument("--output-dir", default="output/train_dynamic")
    a = p.parse_args()
    setup_logging()
    init_distributed()
    stream = ChurnStream(num_users=a.ids, num_items=a.ids, windows=a.hours)
    meta = ensure_churn_dataset(a.data, stream, a.rows_per_hour)
    windows = partitioned_windows(a.data)
    spec = churn_features(stream)

    seed_everything(0)
    # The id features dynamic (the measured defaults, one capacity each), the small categorical
    # hashed; num_embeddings sizes only the hashed table.
    table = DynamicTable(num_slots=a.slots)
    model = DLRMClassifier(["user", "item", "device"], num_dense=len(spec.dense),
                           num_embeddings=[ID_SPACE, ID_SPACE, DEVICE_TABLE_ROWS],
                           embedding_dim=16, dense_arch=(32,), over_arch=(32, 1),
                           dynamic={"user": table, "item": table})
    metrics = MetricReportHook(metrics=["auc", "logloss"], per_window=False)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=a.output_dir, log_steps=100, pipeline=a.pipeline),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=a.batch_size),
        eval_dataset=ParquetWindowDataset(windows[1:], spec, batch_size=4 * a.batch_size),
        dense_optimizers=(lambda params: torch.optim.Adam(params, lr=3e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        hooks=[metrics],
    )
    trainer.train_and_evaluate()
    aucs = [r.values["auc"] for r in metrics.reports if r.scope == "eval"]
    if not aucs:  # resumed from the checkpoint of a finished run (resume_from="auto")
        if trainer.is_rank_zero:
            print(f"{a.output_dir} holds a finished run (step {trainer.state.global_step}): "
                  "nothing left to train; delete it, or pass another --output-dir, to train again")
        shutdown()
        return
    memory = table_memory(trainer.model)  # this rank's shards
    art = os.path.join(a.output_dir, "serving", f"step_{trainer.state.global_step:08d}")
    summary = export_for_serving(trainer, art)  # every rank: a checkpoint, then rank 0 exports
    if trainer.is_rank_zero:
        oracle = list(meta["oracle_auc_per_window"].values())
        print("eval AUC per window (train t, eval t+1): " + " ".join(f"{v:.3f}" for v in aucs))
        print("oracle AUC per window:                   "
              + " ".join(f"{v:.3f}" for v in oracle[1:len(aucs) + 1]))
        print(f"final eval AUC {aucs[-1]:.4f} (the planted effects allow at most "
              f"{oracle[len(aucs)]:.4f} on that hour) after {trainer.state.global_step} steps on "
              f"{trainer.world_size} rank(s)")
        for name, m in sorted(memory.items()):
            print(f"{name}: {m['total']:,} bytes on rank 0 ({m['rows'] + m['optimizer']:,} rows "
                  f"and optimizer state, {m['id_map']:,} id map, {m['policy']:,} policy, "
                  f"{m['history']:,} history, {m['index'] + m['fixed']:,} index and fixed)")
        print(f"serving artifact: {art} ({summary.bytes:,} bytes)")
    shutdown()


if __name__ == "__main__":
    main()
