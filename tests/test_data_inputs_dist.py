"""Sequence, weighted multi-hot and transformed features with the Trainer on 2 real gloo ranks:
exactly-once resume, TrainPipelineSparseDist against the plain loop, and bad inputs named on
every rank."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from data_utils import train_interrupted_then_resumed
from dist_utils import run_distributed
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_trainer import LambdaHook, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.models import weighted_bce_with_logits

pytestmark = pytest.mark.distributed

MAX_LEN = 50
ITEMS = 40
DIM = 8


def _hist(r: int) -> list[int]:
    """Row r's behaviour sequence, oldest first: up to 69 ids, so some rows are cut to 50."""
    return [(r * 7 + k) % ITEMS for k in range(r % 70)]


def _tags(r: int) -> list[int]:
    return [(r + k) % 30 for k in range(r % 4)]


def write_seq_windows(root: str, rows_per_file: list[list[int]], row_group_size: int = 8,
                      bad_weights_row: int | None = None, null_user_file: int | None = None) -> int:
    """Windows ``hour=w`` of files with a row id, a behaviour sequence, weighted multi-hot tags
    and a numeric column to bucketize; returns the total rows. Row ``bad_weights_row`` gets one
    weight more than it has tags; file ``part-{null_user_file}`` a ``user`` column of nulls."""
    rid = 0
    for w, files in enumerate(rows_per_file):
        d = os.path.join(root, f"hour={w:02d}")
        os.makedirs(d, exist_ok=True)
        for f, n in enumerate(files):
            ids = list(range(rid, rid + n))
            rid += n
            t = pa.table({
                "row_id": pa.array(ids, pa.int64()),
                "y": pa.array([float(r % 3 == 0) for r in ids], pa.float32()),
                "user": pa.array([None if f == null_user_file else r % 20 for r in ids], pa.int64()),
                "tags": pa.array([_tags(r) for r in ids], pa.list_(pa.int64())),
                "tag_w": pa.array([[0.5 + k for k in range(len(_tags(r)) + (r == bad_weights_row))]
                                   for r in ids], pa.list_(pa.float32())),
                "age": pa.array([None if r % 11 == 0 else float(r % 80) for r in ids], pa.float64()),
                "item": pa.array([r % ITEMS for r in ids], pa.int64()),
                "hist": pa.array([_hist(r) for r in ids], pa.list_(pa.int64())),
            })
            pq.write_table(t, os.path.join(d, f"part-{f}.parquet"), row_group_size=row_group_size)
    return rid


def seq_spec(labels: tuple[str, ...] = ("y",)) -> FeatureSpec:
    return FeatureSpec(
        labels=list(labels),
        dense=["row_id", DenseFeature(column="row_id", log1p=True, standardize=(4.0, 1.0))],
        sparse=[SparseFeature(name="user", num_embeddings=20),
                SparseFeature(name="tags", num_embeddings=30, weight_column="tag_w"),
                SparseFeature(name="age_b", column="age", num_embeddings=5,
                              boundaries=[18, 30, 45, 60], null_id=0)],
        sequence=[SequenceFeature(name="item", num_embeddings=ITEMS),
                  SequenceFeature(name="hist_item", column="hist", num_embeddings=ITEMS, max_len=MAX_LEN)],
    )


class SeqModel(nn.Module):
    """A weighted EBC over ``batch.sparse`` and an EmbeddingCollection over ``batch.sequence``
    whose one table serves both the candidate item and the history (shared table)."""

    def __init__(self, spec: FeatureSpec) -> None:
        super().__init__()
        torch.manual_seed(0)
        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{s.name}", embedding_dim=DIM, num_embeddings=s.num_embeddings,
                               feature_names=[s.name]) for s in spec.sparse], is_weighted=True, device=meta)
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name="t_item", embedding_dim=DIM, num_embeddings=ITEMS, feature_names=["item", "hist_item"])],
            device=meta)
        self.top = nn.Sequential(nn.Linear(spec.num_dense + DIM * (len(spec.sparse) + 2), 16), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse).values()
        seq = self.ec(batch.sequence)
        item = seq["item"].values()
        hist = seq["hist_item"].to_padded_dense(desired_length=MAX_LEN)  # [B, L, D], zero-padded
        interest = (hist * item.unsqueeze(1)).sum(1)
        x = torch.cat([batch.dense * 0.01, pooled, item, interest], dim=1)
        logits = self.top(x).squeeze(-1)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()


