"""Dynamic (managed-collision) embedding tables: raw ids without collisions, admission, eviction
on CPU, checkpoints and exports; at 1 rank in-process and 2 real gloo ranks."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import bitwise_verdict, local, snapshot
from torch import nn
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
from recsys_trainer.data.generators.id_stream import IdStream
from recsys_trainer.dynamic import (
    COUNT_ONE,
    EMPTY_SLOT,
    ID_SPACE,
    MEMORY_PARTS,
    DynamicEmbeddingBagCollection,
    DynamicShardedMaps,
    DynamicTable,
    MixedEmbeddingBagCollection,
    bookkeeping_per_slot,
    dynamic_collections,
    fallback_index,
    id_map,
    map_memory,
    mc_modules,
    mix_ids,
    shard_of,
    table_memory,
    table_stats,
    unmix_ids,
)
from recsys_trainer.dynamic.id_map import ITER_REBASE
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.storage import StorageError

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
    with pytest.raises(ValueError, match="negative id -5; raw ids must be in"):
        mix_ids(torch.tensor([3, -5, 7]))
    with pytest.raises(ValueError, match=r"`DynamicTable.eviction_interval\*` must be one of "
                                         r"eviction_interval \(steps\), eviction_interval_rows"):
        DynamicTable(num_slots=8, eviction_interval=3, eviction_interval_rows=100)
    with pytest.raises(ValueError, match="`DynamicTable.history_slots` must be None with "
                                         "eviction_policy='lfu'"):
        DynamicTable(num_slots=8, eviction_policy="lfu", history_slots=100)
    with pytest.raises(ValueError, match="`DynamicTable.eviction_policy` must be one that records "
                                         "when an id was last seen"):
        DynamicTable(num_slots=8, eviction_policy="lfu", expire_after_windows=2)
    with pytest.raises(ValueError, match="`DynamicTable.fallback_rows` must be less than "
                                         "num_slots"):
        DynamicTable(num_slots=8, fallback_rows=8)
    with pytest.raises(ValueError, match="`DynamicTable.pooled_lookup` must be true or false, "
                                         "but is 'no'"):
        DynamicTable(num_slots=8, pooled_lookup="no")  # type: ignore[arg-type]
    from recsys_trainer.models import make_tables

    with pytest.raises(ValueError, match="`DynamicTable.pooled_lookup` must be the same for the "
                                         "tables of one DynamicEmbeddingBagCollection"):
        DynamicEmbeddingBagCollection(make_tables(list(FEATS), 8, 4), {
            "t_u": DynamicTable(num_slots=8),
            "t_i": DynamicTable(num_slots=8, pooled_lookup=False)})
    # 15 fallback rows over 2 shards of 8 rows: 8 per shard leaves no slot for an id.
    model = DLRMClassifier(list(FEATS), 4, embedding_dim=8,
                           dynamic=DynamicTable(num_slots=16, fallback_rows=15))
    with pytest.raises(ValueError, match=r"fallback_rows \(table 't_u'\)` must be fewer than the "
                                         r"8 rows of each of its 2 shard\(s\), but is 15"):
        mc_modules(model)["t_u"].rebuild_with_output_id_range((8, 16), [0, 8, 16])
    # The measured defaults (docs/dynamic.md): a pass every max(2048, num_slots) rows.
    d = DynamicTable(num_slots=1600)
    assert (d.eviction_policy, d.eviction_interval_rows, d.eviction_interval, d.history_slots,
            d.fallback_rows, d.admission_threshold) == ("decayed_lfu", 2048, None, 200, 1, 2.0)
    assert DynamicTable(num_slots=10_000).eviction_interval_rows == 10_000
    assert DynamicTable(num_slots=8, eviction_interval=5).eviction_interval_rows is None


# ------------------------------------------------------------------------ one rank, in process

def test_every_raw_id_gets_its_own_row_when_they_fit_and_unknown_ids_read_the_default_row(
        tmp_path: Any) -> None:
    stream = IdStream(FEATS, 40)
    data = stream.batches(6, 32, seed=0)
    t = build(str(tmp_path), DynamicTable(num_slots=64, eviction_interval=2, admission_threshold=1),
              data, train_steps=6)
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
    assert stats == {"slots": 64, "fallback_rows": 1, "occupied": len(ids), "admitted": len(ids),
                     "evicted": 0, "expired": 0, "passes": 3, "dropped": 0, "counters_epoch": 0}


def test_more_ids_than_rows_evicts_and_the_cpu_reset_zeroes_the_row_and_its_adagrad_state(
        tmp_path: Any) -> None:
    """Also: a reset row outside its table is refused, the next table untouched."""
    data = IdStream(FEATS, 400).batches(8, 64, seed=1)
    t = build(str(tmp_path), DynamicTable(num_slots=32, eviction_interval=2, admission_threshold=1),
              data, train_steps=8)
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
    # A reset row outside its table is refused and the next table is untouched. The table laid
    # out first in the host buffer: its row 32 would be the next table's row 0.
    first = min(range(2), key=lambda k: int(tbe.weights_offsets[list(tbe.feature_table_map)
                                                                 .index(k)]))
    before = [w.clone() for w in tbe.split_embedding_weights()]
    with pytest.raises(IndexError):
        tbe.reset_embedding_weight_momentum(
            pruned_indices=torch.tensor([32]), pruned_indices_offsets=torch.tensor([0, 1]),
            logical_table_ids=torch.tensor([first]), buffer_ids=torch.tensor([0], dtype=torch.int))
    assert all(torch.equal(a, b) for a, b in zip(before, tbe.split_embedding_weights(), strict=True))


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
    spec = DynamicTable(num_slots=1024, eviction_policy="distance_lfu", eviction_interval=4,
                        admission_threshold=2)
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
    t = build(str(tmp_path), DynamicTable(num_slots=256, eviction_interval=2, admission_threshold=1),
              data, gradient_accumulation_steps=2)
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


# ------------------------------------------------------------------ passes, admission, history

def passes_per_step(trainer: Trainer, table: str = "t_u") -> list[int]:
    """Adds a hook that records the table's pass count after every step; returns the list."""
    from recsys_trainer.hooks import LambdaHook

    out: list[int] = []
    trainer.add_hook(LambdaHook(
        after_step=lambda tr, _: out.append(table_stats(tr.model)[table]["passes"])))
    return out


def test_a_pass_runs_every_eviction_interval_rows_whatever_the_batch_size(tmp_path: Any) -> None:
    stream = IdStream(FEATS, 100)
    # 6 batches of 16 rows, then 2 of 48: a pass after rows 48, 96, 144 and 192.
    data = stream.batches(6, 16, seed=0) + stream.batches(2, 48, seed=1)
    t = build(str(tmp_path), DynamicTable(num_slots=256, eviction_interval_rows=48,
                                          admission_threshold=1), data)
    passes = passes_per_step(t)
    t.train()
    assert passes == [0, 0, 1, 1, 1, 2, 3, 4]
    # The last pass saw every id of the last 48 rows: all admitted (room for all).
    assert seen_ids(data[-1:], "u") <= set(resident_ids(t, "t_u")[0].tolist())


