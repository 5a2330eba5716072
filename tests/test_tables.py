"""Per-table settings: sparse optimizer and lr per table, init per table, embedding dims that
FBGEMM refuses, and shared tables (several features reading one table), on 1 and 2 real ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import bitwise_verdict, local, snapshot
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.synthetic import synthetic_batches
from recsys_trainer.models import weighted_bce_with_logits
from recsys_trainer.optimizers import resolve_table_optimizers

ROWS = 50
DIM = 8
TIMEOUT = 240

SGD = SparseOptimizer("sgd", lr=0.5)
ROWWISE = SparseOptimizer("rowwise_adagrad", lr=0.05)


class TwoHeads(nn.Module):
    """Tables ``t_a`` (feature ``fa``) and ``t_b`` (``fb``), each with its own linear head and
    its own loss term: a table's trajectory depends on its own optimizer only, so a run with
    per-table optimizers can be compared table by table with runs of one optimizer alone."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=ROWS,
                                       feature_names=[f]) for f in ("a", "b")],
            device=torch.device("meta"))
        self.heads = nn.ModuleDict({f: nn.Linear(DIM, 1) for f in ("a", "b")})

    def forward(self, batch: Batch) -> torch.Tensor:
        pooled = self.ebc(batch.sparse).to_dict()
        return sum(  # type: ignore[return-value]
            weighted_bce_with_logits(self.heads[f](pooled[f]).squeeze(-1), batch.labels, batch.weights)
            for f in ("a", "b"))


def _data(seed: int) -> list[Batch]:
    return synthetic_batches(6, 32, ["a", "b"], 0, ROWS, seed=seed)


def _trainer(out: str, sparse: SparseOptimizer, table_optimizers: Any = None, **args: Any) -> Trainer:
    args.setdefault("train_steps", 6)
    return Trainer(
        TwoHeads(),
        TrainingArguments(output_dir=out, log_steps=1000,
                          sharding_types={"t_a": "table_wise", "t_b": "table_wise"}, **args),
        train_dataset=_data(int(os.environ.get("RANK", "0"))),
        dense_optimizers=(lambda p: torch.optim.SGD(p, lr=0.1), None),
        sparse_optimizer=sparse,
        table_optimizers=table_optimizers,
        add_logger_hook=False,
    )


