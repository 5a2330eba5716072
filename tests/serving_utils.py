"""Train the bundled examples' models for a few steps on tiny data, score with ``predict`` and
with the serving ``Scorer``, and compare, row by row (shared by the 1- and 2-rank tests)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.generators.criteo_synthetic import (
    SPARSE_COLUMNS,
    BehaviourSignal,
    CriteoSignal,
    behaviour_features,
    criteo_features,
    generate_hour,
)
from recsys_trainer.data.inputs import SequenceFeature, SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.dynamic import ID_SPACE, DynamicTable
from recsys_trainer.models import (
    DCNClassifier,
    DINClassifier,
    DLRMClassifier,
    HSTURankingModel,
    MMoEClassifier,
)
from recsys_trainer.predict import read_predictions

ROWS = 160
NUM_EMB = 500
NUM_ITEMS = 60
MAX_LEN = 6
KINDS = ("dlrm", "din", "mmoe", "dynamic", "mixed", "mixed_fp16", "dcn", "hstu")
HSTU_FEATURES = ["C1", "C2", "C3", "C4"]


def write_data(root: str, kind: str, hours: int = 2, rows: int = ROWS, seed: int = 0) -> list[str]:
    """``hours`` windows of the examples' schema (``row_id`` unique); the last window also holds
    edge rows: strings never seen in training, nulls in dense and id columns."""
    signal = CriteoSignal.make(max_vocab=300)
    behaviour = BehaviourSignal.make(num_items=NUM_ITEMS, num_categories=4, max_len=MAX_LEN) \
        if kind in ("din", "mmoe", "hstu") else None
    rng, brng = np.random.default_rng(seed), np.random.default_rng([seed, 1])
    dirs = []
    for h in range(hours):
        table, _ = generate_hour(signal, rows, rng, first_row_id=h * rows, behaviour=behaviour,
                                 behaviour_rng=brng)
        if kind == "hstu":
            table = _with_times(table, rng)
        if kind in ("dynamic", "mixed", "mixed_fp16"):  # raw int64 ids in a wide range: most unseen, some repeated
            for c in SPARSE_COLUMNS[:3]:
                ids = rng.integers(0, 40, rows) * 1_000_003 + (h if c == "C1" else 0)
                i = table.schema.get_field_index(c)
                table = table.set_column(i, c, pa.array(ids.astype(np.int64)))
        if h == hours - 1:
            table = _with_edge_rows(table, kind)
        d = os.path.join(root, f"hour={h:02d}")
        os.makedirs(d, exist_ok=True)
        pq.write_table(table, os.path.join(d, "part-0.parquet"), row_group_size=64)
        dirs.append(os.path.join(d, "part-0.parquet"))
    return dirs


def _with_times(table: pa.Table, rng: np.random.Generator) -> pa.Table:
    """``ts`` (the request's time, seconds) and ``hist_ts`` (one time per history item, oldest
    first, minutes to days before): HSTU's time features."""
    hist = table.column("hist_item").combine_chunks()
    lens = pc.list_value_length(hist).to_numpy()
    ts = 1_800_000_000 + rng.integers(0, 3600, len(lens))
    ago = np.exp(rng.uniform(0, 13, int(lens.sum()))).astype(np.int64)
    owner = np.repeat(np.arange(len(lens)), lens)
    offsets = np.r_[0, np.cumsum(lens)]
    # Oldest first: within a row, the larger ages first.
    order = np.lexsort((-ago, owner))
    times = ts[owner] - ago[order]
    return (table.append_column("ts", pa.array(ts.astype(np.int64)))
            .append_column("hist_ts", pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                                              pa.array(times))))


def _with_edge_rows(table: pa.Table, kind: str) -> pa.Table:
    rows = table.slice(0, 3).to_pylist()
    rows[0]["C4"] = "never-seen-string"  # hashed like any string
    rows[0]["I1"] = None  # dense null -> fill_value
    rows[1]["C5"] = None  # id null -> no id (an empty bag)
    if kind in ("dynamic", "mixed", "mixed_fp16"):
        rows[2]["C1"] = 987_654_321_012  # an id no table ever held: the default row
        rows[2]["C2"] = None
    for i, r in enumerate(rows):
        r["row_id"] = 10_000_000 + i
    return pa.concat_tables([table, pa.Table.from_pylist(rows, schema=table.schema)])


