"""Retrieval on two real gloo ranks: the cross-rank in-batch softmax against the one-process
softmax over the same rows, the frequency sketch kept identical on both ranks, and the
full-corpus metrics of a sharded two-tower model (per row and per user, history excluded) and
of a SASRec with user and side features against a brute-force numpy ranking of the same
embeddings; and one checkpoint's queries (user features whose sharded output order is not the
declared one) equal on 2 ranks, in one process and from the serving export."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_utils import run_distributed, train_recording_failure
from test_retrieval import brute_force_metrics

from recsys_trainer import LambdaHook, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.generators.interactions_synthetic import (
    InteractionSignal,
    interaction_features,
    write_dataset,
)
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
from recsys_trainer.models import SASRecModel, TwoTowerModel
from recsys_trainer.retrieval.candidates import count_items, gather_candidates, start_candidates
from recsys_trainer.retrieval.frequency import ItemFrequencyEstimator
from recsys_trainer.retrieval.losses import in_batch_softmax_loss
from recsys_trainer.retrieval.protocol import find_retrieval_model
from recsys_trainer.serving import Scorer, export_for_serving

B, D = 6, 8


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two ranks' rows: queries, items, item ids (repeats across ranks), weights (padding)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 2, 8, 9, 1, 10])
    w = torch.tensor([1.0] * 9 + [0.0, 0.0, 2.0])  # rank 1 holds two padding rows
    return torch.randn(2 * B, D, generator=g), torch.randn(2 * B, D, generator=g), ids, w


def _user_tower() -> torch.Tensor:
    return torch.randn(D, D, generator=torch.Generator().manual_seed(7))


# Unequal ranks for the launched-early gather: rank 1 holds 4 rows (a window's short batch),
# and the ids lie beyond float32's (and float64's) exact integers, so the id columns carried in
# the embeddings' message must come back bit for bit.
UNEQUAL = (slice(0, B), slice(B, 2 * B - 2))
BIG = 2**60


def _worker(root: str, out: str) -> dict[str, Any]:
    import torch.distributed as dist

    from recsys_trainer.distributed import init_distributed

    init_distributed("cpu")
    rank = dist.get_rank()
    # 1. The cross-rank option on fixed rows (each rank holds half).
    q, items, ids, w = _rows()
    mine = slice(rank * B, (rank + 1) * B)
    q_r, items_r = q[mine].clone().requires_grad_(True), items[mine].clone().requires_grad_(True)
    cand, cand_ids, cand_valid, offset = gather_candidates(items_r, ids[mine], w[mine] > 0, True)
    loss = in_batch_softmax_loss(q_r, cand, cand_ids, w[mine], temperature=0.3, positive_offset=offset,
                                 item_weights=cand_valid.float())
    loss.backward()
    est = ItemFrequencyEstimator(16, half_life_steps=None)
    count_items(est, ids[mine], w[mine] > 0, gathered=False)
    part1 = {"loss": float(loss.detach()), "q_grad": q_r.grad, "items_grad": items_r.grad,
             "counts": est.counts.clone()}
    # 1b. The model's path: the gather launched before the user tower runs, waited for by the
    # loss (and its backward all-reduce in flight during the user tower's backward).
    rows = UNEQUAL[rank]
    q_u, items_u = q[rows].clone().requires_grad_(True), items[rows].clone().requires_grad_(True)
    pending = start_candidates(items_u, ids[rows] + BIG, w[rows] > 0, True)
    query = torch.tanh(q_u @ _user_tower())
    cand, cand_ids, cand_valid, offset = gather_candidates(items_u, ids[rows] + BIG, w[rows] > 0, True, pending)
    loss = in_batch_softmax_loss(query, cand, cand_ids, w[rows], temperature=0.3, positive_offset=offset,
                                 item_weights=cand_valid.float())
    loss.backward()
    part1["early"] = {"loss": float(loss.detach()), "q_grad": q_u.grad, "items_grad": items_u.grad,
                      "ids": cand_ids, "valid": cand_valid, "offset": offset}
    # 1c. Rank 1 with no rows at all: it still sends its (empty) part and takes every rank's.
    n = (3, 0)[rank]
    q_z, items_z = q[:n].clone().requires_grad_(True), items[:n].clone().requires_grad_(True)
    pending = start_candidates(items_z, ids[:n] + BIG, w[:n] > 0, True)
    cand, cand_ids, cand_valid, offset = gather_candidates(items_z, ids[:n] + BIG, w[:n] > 0, True, pending)
    loss = in_batch_softmax_loss(q_z, cand, cand_ids, None, temperature=0.3, positive_offset=offset,
                                 item_weights=cand_valid.float())
    loss.backward()
    part1["empty"] = {"loss": float(loss.detach()), "items_grad": items_z.grad, "ids": cand_ids,
                      "offset": offset}

    # 2. A sharded two-tower trained with cross-rank and uniform negatives, then evaluated.
    import json

    meta = json.loads((Path(root) / "_signal.json").read_text())
    spec = dataclasses.replace(interaction_features(meta), passthrough=["user_id", "ts"])
    model = _two_tower(root, meta)
    windows = partitioned_windows(root)
    per_row = RetrievalMetricHook(k=[5, 20], exclude_history=True, log=False)
    per_user = RetrievalMetricHook(
        k=[5, 20], log=False, exclude_history=True, prefix="user/",
        user_fn=lambda b: torch.as_tensor(np.array(b.passthrough["user_id"])),
        time_fn=lambda b: torch.as_tensor(np.array(b.passthrough["ts"])))
    seen: list[dict[str, Any]] = []
    trainer = Trainer(
        model, TrainingArguments(output_dir=out, log_steps=10**6),
        train_dataset=ParquetWindowDataset(windows[:1], spec, batch_size=100),
        eval_dataset=ParquetWindowDataset(windows[1:], spec, batch_size=128),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        hooks=[per_row, per_user, _keeper(seen)], add_logger_hook=False)
    trainer.train()
    ckpt = trainer.save_checkpoint()
    export_for_serving(trainer, f"{out}/art", activation="none")  # every rank calls it
    metrics = trainer.evaluate()
    corpus = _corpus(trainer, meta["num_items"])
    freq = trainer.model.module.frequency

    # 3. A sharded SASRec with the user features and the item category (history and candidate:
    # the side table is read by two features), trained and evaluated the same way.
    spec = dataclasses.replace(interaction_features(meta, history_side_features=True),
                               passthrough=["user_id", "ts"])
    torch.manual_seed(0)
    sasrec = SASRecModel(num_items=meta["num_items"], max_len=meta["max_len"], embedding_dim=8,
                         num_layers=1, user_features=["user_id", "segment"],
                         user_num_embeddings=[meta["num_users"], meta["num_segments"]],
                         item_side_features={"item_cat": meta["num_clusters"]},
                         item_catalog=f"{root}/_items.parquet", num_uniform_negatives=16)
    sas_seen: list[dict[str, Any]] = []
    sas_hook = RetrievalMetricHook(k=[5, 20], log=False)
    sas = Trainer(
        sasrec, TrainingArguments(output_dir=f"{out}_sasrec", log_steps=10**6),
        train_dataset=ParquetWindowDataset(windows[:1], spec, batch_size=100),
        eval_dataset=ParquetWindowDataset(windows[1:], spec, batch_size=128),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        hooks=[sas_hook, _keeper(sas_seen)], add_logger_hook=False)
    sas.train()
    export_for_serving(sas, f"{out}_sasrec/art", activation="none")
    return {**part1, "metrics": metrics, "seen": seen, "corpus": corpus, "ckpt": ckpt,
            "freq": (freq.counts.clone(), freq.total.clone(), int(freq.step)),
            "steps": trainer.state.global_step, "sas_metrics": sas.evaluate(), "sas_seen": sas_seen,
            "sas_corpus": _corpus(sas, meta["num_items"]), "sas_steps": sas.state.global_step}


def _two_tower(root: str, meta: dict[str, Any]) -> TwoTowerModel:
    """The sharded two-tower of the 2-rank run. Its user features, declared ``[user_id,
    segment]``, come out of the table-wise sharded collection on 2 ranks as ``[segment,
    user_id]``: a model joining them by position would see another column order than on 1
    rank and in serving."""
    torch.manual_seed(0)
    return TwoTowerModel(["user_id", "segment"], num_items=meta["num_items"],
                         user_num_embeddings=[meta["num_users"], meta["num_segments"]],
                         item_side_features={"item_cat": meta["num_clusters"]},
                         item_catalog=f"{root}/_items.parquet", max_len=meta["max_len"],
                         embedding_dim=8, tower_dims=(16, 8), cross_rank_negatives=True,
                         num_uniform_negatives=16)


def _by_row(rows: list[dict[str, Any]]) -> dict[int, np.ndarray]:
    """Evaluation queries keyed by the row's ``ts`` (unique per row in this log)."""
    return {int(t): q for r in rows for t, q in zip(r["ts"], r["query"].numpy(), strict=True)}