def _local_tables(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's table shards, by table name (table-wise: each table lives on one rank)."""
    out = {}
    for k, v in trainer.model.state_dict().items():
        if "embedding_bags" in k and local(v).numel():
            out[k.split(".")[-2]] = local(v).clone()
    return out


def _per_table_vs_alone(root: str) -> dict[str, Any]:
    rank = os.environ.get("RANK", "0")
    runs = {}
    for name, sparse, per_table in (("mixed", ROWWISE, {"t_a*": SGD}), ("sgd", SGD, None),
                                    ("rowwise", ROWWISE, None)):
        t = _trainer(os.path.join(root, name, rank), sparse, per_table)
        before = _local_tables(t)
        t.train()
        runs[name] = {"before": before, "after": _local_tables(t), "lr": t.sparse_lr(),
                      "lrs": t.sparse_lrs()}
    return runs


def _check_per_table_vs_alone(results: list[dict[str, Any]]) -> None:
    merged: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for r in results:
        for run, v in r.items():
            for when in ("before", "after"):
                merged.setdefault(run, {}).setdefault(when, {}).update(v[when])
    m, sgd, rw = merged["mixed"], merged["sgd"], merged["rowwise"]
    assert sorted(m["after"]) == ["t_a", "t_b"]
    for t in ("t_a", "t_b"):  # the same initial rows in every run
        assert torch.equal(m["before"][t], sgd["before"][t]) and torch.equal(m["before"][t], rw["before"][t])
    # t_a trained exactly as under SGD alone, t_b exactly as under row-wise Adagrad alone ...
    assert torch.equal(m["after"]["t_a"], sgd["after"]["t_a"])
    assert torch.equal(m["after"]["t_b"], rw["after"]["t_b"])
    # ... and those two rules really differ on the same table (the test could fail).
    assert not torch.allclose(sgd["after"]["t_a"], rw["after"]["t_a"], atol=1e-4)
    assert not torch.allclose(sgd["after"]["t_b"], rw["after"]["t_b"], atol=1e-4)
    assert not torch.equal(m["after"]["t_a"], m["before"]["t_a"])
    for r in results:
        assert r["mixed"]["lrs"] == {"t_a": 0.5, "t_b": 0.05}
        assert r["mixed"]["lr"] is None, "mixed lrs have no single sparse lr"
        assert r["sgd"]["lr"] == pytest.approx(0.5)


def test_per_table_optimizers_update_each_table_exactly_as_that_optimizer_alone(tmp_path: Any) -> None:
    _check_per_table_vs_alone([_per_table_vs_alone(str(tmp_path))])


@pytest.mark.distributed
def test_per_table_optimizers_update_each_table_exactly_as_that_optimizer_alone_on_2_ranks(
        tmp_path: Any) -> None:
    _check_per_table_vs_alone(run_distributed(_per_table_vs_alone, world_size=2, timeout_s=TIMEOUT,
                                              args=(str(tmp_path),)))


def test_sgd_table_moves_by_lr_times_the_gradient_of_a_reference_computation(tmp_path: Any) -> None:
    """One step against plain autograd on an ``nn.EmbeddingBag`` copy of the start rows."""
    t = _trainer(str(tmp_path), ROWWISE, {"t_a": SGD}, train_steps=1)
    before = _local_tables(t)
    head = {f: (t.model.module.heads[f].weight.detach().clone(),
                t.model.module.heads[f].bias.detach().clone()) for f in ("a",)}
    t.train()
    batch = _data(0)[0]
    ref = nn.EmbeddingBag(ROWS, DIM, mode="sum", _weight=before["t_a"].reshape(ROWS, DIM).clone())
    ids = batch.sparse["a"]
    pooled = ref(ids.values(), ids.offsets()[:-1])
    logits = pooled @ head["a"][0].T + head["a"][1]
    weighted_bce_with_logits(logits.squeeze(-1), batch.labels, None).backward()
    expected = before["t_a"].reshape(ROWS, DIM) - 0.5 * ref.weight.grad
    torch.testing.assert_close(_local_tables(t)["t_a"].reshape(ROWS, DIM), expected, rtol=1e-5, atol=1e-6)


def _resume(root: str) -> dict[str, Any]:
    per_table = {"t_a": SGD, "t_*": SparseOptimizer("adagrad", lr=0.2)}
    full = _trainer(os.path.join(root, "full"), ROWWISE, per_table)
    full.train()
    cut = os.path.join(root, "cut")  # shared by the ranks, as a checkpoint directory must be
    _trainer(cut, ROWWISE, per_table, train_steps=3, save_steps=3).train()
    resumed = _trainer(cut, ROWWISE, per_table)
    resumed.train()
    return {"equal": bitwise_verdict(snapshot(resumed), snapshot(full)),
            "state_keys": sorted(k for e in resumed.optimizer.sparse_state.state_dict()["state"].values()
                                 for k in e)}


def test_resume_with_per_table_optimizers_is_bitwise_identical(tmp_path: Any) -> None:
    r = _resume(str(tmp_path))
    assert r["equal"] == "yes"
    assert r["state_keys"] == ["t_b.momentum1"], "t_b (adagrad) keeps state, t_a (sgd) none"


@pytest.mark.distributed
def test_resume_with_per_table_optimizers_is_bitwise_identical_on_2_ranks(tmp_path: Any) -> None:
    results = run_distributed(_resume, world_size=2, timeout_s=TIMEOUT, args=(str(tmp_path),))
    assert [r["equal"] for r in results] == ["yes", "yes"]


def test_per_table_lrs_are_logged_in_the_log_line_jsonl_and_records(tmp_path: Any, caplog: Any) -> None:
    """A run with mixed sparse lrs has no single ``sparse_lr``: the logs name each table's."""
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recsys_trainer.hooks import JsonlMetricsHook, LoggerHook, TensorBoardHook
    from recsys_trainer.hooks.jsonl import read_jsonl

    t = _trainer(str(tmp_path), ROWWISE, {"t_a": SGD}, train_steps=4)
    logger_hook = LoggerHook(every=2)
    for hook in (logger_hook, JsonlMetricsHook(every=2), TensorBoardHook(every=2)):
        t.add_hook(hook)
    with caplog.at_level(logging.INFO, logger="recsys_trainer"):
        t.train()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert {"lr/sparse/t_a", "lr/sparse/t_b"} <= set(events.Tags()["scalars"])
    assert "lr/sparse" not in events.Tags()["scalars"]
    assert [e.value for e in events.Scalars("lr/sparse/t_a")] == pytest.approx([0.5, 0.5])
    train = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["type"] == "train"]
    assert len(train) == 2
    assert all(r["sparse_lr"] is None and r["sparse_lrs"] == {"t_a": 0.5, "t_b": 0.05} for r in train)
    assert "lr dense 0.1 sparse 0.05 (t_b), 0.5 (t_a)" in caplog.text
    assert logger_hook.records[-1]["sparse_lr/t_a"] == 0.5 and "sparse_lr" not in logger_hook.records[-1]
    # One lr for every table: one number, as before.
    same = _trainer(str(tmp_path / "same"), ROWWISE, train_steps=2)
    same.add_hook(JsonlMetricsHook(every=2))
    same.train()
    rec = [r for r in read_jsonl(str(tmp_path / "same" / "metrics.jsonl")) if r["type"] == "train"][0]
    assert rec["sparse_lr"] == pytest.approx(0.05) and "sparse_lrs" not in rec