class FakeClock:
    """Stands in for the ``time`` module inside ``recsys_trainer.dynamic``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def test_a_pass_runs_once_eviction_interval_seconds_have_passed_at_a_step_end(
        tmp_path: Any, monkeypatch: Any) -> None:
    import recsys_trainer.dynamic.id_map as dyn
    from recsys_trainer.hooks import LambdaHook

    clock = FakeClock()
    monkeypatch.setattr(dyn, "time", clock)
    data = IdStream(FEATS, 100).batches(8, 16, seed=0)
    t = build(str(tmp_path), DynamicTable(num_slots=256, eviction_interval_seconds=60,
                                          admission_threshold=1), data)
    passes = passes_per_step(t)
    t.add_hook(LambdaHook(after_step=lambda tr, _: setattr(clock, "now", clock.now + 25.0)))
    t.train()
    # Steps at t = 1000, 1025, ...: 75 s after the start (step 4) and after that pass (step 7).
    assert passes == [0, 0, 0, 1, 1, 1, 2, 2]


def one_id_batches(steps: int, often: int, seed: int) -> list[Batch]:
    """Batches of 4 rows: feature u holds ``often`` once and 3 ids never seen again."""
    out = []
    for s in range(steps):
        fillers = [10_000_000_000 + 100 * s + j + 1000 * seed for j in range(3)]
        kjt = KeyedJaggedTensor(keys=list(FEATS), values=torch.tensor([often, *fillers, 9, 9, 9, 9]),
                                lengths=torch.ones(8, dtype=torch.int32), stride=4)
        out.append(Batch(dense=torch.zeros(4, 4), sparse=kjt, labels=torch.tensor([1.0, 0, 1, 0])))
    return out


def test_admission_counts_sightings_over_a_decaying_window_not_one_interval(tmp_path: Any) -> None:
    often = 5_000_000_000_001
    data = one_id_batches(4, often, seed=0)
    # Once per interval of one step. decayed_lfu carries its count (halving every 4 passes):
    # 1, then 1 + 2**-0.25 = 1.84, then 2.55 >= 2 at the third pass.
    spec = DynamicTable(num_slots=32, eviction_interval=1, admission_threshold=2,
                        count_half_life=4)
    t = build(str(tmp_path / "decayed"), spec, data)
    resident: list[bool] = []
    from recsys_trainer.hooks import LambdaHook

    t.add_hook(LambdaHook(after_step=lambda tr, _: resident.append(
        often in resident_ids(tr, "t_u")[0].tolist())))
    t.train()
    assert resident == [False, False, True, True]
    # The ids seen once wait with their decayed count, and never reach the threshold.
    ids, counts, waiting = mc_modules(t.model)["t_u"].history_state()
    assert ids.numel() == waiting == 12
    decayed, count = [], COUNT_ONE
    for _ in range(4):  # the fillers of steps 4, 3, 2, 1: decayed 1 to 4 times
        count = int(count * 2 ** -0.25)
        decayed += [count] * 3
    assert sorted(counts.tolist()) == sorted(decayed)
    assert resident_ids(t, "t_u")[0].tolist() == [often]
    # Counted within one interval (torchrec's policies), the id never gets a row.
    legacy = build(str(tmp_path / "legacy"), DynamicTable(
        num_slots=32, eviction_policy="distance_lfu", eviction_interval=1,
        admission_threshold=2), data)
    legacy.train()
    assert resident_ids(legacy, "t_u")[0].tolist() == []


def test_the_history_is_bounded_keeps_the_most_seen_ids_and_counts_the_dropped(
        tmp_path: Any) -> None:
    y, z = 7_000_000_000_001, 7_000_000_000_002
    u = [7_100_000_000_000 + j for j in range(60)] + [y] * 5 + [z] * 3
    n = len(u)
    kjt = KeyedJaggedTensor(keys=list(FEATS), values=torch.tensor(u + [9] * n),
                            lengths=torch.ones(2 * n, dtype=torch.int32), stride=n)
    batch = Batch(dense=torch.zeros(n, 4), sparse=kjt, labels=(torch.arange(n) % 2).float())
    spec = DynamicTable(num_slots=64, eviction_interval=1, admission_threshold=3, history_slots=8)
    t = build(str(tmp_path), spec, [batch])
    t.train()
    m: Any = mc_modules(t.model)["t_u"]
    # 62 distinct ids into a history of 8 waiting ids (and room for 8 sightings): coalesced,
    # the 8 most seen kept. Its bytes: 8 int64 ids and float32 counts, 8 more int64 ids.
    assert m._input_history_buffer_size == 16 and m._history_keep == 8
    assert table_memory(t.model)["t_u"]["history"] == 8 * (8 + 4) + 8 * 8
    assert table_stats(t.model)["t_u"]["dropped"] == 62 - 8
    assert sorted(resident_ids(t, "t_u")[0].tolist()) == [y, z]


def test_a_dynamic_tables_bookkeeping_is_at_most_24_bytes_a_slot_counted_from_its_tensors(
        tmp_path: Any) -> None:
    # ~1,200 u ids a batch: the bucket index of large lookups is built and counted too (a size
    # just above a power of two, where the index is relatively largest).
    data = list_batches([400] * 3, num_ids=9000, max_len=6, seed=3)
    t = build(str(tmp_path), DynamicTable(num_slots=4097), data)
    t.train()
    m: Any = mc_modules(t.model)["t_u"]
    parts = map_memory(m)
    assert parts["index"] > 0 and parts["history"] > 0
    # Every tensor of the map counted once, in one part ...
    tensors = {id(b): b for b in m.buffers()} | {id(m._history_accumulator): m._history_accumulator}
    assert sum(parts.values()) == sum(x.nbytes for x in tensors.values())
    # ... the map and the policy from their element sizes, per slot ...
    slots = int(m._zch_size)
    per_slot = m._mch_sorted_raw_ids.element_size() + m._mch_remapped_ids_mapping.element_size() \
        + sum(b.element_size() for b in m._mch_metadata.values())
    assert parts["id_map"] + parts["policy"] == slots * per_slot
    # ... and the history bounded: its waiting ids and counts, room for as many sightings.
    keep = m._history_keep
    assert keep == 4097 // 8 and parts["history"] == keep * (2 * 8 + 4)
    assert bookkeeping_per_slot(m) <= 24.0, parts
    assert table_memory(t.model)["t_u"]["total"] == sum(
        table_memory(t.model)["t_u"][k] for k in MEMORY_PARTS)


def test_the_bookkeeping_is_at_most_24_bytes_a_slot_at_any_size_from_512_slots() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    def id_map_of(slots: int) -> Any:
        table = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=slots,
                                   feature_names=["f"])
        spec = DynamicTable(num_slots=slots)
        return mc_modules(DynamicEmbeddingBagCollection([table], spec))["t"]

    g = torch.Generator().manual_seed(0)
    # Just above a power of two (the index relatively largest), at the finest index
    # (5,464 slots: 1.5 bytes a slot), and between.
    for slots in (512, 513, 2049, 4097, 5464, 8193, 100_000, 131_073):
        m = id_map_of(slots)
        m._lookup(torch.randint(0, 2**63 - 1, (2 * id_map.INDEXED_LOOKUP_MIN_IDS,),
                                generator=g))
        assert map_memory(m)["index"] > 0
        assert bookkeeping_per_slot(m) <= 24.0, (slots, map_memory(m))
    # Below 512 slots the history keeps 64 ids (1,280 bytes) whatever the size.
    for slots in (64, 300):
        m = id_map_of(slots)
        assert m._history_keep == 64
        assert bookkeeping_per_slot(m) == 20 + 64 * 20 / slots


def test_ids_without_a_row_read_their_fallback_row_which_trains_and_the_export_serves(
        tmp_path: Any) -> None:
    data = IdStream(FEATS, 300).batches(6, 64, seed=4)
    # No id reaches the threshold: every id reads one of the 4 fallback rows (slots 28..31).
    spec = DynamicTable(num_slots=32, fallback_rows=4, admission_threshold=10_000)
    t = build(str(tmp_path), spec, data, train_steps=6, save_end=True)
    coll: Any = next(c for _, c in dynamic_collections(t.model))
    tbe, idx = coll._table_to_tbe_and_index["t_u"]
    weight = tbe.split_embedding_weights()[int(idx)]
    before = weight.clone()
    t.train()
    raw = data[0].sparse["u"].values()
    m: Any = mc_modules(t.model)["t_u"]
    slots = m.remap(m.preprocess({"t_u": JaggedTensor(values=raw, lengths=torch.ones_like(raw))}))
    want = 28 + fallback_index(mix_ids(raw), 4)
    assert torch.equal(slots["t_u"].values(), want) and len(set(want.tolist())) == 4
    # Trained like any row; the id rows were never read.
    assert not torch.equal(weight[28:], before[28:]) and torch.equal(weight[:28], before[:28])
    exported = export_dynamic(os.path.join(str(tmp_path), "step_00000006")).tables["t_u"]
    assert len(exported.ids) == 0 and torch.equal(exported.default, weight[28:])
    assert torch.equal(exported.vectors_for(raw), weight[want])


def window_batches(ids_per_window: list[list[int]], rows: int = 4) -> list[Batch]:
    """One batch per window: feature u cycles through the window's ids, i is always 9."""
    out = []
    for ids in ids_per_window:
        u = [ids[j % len(ids)] for j in range(rows)]
        kjt = KeyedJaggedTensor(keys=list(FEATS), values=torch.tensor(u + [9] * rows),
                                lengths=torch.ones(2 * rows, dtype=torch.int32), stride=rows)
        out.append(Batch(dense=torch.zeros(rows, 4), sparse=kjt,
                         labels=(torch.arange(rows) % 2).float()))
    return out