def _one_rank_queries(root: str, out: str, ckpt: str) -> dict[int, np.ndarray]:
    """The 2-rank checkpoint's evaluation queries from one process (unsharded tables)."""
    import json

    meta = json.loads((Path(root) / "_signal.json").read_text())
    spec = dataclasses.replace(interaction_features(meta), passthrough=["user_id", "ts"])
    seen: list[dict[str, Any]] = []
    trainer = Trainer(
        _two_tower(root, meta), TrainingArguments(output_dir=out, log_steps=10**6),
        eval_dataset=ParquetWindowDataset(partitioned_windows(root)[1:], spec, batch_size=128),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        hooks=[_keeper(seen)], add_logger_hook=False)
    trainer.load_checkpoint(ckpt, mode="scoring")
    trainer.evaluate()
    return _by_row(seen)


def _served_queries(art: str, root: Path) -> dict[int, np.ndarray]:
    """The Scorer's query of every row of the evaluation window (hour 01), keyed by ``ts``."""
    import pyarrow.parquet as pq

    rows = pq.read_table(next(root.glob("*/hour=01/part-0.parquet")))
    return dict(zip(rows.column("ts").to_pylist(), Scorer(art).score(rows), strict=True))


def _max_diff(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> float:
    assert got and set(got) <= set(want), (len(got), len(set(got) - set(want)))
    return max(float(np.abs(q - want[t]).max()) for t, q in got.items())


def _keeper(seen: list[dict[str, Any]]) -> LambdaHook:
    """A hook keeping every real evaluation row's query, target, history, user and time."""
    def keep(trainer: Trainer, output: Any) -> None:
        if output.is_padding:
            return
        for mb in output.micro_batches:
            o, b = mb.outputs, mb.batch
            seen.append({"query": o["query"].clone(), "target": o["target"].clone(),
                         "lengths": o["history_lengths"].clone(), "ids": o["history_ids"].clone(),
                         "user": np.asarray(b.passthrough["user_id"]), "ts": np.asarray(b.passthrough["ts"])})

    return LambdaHook(after_eval_step=keep)


def _corpus(trainer: Trainer, num_items: int) -> np.ndarray:
    retrieval = find_retrieval_model(trainer.model)
    with torch.no_grad():  # a collective: the item table is sharded
        return retrieval.item_embeddings(torch.arange(num_items)).numpy()


def _per_user(rows: list[dict[str, Any]]) -> tuple[np.ndarray, list[list[int]], list[list[int]]]:
    """Each user's earliest row's query and history, and all the user's targets."""
    query = np.concatenate([r["query"].numpy() for r in rows])
    target = np.concatenate([r["target"].numpy() for r in rows])
    user = np.concatenate([r["user"] for r in rows])
    ts = np.concatenate([r["ts"] for r in rows])
    hist = [h for r in rows for h in np.split(r["ids"].numpy(), np.cumsum(r["lengths"].numpy())[:-1])]
    q, t, e = [], [], []
    for u in np.unique(user):
        idx = np.flatnonzero(user == u)
        first = idx[np.argmin(ts[idx])]
        q.append(query[first])
        t.append(sorted(set(target[idx].tolist())))
        e.append(hist[first].tolist())
    return np.stack(q), t, e


@pytest.mark.distributed
def test_cross_rank_negatives_and_full_corpus_metrics_on_two_ranks_equal_one_process_and_brute_force(tmp_path) -> None:
    root = tmp_path / "data"
    signal = InteractionSignal.make(num_users=150, num_items=300, num_clusters=6, max_len=8)
    write_dataset(root, hours=2, rows_per_hour=700, signal=signal, ks=(5,))
    r0, r1 = run_distributed(_worker, 2, timeout_s=300, args=(str(root), str(tmp_path / "out")))

    # The cross-rank loss: each rank's rows against all 12 candidates, i.e. one process's
    # in-batch softmax over the 12 rows, split by rank (weighted by the ranks' row weights).
    q, items, ids, w = _rows()
    q, items = q.requires_grad_(True), items.requires_grad_(True)
    full = in_batch_softmax_loss(q, items, ids, w, temperature=0.3)
    full.backward()
    w0, w1 = float(w[:B].sum()), float(w[B:].sum())
    assert (w0 * r0["loss"] + w1 * r1["loss"]) / (w0 + w1) == pytest.approx(float(full.detach()), rel=1e-6)
    # Gradients reach the queries as in one process (scaled by each rank's share of the weight),
    # and each rank's items get every rank's gradient: one process summing the ranks' losses.
    assert q.grad is not None
    assert torch.allclose(r0["q_grad"] * w0 / (w0 + w1), q.grad[:B], atol=1e-6)
    assert torch.allclose(r1["q_grad"] * w1 / (w0 + w1), q.grad[B:], atol=1e-6)
    items2 = items.detach().clone().requires_grad_(True)
    per_rank = [in_batch_softmax_loss(q.detach()[r * B:(r + 1) * B], items2, ids, w[r * B:(r + 1) * B],
                                      temperature=0.3, positive_offset=r * B, item_weights=w)
                for r in range(2)]
    (per_rank[0] + per_rank[1]).backward()
    assert items2.grad is not None
    assert torch.allclose(torch.cat([r0["items_grad"], r1["items_grad"]]), items2.grad, atol=1e-6)
    assert r1["items_grad"][3:5].abs().sum() == 0  # rank 1's padding rows: never a candidate
    # Both ranks count every rank's real items, identically.
    expected = torch.bincount(ids[w > 0], minlength=16).to(torch.float64)
    assert torch.equal(r0["counts"][0], expected) and torch.equal(r1["counts"][0], expected)

    # The same with the gather launched before the user tower, on ranks of 6 and 4 rows.
    idx = torch.cat([torch.arange(12)[r] for r in UNEQUAL])
    for r, res in enumerate((r0["early"], r1["early"])):
        assert torch.equal(res["ids"], ids[idx] + BIG) and torch.equal(res["valid"], w[idx] > 0)
        assert res["offset"] == (0, B)[r]
    qe = q.detach()[idx].clone().requires_grad_(True)
    ie = items.detach()[idx].clone().requires_grad_(True)
    we = w[idx]
    user = torch.tanh(qe @ _user_tower())
    per_rank = [in_batch_softmax_loss(user[sl], ie, ids[idx], we[sl], temperature=0.3,
                                      positive_offset=sl.start, item_weights=we)
                for sl in (slice(0, B), slice(B, 2 * B - 2))]
    (per_rank[0] + per_rank[1]).backward()
    assert qe.grad is not None and ie.grad is not None
    assert r0["early"]["loss"] == pytest.approx(float(per_rank[0].detach()), rel=1e-6)
    assert r1["early"]["loss"] == pytest.approx(float(per_rank[1].detach()), rel=1e-6)
    assert torch.allclose(torch.cat([r0["early"]["q_grad"], r1["early"]["q_grad"]]), qe.grad, atol=1e-6)
    assert torch.allclose(torch.cat([r0["early"]["items_grad"], r1["early"]["items_grad"]]), ie.grad, atol=1e-6)

    # A rank with no rows: its loss is 0, the other's is the one-process loss over its rows.
    for r, res in enumerate((r0["empty"], r1["empty"])):
        assert torch.equal(res["ids"], ids[:3] + BIG) and res["offset"] == (0, 3)[r]
    assert r1["empty"]["loss"] == 0.0 and r1["empty"]["items_grad"].shape == (0, D)
    iz = items.detach()[:3].clone().requires_grad_(True)
    alone = in_batch_softmax_loss(q.detach()[:3], iz, ids[:3], None, temperature=0.3)
    alone.backward()
    assert r0["empty"]["loss"] == pytest.approx(float(alone.detach()), rel=1e-6)
    assert iz.grad is not None and torch.allclose(r0["empty"]["items_grad"], iz.grad, atol=1e-6)

    # The trained model's frequency sketches are identical on both ranks (checkpoints hold one).
    for a, b in zip(r0["freq"], r1["freq"], strict=True):
        assert (a == b) if isinstance(a, int) else torch.equal(a, b)
    assert r0["freq"][2] == r0["steps"] > 1  # one update per step
    # Exact metrics: both ranks report the same values, equal to ranking the whole corpus.
    assert r0["metrics"] == r1["metrics"]
    assert np.allclose(r0["corpus"], r1["corpus"])
    rows = r0["seen"] + r1["seen"]
    assert r0["seen"] and r1["seen"]  # each rank evaluated part of the rows
    queries = np.concatenate([r["query"].numpy() for r in rows])
    targets = [[int(t)] for r in rows for t in r["target"].numpy()]
    history = [h.tolist() for r in rows for h in np.split(r["ids"].numpy(), np.cumsum(r["lengths"].numpy())[:-1])]
    expected_rows = brute_force_metrics(queries, r0["corpus"], targets, history, [5, 20])
    assert expected_rows["num_queries"] == r0["metrics"]["num_samples"]
    uq, ut, ue = _per_user(rows)
    expected_users = brute_force_metrics(uq, r0["corpus"], ut, ue, [5, 20])
    for name, value in expected_rows.items():
        assert r0["metrics"][name] == pytest.approx(value, abs=1e-9), name
    for name, value in expected_users.items():
        assert r0["metrics"]["user/" + name] == pytest.approx(value, abs=1e-9), name
    assert expected_users["num_queries"] < expected_rows["num_queries"]
    assert expected_users["recall@20"] != expected_users["hitrate@20"]

    # The side-feature SASRec trained on both ranks and its metrics are exact too.
    assert r0["sas_steps"] == r1["sas_steps"] > 1
    assert r0["sas_metrics"] == r1["sas_metrics"]
    assert np.allclose(r0["sas_corpus"], r1["sas_corpus"])
    rows = r0["sas_seen"] + r1["sas_seen"]
    assert r0["sas_seen"] and r1["sas_seen"]
    queries = np.concatenate([r["query"].numpy() for r in rows])
    targets = [[int(t)] for r in rows for t in r["target"].numpy()]
    expected_sas = brute_force_metrics(queries, r0["sas_corpus"], targets, None, [5, 20])
    assert expected_sas["num_queries"] == r0["sas_metrics"]["num_samples"]
    for name, value in expected_sas.items():
        assert r0["sas_metrics"][name] == pytest.approx(value, abs=1e-9), name
    assert r0["sas_metrics"]["recall@20"] > 2 * 20 / 300  # above chance after a few steps

    # One checkpoint, one query per row: the 2-rank evaluation's (sharded user tables, whose
    # output order is not the declared one), one process's and the serving export's agree; as
    # does the SASRec's with the same user features.
    two_ranks = _by_row(r0["seen"] + r1["seen"])
    assert _max_diff(two_ranks, _served_queries(str(tmp_path / "out" / "art"), root)) < 1e-5
    assert _max_diff(_one_rank_queries(str(root), str(tmp_path / "one"), r0["ckpt"]), two_ranks) < 1e-5
    sas_rows = _by_row(r0["sas_seen"] + r1["sas_seen"])
    assert _max_diff(sas_rows, _served_queries(str(tmp_path / "out_sasrec" / "art"), root)) < 1e-5


def _stalled_cross_rank(root: str, out: str) -> None:
    import json
    import os
    import signal
    import time

    rank = int(os.environ["RANK"])
    meta = json.loads((Path(root) / "_signal.json").read_text())
    torch.manual_seed(0)
    model = TwoTowerModel(["user_id", "segment"], num_items=meta["num_items"],
                          user_num_embeddings=[meta["num_users"], meta["num_segments"]],
                          item_side_features={"item_cat": meta["num_clusters"]},
                          item_catalog=f"{root}/_items.parquet", max_len=meta["max_len"],
                          embedding_dim=8, tower_dims=(16, 8), cross_rank_negatives=True)
    stopped_at: list[float] = []

    def after_step(trainer: Any, output: Any) -> None:
        if output.step == 2:
            stopped_at.append(time.monotonic())
            if rank == 1:  # a frozen peer: rank 0 waits in the next step's candidate gather
                os.kill(os.getpid(), signal.SIGSTOP)

    trainer = Trainer(
        model, TrainingArguments(output_dir=out, log_steps=10**6, collective_timeout_s=3),
        train_dataset=ParquetWindowDataset(partitioned_windows(root)[:1], interaction_features(meta),
                                           batch_size=50),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        hooks=[LambdaHook(after_step=after_step)], add_logger_hook=False)
    train_recording_failure(trainer, out, rank, stopped_at)


@pytest.mark.distributed
def test_a_stalled_peer_during_cross_rank_negatives_fails_the_others_with_a_named_error(tmp_path) -> None:
    # The two-tower's cross-rank gather is launched asynchronously (before the user tower) and
    # its gradient all-reduce overlaps the backward: both must still end at collective_timeout_s
    # with the Trainer's named error, not hang.
    import json

    root, out = tmp_path / "data", tmp_path / "out"
    out.mkdir()
    signal = InteractionSignal.make(num_users=150, num_items=300, num_clusters=6, max_len=8)
    write_dataset(root, hours=1, rows_per_hour=700, signal=signal, ks=(5,))
    with pytest.raises((AssertionError, RuntimeError), match="rank 0 failed|exited with code"):
        run_distributed(_stalled_cross_rank, 2, 90, args=(str(root), str(out)))
    r0 = json.loads((out / "rank0.json").read_text())
    assert r0["type"] == "PeerLostError"
    assert r0["message"].startswith(
        "rank 0: a peer rank stopped answering: a collective waited collective_timeout_s=3 s for "
        "it, after step 2 (train, window ")
    assert r0["seconds"] < 30  # hang guard: the default timeout is 1800 s