def test_per_table_optimizers_train_under_the_torchrec_pipeline_as_in_the_plain_loop(tmp_path: Any) -> None:
    """Two optimizer groups (two FBGEMM kernels) under ``TrainPipelineSparseDist``."""
    runs = {}
    for pipeline in ("none", "sparse_dist"):
        t = _trainer(str(tmp_path / pipeline), ROWWISE, {"t_a": SGD}, pipeline=pipeline)
        before = _local_tables(t)
        t.train()
        runs[pipeline] = (before, _local_tables(t), t.state.global_step)
    (b0, plain, n0), (_, piped, n1) = runs["none"], runs["sparse_dist"]
    assert n0 == n1 == 6
    for table in ("t_a", "t_b"):
        assert not torch.equal(plain[table], b0[table])
        torch.testing.assert_close(piped[table], plain[table], rtol=0, atol=1e-6)


def test_table_optimizer_keys_resolve_exact_name_first_then_first_matching_glob() -> None:
    a, b, c = SparseOptimizer("sgd", 1.0), SparseOptimizer("sgd", 2.0), SparseOptimizer("sgd", 3.0)
    got = resolve_table_optimizers(["t_user", "t_user_hist", "t_item"], c,
                                   {"t_user*": a, "t_user": b})
    assert got == {"t_user": b, "t_user_hist": a, "t_item": c}


def test_a_table_optimizer_key_that_matches_no_table_is_refused_naming_the_tables(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"keys \['t_usr\*'\] match no embedding table; the model's "
                                         r"tables are \['t_a', 't_b'\]"):
        _trainer(str(tmp_path), ROWWISE, {"t_a": SGD, "t_usr*": SGD})


def test_a_table_optimizer_fbgemm_cannot_run_on_cpu_is_refused_with_what_works(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="'adam' is not supported by FBGEMM on cpu; supported there: sgd"):
        _trainer(str(tmp_path), ROWWISE, {"t_b": SparseOptimizer("adam", lr=0.01)})


