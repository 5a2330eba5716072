"""HSTU for sequential retrieval: the next item from a user's history and the event times.

    python examples/train_hstu.py                                         (one process, ~20 s)
    torchrun --standalone --nproc_per_node=2 examples/train_hstu.py      (scripts/train-example)
    python examples/train_hstu.py --models hstu sasrec --epochs 3        (against SASRec)

If ``--data`` holds no dataset yet, rank 0 writes one first (``recsys_trainer.data.generators.
sequences_synthetic``: histories of 0..50 items with a power-law length and their times, the
next item and its time; the next item follows the last one within a session and switches topic
after a break, so it needs the order *and* the times; ``_signal.json`` holds the oracle's
HitRate@K with and without the times). ``HSTURetrievalModel`` reads the history (one item table
for the history and the corpus) and its times (``hist_ts``, and ``ts``: the time of the event
to predict, the request's when serving), as jagged rows bucketed by length; trained with
in-batch plus uniform negatives and the logQ correction over the windows but the last, then
evaluated on the last window against the whole corpus. ``--serve DIR`` also exports it for
serving and scores the evaluation window's first rows with the ``Scorer`` (no trainer, no
torchrec), printing how far the served query vectors are from the trained model's.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments, setup_logging, shutdown
from recsys_trainer.data.generators.sequences_synthetic import ensure_dataset, sequence_features
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.distributed import init_distributed
from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
from recsys_trainer.models import HSTURetrievalModel, SASRecModel

log = logging.getLogger("recsys_trainer")
KS = (1, 10, 50)


def build(name: str, meta: dict[str, Any], a: argparse.Namespace) -> tuple[nn.Module, Any]:
    """A model and the FeatureSpec it reads: the same width, depth and negatives for both."""
    torch.manual_seed(a.seed)  # the dense layers are initialised here, before the Trainer exists
    common: dict[str, Any] = dict(num_items=meta["num_items"], max_len=meta["max_len"],
                                  embedding_dim=a.dim, temperature=0.05,
                                  num_uniform_negatives=a.negatives)
    if name == "sasrec":
        return (SASRecModel(num_layers=a.layers, num_heads=a.heads, dropout=0.1, **common),
                sequence_features(meta, times=False))
    return (HSTURetrievalModel(time_feature="hist_ts", query_time_feature="ts", num_layers=a.layers,
                               num_heads=a.heads, dropout=0.1, **common),
            sequence_features(meta, times=True))


def serve_check(trainer: Trainer, out: str) -> None:
    """Export for serving; on rank 0 score the first evaluation rows with the Scorer."""
    from recsys_trainer.serving import Scorer, export_for_serving

    export_for_serving(trainer, out, activation="none")  # every rank: it saves the step first
    ds: Any = trainer.eval_dataset
    window = next(iter(ds.window_ids()))
    batch = next(iter(ds.iter_window(window)))
    trainer.model.eval()
    with torch.no_grad():  # every rank runs one forward: the sharded lookups are collectives
        _, outputs = trainer.model(batch.to(trainer.device))
    if not trainer.is_rank_zero:
        return
    rows = next(iter(ds.read_columns(window, ds.features.columns())))
    query = outputs["query"].float().cpu().numpy()
    served = Scorer(out).score(rows.slice(0, len(query)))
    print(f"served {len(query)} rows from {out}: max |served - trained| query = "
          f"{float(np.abs(served - query).max()):.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/sequences", help="dataset directory (written if missing)")
    p.add_argument("--hours", type=int, default=4, help="hourly windows to generate")
    p.add_argument("--rows-per-hour", type=int, default=20_000)
    p.add_argument("--models", nargs="+", choices=["hstu", "sasrec"], default=["hstu"])
    p.add_argument("--epochs", type=int, default=1, help="passes over the train windows")
    p.add_argument("--batch-size", type=int, default=256, help="rows per rank per step")
    p.add_argument("--dim", type=int, default=32, help="embedding (and layer) width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--negatives", type=int, default=128, help="uniform negatives per step")
    p.add_argument("--serve", default=None, metavar="DIR", help="export for serving to DIR and check it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="output/train_hstu")
    a = p.parse_args()
    setup_logging()
    init_distributed()  # join the job first: rank 0 may write the dataset while the others wait
    meta = ensure_dataset(a.data, a.hours, a.rows_per_hour)
    windows = partitioned_windows(a.data)
    results: dict[str, dict[str, float]] = {}
    trainer = None
    for name in a.models:
        model, spec = build(name, meta, a)
        hook = RetrievalMetricHook(k=KS)
        trainer = Trainer(
            model, TrainingArguments(output_dir=f"{a.output_dir}/{name}", log_steps=100,
                                     train_epoch=a.epochs, seed=a.seed),
            train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=a.batch_size,
                                               shuffle=True, seed=a.seed),
            eval_dataset=ParquetWindowDataset(windows[-1:], spec, batch_size=2048),
            dense_optimizers=(lambda params: torch.optim.Adam(params, lr=2e-3), None),
            sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05), hooks=[hook])
        t0 = time.perf_counter()
        trainer.train()
        results[name] = trainer.evaluate()
        if trainer.is_rank_zero:
            print(f"{name}: {trainer.state.global_step} steps in {time.perf_counter() - t0:.0f} s")
    assert trainer is not None
    if trainer.is_rank_zero:
        oracle, blind = meta["oracle"], meta["oracle_without_time"]
        print(f"oracle            recall@10 {oracle['recall@10']:.4f} ndcg@10 {oracle['ndcg@10']:.4f}")
        print(f"oracle w/o times  recall@10 {blind['recall@10']:.4f} ndcg@10 {blind['ndcg@10']:.4f} "
              "(the best a time-blind model can do)")
        for name, m in results.items():
            print(f"{name:17s} recall@10 {m['recall@10']:.4f} ndcg@10 {m['ndcg@10']:.4f} "
                  f"recall@1 {m['recall@1']:.4f} ({trainer.world_size} rank(s), {a.epochs} epoch(s))")
    if a.serve:
        serve_check(trainer, a.serve)
    shutdown()


if __name__ == "__main__":
    main()
