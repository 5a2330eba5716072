"""Half-precision tables: fp16 tables (hashed and dynamic) train in fp16, checkpoint, resume
bitwise and reshard (table_wise -> column_wise, 2 ranks -> 1) on 1 and 2 gloo ranks; a
precision FBGEMM's kernel lacks on the device (bf16 on CPU) is refused by name; the YAML key.
Serving parity of half-precision tables is in tests/test_serving.py (the ``mixed_fp16`` kind)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import bitwise_verdict, local, snapshot
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.checkpoint.dynamic_export import export_dynamic
from recsys_trainer.checkpoint.export import read_full, saved_keys
from recsys_trainer.dynamic import ID_SPACE, DynamicTable, table_stats
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.table_precision import kernel_trains, rounds_stochastically

TIMEOUT = 240
FEATS = ["u", "i", "c"]
CATEGORIES = 50
HALF = {"t_u": "fp16", "t_c": "fp16"}  # t_i stays fp32: one model holds both precisions
SPEC = DynamicTable(num_slots=32, eviction_interval_rows=64, admission_threshold=1,
                    fallback_rows=2)


def _batches(rank: int, n: int = 6, rows: int = 32) -> list[Batch]:
    g = torch.Generator().manual_seed(100 + rank)
    base = 5_000_000_000_000
    out = []
    for _ in range(n):
        u = base + torch.randint(0, 80, (rows,), generator=g)
        i = base + torch.randint(0, 40, (rows,), generator=g)
        c = torch.randint(0, CATEGORIES, (rows,), generator=g)
        kjt = KeyedJaggedTensor(keys=FEATS, values=torch.cat([u, i, c]),
                                lengths=torch.ones(3 * rows, dtype=torch.int32), stride=rows)
        out.append(Batch(dense=torch.randn(rows, 4, generator=g), sparse=kjt,
                         labels=(torch.rand(rows, generator=g) < 0.4).float()))
    return out


def _trainer(out: str, column_wise: bool = False, **args: Any) -> Trainer:
    torch.manual_seed(0)
    model = DLRMClassifier(FEATS, 4, [ID_SPACE, ID_SPACE, CATEGORIES], embedding_dim=8,
                           dense_arch=(16,), over_arch=(16, 1),
                           dynamic={"u": SPEC, "i": SPEC}, embedding_dtype=HALF)
    args.setdefault("train_steps", 6)
    return Trainer(model=model, args=TrainingArguments(
                       output_dir=out, log_steps=1000,
                       sharding_types={"t_c": "column_wise" if column_wise else "table_wise"},
                       **args),
                   train_dataset=_batches(int(os.environ.get("RANK", "0"))),
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                   add_logger_hook=False)


def _tables(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's shard of each table's weights, by table name."""
    return {k.split(".")[-2]: local(v).clone() for k, v in trainer.model.state_dict().items()
            if k.endswith(".weight") and ("embedding_bags" in k)}


def _run(root: str) -> dict[str, Any]:
    """Train 6 steps; train 3, save, resume and train 3 more; load the 6-step checkpoint with
    the hashed table column-wise and save it again."""
    rank = os.environ.get("RANK", "0")
    full = _trainer(os.path.join(root, "full"), save_steps=6)
    before = _tables(full)
    full.train()
    after = _tables(full)
    cut = os.path.join(root, "cut")
    _trainer(cut, train_steps=3, save_steps=3).train()
    resumed = _trainer(cut)
    resumed.train()
    cw = _trainer(os.path.join(root, "cw", rank), column_wise=True)
    cw.load_checkpoint(os.path.join(root, "full", "step_00000006"))
    return {"dtypes": {t: str(v.dtype) for t, v in after.items() if v.numel()},
            "moved": {t: bool(v.numel()) and not torch.equal(v, before[t])
                      for t, v in after.items()},
            "momentum": sorted({str(local(v).dtype) for e in
                                full.optimizer.sparse_state.state_dict()["state"].values()
                                for v in e.values()}),
            "equal": bitwise_verdict(snapshot(resumed), snapshot(full)),
            "admitted": table_stats(full.model)["t_u"]["admitted"],
            "column_wise": cw.save_checkpoint(os.path.join(root, "cw_saved"))}


def _hashed_state(ckpt: str) -> dict[str, torch.Tensor]:
    keys = {k for k in saved_keys(ckpt) if ".t_c." in k}
    return read_full(ckpt, keys)


def _check(results: list[dict[str, Any]], root: str) -> None:
    for r in results:
        assert r["equal"] == "yes", r["equal"]
        assert r["momentum"] == ["torch.float32"]  # row-wise Adagrad's state stays float32
        assert r["admitted"] > 0
    dtypes = {t: d for r in results for t, d in r["dtypes"].items()}
    assert dtypes == {"t_u": "torch.float16", "t_i": "torch.float32", "t_c": "torch.float16"}
    moved = {t for r in results for t, m in r["moved"].items() if m}
    assert moved == {"t_u", "t_i", "t_c"}
    full = os.path.join(root, "full", "step_00000006")
    # Resharded: the hashed table table_wise -> column_wise (and, at world size 1, the dynamic
    # tables re-routed to one shard), every tensor the same bits in the same precision.
    one = _trainer(os.path.join(root, "one"), column_wise=True,
                   reshard_data_position="restart_window")
    one.load_checkpoint(full)
    for moved_to in (results[0]["column_wise"], one.save_checkpoint(os.path.join(root, "one_s"))):
        a, b = _hashed_state(full), _hashed_state(moved_to)
        assert a.keys() == b.keys() and len(a) == 2  # the weights and their momentum
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
        x, y = export_dynamic(full), export_dynamic(moved_to)
        for t in ("t_u", "t_i"):
            assert torch.equal(x.tables[t].ids, y.tables[t].ids)
            assert torch.equal(x.tables[t].vectors, y.tables[t].vectors)
            assert torch.equal(x.tables[t].default, y.tables[t].default)
        assert x.tables["t_u"].vectors.dtype == torch.float16
        assert x.tables["t_i"].vectors.dtype == torch.float32


