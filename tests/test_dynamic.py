"""Dynamic (managed-collision) embedding tables: raw ids without collisions, admission, eviction
on CPU, checkpoints and exports; at 1 rank in-process and 2 real gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import bitwise_verdict, snapshot
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.checkpoint.dynamic_export import (
    DynamicExport,
    apply_delta,
    export_dynamic,
    load_export,
    write_delta,
)
from recsys_trainer.data.id_stream import IdStream
from recsys_trainer.dynamic import (
    EMPTY_SLOT,
    DynamicTable,
    dynamic_collections,
    mc_modules,
    mix_ids,
    table_stats,
    unmix_ids,
)
from recsys_trainer.models import DLRMClassifier

FEATS = ("u", "i")


def build(out: str, spec: DynamicTable, data: Any, optimizer: str = "rowwise_adagrad",
          **args: Any) -> Trainer:
    torch.manual_seed(0)
    model = DLRMClassifier(list(FEATS), 4, embedding_dim=8, dense_arch=(16,), over_arch=(16, 1),
                           dynamic=spec)
    args.setdefault("log_steps", 1000)
    return Trainer(model=model, args=TrainingArguments(output_dir=out, **args),
                   train_dataset=data, hooks=[],
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                   sparse_optimizer=SparseOptimizer(optimizer, lr=0.1), add_logger_hook=False)


def seen_ids(batches: list[Any], feature: str) -> set[int]:
    return {int(v) for b in batches for v in b.sparse[feature].values()}


def resident_ids(trainer: Trainer, table: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw ids, their slots) in this rank's map."""
    m: Any = mc_modules(trainer.model)[table]
    ids, slots = m._mch_sorted_raw_ids, m._mch_remapped_ids_mapping
    keep = ids != EMPTY_SLOT
    return unmix_ids(ids[keep]), slots[keep]


# ------------------------------------------------------------------------------- config

def test_mixing_is_a_bijection_on_non_negative_int64_that_spreads_sequential_ids() -> None:
    x = torch.cat([torch.arange(0, 4096), torch.tensor([2**63 - 2, 2**62, 123456789012345678])])
    y = mix_ids(x)
    assert (y >= 0).all() and torch.equal(unmix_ids(y), x)
    assert len(set(y.tolist())) == len(x)
    # Sequential ids must reach both halves of the range (the ranks' blocks) about equally.
    assert 0.4 < (y[:4096] < 2**62).float().mean().item() < 0.6


def test_bad_dynamic_settings_name_the_field_and_the_fix(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="`DynamicTable.num_slots` must be an int >= 2, but is 1"):
        DynamicTable(num_slots=1)
    with pytest.raises(ValueError, match="admission_threshold.*lru"):
        DynamicTable(num_slots=8, eviction_policy="lru", admission_threshold=2)
    data = IdStream(FEATS, 50).batches(2, 16, seed=0)
    with pytest.raises(ValueError, match="`sparse_optimizer` must be one of sgd, rowwise_adagrad"):
        build(str(tmp_path), DynamicTable(num_slots=32), data, optimizer="adagrad")
    with pytest.raises(ValueError, match="'t_u' is a dynamic table.*row_wise"):
        build(str(tmp_path), DynamicTable(num_slots=32), data, sharding_types={"t_u": "table_wise"})
    # A table shared by two features: FBGEMM's eviction reset indexes per-feature offsets with
    # a table index, so evicting from one table would zero rows of another.
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from recsys_trainer.dynamic import DynamicEmbeddingBagCollection

    shared = EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=32,
                                feature_names=["item", "hist_item"])
    with pytest.raises(ValueError, match=r"dynamic table 't_item' is read by 2 features \(item, "
                                         r"hist_item\); a dynamic table takes exactly one feature"):
        DynamicEmbeddingBagCollection([shared], DynamicTable(num_slots=32))
    with pytest.raises(ValueError, match="negative id -5; raw ids must be in"):
        mix_ids(torch.tensor([3, -5, 7]))