def _trainer(spec: FeatureSpec, train: Any, eval_: Any = None, hooks: Any = (), **args: Any) -> Trainer:
    return Trainer(SeqModel(spec), TrainingArguments(output_dir="/tmp/recsys_inputs_test", log_steps=1000, **args),
                   train_dataset=train, eval_dataset=eval_, hooks=list(hooks),
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1), add_logger_hook=False)


def _rows_of(b: Batch) -> list[dict[str, Any]]:
    """Per row: its id and what the reader decoded for it (sequence and multi-hot)."""
    assert b.sequence is not None and b.sequence.keys() == ["item", "hist_item"]
    assert b.sequence.stride() == b.sparse.stride() == b.batch_size
    hist = b.sequence["hist_item"].to_dense()
    tags = b.sparse["tags"]
    return [{"row": int(r), "hist": h.tolist(), "tags": t.tolist(), "w": w.tolist()}
            for r, h, t, w in zip(b.dense[:, 0].tolist(), hist, tags.to_dense(),
                                  tags.to_dense_weights() or [], strict=True)]


# ---------------------------------------------------------------------- exactly once


def _resume_worker(root: str, stop_after: int) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []
    interrupted: list[int] = []  # rows seen when each train() ended
    second, _ = train_interrupted_then_resumed(
        lambda: ParquetWindowDataset(root, seq_spec(), batch_size=4, shuffle=True, seed=11),
        lambda ds, **kw: _trainer(seq_spec(), ds, **kw), stop_after,
        LambdaHook(after_data=lambda t, b: seen.extend(_rows_of(b)),
                   after_train=lambda t: interrupted.append(len(seen))))
    return {"seen": seen, "interrupted_at": interrupted[0], "unread": second.state.rows_unread}


def test_resumed_training_with_sequence_and_weighted_multi_hot_features_reads_every_row_once(tmp_path) -> None:
    total = write_seq_windows(str(tmp_path), [[16, 16], [24], [16]], row_group_size=5)
    r0, r1 = run_distributed(_resume_worker, 2, timeout_s=240, args=(str(tmp_path), 6))
    assert r0["interrupted_at"] == r1["interrupted_at"] == 6 * 4
    assert r0["unread"] == r1["unread"] == 0
    everything = r0["seen"] + r1["seen"]
    assert sorted(x["row"] for x in everything) == list(range(total))
    # Each row's sequence and bag arrived whole and in order on whichever rank read it.
    for x in everything:
        r = x["row"]
        assert x["hist"] == _hist(r)[-MAX_LEN:]
        assert x["tags"] == _tags(r) and x["w"] == [0.5 + k for k in range(len(_tags(r)))]
    assert any(len(_hist(x["row"])) > MAX_LEN for x in everything)  # truncation was exercised


# ---------------------------------------------------------------------- pipeline vs plain loop


def _pipeline_vs_plain(root: str, pipeline: str) -> dict[str, Any]:
    train = ParquetWindowDataset(os.path.join(root, "train"), seq_spec(), batch_size=8, sharding="row_groups")
    evals = ParquetWindowDataset(os.path.join(root, "eval"), seq_spec(), batch_size=8, sharding="row_groups")
    losses: list[float] = []
    trainer = _trainer(seq_spec(), train, evals, pipeline=pipeline,
                       hooks=[LambdaHook(after_step=lambda t, out: losses.append(float(out.loss)))])
    trainer.train()
    metrics = trainer.evaluate()
    dense = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
             if not hasattr(p, "_in_backward_optimizers")}
    tables = {n: [s.tensor.clone() for s in t.local_shards()]
              for n, t in trainer.model.state_dict().items() if hasattr(t, "local_shards")}
    return {"dense": dense, "tables": tables, "steps": trainer.state.global_step, "losses": losses,
            "metrics": metrics}