def test_ids_unseen_for_n_windows_expire_free_their_rows_and_show_in_stats_and_deltas(
        tmp_path: Any) -> None:
    from recsys_trainer import JsonlMetricsHook
    from recsys_trainer.checkpoint.dynamic_export import dynamic_delta
    from recsys_trainer.hooks import read_jsonl

    a, b = 3_000_000_000_001, 3_000_000_000_002
    data = _Windows(window_batches([[a, b], [a], [a]]), per_window=1)
    spec = DynamicTable(num_slots=64, eviction_interval=1, admission_threshold=1,
                        expire_after_windows=1)
    out = str(tmp_path)
    torch.manual_seed(0)
    model = DLRMClassifier(list(FEATS), 4, embedding_dim=8, dense_arch=(16,), over_arch=(16, 1),
                           dynamic=spec)
    t = Trainer(model=model, args=TrainingArguments(output_dir=out, log_steps=1000,
                                                    save_every_n_windows=1, max_to_keep=5),
                train_dataset=data, hooks=[JsonlMetricsHook()],
                dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1), add_logger_hook=False)
    coll: Any = next(c for _, c in dynamic_collections(t.model))
    tbe, idx = coll._table_to_tbe_and_index["t_u"]
    rows: dict[int, Any] = {}
    from recsys_trainer.hooks import LambdaHook

    def after_window(tr: Trainer, window: str) -> None:
        ids, slots = resident_ids(tr, "t_u")
        rows[len(rows)] = (dict(zip(ids.tolist(), slots.tolist(), strict=True)),
                           tbe.split_embedding_weights()[int(idx)].clone(),
                           tbe.split_optimizer_states()[int(idx)][0].clone())

    t.add_hook(LambdaHook(after_window=after_window))
    t.train()
    (map0, w0, _), (map1, w1, m1), (map2, _, _) = rows[0], rows[1], rows[2]
    # b was unseen during window 1: gone at its end, although 61 slots were free.
    assert set(map0) == {a, b} and set(map1) == {a} and set(map2) == {a}
    slot_b = map0[b]
    assert m1[slot_b] == 0 and not torch.equal(w1[slot_b], w0[slot_b])  # reset and re-initialised
    records = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl"))
               if r["type"] == "metrics" and "dynamic/t_u/expired" in r]
    assert [r["dynamic/t_u/expired"] for r in records] == [0, 1, 0]
    assert table_stats(t.model)["t_u"]["expired"] == 1
    d = dynamic_delta(export_dynamic(os.path.join(out, "step_00000001")),
                      export_dynamic(os.path.join(out, "step_00000002")))
    assert d.tables["t_u"].deleted_ids.tolist() == [b]


def test_ids_unseen_for_n_seconds_expire_at_a_pass(tmp_path: Any, monkeypatch: Any) -> None:
    import recsys_trainer.dynamic.id_map as dyn
    from recsys_trainer.hooks import LambdaHook

    clock = FakeClock()
    monkeypatch.setattr(dyn, "time", clock)
    a, b = 3_000_000_000_001, 3_000_000_000_002
    data = window_batches([[a, b]] * 2 + [[a]] * 8)
    spec = DynamicTable(num_slots=64, eviction_interval=1, admission_threshold=1,
                        expire_after_seconds=100)
    t = build(str(tmp_path), spec, data)
    seen: list[tuple[float, bool]] = []

    def tick(tr: Trainer, _: Any) -> None:
        seen.append((clock.now, b in resident_ids(tr, "t_u")[0].tolist()))
        clock.now += 30.0

    t.add_hook(LambdaHook(after_step=tick))
    t.train()
    gone = [now for now, there in seen if not there]
    # b was last seen at the pass of step 2 (t=1030); it goes at the first pass >= 100 s later
    # (within 1/16 of the span: the marks are that coarse), and a (seen every step) stays.
    assert gone and 1030 + 100 <= gone[0] <= 1030 + 100 + 30 + 100 / 16
    assert all(there for now, there in seen if now < gone[0])
    assert resident_ids(t, "t_u")[0].tolist() == [a]
    assert table_stats(t.model)["t_u"]["expired"] == 1


@pytest.mark.parametrize("start", [ITER_REBASE - 3, 2**31 - 3])
def test_a_map_resumed_near_2_31_forwards_admits_evicts_and_expires_as_one_counting_from_zero(
        tmp_path: Any, start: int) -> None:
    """The last access of every slot is an int32 forward count: a map resumed after ``start``
    forwards (a long-running online job) rebases it as it passes ``ITER_REBASE``, and every pass
    and expiry decides as in the run that started from zero."""
    from recsys_trainer.dynamic import DynamicTablesState
    from recsys_trainer.hooks import LambdaHook

    data = list_batches([32] * 8, num_ids=100, max_len=3, seed=1)
    spec = DynamicTable(num_slots=16, eviction_interval=1, expire_after_windows=1)
    runs = []
    for name, begin in (("zero", None), ("late", start)):
        t = build(str(tmp_path / name), spec, _Windows(data, per_window=2))
        if begin is not None:
            saved = DynamicTablesState(t.model, 1).state_dict()
            for st in saved["tables"].values():
                st["current_iter"] = st["last_eviction_iter"] = begin
            DynamicTablesState(t.model, 1).load_state_dict(saved)
        maps: list[list[int]] = []
        t.add_hook(LambdaHook(after_window=lambda tr, _w, maps=maps: maps.append(
            sorted(resident_ids(tr, "t_u")[0].tolist()))))
        t.train()
        runs.append((maps, table_stats(t.model)["t_u"],
                     mc_modules(t.model)["t_u"].state_dict()["_mch_last_access_iter"]))
    (maps0, stats0, _), (maps1, stats1, last) = runs
    assert maps1 == maps0 and len(maps0) == 4
    assert stats1 == stats0 and stats0["expired"] > 0 and stats0["evicted"] > 0
    assert last.dtype == torch.int32 and int(last.max()) < ITER_REBASE


# --------------------------------------------------------------------------- shared tables