# ------------------------------------------------------------------------ one rank, in process

def test_every_raw_id_gets_its_own_row_when_they_fit_and_unknown_ids_read_the_default_row(
        tmp_path: Any) -> None:
    stream = IdStream(FEATS, 40)
    data = stream.batches(6, 32, seed=0)
    t = build(str(tmp_path), DynamicTable(num_slots=64, eviction_interval=2), data, train_steps=6)
    t.train()
    ids, slots = resident_ids(t, "t_u")
    # Passes run in steps 2, 4 and 6 and admit what they saw: every id; no two share a row.
    assert set(ids.tolist()) == seen_ids(data, "u")
    assert len(set(slots.tolist())) == len(slots) and int(slots.max()) < 63
    # In eval mode the map is read-only: a resident id reads its slot, a new one the default.
    t.model.eval()
    known, unknown = int(ids[0]), 2**62 + 12345
    m: Any = mc_modules(t.model)["t_u"]
    out = m.remap(m.preprocess({"t_u": JaggedTensor(values=torch.tensor([known, unknown]),
                                                    lengths=torch.tensor([1, 1]))}))
    assert out["t_u"].values().tolist() == [int(slots[0]), 63]
    stats = table_stats(t.model)["t_u"]
    assert stats == {"slots": 64, "occupied": len(ids), "admitted": len(ids), "evicted": 0,
                     "passes": 3}


def test_more_ids_than_rows_evicts_and_the_cpu_reset_zeroes_the_row_and_its_adagrad_state(
        tmp_path: Any) -> None:
    data = IdStream(FEATS, 400).batches(8, 64, seed=1)
    t = build(str(tmp_path), DynamicTable(num_slots=32, eviction_interval=2), data, train_steps=8)
    t.train()
    stats = table_stats(t.model)["t_u"]
    assert stats["occupied"] == 31 and stats["evicted"] > 0
    # The reset torchrec calls on eviction (FBGEMM's op is CUDA-only): rows 3 and 7 of table
    # t_u -> zero weights and zero row-wise Adagrad accumulator, every other row untouched.
    coll: Any = next(c for _, c in dynamic_collections(t.model))
    tbe, idx = coll._table_to_tbe_and_index["t_u"]
    weight = tbe.split_embedding_weights()[int(idx)]
    momentum = tbe.split_optimizer_states()[int(idx)][0]
    assert (momentum[[3, 7]] > 0).all()
    before_w, before_m = weight.clone(), momentum.clone()
    tbe.reset_embedding_weight_momentum(
        pruned_indices=torch.tensor([3, 7]), pruned_indices_offsets=torch.tensor([0, 2]),
        logical_table_ids=idx, buffer_ids=torch.tensor([0], dtype=torch.int))
    assert (weight[[3, 7]] == 0).all() and (momentum[[3, 7]] == 0).all()
    rest = [r for r in range(32) if r not in (3, 7)]
    assert torch.equal(weight[rest], before_w[rest]) and torch.equal(momentum[rest], before_m[rest])


def test_an_id_needs_admission_threshold_sightings_in_an_interval_to_get_a_row(
        tmp_path: Any) -> None:
    often, once = 5_000_000_000_001, 5_000_000_000_002
    # One batch of 4 rows: feature u has `often` 3 times and `once` once; i has one id.
    kjt = KeyedJaggedTensor(keys=list(FEATS),
                            values=torch.tensor([often, often, often, once, 9, 9, 9, 9]),
                            lengths=torch.ones(8, dtype=torch.int32), stride=4)
    batch = Batch(dense=torch.zeros(4, 4), sparse=kjt, labels=torch.tensor([1.0, 0, 1, 0]))
    t = build(str(tmp_path), DynamicTable(num_slots=16, eviction_interval=1, admission_threshold=3),
              [batch], train_steps=1)
    t.train()
    assert resident_ids(t, "t_u")[0].tolist() == [often]
    assert resident_ids(t, "t_i")[0].tolist() == [9]


