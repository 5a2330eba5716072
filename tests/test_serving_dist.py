"""A serving export of a model trained on 2 ranks (the export merges the shards): the Scorer
gives ``predict``'s scores (unknown ids of dynamic tables routed to the default row of the
shard that owns them; DCN-v2; HSTU ranking with its event times), deltas between its
checkpoints reproduce full exports, and HSTU retrieval trained on 2 ranks reports the same
full-corpus metrics on both and serves the queries its 2-rank evaluation ranked with."""

from __future__ import annotations

import os
from typing import Any

import pytest
import serving_utils as su
from dist_utils import run_distributed

pytestmark = pytest.mark.distributed
KINDS = ("dynamic", "mixed_fp16", "dlrm", "dcn", "hstu")  # mixed_fp16: hashed and dynamic tables, fp16 and fp32
DELTA_KINDS = ("dynamic", "mixed_fp16", "dlrm")  # deltas are the model's tables: these cover them


def _train_predict_export(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from recsys_trainer.serving import export_for_serving

    out: dict[str, Any] = {}
    for kind in KINDS:
        r = os.path.join(root, kind)
        windows = [os.path.join(r, "data", f"hour={h:02d}", "part-0.parquet") for h in range(2)]
        trainer = su.make_trainer(kind, r, windows, steps=6, save_steps=3)
        trainer.train()
        pred = su.predicted(trainer, windows[-1], os.path.join(r, "pred"))
        export_for_serving(trainer, os.path.join(r, "art"))  # every rank calls it
        if dist.get_rank() == 0:
            out[kind] = {"diff": su.max_diff(su.scored(os.path.join(r, "art"), windows[-1]), pred),
                         "step": trainer.state.global_step, "rows": len(pred)}
            if kind in DELTA_KINDS:
                su.check_delta(r, kind, windows[-1], 3, trainer.state.global_step)
        dist.barrier()
    out["hstu_retrieval"] = _hstu_retrieval(os.path.join(root, "hstu_retrieval"))
    return out


def _hstu_retrieval(root: str) -> dict[str, Any]:
    """HSTU retrieval on 2 ranks: its metrics on each rank, and (rank 0) the largest difference
    between the served query of each evaluation row and the query the 2-rank evaluation ranked
    the corpus with."""
    import dataclasses
    import json

    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.data.generators.sequences_synthetic import sequence_features
    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.data.windows import partitioned_windows
    from recsys_trainer.hooks import LambdaHook
    from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
    from recsys_trainer.models import HSTURetrievalModel
    from recsys_trainer.serving import Scorer, export_for_serving

    data = os.path.join(root, "data")
    with open(os.path.join(data, "_signal.json")) as f:
        meta = json.load(f)
    windows = partitioned_windows(data)
    spec = sequence_features(meta)
    torch.manual_seed(0)
    model = HSTURetrievalModel(num_items=meta["num_items"], max_len=meta["max_len"], embedding_dim=8,
                               num_heads=2, num_layers=1, num_uniform_negatives=16,
                               cross_rank_negatives=True)
    seen: dict[int, np.ndarray] = {}

    def keep(trainer: Any, output: Any) -> None:
        if not output.is_padding:
            for mb in output.micro_batches:
                ids = np.asarray(mb.batch.passthrough["row_id"]).tolist()
                seen.update(zip(ids, mb.outputs["query"].numpy(), strict=True))

    trainer = Trainer(
        model, TrainingArguments(output_dir=os.path.join(root, "ckpt"), train_steps=4, log_steps=10**6),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=64, shuffle=True, seed=1),
        eval_dataset=ParquetWindowDataset(windows[-1:], dataclasses.replace(spec, passthrough=["row_id"]),
                                          batch_size=128),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        hooks=[RetrievalMetricHook(k=[10], log=False), LambdaHook(after_eval_step=keep)],
        add_logger_hook=False)
    trainer.train()
    metrics = trainer.evaluate()
    art = os.path.join(root, "art")
    export_for_serving(trainer, art, activation="none")
    queries = trainer.gang.all_gather_object(seen)
    out: dict[str, Any] = {"metrics": metrics, "steps": trainer.state.global_step}
    if dist.get_rank() == 0:
        rows = pq.read_table(windows[-1].files[0])
        served = dict(zip(rows.column("row_id").to_pylist(), Scorer(art).score(rows), strict=True))
        both = {**queries[0], **queries[1]}
        out.update(rows=len(both), ranks=[len(q) for q in queries],
                   diff=max(float(np.abs(served[r] - q).max()) for r, q in both.items()))
    dist.barrier()
    return out


def test_an_export_of_two_ranks_scores_as_predict_and_its_deltas_reproduce_full_exports(tmp_path) -> None:
    from recsys_trainer.data.generators.sequences_synthetic import SequenceSignal, write_dataset

    for kind in KINDS:
        su.write_data(str(tmp_path / kind / "data"), kind, rows=400)
    write_dataset(tmp_path / "hstu_retrieval" / "data", hours=2, rows_per_hour=600, ks=(10,),
                  signal=SequenceSignal.make(num_items=200, num_clusters=8, max_len=12))
    r0, r1 = run_distributed(_train_predict_export, 2, 500, args=(str(tmp_path),))
    for kind in KINDS:
        assert r0[kind]["step"] == 6 and r0[kind]["rows"] == 403, (kind, r0[kind])
        assert r0[kind]["diff"] <= 1e-6, (kind, r0[kind])
    hr0, hr1 = r0["hstu_retrieval"], r1["hstu_retrieval"]
    # Both ranks report the same exact full-corpus metrics over every row of the window.
    assert hr0["steps"] == hr1["steps"] == 4 and hr0["metrics"] == hr1["metrics"]
    assert hr0["rows"] == 600 == hr0["metrics"]["num_samples"] and min(hr0["ranks"]) > 0
    assert hr0["diff"] <= 1e-6, hr0