class SharedTableModel(nn.Module):
    """Pooled features: ``i`` (a candidate item) and ``h`` (a list of past items) read one
    dynamic table ``t_i``; ``u`` reads ``t_u``; ``c`` (a category) a hashed table ``t_c``, in
    the same collection (``MixedEmbeddingBagCollection``); a linear layer over them and the
    dense part."""

    def __init__(self, spec: DynamicTable, dim: int = 8, mean_items: bool = False) -> None:
        super().__init__()
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

        tables = [EmbeddingBagConfig(name="t_i", embedding_dim=dim, num_embeddings=spec.num_slots,
                                     feature_names=["i", "h"],
                                     pooling=PoolingType.MEAN if mean_items else PoolingType.SUM),
                  EmbeddingBagConfig(name="t_c", embedding_dim=dim, num_embeddings=CATEGORIES,
                                     feature_names=["c"]),
                  EmbeddingBagConfig(name="t_u", embedding_dim=dim, num_embeddings=spec.num_slots,
                                     feature_names=["u"])]
        self.ebc = MixedEmbeddingBagCollection(tables, {"t_i": spec, "t_u": spec},
                                               device=torch.device("meta"))
        self.out = nn.Linear(4 * dim + 4, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        from recsys_trainer.models import weighted_bce_with_logits

        pooled = self.ebc(batch.sparse).values()
        logits = self.out(torch.cat([pooled, batch.dense], dim=1)).squeeze(-1)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()


CATEGORIES = 10


def shared_batches(sizes: list[int], items: tuple[int, int], seed: int) -> list[Batch]:
    """Batches of ``sizes`` rows: ``u`` one user id, ``i`` one item id from ``items`` (a
    range), ``h`` 0..3 items from the same range, ``c`` one category below ``CATEGORIES``."""
    g = torch.Generator().manual_seed(seed)
    base = 9_000_000_000_000
    out = []
    for rows in sizes:
        lh = torch.randint(0, 4, (rows,), generator=g, dtype=torch.int32)
        u = base + torch.randint(0, 60, (rows,), generator=g)
        i = base + torch.randint(*items, (rows,), generator=g)
        h = base + torch.randint(*items, (int(lh.sum()),), generator=g)
        c = torch.randint(0, CATEGORIES, (rows,), generator=g)
        ones = torch.ones(rows, dtype=torch.int32)
        kjt = KeyedJaggedTensor(keys=["i", "h", "u", "c"], values=torch.cat([i, h, u, c]),
                                lengths=torch.cat([ones, lh, ones, ones]), stride=rows)
        out.append(Batch(dense=torch.randn(rows, 4, generator=g), sparse=kjt,
                         labels=(torch.rand(rows, generator=g) < 0.5).float()))
    return out


def _reseed(trainer: Trainer) -> None:
    # An evicted or newly admitted row is re-initialised from the global RNG, whose state the
    # two lookup paths leave differently after sharding: seed it by step (resume-safe).
    torch.manual_seed(1000 + trainer.state.global_step)


def build_shared(out: str, spec: DynamicTable, data: Any, mean_items: bool = False,
                 reseed: bool = False, **args: Any) -> Trainer:
    """``reseed``: seed the global RNG before every step (only to compare the two lookup paths:
    a resume test with it would not see a checkpoint that fails to restore the RNG)."""
    from recsys_trainer.hooks import LambdaHook

    torch.manual_seed(0)
    args.setdefault("log_steps", 1000)
    return Trainer(model=SharedTableModel(spec, mean_items=mean_items),
                   args=TrainingArguments(output_dir=out, **args),
                   train_dataset=data, hooks=[LambdaHook(before_step=_reseed)] if reseed else [],
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                   add_logger_hook=False)


def test_a_pass_admits_and_evicts_exactly_as_torchrecs_update_and_evict() -> None:
    # DynamicMCHModule._admit skips torchrec's handling of resident ids in the input (a pass
    # ranks only ids of the history, which had no row when seen): two maps fed the same ids,
    # one admitting through torchrec's _update_and_evict, stay equal bit for bit.
    from recsys_trainer.dynamic import DynamicMCHModule, make_eviction_policy

    def torchrec_admit(m: Any, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        m._update_and_evict(ids, counts, {})
        pos = torch.searchsorted(m._mch_sorted_raw_ids, ids)
        return (m._mch_sorted_raw_ids[pos] == ids).nonzero().squeeze(1)

    for seed, fallback, half_life in ((0, 1, 4.0), (1, 3, 1e9), (2, 5, 2.0)):
        g = torch.Generator().manual_seed(seed)
        spec = DynamicTable(num_slots=48, eviction_interval=1, fallback_rows=fallback,
                            count_half_life=half_life, admission_threshold=1)
        maps: list[Any] = [
            DynamicMCHModule(zch_size=48, device=torch.device("cpu"),
                             eviction_policy=make_eviction_policy(spec), eviction_interval=1,
                             input_hash_size=2**63 - 1, input_hash_func=mix_ids, name="t",
                             buckets=1).train() for _ in range(2)]
        for m in maps:
            m.fallback_per_shard = fallback
        maps[1]._admit = lambda ids, counts, m=maps[1]: torchrec_admit(m, ids, counts)
        for step in range(16):  # a full map from the 3rd pass; ties between counts
            ids = mix_ids(torch.randint(0, 30 + 10 * step, (40,), generator=g))
            for m in maps:
                m.profile({"t": JaggedTensor(values=ids, lengths=torch.ones(40, dtype=torch.int64),
                                             weights=torch.tensor([40]))})
            evicted = [m.evict() for m in maps]
            # torchrec queues an empty reset when a pass admits none; ours queues nothing then.
            if evicted[1] is not None and evicted[1].numel() == 0:
                evicted[1] = None
            assert (evicted[0] is None) == (evicted[1] is None)
            assert evicted[0] is None or torch.equal(evicted[0], evicted[1])
            for k, v in maps[0].state_dict().items():
                assert torch.equal(v, maps[1].state_dict()[k]), (seed, step, k)
            assert maps[0].counters == maps[1].counters
            used = maps[0]._current_history_buffer_offset
            assert used == maps[1]._current_history_buffer_offset
            assert torch.equal(maps[0]._history_accumulator[:used],
                               maps[1]._history_accumulator[:used])
            assert torch.equal(maps[0]._history_counts, maps[1]._history_counts)
        assert maps[0].counters["evicted"] > 0 and maps[0].occupied() == 48 - fallback


def test_the_pass_ranks_and_sorts_the_map_exactly_as_torchrec_on_random_scores_with_ties(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass ranks new ids against the slots without torchrec's argsort of every score
    # (DecayedLFUEvictionPolicy.rank_new_ids) and re-sorts the map with its own
    # _sort_mch_buffers: both must give torchrec's tensors, in torchrec's order (the pairs of
    # evicted slot and new id), on scores with many ties and protected (int64 max) slots. The
    # ranking cuts the slots tied at the boundary before sorting from TRIM_TIES_MIN candidates
    # up: both ways are checked on every draw, and on maps of thousands of tied slots.
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    import recsys_trainer.dynamic.policy as policies
    from recsys_trainer.dynamic import DynamicMCHModule, make_eviction_policy
    from recsys_trainer.dynamic.policy import DecayedLFUEvictionPolicy

    g = torch.Generator().manual_seed(0)
    top = torch.iinfo(torch.int64).max
    policy: Any = make_eviction_policy(DynamicTable(num_slots=8))
    admitted = trimmed = 0
    for trial in range(440):
        n, k, protected, spread = (int(torch.randint(lo, hi, (1,), generator=g))
                                   for lo, hi in ((0, 40), (0, 50), (0, 4), (1, 8)))
        if trial >= 400:  # a large map, its counts a few values: thousands of ties
            n, k = 3000 + 100 * (trial - 400), 50 * (trial - 399)
        scores = torch.randint(0, spread, (n,), generator=g) * COUNT_ONE
        new = torch.randint(0, spread, (k,), generator=g) * COUNT_ONE
        if trial % 5 == 0 and n:
            scores[torch.randint(0, n, (2,), generator=g)] = top  # slots that always win
        ranked = torch.cat([scores, torch.full((protected,), top), new])
        want = policy._compute_selected_eviction_and_replacement_indices(n + protected, ranked)
        for trim in (policies.TRIM_TIES_MIN, 0):
            monkeypatch.setattr(policies, "TRIM_TIES_MIN", trim)
            got = DecayedLFUEvictionPolicy.rank_new_ids(scores, new)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), \
                (trial, trim, got, want)
        admitted += int(want[1].numel())
        if want[1].numel() and int(scores.le(scores[want[0][0]]).sum()) >= 1024:
            trimmed += 1
    assert admitted > 1000 and trimmed > 20

    spec = DynamicTable(num_slots=64)
    maps: list[Any] = [
        DynamicMCHModule(zch_size=64, device=torch.device("cpu"),
                         eviction_policy=make_eviction_policy(spec), eviction_interval=1,
                         input_hash_size=2**63 - 1, input_hash_func=mix_ids, name="t", buckets=1)
        for _ in range(2)]
    ids = torch.randint(0, 2**62, (64,), generator=g)
    ids[torch.randint(0, 64, (20,), generator=g)] = EMPTY_SLOT  # empty slots tie
    slots = torch.randperm(64, generator=g)
    meta = torch.randint(0, 5, (2, 64), generator=g)
    for m in maps:
        m._mch_sorted_raw_ids.copy_(ids)
        m._mch_remapped_ids_mapping.copy_(slots)
        for buf, values in zip(m._mch_metadata.values(), meta, strict=True):
            buf.copy_(values)
    maps[0]._sort_mch_buffers()
    MCHManagedCollisionModule._sort_mch_buffers(maps[1])
    for k, v in maps[0].state_dict().items():
        assert torch.equal(v, maps[1].state_dict()[k]), k


def test_large_batches_look_up_by_the_bucket_index_exactly_as_by_binary_search(
        tmp_path: Any, monkeypatch: Any) -> None:
    # Batches of >= INDEXED_LOOKUP_MIN_IDS ids per table look up through the bucket index; it
    # must give searchsorted's positions on any map (empty slots, ids on bucket edges, a full
    # map) and follow the map's changes (passes, evictions, expiry), or rows are silently wrong.
    data = list_batches([400] * 10, num_ids=900, max_len=6, seed=3)  # ~1,200 u ids a batch
    spec = DynamicTable(num_slots=300, eviction_interval_rows=400, history_slots=200)
    indexed = build(str(tmp_path / "a"), spec, data)
    m: Any = mc_modules(indexed.model)["t_u"]
    calls = {"n": 0}
    real = id_map.DynamicMCHModule._indexed_positions

    def counted(self: Any, sorted_ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return real(self, sorted_ids, v)

    monkeypatch.setattr(id_map.DynamicMCHModule, "_indexed_positions", counted)
    indexed.train()
    assert calls["n"] >= 10  # the u lookups took the index (i has 400 ids: binary search)
    monkeypatch.setattr(id_map, "INDEXED_LOOKUP_MIN_IDS", 10**9)
    searched = build(str(tmp_path / "b"), spec, data)
    searched.train()
    assert table_stats(indexed.model)["t_u"]["evicted"] > 0
    assert bitwise_verdict(snapshot(indexed), snapshot(searched)) == "yes"
    assert table_stats(indexed.model) == table_stats(searched.model)

    # The positions themselves, on maps the run may not reach.
    g = torch.Generator().manual_seed(0)
    ids = m._mch_sorted_raw_ids
    n = ids.numel()
    shift = 63 - id_map.index_bits(n)  # ids on the buckets' edges
    for used in (0, 1, n // 2, n - 1):  # the last slot is always empty (a fallback row)
        pool = torch.cat([torch.randint(0, 2**63 - 1, (used,), generator=g),
                          torch.arange(1, 4) << shift, (torch.arange(1, 4) << shift) - 1,
                          torch.tensor([0, 2**63 - 2])])
        filled = pool[torch.randperm(pool.numel(), generator=g)][:used].sort().values
        ids.fill_(EMPTY_SLOT)
        ids[:used] = filled
        queries = torch.cat([pool, filled, torch.randint(0, 2**63 - 1, (2000,), generator=g)])
        assert torch.equal(real(m, ids, queries), torch.searchsorted(ids, queries)), used
    # A map made under inference_mode (no version counter to key the index by) still looks up.
    monkeypatch.undo()  # the index's threshold back
    assert queries.numel() >= id_map.INDEXED_LOOKUP_MIN_IDS
    with torch.inference_mode():
        m._mch_sorted_raw_ids = ids.clone()
    m._lookup_cache = None
    assert torch.equal(m._lookup(queries)[0], torch.searchsorted(ids, queries))


def test_a_pass_that_admits_no_id_queues_no_row_reset() -> None:
    # A full map whose residents all outscore the ids waiting at the threshold: the pass admits
    # none, so evict() stays None (torchrec's forward then resets no rows, syncs nothing and
    # logs no "inserting 0 ids") and the map is unchanged.
    from recsys_trainer.dynamic import DynamicMCHModule, make_eviction_policy

    spec = DynamicTable(num_slots=8, eviction_interval=1, count_half_life=1e9,
                        admission_threshold=1)
    m: Any = DynamicMCHModule(zch_size=8, device=torch.device("cpu"),
                              eviction_policy=make_eviction_policy(spec), eviction_interval=1,
                              input_hash_size=2**63 - 1, input_hash_func=mix_ids, name="t",
                              buckets=1).train()

    def step(raw: list[int]) -> Any:
        ids = m.preprocess({"t": JaggedTensor(values=torch.tensor(raw),
                                              lengths=torch.ones(len(raw), dtype=torch.int64))})
        m.remap(m.profile(ids))
        return m.evict()

    first = step(list(range(7)) * 3)  # 7 ids, 3 sightings each: they fill the 7 free slots
    assert first is not None and first.numel() == 7 and m.occupied() == 7
    ids, slots = m._mch_sorted_raw_ids.clone(), m._mch_remapped_ids_mapping.clone()
    assert step([100, 101]) is None  # seen once: at the threshold, below every resident
    assert m.counters["admitted"] == 7 and m.counters["passes"] == 2
    assert torch.equal(m._mch_sorted_raw_ids, ids) and torch.equal(m._mch_remapped_ids_mapping,
                                                                   slots)


def test_a_map_built_without_an_input_hash_func_reads_the_ids_unchanged_as_torchrecs() -> None:
    # torchrec's MCH modules take input_hash_func=None (no mixing): the map's own preprocess
    # must pass the ids through, not call None.
    from recsys_trainer.dynamic import DynamicMCHModule, make_eviction_policy

    spec = DynamicTable(num_slots=8, eviction_interval=1, admission_threshold=1)
    m: Any = DynamicMCHModule(zch_size=8, device=torch.device("cpu"),
                              eviction_policy=make_eviction_policy(spec), eviction_interval=1,
                              input_hash_size=2**63 - 1, name="t", buckets=1).train()
    ids = torch.tensor([5, 3, 3])
    f = {"t": JaggedTensor(values=ids, lengths=torch.ones(3, dtype=torch.int64))}
    slots = m(f)["t"].values()  # the pass at the end of profile gives both ids a row
    assert torch.equal(m._mch_sorted_raw_ids[:2], torch.tensor([3, 5]))  # stored unmixed
    assert slots[1] == slots[2] != slots[0] and bool((slots < 7).all())
    assert torch.equal(m(f)["t"].values(), slots)


def test_a_table_read_by_several_features_shares_ids_and_rows_and_its_reset_touches_only_it(
        tmp_path: Any) -> None:
    data = shared_batches([32] * 4, items=(0, 40), seed=0)
    spec = DynamicTable(num_slots=64, eviction_interval=1, admission_threshold=1)
    t = build_shared(str(tmp_path), spec, data)
    t.train()
    # One map for both item features: an id seen only in histories has its row too.
    items = seen_ids(data, "i") | seen_ids(data, "h")
    assert set(resident_ids(t, "t_i")[0].tolist()) == items
    coll: Any = next(c for _, c in dynamic_collections(t.model))
    tbe_i, idx_i = coll._table_to_tbe_and_index["t_i"]
    tbe_u, idx_u = coll._table_to_tbe_and_index["t_u"]
    # One table-batched module, features [i, h, u] over tables [t_i, t_u]: t_u's table index
    # (1) is the feature index of h, a feature of t_i.
    assert tbe_i is tbe_u and list(tbe_u.feature_table_map) == [0, 0, 1] and int(idx_u) == 1
    w_i, w_u = (tbe_u.split_embedding_weights()[k].clone() for k in (0, 1))
    m_i, m_u = (tbe_u.split_optimizer_states()[k][0] for k in (0, 1))
    rows = ((m_u > 0) & (m_i > 0)).nonzero().squeeze(1)[:2]  # trained in both tables
    assert len(rows) == 2
    before_m_i = m_i.clone()
    # torchrec's eviction call for two trained slots of t_u: only t_u's rows are reset.
    tbe_u.reset_embedding_weight_momentum(
        pruned_indices=rows, pruned_indices_offsets=torch.tensor([0, 2]),
        logical_table_ids=idx_u, buffer_ids=torch.tensor([0], dtype=torch.int))
    assert torch.equal(tbe_u.split_embedding_weights()[0], w_i) and torch.equal(m_i, before_m_i)
    after_u = tbe_u.split_embedding_weights()[1]
    assert (after_u[rows] == 0).all() and (m_u[rows] == 0).all()
    rest = [r for r in range(64) if r not in rows.tolist()]
    assert torch.equal(after_u[rest], w_u[rest])


def lookup_paths_differ(pooled: Trainer, unpooled: Trainer) -> list[str]:
    """What differs between two runs of one model, one on the pooled lookup
    (``ManagedCollisionEmbeddingBagCollection``), the other on the unpooled one pooled after:
    the id maps and every counter must be equal, the rows, the optimizer state and the dense
    part equal up to the float sums' order."""
    def state(t: Trainer) -> dict[str, torch.Tensor]:
        return {k.replace("mc_ec.", "mc_ebc.").replace(".embeddings.", ".embedding_bags."): v
                for k, v in snapshot(t).items()}

    a, b = state(pooled), state(unpooled)
    bad = sorted(set(a) ^ set(b))
    for k, v in a.items():
        if k in b and not (torch.equal(v, b[k]) if "_mch_" in k or not v.is_floating_point()
                           else torch.allclose(v, b[k], rtol=1e-4, atol=1e-5)):
            bad.append(k)
    if table_stats(pooled.model) != table_stats(unpooled.model):
        bad.append("table_stats")
    return bad


@pytest.mark.parametrize("mean_items", [False, True])
def test_the_pooled_lookup_trains_as_the_unpooled_one_with_passes_evictions_and_expiry(
        tmp_path: Any, mean_items: bool) -> None:
    # The default lookup is torchrec's ManagedCollisionEmbeddingBagCollection, sharded row-wise
    # on CPU; `pooled_lookup=False` is the unpooled collection pooled after (the former path).
    data = shared_windows(0, 3)
    pooled = build_shared(str(tmp_path / "p"), SHARED_SPEC, data, mean_items=mean_items,
                          reseed=True)
    unpooled = build_shared(str(tmp_path / "u"), dataclasses.replace(
        SHARED_SPEC, pooled_lookup=False), data, mean_items=mean_items, reseed=True)
    assert [n for n, _ in dynamic_collections(pooled.model)][0].endswith("ebc.dynamic.mc_ebc")
    assert [n for n, _ in dynamic_collections(unpooled.model)][0].endswith("ebc.dynamic.mc_ec")
    pooled.train()
    unpooled.train()
    stats = table_stats(pooled.model)["t_i"]
    assert stats["evicted"] > 0 and stats["expired"] > 0  # rows were reset on both paths
    assert lookup_paths_differ(pooled, unpooled) == []


def sharded_maps(trainer: Trainer) -> list[DynamicShardedMaps]:
    return [m for m in trainer.model.modules() if isinstance(m, DynamicShardedMaps)]


def on_torchrecs_path(trainer: Trainer) -> Trainer:
    """``trainer`` with its sharded maps on torchrec's path per batch, not the short one."""
    for m in sharded_maps(trainer):
        m._short = False
    return trainer


@pytest.mark.parametrize(("pooled", "pipeline"),
                         [(True, "none"), (False, "none"), (True, "sparse_dist")])
def test_the_short_path_of_the_sharded_maps_trains_and_scores_bitwise_as_torchrecs(
        tmp_path: Any, pooled: bool, pipeline: str) -> None:
    # DynamicShardedMaps mixes all tables' ids in one op and runs each map on tensors; torchrec's
    # path splits per table and wraps each lookup. A table read by two features (items and a
    # history), fallback rows, passes, evictions and expiry; trained and scored. At one rank
    # the short path also skips the route (an all-to-all with itself), which torchrec's
    # pipeline fuses with other modules' routes when it runs the input dist ahead.
    spec = dataclasses.replace(SHARED_SPEC, pooled_lookup=pooled)
    data = shared_windows(0, 3)
    short = build_shared(str(tmp_path / "s"), spec, data, reseed=True, pipeline=pipeline)
    torchrecs = on_torchrecs_path(build_shared(str(tmp_path / "t"), spec, data, reseed=True,
                                               pipeline=pipeline))
    short.train()
    torchrecs.train()
    assert [m.short_path_batches for m in sharded_maps(short)] == [9]
    assert [m.short_path_batches for m in sharded_maps(torchrecs)] == [0]
    stats = table_stats(short.model)
    assert stats["t_i"]["evicted"] > 0 and stats["t_i"]["expired"] > 0
    assert stats == table_stats(torchrecs.model)
    assert bitwise_verdict(snapshot(short), snapshot(torchrecs)) == "yes"
    # The checkpointed forward count is the current one: 9 forwards (the map keeps it in
    # Python and writes its buffer when the state is read).
    counts = {k: int(local(v)) for k, v in short.model.state_dict().items()
              if k.endswith("_current_iter_tensor")}
    assert len(counts) == 2 and set(counts.values()) == {9}, counts
    scored = []
    for t in (short, torchrecs):
        t.model.eval()
        with torch.no_grad():
            scored.append(torch.cat([t.model(b)[1] for b in shared_batches([48, 48], (0, 80), 9)]))
    assert torch.equal(scored[0], scored[1])


def test_a_dlrm_makes_only_the_features_it_is_given_dynamic_and_the_others_stay_hashed(
        tmp_path: Any) -> None:
    data = IdStream(FEATS, 40).batches(6, 64, seed=4)
    for b in data:  # u: small ids a hashed table reads as row numbers; i: raw 63-bit ids
        b.sparse._values[:64] %= 97
    spec = DynamicTable(num_slots=64, eviction_interval_rows=64, admission_threshold=1)
    t = build(str(tmp_path), {"i": spec}, data)  # type: ignore[arg-type]
    assert {n for n, _ in dynamic_collections(t.model)} and set(mc_modules(t.model)) == {"t_i"}
    hashed: Any = t.model.module.dlrm.sparse_arch.embedding_bag_collection.hashed
    tbe = hashed._lookups[0]._emb_modules[0]._emb_module
    before = tbe.split_embedding_weights()[0].clone()
    t.train()
    # The hashed table's rows are the ids: exactly the rows of the ids seen changed.
    after = tbe.split_embedding_weights()[0]
    assert before.shape[0] == 10_000
    changed = set((after != before).any(dim=1).nonzero().squeeze(1).tolist())
    assert changed == seen_ids(data, "u")
    # The dynamic one gave every item seen before the last pass a row of its own (64 slots,
    # 40 ids: no eviction).
    items = seen_ids(data[:5], "i")
    assert items <= set(resident_ids(t, "t_i")[0].tolist()) <= seen_ids(data, "i")
    with pytest.raises(ValueError, match=r"`dynamic` names features \['x'\] that the model does "
                                         r"not have; its sparse features are \['u', 'i'\]"):
        DLRMClassifier(list(FEATS), 4, dynamic={"x": spec})
    with pytest.raises(TypeError, match=r"`dynamic\['i'\]` must be a recsys_trainer.dynamic."
                                        r"DynamicTable, but is a dict"):
        DLRMClassifier(list(FEATS), 4, dynamic={"i": {"num_slots": 64}})  # type: ignore[dict-item]
    # A feature of raw ids left out of `dynamic` would be a hashed table of 2**63 rows.
    with pytest.raises(ValueError, match=r"feature 'u' has num_embeddings 9223372036854775807 \(the "
                                         r"raw id space\) but no dynamic table: name it in `dynamic`"):
        DLRMClassifier(list(FEATS), 4, num_embeddings=[ID_SPACE, ID_SPACE], dynamic={"i": spec})
    with pytest.raises(ValueError, match=r"`pooled_lookup` must be the same for every dynamic "
                                         r"table of the model, but is \{'u': True, 'i': False\}"):
        DLRMClassifier(list(FEATS), 4, dynamic={
            "u": spec, "i": dataclasses.replace(spec, pooled_lookup=False)})
    with pytest.raises(ValueError, match=r"`num_embeddings` has 1 sizes for 2 sparse features"):
        DLRMClassifier(list(FEATS), 4, num_embeddings=[97], dynamic={"i": spec})


def test_a_mixed_collection_returns_every_feature_in_the_order_of_its_tables() -> None:
    # Hashed and dynamic tables interleaved: [a (dynamic), b (hashed), c (dynamic), d (hashed)].
    spec = DynamicTable(num_slots=32, admission_threshold=1, eviction_interval=1)
    torch.manual_seed(0)
    model = DLRMClassifier(["a", "b", "c", "d"], 4, num_embeddings=[ID_SPACE, 40, ID_SPACE, 50],
                           embedding_dim=8, dense_arch=(16,), over_arch=(16, 1),
                           table_device="cpu", dynamic={"a": spec, "c": spec})
    coll: Any = model.dlrm.sparse_arch.embedding_bag_collection
    assert isinstance(coll, MixedEmbeddingBagCollection)
    ids = {"a": [5, 6], "b": [3, 7], "c": [8, 9], "d": [1, 2]}
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=list(ids), values=torch.tensor([v for f in ids for v in ids[f]]),
        lengths=torch.ones(8, dtype=torch.int32))
    with torch.no_grad():
        for _ in range(2):  # the first forward admits the ids (a pass per step)
            kt = coll(kjt)
        embedded = model.dlrm.sparse_arch(kjt)  # [B, F, D], what the interaction reads
    assert kt.keys() == ["a", "b", "c", "d"]
    by_position = kt.values().split(8, dim=1)
    dyn = coll.dynamic(kjt).to_dict()
    for k, f in enumerate(ids):
        want = (coll.hashed.embedding_bags[f"t_{f}"].weight[ids[f]] if f in ("b", "d")
                else dyn[f])
        assert torch.equal(by_position[k], want) and torch.equal(embedded[:, k], want), f


@pytest.mark.parametrize("keys", [
    ["a0", "a1", "b0", "b1", "a2"],  # runs: a0-a1, b0-b1, a2
    ["b1", "a2", "a0", "b0", "a1"],  # every run one key, out of both sources' order
    ["a0", "a1", "a2", "b0", "b1"],  # one run per source
])
def test_the_merge_of_two_pooled_outputs_is_a_reordering_in_values_and_gradients(
        keys: list[str]) -> None:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    from recsys_trainer.dynamic.modules import _merge_keyed

    g = torch.Generator().manual_seed(0)
    dims = {"a0": 4, "a1": 8, "a2": 4, "b0": 4, "b1": 12}
    a_keys, b_keys = ["a0", "a1", "a2"], ["b0", "b1"]
    a = torch.randn(3, 16, generator=g, requires_grad=True)
    b = torch.randn(3, 16, generator=g, requires_grad=True)
    kt_a = KeyedTensor(keys=a_keys, length_per_key=[dims[k] for k in a_keys], values=a)
    kt_b = KeyedTensor(keys=b_keys, length_per_key=[dims[k] for k in b_keys], values=b)
    out = _merge_keyed(kt_a, kt_b, keys, [dims[k] for k in keys])
    ref = {**kt_a.to_dict(), **kt_b.to_dict()}
    want = torch.cat([ref[k] for k in keys], dim=1)
    assert out.keys() == keys and torch.equal(out.values(), want)
    weight = torch.randn(want.shape, generator=g)
    grads = torch.autograd.grad((out.values() * weight).sum(), (a, b))
    want_grads = torch.autograd.grad((want * weight).sum(), (a, b))
    assert all(torch.equal(x, y) for x, y in zip(grads, want_grads, strict=True))
    # A width that is not the table's is refused, not cut silently.
    with pytest.raises(ValueError, match=r"pooled feature 'a0' is 4 wide, but 8 was expected"):
        _merge_keyed(kt_a, kt_b, keys, [8 if k == "a0" else dims[k] for k in keys])


def test_a_sequence_feature_and_a_candidate_share_one_dynamic_table_in_din(tmp_path: Any) -> None:
    from recsys_trainer.models import DINClassifier

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        ones = torch.ones(16, dtype=torch.int32)
        users = KeyedJaggedTensor(keys=["u"], values=torch.randint(0, 64, (16,), generator=g),
                                  lengths=ones, stride=16)
        lh = torch.randint(1, 5, (16,), generator=g, dtype=torch.int32)
        hist = 4_000_000_000_000 + torch.randint(0, 30, (int(lh.sum()),), generator=g)
        item = 4_000_000_000_000 + torch.randint(20, 50, (16,), generator=g)
        seq = KeyedJaggedTensor(keys=["item", "hist_item"], values=torch.cat([item, hist]),
                                lengths=torch.cat([ones, lh]), stride=16)
        data.append(Batch(dense=torch.randn(16, 4, generator=g), sparse=users,
                          labels=(torch.rand(16, generator=g) < 0.5).float(), sequence=seq))
    torch.manual_seed(0)
    model = DINClassifier(["u"], 4, num_items=1, max_len=4, embedding_dim=8, num_embeddings=64,
                          dense_arch=(16,), over_arch=(16, 1),
                          dynamic=DynamicTable(num_slots=128, eviction_interval=1,
                                               admission_threshold=1))
    t = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), log_steps=1000),
                train_dataset=data, hooks=[], add_logger_hook=False,
                sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1))
    t.train()
    items = {int(v) for b in data for v in b.sequence.values()}  # type: ignore[union-attr]
    assert set(resident_ids(t, "t_item")[0].tolist()) == items