def list_batches(sizes: list[int], num_ids: int, max_len: int, seed: int) -> list[Batch]:
    """Batches of ``sizes`` rows; feature u is a list of 0..max_len raw ids per row, i one id."""
    g = torch.Generator().manual_seed(seed)
    base = 7_000_000_000_000
    out = []
    for rows in sizes:
        lu = torch.randint(0, max_len + 1, (rows,), generator=g, dtype=torch.int32)
        u = base + torch.randint(0, num_ids, (int(lu.sum()),), generator=g)
        i = base + torch.randint(0, num_ids, (rows,), generator=g)
        kjt = KeyedJaggedTensor(keys=list(FEATS), values=torch.cat([u, i]),
                                lengths=torch.cat([lu, torch.ones(rows, dtype=torch.int32)]),
                                stride=rows)
        out.append(Batch(dense=torch.randn(rows, 4, generator=g), sparse=kjt,
                         labels=(torch.rand(rows, generator=g) < 0.5).float()))
    return out


def ids_over_threshold(batches: list[Batch], feature: str, interval: int, threshold: int) -> set[int]:
    """Ids seen ``threshold`` times within some interval of ``interval`` batches."""
    out: set[int] = set()
    for lo in range(0, len(batches), interval):
        seen = torch.cat([b.sparse[feature].values() for b in batches[lo:lo + interval]])
        ids, counts = torch.unique(seen, return_counts=True)
        out.update(ids[counts >= threshold].tolist())
    return out


def test_a_short_first_batch_does_not_starve_admission_also_with_list_features(
        tmp_path: Any) -> None:
    # torchrec sizes its id history from the first batch (ids x interval x 1.25) and drops what
    # does not fit: a 1-row first batch left room for about 10 ids per interval.
    data = list_batches([1] + [48] * 7, num_ids=300, max_len=4, seed=0)
    spec = DynamicTable(num_slots=1024, eviction_interval=4, admission_threshold=2)
    t = build(str(tmp_path), spec, data, train_steps=8)
    t.train()
    for feature in FEATS:
        want = ids_over_threshold(data, feature, interval=4, threshold=2)
        assert len(want) > 50
        # Free slots abound: every id that met the threshold in an interval has its own row.
        assert set(resident_ids(t, f"t_{feature}")[0].tolist()) == want, feature


def test_eviction_interval_counts_optimizer_steps_under_gradient_accumulation(
        tmp_path: Any) -> None:
    from recsys_trainer.hooks import LambdaHook

    # Windows of 3 micro-batches at gradient_accumulation_steps=2: steps of 2 and 1 micro-batches.
    raw = IdStream(FEATS, 100).batches(9, 16, seed=0)
    data = _Windows(raw, per_window=3)
    passes: list[int] = []
    t = build(str(tmp_path), DynamicTable(num_slots=256, eviction_interval=2), data,
              gradient_accumulation_steps=2)
    t.add_hook(LambdaHook(after_step=lambda tr, out: passes.append(table_stats(tr.model)["t_u"]["passes"])))
    t.train()
    # 6 optimizer steps: a pass closes steps 2, 4 and 6, whatever their micro-batches.
    assert t.state.global_step == 6
    assert passes == [0, 1, 1, 2, 2, 3]
    # Free slots abound: the pass closing step 6 admitted every id, the last micro-batch's too.
    assert set(resident_ids(t, "t_u")[0].tolist()) == seen_ids(raw, "u")
    # The schedule is checkpointed in steps; a checkpoint from before (no step keys) counted
    # forwards, which were steps without accumulation.
    from recsys_trainer.dynamic import DynamicTablesState

    state = DynamicTablesState(t.model, 1)
    saved = state.state_dict()
    assert (saved["tables"]["t_u"]["steps"], saved["tables"]["t_u"]["current_iter"]) == (6, 9)
    for st in saved["tables"].values():
        del st["steps"], st["last_pass_step"]
    state.load_state_dict(saved)
    m: Any = mc_modules(t.model)["t_u"]
    assert (m._steps, m._last_pass_step) == (9, 9)