# ---------------------------------------------------------------------------- init per table

# num_dense=0: the dense tower's first layer has no inputs, which torch's init warns about.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")
def test_each_table_is_initialised_by_its_own_init_after_sharding(tmp_path: Any) -> None:
    from recsys_trainer.models import DLRMClassifier, normal_init, uniform_init

    torch.manual_seed(0)
    model = DLRMClassifier(["a", "b", "c"], 0, 4000, embedding_dim=16, dense_arch=(16,),
                           over_arch=(8, 1), embedding_init={"t_a": normal_init(1.0),
                                                             "t_b": uniform_init(0.001)})
    t = Trainer(model, TrainingArguments(output_dir=str(tmp_path)), add_logger_hook=False)
    w = _local_tables(t)
    assert abs(float(w["t_a"].std()) - 1.0) < 0.03 and float(w["t_a"].abs().max()) > 3.0
    assert float(w["t_b"].abs().max()) <= 0.001 and float(w["t_b"].std()) > 0.0004
    default_bound = (1 / 4000) ** 0.5  # torchrec's default for the table left alone
    assert float(w["t_c"].abs().max()) <= default_bound and float(w["t_c"].abs().max()) > 0.9 * default_bound


def test_an_init_for_a_table_that_does_not_exist_is_refused() -> None:
    from recsys_trainer.models import make_tables, normal_init

    with pytest.raises(ValueError, match=r"`init` names tables \['t_x'\] that do not exist"):
        make_tables(["a"], 10, 8, {"t_x": normal_init(1.0)})


# ---------------------------------------------------------------------------- dims

