"""The serving export and its Scorer: same scores as ``trainer.predict`` on the bundled
examples' models, edge rows, the JSON spec, deltas, quantized tables, a fresh process that
never imports the trainer, and the artifact's integrity checks."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from typing import Any

import fs_utils
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import serving_utils as su
import torch

from recsys_trainer.data.errors import DataError
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.serving import ArtifactError, Scorer, export_for_serving
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving.quantize import dequantize, quantize
from recsys_trainer.serving.routing import Routing, mix_ids
from recsys_trainer.storage import StorageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_predict_batches(path: str, window: str) -> dict[int, np.ndarray]:
    """Scores of ``window`` in the batches ``predict`` scored it in (50 rows, in file order)."""
    table = pq.read_table(window)
    scorer = Scorer(path)
    out = np.concatenate([scorer.score(table.slice(i, 50)).reshape(-1, len(scorer.output_names))
                          for i in range(0, table.num_rows, 50)])
    return {int(r): s for r, s in zip(table.column("row_id").to_pylist(), out, strict=True)}


def _train_export(kind: str, root: str) -> dict[str, Any]:
    windows = su.write_data(os.path.join(root, "data"), kind)
    trainer = su.make_trainer(kind, root, windows, steps=6, save_steps=3)
    trainer.train()
    pred = su.predicted(trainer, windows[-1], os.path.join(root, "pred"))
    art = os.path.join(root, "art")
    summary = export_for_serving(trainer, art)
    # The device guard: the same checkpoint exported with the model's dense part on another
    # device than the host (meta, standing for the GPU it trained on) is the same artifact.
    spec, model = su.spec_and_model(kind)
    on_meta = export_for_serving(os.path.join(root, "ckpt"), os.path.join(root, "art_meta"),
                                 model=su.dense_on_meta(model), features=spec)
    assert on_meta.content_hash == summary.content_hash
    return {"trainer": trainer, "windows": windows, "pred": pred, "art": art, "summary": summary,
            "root": root}


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The DLRM example's model trained 5 steps (checkpoints at steps 3 and 5), exported."""
    return _train_export("dlrm", str(tmp_path_factory.mktemp("dlrm")))


def _check_parity(case: dict[str, Any]) -> None:
    window, pred = case["windows"][-1], case["pred"]
    # Bitwise in predict's batches; all rows in one call differ only by the GEMM's blocking.
    assert su.max_diff(_in_predict_batches(case["art"], window), pred) == 0.0
    assert su.max_diff(su.scored(case["art"], window), pred) <= 1e-6


def test_the_dlrm_example_scores_exactly_as_predict_including_unseen_strings_and_nulls(dlrm) -> None:
    _check_parity(dlrm)
    # The edge rows (an unseen string, null dense and id values) are among those compared.
    assert {10_000_000, 10_000_001, 10_000_002} <= set(dlrm["pred"])
    m = Scorer(dlrm["art"]).manifest
    assert m["step"] == 5 and m["labels"] == ["label"] and m["program"]["outputs"] == ["label"]
    assert {t["name"]: (t["rows"], t["dim"]) for t in m["tables"]}["t_C1"] == (su.NUM_EMB, 8)


@pytest.mark.parametrize("kind", ["din", "mmoe", "dynamic", "mixed", "mixed_fp16", "dcn", "hstu"])
def test_din_mmoe_and_dynamic_table_models_score_exactly_as_predict(kind: str, tmp_path) -> None:
    case = _train_export(kind, str(tmp_path))
    _check_parity(case)
    if kind == "mixed_fp16":
        _check_half_precision_tables(case)
    if kind in ("hstu", "dcn"):
        # A program that reads value features (HSTU's event times: integers, no table) is
        # schema 3: a reader of 2 would look for their tables and dims.
        m = Scorer(case["art"]).manifest
        values = [q["feature"] for q in m["program"]["inputs"]["sequences"] if q.get("values")]
        assert (m["schema_version"], values) == ((3, ["hist_ts", "ts"]) if kind == "hstu" else (1, []))
    if kind in ("dynamic", "mixed", "mixed_fp16"):
        # Row 10_000_002 holds an id no table ever held (its default row) and a null id.
        tables = Scorer(case["art"]).tables
        t = tables["t_C1"]
        assert t.dynamic is not None and 987_654_321_012 not in set(t.dynamic.ids.tolist())
        # The mixed model's two hashed tables are served as such, beside the dynamic ones.
        hashed = [n for n, x in tables.items() if x.dynamic is None]
        assert hashed == ([] if kind == "dynamic" else ["t_C4", "t_C5"])
        if kind != "dynamic":
            assert tables["t_C4"].weight is not None and tables["t_C4"].weight.shape[0] == su.NUM_EMB
        su.check_delta(case["root"], kind, case["windows"][-1], 3, 5)
    if kind == "din":
        # A null candidate: no id in the row. Served: named by column, feature and row (the
        # program's assert holds no row); trained (CPU): named by feature and batch row.
        from recsys_trainer.models import check_sequence_lengths

        row = {k: v for k, v in pq.read_table(case["windows"][-1]).to_pylist()[0].items()
               if k != "label"}
        with pytest.raises(DataError, match=r"file the rows to score, row 1, column 'item': the "
                                            r"model reads exactly one id per row of sequence "
                                            r"feature 'item' \(its candidate\), but this row has 0"):
            Scorer(case["art"]).score([row, {**row, "item": None}])
        with pytest.raises(ValueError, match=r"DINClassifier's candidate feature 'item' .* must "
                                             r"have exactly one id per row; at fault: batch row 1 "
                                             r"\(0 ids\)"):
            check_sequence_lengths(torch.tensor([1, 0]), torch.tensor([1, 1]), 3, "item", "hist_item",
                                   model="DINClassifier")