# -------------------------------------------------------------------------- two ranks

def _two_rank_resume(root: str) -> dict[str, Any]:
    stream = IdStream(FEATS, 300)
    rank = int(os.environ["RANK"])
    # A 2-row first batch: the id history grows past the size it starts with, and resumes.
    data = stream.batches(1, 2, seed=10 + rank) + stream.batches(9, 64, seed=rank)
    spec = DynamicTable(num_slots=32, eviction_interval=3, admission_threshold=2)
    full = build(os.path.join(root, "full"), spec, data, train_steps=10, save_steps=10)
    full.train()
    exported = export_dynamic(os.path.join(root, "full", "step_00000010"))
    cut = os.path.join(root, "cut")
    # Saved at step 4: one step into an interval, so the history must be restored too.
    build(cut, spec, data, train_steps=4, save_steps=4).train()
    resumed = build(cut, spec, data, train_steps=10)
    resumed.train()
    equal = bitwise_verdict(snapshot(resumed), snapshot(full))
    return {"equal": equal, "stats": table_stats(full.model), "stats_resumed":
            table_stats(resumed.model), "ids": resident_ids(full, "t_u")[0].tolist(),
            "exported": exported.tables["t_u"].ids.tolist(),
            "defaults": exported.tables["t_u"].default.shape[0]}


def _resume_at_one_rank(root: str) -> str:
    data = IdStream(FEATS, 300).batches(10, 64, seed=0)
    spec = DynamicTable(num_slots=32, eviction_interval=3, admission_threshold=2, buckets=2)
    try:
        build(os.path.join(root, "cut"), spec, data, train_steps=10,
              reshard_data_position="restart_window").train()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    return "no error"


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_two_ranks_train_evict_and_resume_bitwise_and_another_world_size_is_refused(
        tmp_path: Any) -> None:
    r0, r1 = run_distributed(_two_rank_resume, world_size=2, timeout_s=240, args=(str(tmp_path),))
    for r in (r0, r1):
        assert r["equal"] == "yes", r["equal"]
        assert r["stats"] == r["stats_resumed"]
        assert r["stats"]["t_u"]["evicted"] > 0 and r["stats"]["t_u"]["occupied"] == 15
    # Each rank owns the ids of its buckets: no id is resident on both.
    assert not set(r0["ids"]) & set(r1["ids"])
    # The merged export holds both ranks' ids and both shards' default rows.
    assert r0["exported"] == sorted(r0["ids"] + r1["ids"]) and r0["defaults"] == 2
    (msg,) = run_distributed(_resume_at_one_rank, world_size=1, timeout_s=120,
                             args=(str(tmp_path),))
    assert "checkpointed at world size 2 and cannot be resumed at 1" in msg, msg


# ------------------------------------------------------------------------------ exports

def assert_exports_equal(a: DynamicExport, b: DynamicExport) -> None:
    assert a.tables.keys() == b.tables.keys() and a.other.keys() == b.other.keys()
    for name, t in a.tables.items():
        u = b.tables[name]
        assert torch.equal(t.ids, u.ids) and torch.equal(t.vectors, u.vectors), name
        assert torch.equal(t.default, u.default), name
    for k, v in a.other.items():
        assert torch.equal(v, b.other[k]), k