@pytest.mark.parametrize("dim", [1, 6])
def test_an_embedding_dim_not_a_multiple_of_4_is_refused_at_construction_naming_table_and_fix(
        tmp_path: Any, dim: int) -> None:
    class Bias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="t_user", embedding_dim=8, num_embeddings=10, feature_names=["u"]),
                EmbeddingBagConfig(name="t_bias", embedding_dim=dim, num_embeddings=10, feature_names=["b"]),
            ], device=torch.device("meta"))
            self.lin = nn.Linear(1, 1)

        def forward(self, batch: Batch) -> torch.Tensor:  # pragma: no cover - never built
            raise AssertionError

    want = -(-dim // 4) * 4
    with pytest.raises(ValueError, match=rf"embedding table 't_bias' has embedding_dim={dim}, but "
                                         rf"FBGEMM's table-batched kernels need a multiple of 4 .* "
                                         rf"Give it embedding_dim={want} and use its first {dim}"):
        Trainer(Bias(), TrainingArguments(output_dir=str(tmp_path)), add_logger_hook=False)


def test_a_sequence_table_dim_not_a_multiple_of_4_is_refused_at_construction_too(tmp_path: Any) -> None:
    """EmbeddingCollection (``batch.sequence``) tables go through the same FBGEMM kernels."""
    from recsys_trainer.models import DINClassifier

    with pytest.raises(ValueError, match=r"embedding table 't_a' has embedding_dim=6, .* \(2 such "
                                         r"table\(s\): 't_a'=6, 't_item'=6\)\. Give it embedding_dim=8"):
        Trainer(DINClassifier(["a"], 13, num_items=100, embedding_dim=6, num_embeddings=10),
                TrainingArguments(output_dir=str(tmp_path)), add_logger_hook=False)


# ---------------------------------------------------------------------------- shared tables

class SharedItems(nn.Module):
    """One table ``t_item`` read by two features: the candidate ``item`` and ``hist_item``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_item", embedding_dim=DIM, num_embeddings=ROWS,
                               feature_names=["item", "hist_item"]),
            EmbeddingBagConfig(name="t_user", embedding_dim=DIM, num_embeddings=ROWS,
                               feature_names=["user"])],
            device=torch.device("meta"))
        self.head = nn.Linear(3 * DIM, 1)
        self.pooled: dict[str, torch.Tensor] = {}

    def forward(self, batch: Batch) -> torch.Tensor:
        kt = self.ebc(batch.sparse)
        self.pooled = {k: v.detach() for k, v in kt.to_dict().items()}
        logits = self.head(kt.values()).squeeze(-1)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights)


def _shared_batches(n: int, seed: int) -> list[Batch]:
    """Candidate items in [0, 10), history items in [10, 20): rows >= 20 are never read."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        b = 16
        item = torch.randint(0, 10, (b,), generator=g)
        hist = torch.randint(10, 20, (b,), generator=g)
        user = torch.randint(0, ROWS, (b,), generator=g)
        kjt = KeyedJaggedTensor(keys=["item", "hist_item", "user"],
                                values=torch.cat([item, hist, user]),
                                lengths=torch.ones(3 * b, dtype=torch.int32), stride=b)
        out.append(Batch(dense=torch.zeros(b, 0), sparse=kjt,
                         labels=(torch.rand(b, generator=g) < 0.5).float()))
    return out


def _shared_table(root: str) -> dict[str, Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rank = int(os.environ.get("RANK", "0"))
    t = Trainer(SharedItems(), TrainingArguments(output_dir=os.path.join(root, str(rank)),
                                                 train_steps=4, log_steps=1000),
                train_dataset=_shared_batches(4, seed=rank),
                dense_optimizers=(lambda p: torch.optim.SGD(p, lr=0.1), None),
                sparse_optimizer=SparseOptimizer("sgd", lr=0.5), add_logger_hook=False)
    module = t.model.module
    # The same ids through both features: the same rows, so the same pooled vectors.
    ids = torch.arange(8) % ROWS
    kjt = KeyedJaggedTensor(keys=["item", "hist_item", "user"], values=torch.cat([ids, ids, ids]),
                            lengths=torch.ones(24, dtype=torch.int32), stride=8)
    t.model(Batch(dense=torch.zeros(8, 0), sparse=kjt, labels=torch.zeros(8)))
    same_rows = bool(torch.equal(module.pooled["item"], module.pooled["hist_item"]))
    before = _local_tables(t)
    t.train()
    after = _local_tables(t)
    seen = {k: sorted({int(i) for b in _shared_batches(4, seed=rank) for i in b.sparse[k].values()})
            for k in ("item", "hist_item")}
    return {"same_rows": same_rows, "seen": seen, "tables": sorted(k for k in t.model.state_dict() if "embedding_bags" in k),
            "before": before, "after": after}


def _check_shared(results: list[dict[str, Any]]) -> None:
    assert all(r["same_rows"] for r in results)
    assert results[0]["tables"] == ["ebc.embedding_bags.t_item.weight", "ebc.embedding_bags.t_user.weight"]
    holder = [r for r in results if "t_item" in r["after"]]
    assert len(holder) == 1, "table-wise: one rank holds t_item"
    before = holder[0]["before"]["t_item"].reshape(ROWS, DIM)
    after = holder[0]["after"]["t_item"].reshape(ROWS, DIM)
    moved = (before != after).any(1).nonzero().reshape(-1).tolist()
    items = {i for r in results for i in r["seen"]["item"]}
    hist = {i for r in results for i in r["seen"]["hist_item"]}
    assert items <= set(range(10)) and hist <= set(range(10, 20)) and len(hist) > 5
    # One table trained through both features (every rank's ids): exactly the rows they read.
    assert moved == sorted(items | hist)


def test_two_features_sharing_a_table_read_the_same_rows_and_train_that_one_table(tmp_path: Any) -> None:
    _check_shared([_shared_table(str(tmp_path))])


@pytest.mark.distributed
def test_two_features_sharing_a_table_read_the_same_rows_and_train_that_one_table_on_2_ranks(
        tmp_path: Any) -> None:
    _check_shared(run_distributed(_shared_table, world_size=2, timeout_s=TIMEOUT, args=(str(tmp_path),)))


def test_data_checks_name_a_shared_tables_feature_missing_or_too_wide_for_it() -> None:
    from recsys_trainer.data.inputs import SparseFeature
    from recsys_trainer.data.spec import FeatureSpec
    from recsys_trainer.sharding import check_data_fits_model

    class Data:
        def __init__(self, **bounds: int) -> None:
            self.features = FeatureSpec(labels=["y"], sparse=[
                SparseFeature(name=k, num_embeddings=v) for k, v in bounds.items()])

    model = SharedItems()
    check_data_fits_model(model, [Data(item=ROWS, hist_item=ROWS, user=ROWS)])
    with pytest.raises(ValueError, match=r"\['hist_item'\] missing"):
        check_data_fits_model(model, [Data(item=ROWS, user=ROWS)])
    with pytest.raises(ValueError, match=rf"sparse feature 'hist_item' holds ids in \[0, {2 * ROWS}\) .* "
                                         rf"the table it feeds, 't_item', has {ROWS} rows"):
        check_data_fits_model(model, [Data(item=ROWS, hist_item=2 * ROWS, user=ROWS)])


# ---------------------------------------------------------------------------- the CLI section

def test_the_cli_config_takes_table_optimizers_by_name_or_glob(tmp_path: Any) -> None:
    import subprocess
    import sys

    from test_cli import REPO, TINY, _env, write_config

    from recsys_trainer.config import ConfigError, RunConfig, apply_overrides

    raw = apply_overrides(TINY, [("table_optimizers", "{t_cat_0: {name: sgd, lr: 0.5}, 't_cat_[23]': {name: adagrad, lr: 0.2}}")])
    cfg = RunConfig.from_dict(raw)
    assert cfg.table_optimizers == {"t_cat_0": SparseOptimizer("sgd", 0.5),
                                    "t_cat_[23]": SparseOptimizer("adagrad", 0.2)}
    with pytest.raises(ConfigError, match=r"`table_optimizers.t_cat_0`: `sparse_optimizer.name` must be one of sgd"):
        RunConfig.from_dict(apply_overrides(TINY, [("table_optimizers", "{t_cat_0: {name: adamw}}")]))
    p = subprocess.run([sys.executable, "-m", "recsys_trainer", str(write_config(tmp_path, raw)),
                        "--args.train_steps", "3", "--run=train"],
                       capture_output=True, text=True, timeout=150, env=_env(), cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "lr dense 0.01 sparse 0.2 (t_cat_2, t_cat_3), 0.05 (t_cat_1), 0.5 (t_cat_0)" in p.stderr


def test_resuming_with_another_optimizer_for_a_table_is_refused_naming_its_state(tmp_path: Any) -> None:
    from recsys_trainer.checkpoint import CheckpointError

    _trainer(str(tmp_path), ROWWISE, {"t_a": SGD}, train_steps=2, save_steps=2).train()
    with pytest.raises(CheckpointError, match=r"lacks 1 entries this trainer has, e.g. "
                                              r"\['optim.state.sparse.ebc.embedding_bags.t_a.weight.t_a.momentum1'\]"):
        _trainer(str(tmp_path), ROWWISE, None, train_steps=4).train()
    # The way to change a table's optimizer: a new run warm-started from the weights.
    warm = _trainer(str(tmp_path / "warm"), ROWWISE, None, train_steps=4,
                    model_bank=[{"path": str(tmp_path), "include": {"tables": ["*"], "dense": ["*"]}}])
    warm.resume()
    saved = _trainer(str(tmp_path / "ref"), ROWWISE, {"t_a": SGD}, resume_from=str(tmp_path))
    saved.resume()
    assert all(torch.equal(v, _local_tables(warm)[k]) for k, v in _local_tables(saved).items())