# ---------------------------------------------------------------------------- checkpoints

def test_a_map_saved_in_torchrecs_int64_layout_loads_into_the_compact_map(tmp_path: Any) -> None:
    """Checkpoints from before the compact map hold the map as int64 buffers (slots, counts in
    COUNT_ONE units, last access) and a format-2 history (every entry with an int64 count, up
    to twice ``history_slots``): they load, with the same values in the compact dtypes, and
    the history coalesced into one entry per id."""
    from recsys_trainer.dynamic import DynamicTablesState

    data = IdStream(FEATS, 400).batches(6, 64, seed=0)
    spec = DynamicTable(num_slots=64, eviction_interval_rows=128, history_slots=16)
    t = build(str(tmp_path / "a"), spec, data)
    t.train()
    m: Any = mc_modules(t.model)["t_u"]
    wide = {k: (v.long() if k in ("_mch_remapped_ids_mapping", "_mch_counts",
                                  "_mch_last_access_iter") else v.clone())
            for k, v in m.state_dict().items()}
    assert wide["_mch_counts"].dtype == torch.int64 and int(wide["_mch_counts"].max()) > 0
    saved = DynamicTablesState(t.model, 1).state_dict()
    old = {**saved, "format": 2, "tables": {}}
    for name, st in saved["tables"].items():
        ids, counts = st["history"], st["history_metadata"]["counts"]
        # Format 2's buffer: its entries all counted (int64), an id possibly twice.
        old["tables"][name] = {**{k: v for k, v in st.items() if k != "waiting"},
                               "history": torch.cat([ids, ids[:3]]),
                               "history_metadata": {"counts": torch.cat([counts, counts[:3]]).long()},
                               "used": int(ids.numel()) + 3}
    fresh = build(str(tmp_path / "b"), spec, data)
    n: Any = mc_modules(fresh.model)["t_u"]
    n.load_state_dict(wide)
    n.validate_state()
    for k, v in m.state_dict().items():
        assert n.state_dict()[k].dtype == v.dtype and torch.equal(n.state_dict()[k], v), k
    DynamicTablesState(fresh.model, 1).load_state_dict(old)
    ids, counts, _ = n.history_state()
    assert torch.equal(ids, torch.unique(saved["tables"]["t_u"]["history"]))
    expect = {int(i): 0.0 for i in ids}
    for i, c in zip(old["tables"]["t_u"]["history"].tolist(),
                    old["tables"]["t_u"]["history_metadata"]["counts"].tolist(), strict=True):
        expect[i] += c
    assert counts.tolist() == [expect[int(i)] for i in ids]
    fresh.train()  # and it trains on
    assert table_stats(fresh.model)["t_u"]["passes"] > 0