def test_export_maps_raw_ids_to_their_rows_and_base_plus_deltas_equals_the_full_export(
        tmp_path: Any) -> None:
    out = str(tmp_path / "run")
    data = IdStream(FEATS, 400).batches(9, 64, seed=2)
    t = build(out, DynamicTable(num_slots=64, eviction_interval=2), data, train_steps=9,
              save_steps=3, max_to_keep=5)
    t.train()
    ck = [os.path.join(out, f"step_{s:08d}") for s in (3, 6, 9)]
    exp = str(tmp_path / "exports")
    base = export_dynamic(ck[0], os.path.join(exp, "full_3.pt"))
    d1 = write_delta(ck[1], os.path.join(exp, "full_3.pt"), os.path.join(exp, "delta_6.pt"),
                     full_out_file=os.path.join(exp, "full_6.pt"))
    d2 = write_delta(ck[2], os.path.join(exp, "full_6.pt"), os.path.join(exp, "delta_9.pt"))
    full = export_dynamic(ck[2])
    rebuilt = apply_delta(apply_delta(load_export(os.path.join(exp, "full_3.pt")),
                                      load_export(os.path.join(exp, "delta_6.pt"))),
                          load_export(os.path.join(exp, "delta_9.pt")))
    assert_exports_equal(rebuilt, full)
    assert rebuilt.step == 9 and d1.base_step == 3 and d2.step == 9
    # Deltas carry only changed rows: rare ids not seen between two exports keep their vector.
    for d in (d1, d2):
        assert 0 < d.num_rows() < sum(len(x.ids) for x in full.tables.values())
    assert len(d1.tables["t_u"].deleted_ids) > 0  # 400 ids through 63 rows: some were evicted
    with pytest.raises(ValueError, match="apply deltas in order"):
        apply_delta(base, d2)
    # The export's vector of a resident raw id is the row the trained model reads for it.
    ids, slots = resident_ids(t, "t_u")
    coll: Any = next(c for _, c in dynamic_collections(t.model))
    tbe, idx = coll._table_to_tbe_and_index["t_u"]
    weight = tbe.split_embedding_weights()[int(idx)]
    vec, found = full.tables["t_u"].lookup(ids)
    assert found.all() and torch.equal(vec, weight[slots])
    assert set(full.tables["t_u"].ids.tolist()) == set(ids.tolist())
    assert torch.equal(full.tables["t_u"].default, weight[[63]])


class _Windows:
    """Three windows of batches from one id stream (a WindowedDataset over lists)."""

    def __new__(cls, batches: list[Any], per_window: int) -> Any:
        from recsys_trainer.data.base import WindowedDataset

        class Windows(WindowedDataset):
            def window_ids(self) -> Any:
                return iter(f"w{i}" for i in range(len(batches) // per_window))

            def iter_window(self, window_id: str, skip_batches: int = 0) -> Any:
                i = int(window_id[1:])
                return iter(batches[i * per_window + skip_batches:(i + 1) * per_window])

        return Windows()


def test_occupancy_admissions_and_evictions_are_reported_per_window_to_logs_tensorboard_and_jsonl(
        tmp_path: Any, caplog: Any) -> None:
    import logging

    from recsys_trainer import JsonlMetricsHook, TensorBoardHook
    from recsys_trainer.hooks import DynamicTableStatsHook, read_jsonl

    data = _Windows(IdStream(FEATS, 400).batches(9, 64, seed=3), per_window=3)
    torch.manual_seed(0)
    model = DLRMClassifier(list(FEATS), 4, embedding_dim=8, dense_arch=(16,), over_arch=(16, 1),
                           dynamic=DynamicTable(num_slots=32, eviction_interval=2))
    tb_dir = str(tmp_path / "tb")
    t = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), log_steps=1000),
                train_dataset=data, hooks=[TensorBoardHook(log_dir=tb_dir), JsonlMetricsHook()],
                dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1), add_logger_hook=False)
    # Added by the Trainer because the model has dynamic tables, ahead of the reporters.
    assert isinstance(next(iter(t.hooks)), DynamicTableStatsHook)
    with caplog.at_level(logging.INFO, logger="recsys_trainer"):
        t.train()
    records = [r for r in read_jsonl(os.path.join(str(tmp_path), "metrics.jsonl"))
               if r["type"] == "metrics" and "dynamic/t_u/occupancy" in r]
    assert [r["window_id"] for r in records] == ["w0", "w1", "w2"]
    assert [r["window_index"] for r in records] == [0, 1, 2]
    final = table_stats(t.model)["t_u"]
    # Per-window figures add up to the table's counters since the start.
    assert sum(r["dynamic/t_u/admitted"] for r in records) == final["admitted"]
    assert sum(r["dynamic/t_u/evicted"] for r in records) == final["evicted"] > 0
    assert records[-1]["dynamic/t_u/occupied"] == final["occupied"]
    assert records[-1]["dynamic/t_u/occupancy"] == pytest.approx(final["occupied"] / final["slots"])
    assert sum("dynamic table t_u after window w2" in m for m in caplog.messages) == 1

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    events = acc.Scalars("train_window/dynamic/t_i/evicted")
    assert [e.step for e in events] == [0, 1, 2]
    assert sum(e.value for e in events) == table_stats(t.model)["t_i"]["evicted"]