def spec_and_model(kind: str) -> tuple[FeatureSpec, torch.nn.Module]:
    """The examples' models, small: examples/train_dlrm.py, train_din.py, train_multitask.py,
    the DLRM with every table dynamic, and one with three dynamic tables and two hashed ones."""
    torch.manual_seed(0)
    if kind == "dlrm":
        return criteo_features(NUM_EMB), DLRMClassifier(
            SPARSE_COLUMNS, 13, NUM_EMB, 8, dense_arch=(16, 8), over_arch=(16, 1), dense_log1p=True)
    if kind == "din":
        return behaviour_features(NUM_EMB, num_items=NUM_ITEMS, max_len=MAX_LEN), DINClassifier(
            SPARSE_COLUMNS, 13, num_items=NUM_ITEMS, max_len=MAX_LEN, num_embeddings=NUM_EMB,
            embedding_dim=8, dense_arch=(16, 8), attention_arch=(8,), over_arch=(16, 1),
            dense_log1p=True)
    if kind == "mmoe":
        feats = [*SPARSE_COLUMNS, "item"]
        return behaviour_features(NUM_EMB, num_items=NUM_ITEMS, labels=["label", "like"],
                                  sequence=False), MMoEClassifier(
            feats, 13, ["label", "like"], num_embeddings=[NUM_EMB] * 26 + [NUM_ITEMS],
            embedding_dim=8, dense_arch=(16, 8), num_experts=2, expert_arch=(16,), tower_arch=(8,),
            dense_log1p=True)
    if kind == "dcn":
        return criteo_features(NUM_EMB), DCNClassifier(
            SPARSE_COLUMNS, 13, NUM_EMB, 8, dense_arch=(16, 8), cross="mixture", num_cross_layers=2,
            low_rank=8, num_experts=2, deep_arch=(16,), structure="parallel", dense_log1p=True)
    if kind == "hstu":
        spec = behaviour_features(NUM_EMB, num_items=NUM_ITEMS, max_len=MAX_LEN, labels=["label", "like"])
        spec = dataclasses.replace(spec, sparse=spec.sparse[:len(HSTU_FEATURES)], sequence=[
            *spec.sequence, SequenceFeature(name="hist_ts", num_embeddings=ID_SPACE, max_len=MAX_LEN),
            SequenceFeature(name="ts", num_embeddings=ID_SPACE)])
        return spec, HSTURankingModel(
            HSTU_FEATURES, 13, ["label", "like"], num_items=NUM_ITEMS, max_len=MAX_LEN,
            num_embeddings=NUM_EMB, embedding_dim=8, num_heads=2, dense_arch=(16, 8),
            tower_arch=(8,), dense_log1p=True)
    table = DynamicTable(num_slots=64, eviction_interval=2, fallback_rows=4)
    dynamic = SPARSE_COLUMNS[:3]
    if kind == "dynamic":
        spec = FeatureSpec(labels=["label"], dense=criteo_features().dense,
                           sparse=[SparseFeature(name=c, num_embeddings=ID_SPACE) for c in dynamic])
        return spec, DLRMClassifier(dynamic, 13, embedding_dim=8, dense_arch=(16, 8),
                                    over_arch=(16, 1), dense_log1p=True, dynamic=table)
    # Three dynamic tables (raw ids) and two hashed ones (strings hashed below NUM_EMB) in one
    # DLRM: DLRMClassifier(dynamic={feature: DynamicTable}); "mixed_fp16" stores two dynamic
    # tables and a hashed one in fp16 (the others fp32).
    assert kind in ("mixed", "mixed_fp16")
    hashed = SPARSE_COLUMNS[3:5]
    spec = FeatureSpec(labels=["label"], dense=criteo_features().dense,
                       sparse=[*(SparseFeature(name=c, num_embeddings=ID_SPACE) for c in dynamic),
                               *(SparseFeature(name=c, num_embeddings=NUM_EMB) for c in hashed)])
    return spec, DLRMClassifier([*dynamic, *hashed], 13, [ID_SPACE] * 3 + [NUM_EMB] * 2,
                                embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1),
                                dense_log1p=True, dynamic=dict.fromkeys(dynamic, table),
                                embedding_dtype=HALF_TABLES if kind == "mixed_fp16" else None)


HALF_TABLES = {"t_C1": "fp16", "t_C2": "fp16", "t_C4": "fp16"}
"""The "mixed_fp16" model's tables stored in fp16."""