def test_a_checkpoint_holding_the_maps_in_torchrecs_int64_layout_resumes_bitwise(
        tmp_path: Any) -> None:
    """A checkpoint written before the compact map holds the maps' slots, counts and last
    accesses as int64 DCP tensors: the Trainer's resume casts them into the compact map (the
    same values) and goes on as the uninterrupted run. (Its format-2 history: the test above.)"""
    import json
    import zlib

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    data = IdStream(FEATS, 400).batches(6, 64, seed=0)
    spec = DynamicTable(num_slots=64, eviction_interval_rows=128, history_slots=16)
    full = build(str(tmp_path / "full"), spec, data, train_steps=6)
    full.train()
    out = str(tmp_path / "resumed")
    build(out, spec, data, train_steps=3, save_steps=3).train()
    step = os.path.join(out, "step_00000003")
    whole = str(tmp_path / "whole.pt")
    dcp_to_torch_save(step, whole)
    state = torch.load(whole, weights_only=False)
    wide = ("_mch_remapped_ids_mapping", "_mch_counts", "_mch_last_access_iter")
    widened = [k for k in state["model"] if k.endswith(wide)]
    assert len(widened) == 6 and state["model"][widened[1]].dtype != torch.int64
    for k in widened:
        state["model"][k] = state["model"][k].long()
    torch.save(state, whole)
    for name in os.listdir(step):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(os.path.join(step, name))
    torch_save_to_dcp(whole, step)
    with open(os.path.join(step, "COMMITTED")) as f:
        marker = json.load(f)
    files = {}
    for name in sorted(os.listdir(step)):
        if name != "COMMITTED":
            with open(os.path.join(step, name), "rb") as f:
                raw = f.read()
            files[name] = {"size": len(raw), "crc32": zlib.crc32(raw)}
    with open(os.path.join(step, "COMMITTED"), "w") as f:
        json.dump({**marker, "files": files}, f)
    from recsys_trainer.hooks import LambdaHook

    resumed = build(out, spec, data, train_steps=6)
    steps: list[int] = []
    resumed.add_hook(LambdaHook(after_step=lambda tr, _: steps.append(1)))
    resumed.train()
    assert len(steps) == 3  # from the checkpoint of step 3
    assert bitwise_verdict(snapshot(resumed), snapshot(full)) == "yes"
    assert table_stats(resumed.model) == table_stats(full.model)