_NO_LOGGING_SETUP = r"""
import logging, sys
from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.id_stream import IdStream
from recsys_trainer.dynamic import DynamicTable
from recsys_trainer.models import DLRMClassifier

batches = IdStream(("u", "i"), 100).batches(4, 16, seed=0)
model = DLRMClassifier(["u", "i"], 4, embedding_dim=8, dense_arch=(16,), over_arch=(16, 1),
                       dynamic=DynamicTable(num_slots=64, eviction_interval=2))
t = Trainer(model=model, args=TrainingArguments(output_dir=sys.argv[1], log_steps=2),
            train_dataset=batches, eval_dataset=batches[:1],
            sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1))
t.train()
print("=== the program configures logging", file=sys.stderr, flush=True)
# force: importing torchrec already gave the root logger a handler (fbgemm_gpu's logging.info).
logging.basicConfig(format="PROGRAM %(message)s", level=logging.WARNING, force=True)
t.evaluate()
"""


def test_the_per_window_and_loss_lines_show_in_a_program_that_sets_up_no_logging(
        tmp_path: Any) -> None:
    import subprocess
    import sys

    # A fresh interpreter: pytest's own logging handlers would hide the difference.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    r = subprocess.run([sys.executable, "-c", _NO_LOGGING_SETUP, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    before, after = r.stderr.split("=== the program configures logging")
    lines = before.splitlines()
    for line in ("dynamic table t_u after window all: ", "step 2 | epoch 0 | loss",
                 "step 4 | epoch 0 | loss"):
        assert sum(line in x for x in lines) == 1, (line, before)
    # The program's handlers show them, once (its root level does not hide the project's INFO
    # lines: the logger's own level does, if the program sets it).
    shown = [x for x in after.splitlines() if "eval @ step 4" in x]
    assert len(shown) == 1 and shown[0].startswith("PROGRAM eval @ step 4"), after


def test_a_model_bank_warm_start_of_a_dynamic_table_is_refused_naming_the_key(tmp_path: Any) -> None:
    from recsys_trainer.checkpoint.errors import CheckpointError

    data = IdStream(FEATS, 100).batches(4, 32, seed=0)
    src = build(str(tmp_path / "src"), DynamicTable(num_slots=32, eviction_interval=2), data,
                train_steps=4, save_end=True)
    src.train()
    with pytest.raises(CheckpointError, match=r"model bank: '.*' belongs to a dynamic table, which "
                                              r"cannot be warm-started"):
        build(str(tmp_path / "dst"), DynamicTable(num_slots=32, eviction_interval=2), data,
              train_steps=4, model_bank=[{"path": str(tmp_path / "src")}]).train()


def test_a_delta_compares_rows_bitwise_so_a_sign_of_zero_change_is_sent_and_nan_rows_are_not_resent() -> None:
    from recsys_trainer.checkpoint.dynamic_export import TableExport, dynamic_delta

    ids = torch.tensor([1, 2, 3])
    base = DynamicExport(tables={"t": TableExport(ids, torch.tensor([[0.0], [float("nan")], [1.0]]),
                                                  torch.zeros(1, 1))}, other={})
    new = DynamicExport(tables={"t": TableExport(ids, torch.tensor([[-0.0], [float("nan")], [1.0]]),
                                                 torch.zeros(1, 1))}, other={})
    assert dynamic_delta(base, new).tables["t"].upsert_ids.tolist() == [1]
