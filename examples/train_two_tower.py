"""Retrieval: a two-tower model (and a SASRec-style sequential one) on a planted interaction log,
evaluated over the full item corpus against the oracle, with an item export for faiss.

    python examples/train_two_tower.py                                   (one process)
    torchrun --standalone --nproc_per_node=2 examples/train_two_tower.py
    python examples/train_two_tower.py --models two_tower sasrec --epochs 5
    python examples/train_two_tower.py --export output/two_tower/items --faiss

If ``--data`` holds no dataset yet, rank 0 writes one (``python -m
recsys_trainer.data.generators.interactions_synthetic``): hourly windows of user-item
interactions with planted interests, popularity and a sequential signal, an item catalog, and
the oracle's Recall@K. Each model trains on every window but the last (``--epochs`` passes) and
is evaluated on the last one after every epoch: Recall/NDCG@K of each event's next item, every
eval user scored against all items (``RetrievalMetricHook``).

- ``two_tower``: ``retrieval.TwoTowerModel``: user id and segment, the mean of the history and
  its most recent item (user tower), item id and category (item tower), in-batch softmax with
  the logQ correction;
- ``sasrec``: ``retrieval.SASRecModel``: a causal transformer (one layer, dim 32) over the
  history, each item the sum of its id's and its category's embeddings (history and candidate);
  next-item loss at the last 10 positions of each row against the batch's items plus 128
  uniformly sampled ones (``--sasrec-*`` flags change it: ``--sasrec-user-features`` adds the
  user id and segment to every query, ``--no-sasrec-side-features`` drops the category,
  ``--sasrec-loss full`` makes every item a negative, ``--sasrec-eval-positions 1`` makes the
  evaluation loss score the ranked query only; docs/retrieval.md has the measurements).

``--sparse-lr-final F`` decays the tables' lr linearly to ``F`` times ``--sparse-lr`` by the last
step (``optimizers.SparseLRSchedule``), after ``--sparse-lr-warmup`` steps of warm-up.

``--export DIR`` writes the last model's item embeddings (``export_item_embeddings``);
``--faiss`` then builds an exact faiss index (``IndexFlatIP``) from the export, searches it with
the first eval batch's user embeddings and checks that its top K equals a brute-force numpy
top K (an exact index at this size: the check is of the export, ids and vectors).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn

from recsys_trainer import (
    LambdaHook,
    SparseOptimizer,
    Trainer,
    TrainingArguments,
    setup_logging,
    shutdown,
)
from recsys_trainer.data.generators.interactions_synthetic import (
    InteractionSignal,
    ensure_dataset,
    interaction_features,
)
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.distributed import init_distributed
from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
from recsys_trainer.models import SASRecModel, TwoTowerModel
from recsys_trainer.optimizers import SparseLRSchedule, linear_decay
from recsys_trainer.retrieval.export import export_item_embeddings, read_item_embeddings

KS = (10, 50, 100)


def build(name: str, meta: dict[str, Any], a: argparse.Namespace) -> tuple[nn.Module, Any]:
    """A model and the FeatureSpec it reads."""
    torch.manual_seed(a.seed)  # the dense towers are initialised here, before the Trainer exists
    if name == "two_tower":
        spec = interaction_features(meta)
        model: nn.Module = TwoTowerModel(
            ["user_id", "segment"], num_items=meta["num_items"],
            user_num_embeddings=[meta["num_users"], meta["num_segments"]],
            item_side_features={"item_cat": meta["num_clusters"]},
            item_catalog=f"{a.data}/_items.parquet", max_len=meta["max_len"], recent_items=1,
            embedding_dim=64, tower_dims=(128, 64), temperature=0.05,
            num_uniform_negatives=a.uniform_negatives, log_q_correction=not a.no_log_q,
            cross_rank_negatives=a.cross_rank)
    else:
        spec = interaction_features(meta, user_features=a.sasrec_user_features,
                                    item_side_features=a.sasrec_side_features,
                                    history_side_features=a.sasrec_side_features)
        user = ["user_id", "segment"] if a.sasrec_user_features else []
        side = {"item_cat": meta["num_clusters"]} if a.sasrec_side_features else {}
        model = SASRecModel(num_items=meta["num_items"], max_len=meta["max_len"],
                            user_features=user, user_num_embeddings=[meta["num_users"], meta["num_segments"]][:len(user)],
                            item_side_features=side, item_catalog=f"{a.data}/_items.parquet" if side else None,
                            embedding_dim=a.sasrec_dim, num_layers=a.sasrec_layers,
                            num_heads=a.sasrec_heads, dropout=a.sasrec_dropout, temperature=0.05,
                            train_positions=a.sasrec_positions or None,
                            eval_positions=a.sasrec_eval_positions or None, loss=a.sasrec_loss,
                            # The full softmax scores every item: it takes no sample (and refuses one).
                            num_uniform_negatives=0 if a.sasrec_loss == "full"
                            else max(a.uniform_negatives, a.sasrec_negatives),
                            log_q_correction=not a.no_log_q, cross_rank_negatives=a.cross_rank)
    return model, spec


def fit(name: str, a: argparse.Namespace, meta: dict[str, Any], windows: list[Any]
        ) -> tuple[Trainer, list[dict[str, float]]]:
    model, spec = build(name, meta, a)
    lr = a.sasrec_lr if name == "sasrec" and a.sasrec_lr is not None else a.lr
    sparse_lr = a.sasrec_sparse_lr if name == "sasrec" and a.sasrec_sparse_lr is not None else a.sparse_lr
    hook = RetrievalMetricHook(k=KS)
    hooks: list[Any] = [hook]
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=f"{a.output_dir}/{name}", log_steps=a.log_steps,
                               train_epoch=a.epochs, eval_every_n_epochs=1, seed=a.seed),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=a.batch_size,
                                           shuffle=a.shuffle, seed=a.seed),
        eval_dataset=ParquetWindowDataset(windows[-1:], spec, batch_size=2048),
        dense_optimizers=(lambda params: torch.optim.Adam(params, lr=lr), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=sparse_lr),
        hooks=hooks,
    )
    if a.sparse_lr_final != 1.0 or a.sparse_lr_warmup:
        # Steps of the whole run, from the log's size: the decay ends with the last epoch.
        total = a.epochs * a.rows_per_hour * (len(windows) - 1) // (a.batch_size * trainer.world_size)
        schedule = SparseLRSchedule(trainer.optimizer, linear_decay(
            total, a.sparse_lr_final, a.sparse_lr_warmup))
        trainer.add_hook(LambdaHook(before_step=lambda tr: schedule.apply(tr.state.global_step)))
    trainer.train_and_evaluate()
    return trainer, [r.values for r in hook.reports]


def faiss_check(trainer: Trainer, export_dir: str, k: int) -> None:
    """Search an exact faiss index built from the export with the first eval batch's user
    embeddings; its top ``k`` must equal the brute-force top ``k``."""
    assert trainer.eval_dataset is not None
    window = next(iter(trainer.eval_dataset.window_ids()))
    batch = next(iter(trainer.eval_dataset.iter_window(window))).to(trainer.device)
    trainer.model.eval()
    with torch.no_grad():  # every rank runs one forward: the sharded lookups are collectives
        _, outputs = trainer.model(batch)
    queries = trainer.gang.all_gather_object(outputs["query"].cpu().numpy())
    if not trainer.is_rank_zero:
        return
    import faiss  # a dev requirement (requirements/dev.txt), not one of recsys_trainer's

    q = np.concatenate(queries).astype(np.float32)
    ids, emb = read_item_embeddings(export_dir)
    index = faiss.IndexIDMap(faiss.IndexFlatIP(emb.shape[1]))
    index.add_with_ids(emb, ids)
    _, ann = index.search(q, k)
    brute = ids[np.argsort(-(q @ emb.T), axis=1, kind="stable")[:, :k]]
    same = np.array([set(x) == set(y) for x, y in zip(ann, brute, strict=True)])
    print(f"faiss IndexFlatIP over {len(ids)} exported items, {len(q)} queries: top-{k} equals the "
          f"brute-force top-{k} for {same.sum()}/{len(q)} queries")
    if not same.all():
        raise SystemExit("faiss top-K differs from the brute-force top-K")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/interactions", help="dataset (written if missing)")
    p.add_argument("--hours", type=int, default=8, help="hourly windows to generate")
    p.add_argument("--rows-per-hour", type=int, default=40_000)
    p.add_argument("--models", nargs="+", choices=["two_tower", "sasrec"], default=["two_tower"])
    p.add_argument("--epochs", type=int, default=1, help="passes over the train windows")
    p.add_argument("--batch-size", type=int, default=512, help="rows per rank per step")
    p.add_argument("--lr", type=float, default=2e-3, help="dense Adam lr")
    p.add_argument("--sparse-lr", type=float, default=0.05, help="row-wise Adagrad lr of the tables")
    p.add_argument("--sparse-lr-final", type=float, default=1.0,
                   help="decay the tables' lr linearly to this fraction of it by the last step "
                        "(SparseLRSchedule; 1: constant)")
    p.add_argument("--sparse-lr-warmup", type=int, default=0, help="steps of linear warm-up of the tables' lr")
    p.add_argument("--shuffle", action="store_true", help="shuffle the rows within each window")
    p.add_argument("--uniform-negatives", type=int, default=0, help="uniform negatives per step (mixed)")
    p.add_argument("--cross-rank", action="store_true", help="in-batch negatives from every rank")
    p.add_argument("--no-log-q", action="store_true", help="turn the logQ correction off")
    p.add_argument("--export", default=None, help="write the last model's item embeddings here")
    p.add_argument("--faiss", action="store_true", help="check a faiss index of the export (needs --export)")
    s = p.add_argument_group("sasrec", "SASRecModel's settings (the two-tower's are fixed in build())")
    s.add_argument("--sasrec-dim", type=int, default=32, help="embedding (and transformer) dim")
    s.add_argument("--sasrec-layers", type=int, default=1)
    s.add_argument("--sasrec-heads", type=int, default=2)
    s.add_argument("--sasrec-dropout", type=float, default=0.1)
    s.add_argument("--sasrec-positions", type=int, default=10,
                   help="train on the last N positions of each row (0: every position)")
    s.add_argument("--sasrec-negatives", type=int, default=128, help="uniform negatives per step (none with --sasrec-loss full)")
    s.add_argument("--sasrec-loss", choices=["in_batch", "sampled", "full"], default="in_batch",
                   help="full: every item a negative (a softmax over the whole corpus)")
    s.add_argument("--sasrec-eval-positions", type=int, default=0,
                   help="the evaluation loss scores the last N positions (0: as in training)")
    s.add_argument("--sasrec-user-features", action=argparse.BooleanOptionalAction, default=False,
                   help="user id and segment, projected into every query (measured: a head start, "
                        "then it overfits)")
    s.add_argument("--sasrec-side-features", action=argparse.BooleanOptionalAction, default=True,
                   help="the item category added to every history item's and candidate's vector "
                        "(--no-sasrec-side-features: the item ids only)")
    s.add_argument("--sasrec-lr", type=float, default=None, help="dense Adam lr (default: --lr)")
    s.add_argument("--sasrec-sparse-lr", type=float, default=None, help="table lr (default: --sparse-lr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-steps", type=int, default=200)
    p.add_argument("--output-dir", default="output/train_two_tower")
    a = p.parse_args()
    if a.faiss and not a.export:
        p.error("--faiss checks the export: give --export DIR too")
    setup_logging()
    init_distributed()
    meta = ensure_dataset(a.data, a.hours, a.rows_per_hour, signal=InteractionSignal.make())
    windows = partitioned_windows(a.data)
    if "sasrec" in a.models and a.sasrec_side_features and \
            "hist_item_cat" not in pq.read_schema(windows[0].files[0]).names:
        p.error(f"{a.data} was written before the log carried hist_item_cat (the history's "
                "categories, SASRec's side feature): delete it to write it anew, or give "
                "--no-sasrec-side-features")
    oracle = meta["per_window"][windows[-1].id]["oracle"] if windows[-1].id in meta["per_window"] \
        else meta["oracle"]
    results: dict[str, list[dict[str, float]]] = {}
    trainer = None
    for name in a.models:
        t0 = time.perf_counter()
        trainer, results[name] = fit(name, a, meta, windows)
        if trainer.is_rank_zero:
            print(f"{name}: {trainer.state.global_step} steps in {time.perf_counter() - t0:.0f} s")
    assert trainer is not None
    if trainer.is_rank_zero:
        print("oracle " + " ".join(f"{name} {v:.4f}" for name, v in oracle.items()))
        for name, evals in results.items():
            per_epoch = " ".join(f"{e['recall@50']:.4f}" for e in evals)
            last = evals[-1]
            print(f"{name:9s} recall@50 per epoch: {per_epoch}")
            ratio = (f" = {last['recall@50'] / oracle['recall@50']:.3f}x the oracle's recall@50"
                     if "recall@50" in oracle else "")
            print(f"{name:9s} final recall@10 {last['recall@10']:.4f} recall@50 {last['recall@50']:.4f} "
                  f"ndcg@50 {last['ndcg@50']:.4f} recall@100 {last['recall@100']:.4f}{ratio} "
                  f"({trainer.world_size} rank(s), {len(evals)} epoch(s))")
    if a.export:
        export = export_item_embeddings(trainer.model, a.export, gang=trainer.gang,
                                        group=trainer.process_group)
        if trainer.is_rank_zero:
            print(f"exported {export.num_items} item embeddings of dim {export.dim} to {a.export}")
        if a.faiss:
            faiss_check(trainer, a.export, 50)
    shutdown()


if __name__ == "__main__":
    main()