def test_a_checkpoint_of_the_former_format_resumes_and_a_changed_policy_is_named(
        tmp_path: Any) -> None:
    from recsys_trainer.dynamic import DynamicTablesState

    data = IdStream(FEATS, 200).batches(4, 32, seed=0)
    legacy = DynamicTable(num_slots=32, eviction_policy="distance_lfu", eviction_interval=2)
    t = build(str(tmp_path / "a"), legacy, data, train_steps=4)
    t.train()
    now = table_stats(t.model)["t_u"]
    saved = DynamicTablesState(t.model, 1).state_dict()
    # What the former code saved (format 1): no layout, counters on the policy.
    old = {"world_size": 1, "tables": {
        name: {**{k: st[k] for k in ("buffer_size", "used", "history", "history_metadata",
                                     "current_iter", "last_eviction_iter", "steps",
                                     "last_pass_step")},
               "admitted": st["counters"]["admitted"], "passes": st["counters"]["passes"]}
        for name, st in saved["tables"].items()}}
    DynamicTablesState(t.model, 1).load_state_dict(old)
    assert table_stats(t.model)["t_u"] == now
    decayed = build(str(tmp_path / "b"), DynamicTable(num_slots=32), data)
    with pytest.raises(ValueError, match="dynamic table 't_u' was checkpointed with a legacy "
                                         "eviction policy and is built with decayed_lfu; build it "
                                         "with the checkpoint's eviction_policy"):
        DynamicTablesState(decayed.model, 1).load_state_dict(old)


def test_a_checkpoint_of_the_unpooled_lookup_is_refused_by_the_pooled_one_naming_the_setting(
        tmp_path: Any) -> None:
    from recsys_trainer.checkpoint.errors import CheckpointError

    data = IdStream(FEATS, 200).batches(4, 32, seed=0)
    unpooled = DynamicTable(num_slots=32, eviction_interval_rows=32, pooled_lookup=False)
    build(str(tmp_path / "a"), unpooled, data, train_steps=2, save_steps=2).train()
    saved = str(tmp_path / "a" / "step_00000002")
    # The setting is named for Python and for YAML (a CLI user's model is built from the config).
    with pytest.raises(CheckpointError, match=r"saved by the unpooled lookup .*build the model "
                                              r"with DynamicTable\(\.\.\., pooled_lookup=False\) "
                                              r"\(YAML: `model.dynamic.pooled_lookup: false`\)"):
        build(str(tmp_path / "b"), dataclasses.replace(unpooled, pooled_lookup=True),
              data).load_checkpoint(saved)
    again = build(str(tmp_path / "c"), unpooled, data)
    again.load_checkpoint(saved)
    assert table_stats(again.model)["t_u"]["occupied"] > 0


# -------------------------------------------------------------------------- two ranks

SHARED_SPEC = DynamicTable(num_slots=32, eviction_interval_rows=128, admission_threshold=2,
                           fallback_rows=4, expire_after_windows=1)


def shared_windows(rank: int, windows: int) -> Any:
    """3 batches per window, rank 0's of 48 rows and rank 1's of 16 (64 a step); the items
    drift from window to window, so some stop being seen."""
    sizes = [48 if rank == 0 else 16] * 3
    batches = [b for w in range(windows)
               for b in shared_batches(sizes, items=(20 * w, 20 * w + 40), seed=10 * w + rank)]
    return _Windows(batches, per_window=3)