def _check_half_precision_tables(case: dict[str, Any]) -> None:
    """fp16 tables (two dynamic, one hashed) are served in fp16, the rows training read bit
    for bit (the parity above is bitwise); the artifact says so (schema 2, each table's
    ``dtype``), and an int8 export quantizes the same rows."""
    scorer = Scorer(case["art"])
    m = scorer.manifest
    assert m["schema_version"] == 2
    assert {t["name"]: t.get("dtype", "fp32") for t in m["tables"]} == {
        "t_C1": "fp16", "t_C2": "fp16", "t_C3": "fp32", "t_C4": "fp16", "t_C5": "fp32"}
    served = {n: t.weight if t.dynamic is None else t.dynamic.vectors
              for n, t in scorer.tables.items()}
    assert {n: str(w.dtype) for n, w in served.items() if n in su.HALF_TABLES} == dict.fromkeys(
        su.HALF_TABLES, "torch.float16")
    int8 = os.path.join(case["root"], "art_int8")
    export_for_serving(case["trainer"], int8, quantize="int8")
    q = Scorer(int8)
    assert q.manifest["schema_version"] == 1  # quantized rows: no half-precision table
    for name in ("t_C1", "t_C4"):
        t = q.tables[name]
        rows = t.weight if t.dynamic is None else t.dynamic.vectors
        assert torch.equal(rows, quantize(served[name].float(), "int8"))
    assert su.max_diff(su.scored(int8, case["windows"][-1]), case["pred"]) < 0.05
    # A precision this reader does not know (a newer writer's) is named, not read as float32.
    newer = os.path.join(case["root"], "art_newer")
    shutil.copytree(case["art"], newer)
    with open(os.path.join(newer, mf.MANIFEST)) as f:
        manifest = json.load(f)
    manifest["tables"][0]["dtype"] = "fp8"
    data = json.dumps(manifest).encode()
    with open(os.path.join(newer, mf.MANIFEST), "wb") as f:
        f.write(data)
    with open(os.path.join(newer, mf.MARKER)) as f:
        marker = json.load(f)
    with open(os.path.join(newer, mf.MARKER), "w") as f:
        json.dump({**marker, "manifest_sha256": mf.sha256_bytes(data)}, f)
    with pytest.raises(ArtifactError, match=rf"table {manifest['tables'][0]['name']!r} of the "
                                            r"serving artifact .*art_newer' is stored in 'fp8'; "
                                            r"this reader reads fp32, fp16, bf16"):
        Scorer(newer)


def test_a_delta_of_plain_tables_reproduces_the_full_export_of_the_later_step(dlrm) -> None:
    su.check_delta(dlrm["root"], "dlrm", dlrm["windows"][-1], 3, 5)


def test_an_export_from_the_checkpoint_equals_the_export_from_the_live_trainer(dlrm, tmp_path) -> None:
    spec, model = su.spec_and_model("dlrm")
    summary = export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(tmp_path / "a"),
                                 model=model, features=spec)
    assert summary.content_hash == dlrm["summary"].content_hash
    with pytest.raises(FileExistsError, match="already holds a committed serving artifact"):
        export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(tmp_path / "a"), model=model,
                           features=spec)
    # A directory holding anything an export does not write (a mistyped output_dir: the
    # checkpoints, a parent of artifacts) is refused and left alone, not cleared.
    mine = tmp_path / "mine"
    (mine / "step_00000003").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"holds \['notes.txt', 'step_00000003'\]"):
        export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(mine), model=model, features=spec)
    assert (mine / "notes.txt").read_text() == "keep" and (mine / "step_00000003").is_dir()
    # Only the names an export writes, but not an export's: a user's manifest.json and
    # vocab/words.json (no manifest of ours), or ours beside a file it does not list.
    other = tmp_path / "other"
    (other / "vocab").mkdir(parents=True)
    (other / "manifest.json").write_text('{"name": "my app"}')
    (other / "vocab" / "words.json").write_text('["a"]')
    with pytest.raises(FileExistsError, match=r"holds \['manifest.json', 'vocab/words.json'\] "
                                              r"with a manifest.json that is not a serving export's"):
        export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(other), model=model, features=spec)
    assert (other / "manifest.json").read_text() == '{"name": "my app"}'
    assert (other / "vocab" / "words.json").read_text() == '["a"]'
    # What an export that died before its marker left (its manifest is written first) is
    # cleared by the next one: a truncated file, another's temporary file.
    left = tmp_path / "left"
    export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(left), model=model, features=spec)
    (left / mf.MARKER).unlink()
    (left / mf.TABLES).write_bytes(b"partial")
    (left / (mf.PROGRAM + ".tmp.99")).write_bytes(b"partial")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "manifest.json").write_bytes((left / "manifest.json").read_bytes())
    (mixed / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"holds \['notes.txt'\], which its manifest.json does not list"):
        export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(mixed), model=model, features=spec)
    assert (mixed / "notes.txt").read_text() == "keep"
    export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(left), model=model, features=spec)
    assert Scorer(str(left)).content_hash == summary.content_hash
    assert not (left / (mf.PROGRAM + ".tmp.99")).exists()