def test_sparse_dist_pipeline_trains_sequence_and_weighted_features_like_the_plain_loop(tmp_path) -> None:
    root = str(tmp_path)
    # Uneven: rank 0 reads 5 batches of train, rank 1 3; in eval rank 1 has no rows at all, so
    # it is fed padding batches (with sequence keys) while rank 0 evaluates.
    write_seq_windows(os.path.join(root, "train"), [[40, 24]], row_group_size=100)
    write_seq_windows(os.path.join(root, "eval"), [[16]], row_group_size=100)
    plain = run_distributed(_pipeline_vs_plain, 2, timeout_s=240, args=(root, "none"))
    piped = run_distributed(_pipeline_vs_plain, 2, timeout_s=240, args=(root, "sparse_dist"))
    for a, b in zip(plain, piped, strict=True):
        assert a["steps"] == b["steps"] == 3
        np.testing.assert_allclose(a["losses"], b["losses"], rtol=0, atol=1e-6)
        assert set(a["tables"]) == set(b["tables"])
        assert any("ec." in n for n in a["tables"]) and any("ebc." in n for n in a["tables"])
        for name in a["dense"]:
            torch.testing.assert_close(a["dense"][name], b["dense"][name], rtol=0, atol=1e-6)
        for name in a["tables"]:
            for x, y in zip(a["tables"][name], b["tables"][name], strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
        assert a["metrics"]["num_samples"] == b["metrics"]["num_samples"] == 16
    # The tables did train (the comparison is not between two untouched models).
    assert plain[0]["losses"][0] != plain[0]["losses"][-1]


# ---------------------------------------------------------------------- bad inputs on every rank


def _bad_input_worker(root: str, case: str) -> dict[str, Any]:
    spec = seq_spec(("y", "like")) if case == "missing_label" else seq_spec()
    if case == "not_a_list":
        spec = FeatureSpec(labels=["y"], sparse=list(spec.sparse), sequence=[
            SequenceFeature(name="hist_item", column="item", num_embeddings=ITEMS, max_len=MAX_LEN)])
    ds = ParquetWindowDataset(root, spec, batch_size=4)
    trainer = Trainer(SeqModel(seq_spec()) if case != "not_a_list" else _NotAListModel(spec),
                      TrainingArguments(output_dir="/tmp/recsys_inputs_test", log_steps=1000),
                      train_dataset=ds, dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                      sparse_optimizer=SparseOptimizer("sgd", lr=0.1), add_logger_hook=False)
    t0 = time.monotonic()
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0,
                "step": trainer.state.global_step}
    return {"error": None, "message": "", "seconds": 0.0, "step": trainer.state.global_step}


class _NotAListModel(nn.Module):
    def __init__(self, spec: FeatureSpec) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name="t_hist", embedding_dim=DIM, num_embeddings=ITEMS, feature_names=["hist_item"])],
            device=torch.device("meta"))
        self.top = nn.Linear(DIM, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.ec(batch.sequence)["hist_item"].to_padded_dense(desired_length=MAX_LEN).sum(1)
        logits = self.top(x).squeeze(-1)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()


@pytest.mark.parametrize(("case", "message"), [
    ("missing_label", "column 'like': the declared label column is missing"),
    ("not_a_list", "column 'item': sequence feature 'hist_item' has max_len=50, so its column must be a list"),
    ("bad_weights", "row group 0, row 3, column 'tag_w': has 4 weights but column 'tags' has 3 ids in this row"),
    ("null_user", "column 'user': the id column has no value in any of the file's 16 rows"),
])
def test_bad_inputs_are_named_on_every_rank_without_a_hang(tmp_path, case: str, message: str) -> None:
    # Rank 0 reads part-0 (rows 0-15), rank 1 part-1: a bad row 3 fails rank 0's read only.
    write_seq_windows(str(tmp_path), [[16, 16]], row_group_size=8,
                      bad_weights_row=3 if case == "bad_weights" else None,
                      null_user_file=0 if case == "null_user" else None)
    r0, r1 = run_distributed(_bad_input_worker, 2, timeout_s=120, args=(str(tmp_path), case))
    for r in (r0, r1):
        assert r["error"] == "DataError" and message in r["message"], r
        assert "part-0.parquet" in r["message"]
        assert r["step"] == 0 and r["seconds"] < 30