def _two_rank_run(root: str) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    data = shared_windows(rank, 3)
    full = build_shared(os.path.join(root, "full"), SHARED_SPEC, data, save_every_n_windows=1,
                        max_to_keep=5)
    passes = passes_per_step(full, "t_i")
    full.train()
    cut = os.path.join(root, "cut")
    # Saved at step 4: one step into window 1, between two passes, so the history, the rows
    # since the last pass and the expiry marks must all be restored.
    build_shared(cut, SHARED_SPEC, data, train_steps=4, save_steps=4).train()
    resumed = build_shared(cut, SHARED_SPEC, data)
    resumed.train()
    # The former, unpooled lookup path: the same maps and stats, the same rows up to float sums
    # (rank 0's batches are 3x rank 1's: the pooled rows' reduce-scatter has unequal splits).
    # Both seed the RNG by step (re-initialised rows), so not `full`: its resume must restore it.
    paths = {p: build_shared(os.path.join(root, f"pooled_{p}"), dataclasses.replace(
        SHARED_SPEC, pooled_lookup=p), data, reseed=True) for p in (True, False)}
    # And the pooled path with the sharded maps on torchrec's path per batch: bitwise the same.
    torchrecs = on_torchrecs_path(build_shared(os.path.join(root, "torchrecs"), SHARED_SPEC,
                                               data, reseed=True))
    # Both again under torchrec's pipeline, which runs the next batch's route ahead (fusing
    # the routes' splits across modules).
    piped = [build_shared(os.path.join(root, f"piped_{k}"), SHARED_SPEC, data, reseed=True,
                          pipeline="sparse_dist") for k in ("short", "torchrecs")]
    on_torchrecs_path(piped[1])
    for t in (*paths.values(), torchrecs, *piped):
        t.train()
    m: Any = mc_modules(full.model)["t_i"]
    return {"equal": bitwise_verdict(snapshot(resumed), snapshot(full)), "passes": passes,
            "paths_differ": lookup_paths_differ(paths[True], paths[False]),
            "short_path": [sm.short_path_batches for sm in sharded_maps(paths[True])],
            "torchrecs_path": bitwise_verdict(snapshot(paths[True]), snapshot(torchrecs)),
            "piped": (bitwise_verdict(snapshot(piped[0]), snapshot(piped[1])),
                      [sm.short_path_batches for sm in sharded_maps(piped[0])]),
            "stats": table_stats(full.model), "stats_resumed": table_stats(resumed.model),
            "mixed": m._mch_sorted_raw_ids[m._mch_sorted_raw_ids != EMPTY_SLOT].tolist()}


def _save_after_loading(root: str, source: str, target: str, windows: int) -> dict[str, Any]:
    """Load ``source`` (another world size), save it again at once as ``target``, then train
    what data is left."""
    from recsys_trainer.hooks import LambdaHook

    rank = int(os.environ.get("RANK", "0"))
    t = build_shared(os.path.join(root, target), SHARED_SPEC, shared_windows(rank, windows))
    reports: list[dict[str, float]] = []
    t.add_hook(LambdaHook(on_metrics=lambda tr, report: reports.append(dict(report.values))))
    t.load_checkpoint(source)
    saved = t.save_checkpoint()
    out: dict[str, Any] = {"saved": saved, "routed": {}}
    for table, m in mc_modules(t.model).items():
        mm: Any = m
        mixed = mm._mch_sorted_raw_ids[mm._mch_sorted_raw_ids != EMPTY_SLOT]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        out["routed"][table] = bool((shard_of(mixed, world) == rank).all())
    t.train()
    out["stats"] = table_stats(t.model)
    out["reports"] = [r for r in reports if "dynamic/t_i/admitted" in r]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_ranks_resume_bitwise_and_a_checkpoint_moves_to_one_rank_and_back(
        tmp_path: Any) -> None:
    root = str(tmp_path)
    r0, r1 = run_distributed(_two_rank_run, world_size=2, timeout_s=300, args=(root,))
    for r in (r0, r1):
        assert r["equal"] == "yes", r["equal"]
        assert r["paths_differ"] == []
        assert r["short_path"] == [9] and r["torchrecs_path"] == "yes"
        assert r["piped"] == ("yes", [9])
        assert r["stats"] == r["stats_resumed"]
        # 64 rows a step (48 + 16) over both ranks: a pass every 2 steps on each rank.
        assert r["passes"] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
        # 16 rows a shard, 2 of them fallback rows.
        assert r["stats"]["t_i"]["fallback_rows"] == 2 and r["stats"]["t_i"]["occupied"] <= 14
    # Each rank holds the ids of its half of the (mixed) id space.
    assert all(shard_of(torch.tensor(r["mixed"]), 2).eq(k).all() for k, r in enumerate((r0, r1)))
    assert sum(r["stats"]["t_i"]["expired"] for r in (r0, r1)) > 0
    two = os.path.join(root, "full", "step_00000009")
    before = export_dynamic(two)
    assert sum(len(x.ids) for x in before.tables.values()) > 0
    assert before.tables["t_i"].default.shape[0] == 4
    # The hashed table beside them (resharded by DCP, not re-routed) is compared too.
    assert [k for k in before.other if ".t_c." in k] == ["ebc.hashed.embedding_bags.t_c.weight"]
    # 2 -> 1: every id keeps its row, the 4 fallback rows keep theirs.
    one = _save_after_loading(root, two, "one", windows=3)
    assert one["routed"] == {"t_i": True, "t_u": True}
    assert_exports_equal(export_dynamic(one["saved"]), before)
    # 1 -> 2, then a fourth window trains on the re-routed tables.
    r0, r1 = run_distributed(_save_after_loading, world_size=2, timeout_s=240,
                             args=(root, one["saved"], "two_again", 4))
    assert_exports_equal(export_dynamic(r0["saved"]), before)
    for r in (r0, r1):
        assert r["routed"] == {"t_i": True, "t_u": True}
        assert r["stats"]["t_i"]["passes"] > 0 and r["stats"]["t_i"]["counters_epoch"] == 2
    # The counters restarted with the new layout, and so did the stats hook's baseline: the
    # fourth window's report is what both ranks counted since.
    (report,) = r0["reports"]
    assert report["dynamic/t_i/admitted"] == sum(r["stats"]["t_i"]["admitted"] for r in (r0, r1))


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
    t = build(out, DynamicTable(num_slots=64, eviction_interval=2, admission_threshold=1), data,
              train_steps=9, save_steps=3, max_to_keep=5)
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
    # A full disk (the temporary file is /dev/full): a StorageError naming the file, no temporary
    # file left, the export already at that name intact.
    delta_9 = os.path.join(exp, "delta_9.pt")
    os.symlink("/dev/full", delta_9 + ".tmp")
    with pytest.raises(StorageError, match="cannot write .*delta_9.pt"):
        write_delta(ck[2], os.path.join(exp, "full_6.pt"), delta_9)
    assert not os.path.lexists(delta_9 + ".tmp")
    assert_exports_equal(apply_delta(load_export(os.path.join(exp, "full_6.pt")),
                                     load_export(delta_9)), full)


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
from recsys_trainer.data.generators.id_stream import IdStream
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


def test_the_example_trains_dynamic_and_hashed_tables_from_parquet_and_serves_them(
        tmp_path: Any) -> None:
    import re
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from recsys_trainer.serving import Scorer

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    data, out = tmp_path / "churn", tmp_path / "out"
    r = subprocess.run([sys.executable, os.path.join(repo, "examples", "train_dynamic.py"),
                        "--data", str(data), "--hours", "3", "--rows-per-hour", "8192",
                        "--ids", "8000", "--slots", "640", "--output-dir", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    # The data was written (hourly partitions, raw ids), the stats hook reported each window.
    assert sorted(os.listdir(data)) == ["_signal.json", "hour=00", "hour=01", "hour=02"]
    for w in ("00", "01"):
        assert f"dynamic table t_item after window hour={w}: " in r.stderr, r.stderr[-3000:]
    final = re.search(r"final eval AUC (\S+) \(the planted effects allow at most (\S+) on that "
                      r"hour\)", r.stdout)
    assert final, r.stdout
    auc, oracle = float(final[1]), float(final[2])
    assert 0.6 < auc < oracle, r.stdout  # it learns the planted effects (0.5: chance)
    # The artifact holds the two dynamic tables and the hashed one, and scores the raw rows.
    scorer = Scorer(str(out / "serving" / "step_00000032"))
    kinds = {n: t.dynamic is not None for n, t in scorer.tables.items()}
    assert kinds == {"t_user": True, "t_item": True, "t_device": False}
    rows = pq.read_table(data / "hour=02" / "part-0.parquet").slice(0, 100)
    scores = scorer.score(rows)
    assert scores.shape[0] == 100 and ((scores > 0) & (scores < 1)).all()


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