def test_scorers_built_in_threads_while_the_process_exports_load_and_score_the_same(
        dlrm, tmp_path) -> None:
    """A server's follower loads in its thread while requests are scored, and a training job
    may follow its own location while it publishes in-process: torch.export's load and export
    share process-wide state, so without serving.program's lock these fail ('_CURRENT_DESERIALIZER
    is already set', 'not tracked with proxy') and can leave the process unable to export."""
    import threading

    window = dlrm["windows"][-1]
    expected = su.scored(dlrm["art"], window)
    results: list[Any] = []

    def build() -> None:
        try:
            for _ in range(3):
                results.append(su.max_diff(su.scored(dlrm["art"], window), expected))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results.append(e)

    threads = [threading.Thread(target=build, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    spec, model = su.spec_and_model("dlrm")
    hashes = [export_for_serving(os.path.join(dlrm["root"], "ckpt"), str(tmp_path / str(i)),
                                 model=model, features=spec).content_hash for i in range(2)]
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a Scorer thread hung"
    assert results == [0.0] * 9
    assert hashes == [dlrm["summary"].content_hash] * 2


def test_an_artifact_on_object_storage_loads_and_scores_the_same(dlrm) -> None:
    spec, model = su.spec_and_model("dlrm")
    url = "memory://serving-test/art"
    export_for_serving(os.path.join(dlrm["root"], "ckpt"), url, model=model, features=spec)
    window = pq.read_table(dlrm["windows"][-1])
    assert np.array_equal(Scorer(url).score(window), Scorer(dlrm["art"]).score(window))


def test_rows_as_dicts_with_nulls_and_missing_columns_get_what_training_does_or_a_named_error(dlrm) -> None:
    scorer = Scorer(dlrm["art"])
    table = pq.read_table(dlrm["windows"][-1]).slice(0, 4)
    rows = table.drop_columns(["label", "row_id"]).to_pylist()
    rows[1]["I2"], rows[2]["C3"] = None, None
    typed = pa.Table.from_pylist(rows, schema=table.drop_columns(["label", "row_id"]).schema)
    assert np.array_equal(scorer.score(rows), scorer.score(typed))
    # A column that is None in every row still decodes as training decodes a null.
    for r in rows:
        r["C7"] = None
    assert scorer.score(rows).shape == (4,)
    del rows[0]["I3"]  # missing in one row: null there (from_pylist)
    scorer.score(rows)
    with pytest.raises(DataError, match="'C9'.*declared sparse id column is missing"):
        scorer.score([{k: v for k, v in r.items() if k != "C9"} for r in rows])
    assert scorer.score(table.slice(0, 0)).shape == (0,)
    with pytest.raises(DataError, match="column 'C4': its values do not make one column"):
        scorer.score([rows[0], {**rows[1], "C4": 5}])  # a string column given an int
    # An integer sent for a string id column is refused by name: 7 may have meant "7" or "007".
    with pytest.raises(DataError, match=r"row 0, column 'C4': the id column held string ids in "
                                        r"training, but value 5 is an integer.*send the ids as "
                                        r"strings"):
        scorer.score([{**rows[1], "C4": 5}])
    # Any iterable of dicts scores, a generator too (counted once, from one list).
    assert np.array_equal(scorer.score(r for r in rows[:2]), scorer.score(rows[:2]))
    assert scorer.score(iter([])).shape == (0,)
    # The edge rows (a null dense value, a null id) alone, as one-row requests: predict's.
    edge = pq.read_table(dlrm["windows"][-1]).to_pylist()[-3:]
    for r in edge:
        request = {k: v for k, v in r.items() if k != "label"}
        assert abs(float(scorer.score([request])[0]) - float(dlrm["pred"][r["row_id"]][0])) <= 1e-6


def test_a_negative_dynamic_id_is_refused_as_in_training() -> None:
    from recsys_trainer.serving.runtime.tables import DynamicRows, Table

    t = Table(name="t", kind="pooled", dim=2, pooling="sum", weighted=False, features=["f"],
              quantization=None, weight=None, dynamic=DynamicRows(
                  ids=torch.tensor([3, 7]), vectors=torch.ones(2, 2), default_rows=torch.zeros(1, 2),
                  routing=Routing(rule="shard_fallback_rows", shards=1)))
    assert t.pool(np.array([7, 5]), np.array([1, 1]), None).tolist() == [[1.0, 1.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="negative id -4"):
        t.pool(np.array([-4]), np.array([1]), None)


def test_the_spec_round_trips_through_json_with_every_transform_and_decodes_the_same() -> None:
    spec = FeatureSpec(
        labels=["y", "z"], weight_column="w", on_nan_label="drop", label_range=(0, 1),
        passthrough=["rid"],
        dense=[DenseFeature(column="a", fill_value=-1.5, clip=(0, None), log1p=True,
                            standardize=(0.25, 3.0)), DenseFeature(column="b", on_non_finite="error")],
        sparse=[SparseFeature(name="s", num_embeddings=97, weight_column="sw"),
                SparseFeature(name="bk", column="a2", num_embeddings=4, boundaries=[0.5, 1, 7.25]),
                SparseFeature(name="dm", column="t", num_embeddings=24, div=3600, mod=24, null_id=0),
                SparseFeature(name="x", num_embeddings=50, cross=["s", "t"], null_id=3),
                SparseFeature(name="v", vocab=["b", "a", "ü\n"], null_id=0),
                SparseFeature(name="vi", column="t", num_embeddings=8, vocab=[5, 3], hash=False),
                SparseFeature(name="h", column="t", num_embeddings=10, hash=True)],
        sequence=[SequenceFeature(name="q", num_embeddings=13, max_len=3, on_out_of_range="hash")])
    raw, files = mf.spec_to_json(spec)
    back = mf.spec_from_json(json.loads(json.dumps(raw)), lambda n: files[n])
    assert mf.spec_to_json(back)[0] == raw and back == spec
    table = pa.table({
        "y": [0.0, 1.0, 1.0], "z": [1.0, 0.0, 1.0], "w": [1.0, 2.0, 0.5], "rid": ["r1", "r2", "r3"],
        "a": [None, 2.0, 9.0], "b": [1.0, 2.0, 3.0], "s": ["u1", "u2", None], "sw": [0.5, 1.0, 2.0],
        "a2": [0.1, 1.0, 8.0], "t": pa.array([7200, None, 86400 * 3 + 5], pa.int64()),
        "v": ["a", "zz", None], "q": [[1, 2, 3, 40], [], None]})
    a, b = spec.decode(table), back.decode(table)
    for x, y in ((a.dense, b.dense), (a.labels, b.labels), (a.weights, b.weights),
                 (a.sparse.values(), b.sparse.values()), (a.sparse.lengths(), b.sparse.lengths()),
                 (a.sequence.values(), b.sequence.values())):  # type: ignore[union-attr]
        assert torch.equal(x, y)


def test_serving_id_mixing_and_routing_match_dynamic_tables_and_fbgemm_bucketization() -> None:
    import fbgemm_gpu  # noqa: F401  (registers the op)

    from recsys_trainer.dynamic import ID_SPACE, DynamicTable
    from recsys_trainer.dynamic import mix_ids as training_mix
    from recsys_trainer.dynamic.modules import _mc_module

    ids = torch.randint(0, 2**62, (3000,), generator=torch.Generator().manual_seed(0)) * 2 + 1
    assert torch.equal(mix_ids(ids), training_mix(ids))
    mixed = training_mix(ids)
    for shards, per_shard in ((2, 1), (3, 1), (2, 3), (4, 2)):
        # Which rank torchrec sends each id to: FBGEMM's block bucketization.
        lengths, values = torch.ops.fbgemm.block_bucketize_sparse_features(
            torch.ones(len(ids), dtype=torch.int32), mixed, False, True,
            torch.tensor([-(-ID_SPACE // shards)]), shards, keep_orig_idx=True)[:2]
        rank_of = dict(zip(values.tolist(), torch.repeat_interleave(
            torch.arange(shards), lengths.view(shards, -1).sum(1)).tolist(), strict=True))
        # Which fallback row that rank's module reads for it: the training module itself.
        slots = 16 * shards
        whole = _mc_module("t", DynamicTable(num_slots=slots, fallback_rows=shards * per_shard),
                           torch.device("cpu"))
        bounds = [slots // shards * s for s in range(shards + 1)]
        ranks = torch.tensor([rank_of[m] for m in mixed.tolist()])
        expect = torch.empty_like(ids)
        for r in range(shards):
            shard = whole.rebuild_with_output_id_range((bounds[r], bounds[r + 1]), bounds)
            assert shard.fallback_per_shard == per_shard
            mine = ranks == r
            expect[mine] = r * per_shard + shard.fallback_slots(mixed[mine]) - (bounds[r + 1] - per_shard)
        routed = Routing(rule="shard_fallback_rows", shards=shards, rows_per_shard=per_shard)
        assert torch.equal(routed.default_row(ids), expect), (shards, per_shard)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_tables_dequantize_in_plain_torch_exactly_as_fbgemm(kind: str) -> None:
    w = torch.randn(37, 12) * 3
    q = quantize(w, kind)
    ref = (torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(q) if kind == "int8"
           else torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(q, 4))
    assert torch.equal(dequantize(q, kind, 12), ref)
    assert float((ref - w).abs().max()) < (0.1 if kind == "int8" else 1.5)


def test_a_quantized_export_is_smaller_and_scores_close_to_the_float_one(dlrm, tmp_path) -> None:
    spec, model = su.spec_and_model("dlrm")
    ckpt = os.path.join(dlrm["root"], "ckpt")
    export_for_serving(ckpt, str(tmp_path / "q8"), model=model, features=spec, quantize="int8")
    size = {n: os.path.getsize(os.path.join(p, mf.TABLES))
            for n, p in (("f", dlrm["art"]), ("q", str(tmp_path / "q8")))}
    assert size["q"] < 0.6 * size["f"]  # dim 8: (8 + 8) / 32 bytes per row
    window = pq.read_table(dlrm["windows"][-1])
    diff = np.abs(Scorer(str(tmp_path / "q8")).score(window) - Scorer(dlrm["art"]).score(window))
    assert 0 < diff.max() < 0.02


def test_an_export_onto_a_full_or_read_only_disk_is_a_storage_error_naming_the_artifact(
        dlrm, tmp_path) -> None:
    spec, model = su.spec_and_model("dlrm")
    ckpt = os.path.join(dlrm["root"], "ckpt")
    with fs_utils.small_tmpfs(str(tmp_path / "full"), 64) as full:
        art = os.path.join(full, "art")
        with pytest.raises(StorageError, match=f"cannot write {re.escape(art)}: .*No space left"):
            export_for_serving(ckpt, art, model=model, features=spec)
        with pytest.raises(ArtifactError, match="not a committed serving artifact"):
            Scorer(art)
        assert not [n for n in os.listdir(art) if ".tmp." in n]  # no partial file left
    with fs_utils.read_only(str(tmp_path / "ro")) as ro:
        art = os.path.join(ro, "art")
        with pytest.raises(StorageError, match=f"cannot write {re.escape(art)}: .*Read-only"):
            export_for_serving(ckpt, art, model=model, features=spec)


# The pickling artifact is refused by torch's weights-only loader, which warns about its protocol.
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_a_corrupt_uncommitted_or_pickling_artifact_is_refused_naming_the_file(dlrm, tmp_path) -> None:
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(dlrm["art"], bad)
    with open(os.path.join(bad, mf.TABLES), "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ArtifactError, match="tables.safetensors.*corrupt"):
        Scorer(bad)
    # A truncated manifest (a copy cut short) and a garbled marker are named, not JSON errors.
    shutil.copy(os.path.join(dlrm["art"], mf.TABLES), os.path.join(bad, mf.TABLES))
    manifest = open(os.path.join(bad, mf.MANIFEST), "rb").read()
    with open(os.path.join(bad, mf.MANIFEST), "wb") as f:
        f.write(manifest[:len(manifest) // 2])
    with pytest.raises(ArtifactError, match="manifest of .* does not match its COMMITTED marker"):
        Scorer(bad)
    with open(os.path.join(bad, mf.MANIFEST), "wb") as f:
        f.write(manifest)
    with open(os.path.join(bad, mf.MARKER), "wb") as f:
        f.write(b'{"manifest_sha')
    with pytest.raises(ArtifactError, match="COMMITTED marker of .* is corrupt"):
        Scorer(bad)
    os.remove(os.path.join(bad, mf.MARKER))
    with pytest.raises(ArtifactError, match="not a committed serving artifact"):
        Scorer(bad)
    # A program archive with a pickled member is refused before torch.export.load sees it.
    from recsys_trainer.serving.runtime.scorer import check_program_archive

    src = os.path.join(dlrm["art"], mf.PROGRAM)
    out = str(tmp_path / "p.pt2")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename.endswith("sample_inputs/model.pt"):
                data = pickle.dumps(print)  # a global weights_only refuses
            zout.writestr(item, data)
    with pytest.raises(ArtifactError, match="not a plain tensor file"):
        check_program_archive(open(out, "rb").read(), out)


_FRESH = """
import json, sys
import torch
after_torch = set(sys.modules)
import pyarrow.parquet as pq
import recsys_trainer.serving as serving
after_import = set(sys.modules)
torch.export.load(sys.argv[1] + "/dense.pt2")  # what torch.export itself imports
after_torch_export = set(sys.modules)
scorer = serving.Scorer(sys.argv[1])
scores = scorer.score(pq.read_table(sys.argv[2]))
# As a server gets them: the edge rows (nulls) one request each, and an empty request.
edge = [{k: v for k, v in r.items() if k != "label"} for r in pq.read_table(sys.argv[2]).to_pylist()[-3:]]
one = {r["row_id"]: float(scorer.score([r])[0]) for r in edge}
print(json.dumps({"scores": scores.tolist(), "one": one, "empty": list(scorer.score([]).shape),
                  "by_import": sorted(after_import - after_torch),
                  "by_scoring": sorted(set(sys.modules) - after_torch_export),
                  "all": sorted(sys.modules)}))
"""
_FRESH_REQUESTS = """
import json, sys
import recsys_trainer.serving as serving
scorer = serving.Scorer(sys.argv[1])
scores = [float(scorer.score([r])[0]) for r in json.loads(sys.argv[2])]
print(json.dumps({"scores": scores, "empty": list(scorer.score([]).shape)}))
"""
_TRAINING = ("torchrec", "fbgemm_gpu", "accelerate", "recsys_trainer.trainer",
             "recsys_trainer.checkpoint", "recsys_trainer.sharding", "recsys_trainer.distributed",
             "recsys_trainer.batch", "recsys_trainer.dynamic", "recsys_trainer.models")
_DIST = ("torch.distributed", "torch.nn.parallel")


def test_an_export_scores_in_a_fresh_process_that_never_imports_the_trainer_or_torchrec(dlrm) -> None:
    window = dlrm["windows"][-1]
    out = subprocess.run([sys.executable, "-c", _FRESH, dlrm["art"], window], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Importing the package adds no torch.distributed module; scoring adds none beyond those
    # torch.export.load itself imports (torch's own); nothing of the training stack, ever.
    assert not [m for m in got["by_import"] if m.startswith(_DIST)]
    assert not [m for m in got["by_scoring"] if m.startswith(_DIST)]
    assert not [m for m in got["all"] if m.startswith(_TRAINING)]
    assert np.array_equal(np.array(got["scores"], np.float32),
                          Scorer(dlrm["art"]).score(pq.read_table(window)))
    assert got["empty"] == [0] and len(got["one"]) == 3
    for row_id, score in got["one"].items():
        assert abs(score - float(dlrm["pred"][int(row_id)][0])) <= 1e-6, row_id


def test_run_export_writes_the_artifact_of_the_newest_checkpoint_of_a_cli_training_run(tmp_path) -> None:
    import yaml
    from helpers import FEATURES, NUM_DENSE, ROWS
    from predict_utils import scoring_spec, write_scoring_windows

    from recsys_trainer.config import ConfigError, load_config

    write_scoring_windows(str(tmp_path / "data"), [[20], [12]])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "run": "train",
        "args": {"output_dir": str(tmp_path / "ckpt"), "save_end": True, "resume_from": "auto"},
        "model": {"embedding_dim": 8, "dense_arch": [16], "over_arch": [16, 1]},
        "data": {"kind": "parquet", "train": str(tmp_path / "data"), "batch_size": 8, "features": {
            "labels": ["y"], "dense": [f"d{i}" for i in range(NUM_DENSE)],
            "sparse": [{"name": f, "num_embeddings": ROWS} for f in FEATURES]}},
        "dense_optimizer": {"name": "adam", "lr": 0.05},
        "export": {"output_dir": str(tmp_path / "art"), "quantize": None},
    }))

    def cli(*extra: str) -> str:
        p = subprocess.run([sys.executable, "-m", "recsys_trainer", str(config), *extra],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    cli()
    out = cli("--run", "export")
    scorer = Scorer(str(tmp_path / "art"))
    assert scorer.step == 5 and f"exported={scorer.content_hash}" in out
    # The same checkpoint exported in this process, from a model built by the same config.
    reference = export_for_serving(str(tmp_path / "ckpt"), str(tmp_path / "ref"),
                                   model=load_config(str(config), []).model.build(),
                                   features=scoring_spec(passthrough=[]))
    assert reference.content_hash == scorer.content_hash
    with pytest.raises(ConfigError, match="`run: export` needs an `export` section"):
        load_config(str(config), [("run", "export"), ("export", "null")])


def test_a_few_rows_decode_to_the_ids_they_have_among_many() -> None:
    """Small requests hash their string columns in one call (a serving speed-up in the shared
    decoder): the ids must be those of the same rows decoded in a large batch."""
    from recsys_trainer.data.generators.criteo_synthetic import (
        CriteoSignal,
        criteo_features,
        generate_hour,
    )

    table, _ = generate_hour(CriteoSignal.make(max_vocab=300), 200, np.random.default_rng(3), 0)
    spec = criteo_features(1000)
    many = spec.decode(table).sparse
    for lo, n in ((0, 1), (7, 16), (100, 64)):
        few = spec.decode(table.slice(lo, n)).sparse
        for key in spec.sparse_names:
            assert torch.equal(few[key].values(), many[key].values()[lo:lo + n]), (key, lo, n)


def test_a_user_model_with_vocabularies_built_from_data_multi_hot_and_sequences_scores_as_predict(
        tmp_path) -> None:
    """A model of one's own (implementing the serving contract) with ``VocabFromData``
    vocabularies (strings and integers), a multi-hot list feature and two sequence features
    reading one table: the export resolves the built vocabularies (from the Trainer, and from
    the checkpoint in the same way) and scores as ``predict``, unseen values on the OOV row."""
    from vocab_data import MAX_LEN, TinyModel, write_vocab_windows

    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.data.vocab import VocabFromData

    class ServableTiny(TinyModel):
        def serving_sequence_lengths(self) -> dict[str, int]:
            return dict.fromkeys(self.seq_names, MAX_LEN)

        def serving_logits(self, dense, pooled, sequences, lengths):  # type: ignore[no-untyped-def]
            parts = [dense * 1e-3, torch.cat([pooled[n] for n in self.pooled_names], dim=1),
                     sum(sequences[n].sum(1) for n in self.seq_names)]
            return self.top(torch.cat(parts, dim=1)).squeeze(-1)

    spec = FeatureSpec(
        labels=["y"], dense=["row_id"],
        sparse=[SparseFeature(name="genre", num_embeddings=12, vocab=VocabFromData()),
                SparseFeature(name="year", num_embeddings=10, vocab=VocabFromData()),
                SparseFeature(name="tags", num_embeddings=8, vocab=VocabFromData()),
                # Reads the vocabularies' columns, hashed (no vocabulary of its own).
                SparseFeature(name="genre_x_year", num_embeddings=16, cross=("genre", "year"))],
        sequence=[SequenceFeature(name="item", num_embeddings=16, vocab=VocabFromData(name="items")),
                  SequenceFeature(name="hist", num_embeddings=16, max_len=MAX_LEN,
                                  vocab=VocabFromData(name="items"))])
    data = str(tmp_path / "data")
    write_vocab_windows(data, (64, 48), files_per_window=1)
    windows = [os.path.join(data, f"hour={w:02d}", "part-0.parquet") for w in range(2)]
    # Rows with one column null each, of every kind (a string and an integer vocabulary, both
    # also crossed; a list; a sequence's candidate and its history), in the predicted window.
    nullable = ("genre", "year", "tags", "item", "hist")
    later = pq.read_table(windows[1])
    first = later.slice(0, 1).to_pylist()[0]
    null_rows = [{**first, c: None, "row_id": 1_000_000 + i} for i, c in enumerate(nullable)]
    pq.write_table(pa.concat_tables([later, pa.Table.from_pylist(null_rows, schema=later.schema)]),
                   windows[1])

    def model() -> ServableTiny:
        m = ServableTiny(spec)
        m.pooled_names = spec.sparse_names
        return m

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments

    trainer = Trainer(model(), TrainingArguments(output_dir=str(tmp_path / "ckpt"), log_steps=1000),
                      train_dataset=ParquetWindowDataset(windows[:1], spec, batch_size=16),
                      dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                      sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                      add_logger_hook=False)
    trainer.train()
    out = str(tmp_path / "pred")
    trainer.predict(ParquetWindowDataset(windows[1:], dataclasses.replace(spec, passthrough=["row_id"]),
                                         batch_size=48), out)
    from recsys_trainer.predict import read_predictions

    pred = read_predictions(out)
    art = str(tmp_path / "art")
    summary = export_for_serving(trainer, art)
    scorer = Scorer(art)
    assert list(scorer.features.sparse[0].vocab.values) == list(trainer.vocabularies["genre"].values)
    rows = pq.read_table(windows[1])
    got = dict(zip(rows.column("row_id").to_pylist(), scorer.score(rows).tolist(), strict=True))
    want = dict(zip(pred.column("row_id").to_pylist(), pred.column("y").to_pylist(), strict=True))
    assert max(abs(got[r] - want[r]) for r in want) <= 1e-6 and set(got) == set(want)
    # Each null row alone, as a server gets it (dicts, or a table built from them, where the
    # null column has no type): what predict gave the row in the file. The column of a
    # vocabulary that a cross shares takes the vocabulary's kind, whichever feature is last.
    for r in null_rows:
        request = {k: v for k, v in r.items() if k != "y"}
        for one in ([request], pa.Table.from_pylist([request])):
            assert abs(float(scorer.score(one)[0]) - want[r["row_id"]]) <= 1e-6, (request, one)
    assert scorer.id_kinds == {"genre": "string", "hist": "integer", "item": "integer",
                               "tags": "string", "year": "integer"}
    # The same in a fresh process, as a server runs: each null row alone, an integer id sent as
    # its string (JSON clients do), and an empty request.
    as_string = {**{k: v for k, v in first.items() if k != "y"}, "item": str(first["item"])}
    requests = [{k: v for k, v in r.items() if k != "y"} for r in null_rows] + [as_string]
    out = subprocess.run([sys.executable, "-c", _FRESH_REQUESTS, art, json.dumps(requests)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    for r, score in zip(null_rows, fresh["scores"], strict=False):
        assert abs(score - want[r["row_id"]]) <= 1e-6, r
    assert fresh["scores"][-1] == float(scorer.score([{**as_string, "item": first["item"]}])[0])
    assert fresh["empty"] == [0]
    # An empty request: no rows, no columns to check; the shape a caller indexes by output.
    for empty in ([], pa.table({}), rows.slice(0, 0)):
        assert scorer.score(empty).shape == (0,)
    again = export_for_serving(str(tmp_path / "ckpt"), str(tmp_path / "again"), model=model(),
                               features=spec)
    assert again.content_hash == summary.content_hash
    # A vocabulary of the same size but other entries is another spec: no delta across it
    # (it would leave the scorer decoding with the old entries).
    from recsys_trainer.data.vocab import Vocabulary
    from recsys_trainer.serving import export_delta

    genre = trainer.vocabularies["genre"]
    swapped = dataclasses.replace(spec, sparse=[dataclasses.replace(
        spec.sparse[0], vocab=Vocabulary(list(reversed(genre.values)), kind=genre.kind,
                                      source="test")),
        *spec.sparse[1:]])
    with pytest.raises(ArtifactError, match="feature spec changed"):
        export_delta(str(tmp_path / "ckpt"), art, str(tmp_path / "delta"), model=model(),
                     features=swapped)


def test_weighted_multi_hot_bucketized_and_shared_sequence_features_score_as_predict(tmp_path) -> None:
    """A weighted pooled collection (multi-hot ids with per-id weights, a bucketized feature
    with ``null_id``) and one sequence table read by a candidate and a truncated history: the
    Scorer gives ``predict``'s scores, from a table and from dicts, one row at a time too, where
    a row's empty lists (no tags, no weights, no history) are what training reads, not a type
    error."""
    from test_data_inputs_dist import MAX_LEN, SeqModel, seq_spec, write_seq_windows

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.predict import read_predictions

    class ServableSeqModel(SeqModel):
        def serving_sequence_lengths(self) -> dict[str, int]:
            return {"item": 1, "hist_item": MAX_LEN}

        def serving_logits(self, dense, pooled, sequences, lengths):  # type: ignore[no-untyped-def]
            item = sequences["item"].squeeze(1)
            interest = (sequences["hist_item"] * item.unsqueeze(1)).sum(1)
            x = torch.cat([dense * 0.01, pooled["user"], pooled["tags"], pooled["age_b"], item,
                           interest], dim=1)
            return self.top(x).squeeze(-1)

    spec = seq_spec()
    write_seq_windows(str(tmp_path / "data"), [[64], [48]])
    windows = [str(tmp_path / "data" / f"hour={w:02d}" / "part-0.parquet") for w in range(2)]
    # Rows with nulls of the other kinds (an integer id; a weighted list with its weights; a
    # bucketized number with null_id; a history), in the predicted window.
    later = pq.read_table(windows[1])
    first = later.slice(1, 1).to_pylist()[0]
    null_rows = [{**first, **dict.fromkeys(cols), "row_id": 1_000_000 + i}
                 for i, cols in enumerate((["user"], ["tags", "tag_w"], ["age"], ["hist"]))]
    pq.write_table(pa.concat_tables([later, pa.Table.from_pylist(null_rows, schema=later.schema)]),
                   windows[1])
    trainer = Trainer(ServableSeqModel(spec), TrainingArguments(output_dir=str(tmp_path / "ckpt"),
                                                                log_steps=1000),
                      train_dataset=ParquetWindowDataset(windows[:1], spec, batch_size=16),
                      dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                      sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                      add_logger_hook=False)
    trainer.train()
    trainer.predict(ParquetWindowDataset(windows[1:], dataclasses.replace(spec, passthrough=["row_id"]),
                                         batch_size=48), str(tmp_path / "pred"))
    pred = read_predictions(str(tmp_path / "pred"))
    want = dict(zip(pred.column("row_id").to_pylist(), pred.column("y").to_pylist(), strict=True))
    # The predicted window with its integer user ids written as strings: read as training read
    # them (the predict dataset follows the train dataset's id kinds), the same predictions.
    as_text, t = str(tmp_path / "as_text.parquet"), pq.read_table(windows[1])
    users = [None if u is None else str(u) for u in t.column("user").to_pylist()]
    pq.write_table(t.set_column(t.schema.get_field_index("user"), "user", pa.array(users)), as_text)
    trainer.predict(ParquetWindowDataset([as_text], dataclasses.replace(spec, passthrough=["row_id"]),
                                         batch_size=48), str(tmp_path / "pred_text"))
    text_pred = read_predictions(str(tmp_path / "pred_text"))
    assert dict(zip(text_pred.column("row_id").to_pylist(), text_pred.column("y").to_pylist(),
                    strict=True)) == want
    export_for_serving(trainer, str(tmp_path / "art"))
    scorer = Scorer(str(tmp_path / "art"))
    assert scorer.tables["t_tags"].weighted and scorer.tables["t_item"].kind == "sequence"
    rows = pq.read_table(windows[1])
    got = dict(zip(rows.column("row_id").to_pylist(), scorer.score(rows).tolist(), strict=True))
    assert set(got) == set(want) and max(abs(got[r] - want[r]) for r in want) == 0.0
    dicts = rows.to_pylist()
    # Rows whose tags (and their weights) or history are empty lists, one per request.
    empty = [r for r in dicts if not r["tags"]][:2] + [{**dicts[1], "hist": []}]
    assert len(empty) == 3 and not empty[0]["tag_w"]
    typed = scorer.score(pa.Table.from_pylist(empty, schema=rows.schema))
    one_by_one = np.array([scorer.score([r])[0] for r in empty])
    assert np.abs(one_by_one - typed).max() <= 1e-6
    assert abs(typed[0] - want[empty[0]["row_id"]]) <= 1e-6
    for r in null_rows:
        request = {k: v for k, v in r.items() if k != "y"}
        for one in ([request], pa.Table.from_pylist([request])):
            assert abs(float(scorer.score(one)[0]) - want[r["row_id"]]) <= 1e-6, request
    # Integer ids sent as strings: the same rows when written as str(int) writes them (a hash
    # of the text would score other rows, silently); anything else is refused by name.
    request = {k: v for k, v in dicts[1].items() if k != "y"}
    as_text = {**request, "user": str(request["user"]), "tags": [str(t) for t in request["tags"]],
               "hist": [str(t) for t in request["hist"]]}
    assert scorer.id_kinds["user"] == "integer" and request["tags"] and request["hist"]
    assert float(scorer.score([as_text])[0]) == float(scorer.score([request])[0])
    for bad in ("abc", "07", "+7", " 7", "-0"):
        with pytest.raises(DataError, match=rf"row 1, column 'user': the id column held integer "
                                            rf"ids in training, but value '{re.escape(bad)}'"):
            scorer.score([as_text, {**as_text, "user": bad}])


def test_a_delta_against_a_base_without_id_kinds_says_so_not_that_the_spec_changed() -> None:
    """A base exported before the features JSON recorded ``id_kinds`` hashes to another
    ``features_sha256`` than a new export of the same spec: told apart from a changed spec."""
    from recsys_trainer.serving.exporting.export import _check_delta_features

    new = {"features": {"sparse": [], "id_kinds": {"C1": "string"}}, "features_sha256": "b"}
    _check_delta_features({**new}, new)  # the same spec: nothing to say
    old_base = {"features": {"sparse": []}, "features_sha256": "a"}
    with pytest.raises(ArtifactError, match=r"the base was exported before id kinds were recorded "
                                            r".*export in full once, then deltas work again"):
        _check_delta_features(old_base, new)
    changed = {"features": {"sparse": [1], "id_kinds": {}}, "features_sha256": "c"}
    with pytest.raises(ArtifactError, match="the feature spec changed since the base export"):
        _check_delta_features(changed, new)


def test_a_delta_that_fails_to_apply_leaves_the_scorer_as_it_was(dlrm, tmp_path) -> None:
    """A delta directory missing its new dense program (a partial copy) is refused, and the
    scorer still scores as its base: no table was changed before the failure."""
    import shutil

    from recsys_trainer.serving import export_delta

    spec, model = su.spec_and_model("dlrm")
    ckpt = os.path.join(dlrm["root"], "ckpt")
    base, delta, full = (str(tmp_path / n) for n in ("base", "delta", "full"))
    export_for_serving(os.path.join(ckpt, "step_00000003"), base, model=model, features=spec)
    export_delta(os.path.join(ckpt, "step_00000005"), base, delta, full_out_dir=full,
                 model=su.spec_and_model("dlrm")[1], features=spec)
    rows = pq.read_table(dlrm["windows"][-1])
    scorer, before = Scorer(base), Scorer(base).score(rows)
    program = os.path.join(delta, mf.PROGRAM)
    shutil.move(program, str(tmp_path / "kept.pt2"))  # the dense part changed: the delta has one
    with pytest.raises(ArtifactError, match="has no file 'dense.pt2'"):
        scorer.apply_delta(delta)
    assert np.array_equal(scorer.score(rows), before) and scorer.step == 3
    shutil.move(str(tmp_path / "kept.pt2"), program)
    scorer.aot_inductor = True  # as if it ran an AOTInductor package: the delta's program replaces it
    scorer.apply_delta(delta)
    assert not scorer.aot_inductor
    assert np.array_equal(scorer.score(rows), Scorer(full).score(rows)) and scorer.step == 5


def test_the_exports_host_copy_takes_the_checkpoints_values_in_the_models_dtypes_on_the_cpu() -> None:
    """``_on_host`` is where the export crosses to the host: a dense part on another device
    (``meta`` here, a GPU in training) comes back on the CPU with the checkpoint's values, and a
    model built in another precision keeps it (a copy into its tensors would)."""
    from recsys_trainer.serving.exporting.model_parts import on_host as _on_host

    state = {k: v.float() for k, v in torch.nn.Linear(3, 2).state_dict().items()}
    double = _on_host(torch.nn.Linear(3, 2).to(torch.float64), state)
    assert {p.dtype for p in double.parameters()} == {torch.float64}
    assert torch.equal(double.weight, state["weight"].double())
    on_meta = _on_host(torch.nn.Linear(3, 2, device="meta"), state)
    assert {p.device.type for p in on_meta.parameters()} == {"cpu"}
    assert torch.equal(on_meta.weight, state["weight"])
    with_buffer = torch.nn.Linear(3, 2, device="meta")
    with_buffer.register_buffer("positions", torch.arange(3, device="meta"), persistent=False)
    with pytest.raises(ValueError, match=r"\['positions'\] on the meta device"):
        _on_host(with_buffer, state)