def test_fp16_tables_train_checkpoint_resume_bitwise_and_reshard(tmp_path: Any) -> None:
    root = str(tmp_path)
    _check([_run(root)], root)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_fp16_tables_train_checkpoint_resume_bitwise_and_reshard_on_2_ranks(
        tmp_path: Any) -> None:
    root = str(tmp_path)
    _check(run_distributed(_run, world_size=2, timeout_s=TIMEOUT, args=(root,)), root)


def _refused_for_t_b(out: str, dtype: str, match: str, **args: Any) -> None:
    """Building a Trainer for a DLRM whose table ``t_b`` is stored in ``dtype`` raises a
    ``ValueError`` matching ``match``."""
    model = DLRMClassifier(["a", "b"], 4, 50, embedding_dim=8, dense_arch=(16,),
                           over_arch=(16, 1), embedding_dtype={"t_b": dtype})
    with pytest.raises(ValueError, match=match):
        Trainer(model=model, args=TrainingArguments(output_dir=out, **args),
                train_dataset=_batches(0), add_logger_hook=False,
                dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1))


@pytest.mark.skipif(kernel_trains("cpu", "bf16", "rowwise_adagrad") is None,
                    reason="this FBGEMM trains bf16 tables on CPU")
def test_a_bf16_table_on_cpu_is_refused_by_name_before_sharding(tmp_path: Any) -> None:
    _refused_for_t_b(str(tmp_path), "bf16",
                     r"embedding table 't_b' is stored in bf16 .* FBGEMM's table-batched kernel "
                     r"on cpu cannot train a bf16 table with the rowwise_adagrad optimizer "
                     r"\(NotImplementedError.*On cpu store it in one of fp32, fp16: set the "
                     r"model's `embedding_dtype=\{'t_b': 'fp16'\}` \(`model.embedding_dtype` in "
                     r"YAML; `data_type` in your own torchrec table configs\); or train on CUDA")


def test_the_rounding_probe_says_the_cpu_kernel_rounds_fp16_to_nearest_and_names_what_it_cannot_probe(
        ) -> None:
    # docs/tables.md: FBGEMM's CPU kernel rounds half-precision updates to nearest.
    assert rounds_stochastically("cpu", "fp16") is False
    assert rounds_stochastically("cpu", "fp32") is False
    with pytest.raises(ValueError, match=r"`dtype` must be one of 'fp32', 'fp16', 'bf16', but "
                                         r"is 'half'"):
        rounds_stochastically("cpu", "half")
    if kernel_trains("cpu", "bf16", "sgd") is not None:
        with pytest.raises(ValueError, match=r"FBGEMM's table-batched kernel on cpu cannot "
                                             r"train a bf16 table \(NotImplementedError.*\), so "
                                             r"it has no rounding to probe"):
            rounds_stochastically("cpu", "bf16")


def test_a_half_precision_table_sharded_data_parallel_is_refused_by_name(tmp_path: Any) -> None:
    # Such a table would be a plain parameter of the dense optimizer: with Adam every row NaN
    # after one step, silently.
    _refused_for_t_b(str(tmp_path), "fp16",
                     r"embedding table 't_b' is stored in fp16 and sharded data_parallel "
                     r"\(`sharding_types\['t_b'\]` asks for it.*Shard it table_wise or "
                     r"column_wise .* or store it in fp32 \(`embedding_dtype`, torchrec's "
                     r"`data_type`\)", sharding_types={"t_b": "data_parallel"})


def test_a_precision_is_a_per_table_setting_checked_by_name_in_python_and_yaml() -> None:
    from recsys_trainer.config import ConfigError, RunConfig

    m = DLRMClassifier(["a", "b"], 4, 50, embedding_dim=8, embedding_dtype={"t_a": "fp16"})
    dtypes = {c.name: c.data_type.value for c in m.dlrm.sparse_arch.embedding_bag_collection
              .embedding_bag_configs()}
    assert dtypes == {"t_a": "FP16", "t_b": "FP32"}
    with pytest.raises(ValueError, match=r"`embedding_dtype\['t_a'\]` must be one of 'fp32', "
                                         r"'fp16', 'bf16', but is 'half'"):
        DLRMClassifier(["a"], 4, 50, embedding_dtype={"t_a": "half"})
    with pytest.raises(ValueError, match=r"`embedding_dtype` names tables \['t_x'\]"):
        DLRMClassifier(["a"], 4, 50, embedding_dtype={"t_x": "fp16"})
    cfg = {"model": {"sparse_features": ["a", "b"], "num_dense": 2, "num_embeddings": 50,
                     "embedding_dtype": {"t_b": "fp16"}},
           "data": {"kind": "synthetic", "train_batches": 2}}
    built = RunConfig.from_dict(cfg).model.build()
    assert [c.data_type.value for c in built.dlrm.sparse_arch.embedding_bag_collection
            .embedding_bag_configs()] == ["FP32", "FP16"]
    with pytest.raises((ConfigError, ValueError), match=r"`model.embedding_dtype` must be one of"):
        RunConfig.from_dict({**cfg, "model": {**cfg["model"], "embedding_dtype": "fp8"}})