def dense_on_meta(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter and persistent buffer on the ``meta`` device: a stand-in,
    on a CPU-only host, for a model that trained on a GPU (PyTorch refuses to mix meta and CPU
    tensors in one op as it refuses CUDA and CPU, so code that forgets to bring the model to the
    host fails here as it fails on a GPU). Non-persistent buffers stay: no checkpoint holds
    them, so an export of a real GPU model moves them, which meta tensors cannot be."""
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(p.detach().to("meta"), p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and name not in m._non_persistent_buffers_set:
                m._buffers[name] = b.to("meta")
    return model


def make_trainer(kind: str, root: str, windows: list[str], steps: int,
                 save_steps: int | None = None) -> Trainer:
    spec, model = spec_and_model(kind)
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=os.path.join(root, "ckpt"), train_steps=steps,
                               log_steps=1000, seed=0, save_steps=save_steps),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=32),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False,
    )


def predicted(trainer: Trainer, window: str, out: str) -> dict[int, np.ndarray]:
    """``trainer.predict`` of ``window``: ``{row_id: scores}`` (every rank's rows)."""
    spec = trainer.train_dataset.features  # type: ignore[union-attr]
    spec = dataclasses.replace(spec, passthrough=["row_id"])
    trainer.predict(ParquetWindowDataset([window], spec, batch_size=50), out)
    if trainer.world_size > 1:
        trainer.gang.barrier()
    t = read_predictions(out)
    names = [c for c in t.column_names if c not in ("window", "row_id")]
    scores = np.stack([t.column(n).to_numpy() for n in names], axis=1)
    return {int(r): s for r, s in zip(t.column("row_id").to_pylist(), scores, strict=True)}


def scored(path: str, window: str, **kw: Any) -> dict[int, np.ndarray]:
    """The serving ``Scorer``'s scores of ``window``'s rows: ``{row_id: scores}``."""
    from recsys_trainer.serving import Scorer

    table = pq.read_table(window)
    out = Scorer(path, **kw).score(table)
    out = out.reshape(len(out), -1)
    return {int(r): s for r, s in zip(table.column("row_id").to_pylist(), out, strict=True)}


def max_diff(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float:
    assert set(a) == set(b), (len(a), len(b), sorted(set(a) ^ set(b))[:5])
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def check_delta(root: str, kind: str, window: str, first: int, last: int) -> None:
    """Base = the export of checkpoint ``first``; its delta to ``last`` applied by a Scorer
    equals a full export of ``last``: every table bitwise, the same scores."""
    from recsys_trainer.serving import ArtifactError, Scorer, export_delta, export_for_serving
    from recsys_trainer.serving import manifest as mf

    spec, model = spec_and_model(kind)
    ckpt = os.path.join(root, "ckpt")
    base, delta, full = (os.path.join(root, n) for n in ("base", "delta", "full"))
    export_for_serving(os.path.join(ckpt, f"step_{first:08d}"), base, model=model, features=spec)
    export_delta(os.path.join(ckpt, f"step_{last:08d}"), base, delta, full_out_dir=full,
                 model=spec_and_model(kind)[1], features=spec)
    scorer, reference = Scorer(base), Scorer(full)
    rows = pq.read_table(window)
    assert not np.array_equal(scorer.score(rows), reference.score(rows))
    scorer.apply_delta(delta)
    assert scorer.step == last and scorer.content_hash == reference.content_hash
    assert len(scorer.applied_deltas) == 1 and scorer.applied_deltas[0].endswith("delta")
    assert scorer.manifest["step"] == first  # the base's manifest, as documented
    for name, t in reference.tables.items():
        mine = scorer.tables[name]
        if t.dynamic is None:
            assert mine.weight is not None and t.weight is not None
            assert torch.equal(mine.weight, t.weight), name
        else:
            assert mine.dynamic is not None
            for f in ("ids", "vectors", "default_rows"):
                assert torch.equal(getattr(mine.dynamic, f), getattr(t.dynamic, f)), (name, f)
    assert np.array_equal(scorer.score(rows), reference.score(rows))
    # Only changed rows are shipped, and a delta applies once: its base is gone now.
    try:
        scorer.apply_delta(delta)
        raise AssertionError("a delta applied twice was not refused")
    except ArtifactError as e:
        assert "apply deltas in order" in str(e)
    assert len(scorer.applied_deltas) == 1
    assert os.path.getsize(os.path.join(delta, "delta.safetensors")) < \
        os.path.getsize(os.path.join(full, mf.TABLES))


def export_query_and_rows(trainer: Trainer, art: str) -> tuple[torch.Tensor, pa.Table]:
    """A trained retrieval model exported to ``art`` (the query embedding), then the query its
    ``forward`` gives the first batch of the evaluation's first window (in eval mode) and that
    batch's raw rows: what a served query is compared with."""
    from recsys_trainer.serving import export_for_serving

    export_for_serving(trainer, art, activation="none")
    ds: Any = trainer.eval_dataset
    wid = next(iter(ds.window_ids()))
    batch = next(iter(ds.iter_window(wid)))
    rows = next(iter(ds.read_columns(wid, ds.features.columns())))
    trainer.model.eval()
    with torch.no_grad():
        _, out = trainer.model(batch)
    return out["query"], rows
