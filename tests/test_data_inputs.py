"""Real inputs (issue 11, data side): transforms declared in the FeatureSpec against numpy
references, weighted multi-hot features, sequence features (``Batch.sequence``) through the
parquet reader, and bad inputs named."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_trainer.data.errors import DataError
from recsys_trainer.data.hashing import stable_hash_ints
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec


def _lists(rows: list[list[int] | None]) -> pa.Array:
    return pa.array(rows, pa.list_(pa.int64()))


def _jagged(kjt, key: str) -> list[list[int]]:  # type: ignore[no-untyped-def]
    jt = kjt[key]
    return [x.tolist() for x in jt.to_dense()]


# ---------------------------------------------------------------------- sequence features


def test_sequence_lists_keep_their_most_recent_max_len_ids_and_scalars_give_one_id() -> None:
    t = pa.table({"y": [1.0, 0.0, 1.0, 0.0],
                  "hist": _lists([[1, 2, 3, 4, 5], [6], None, [7, 8, 9]]),
                  "item": [11, 12, 13, 14]})
    spec = FeatureSpec(labels=["y"], sequence=[
        SequenceFeature(name="item", num_embeddings=20),
        SequenceFeature(name="hist_item", column="hist", num_embeddings=20, max_len=3),
    ])
    b = spec.decode(t)
    seq = b.sequence
    assert seq is not None and seq.keys() == ["item", "hist_item"] and seq.stride() == 4
    assert _jagged(seq, "hist_item") == [[3, 4, 5], [6], [], [7, 8, 9]]  # oldest first: tail kept
    assert _jagged(seq, "item") == [[11], [12], [13], [14]]
    assert seq.values().dtype == torch.int64
    assert b.sparse.keys() == []  # nothing pooled declared


def test_sequence_and_sparse_features_decode_side_by_side_with_transforms_after_truncation() -> None:
    # Sliced list column (slice offsets honoured), hashed sequence ids, and a multi-hot sparse
    # feature on the same column (not truncated).
    t = pa.table({"y": [0.0] * 4, "hist": _lists([[9], [1, 2, 3], [4, 5, 6, 7], [8]])}).slice(1, 2)
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="bag", column="hist", num_embeddings=10)],
                       sequence=[SequenceFeature(name="h", column="hist", num_embeddings=1000,
                                                 max_len=2, hash=True)])
    b = spec.decode(t)
    assert _jagged(b.sparse, "bag") == [[1, 2, 3], [4, 5, 6, 7]]
    expected = (stable_hash_ints(np.array([2, 3, 6, 7])) % np.uint64(1000)).astype(np.int64)
    assert b.sequence is not None and b.sequence.values().tolist() == expected.tolist()
    assert b.sequence.lengths().tolist() == [2, 2]


def test_a_sequence_column_that_is_not_a_list_is_a_named_error_when_max_len_exceeds_1() -> None:
    t = pa.table({"y": [0.0], "hist": [3]})
    spec = FeatureSpec(labels=["y"], sequence=[SequenceFeature(name="h", column="hist",
                                                               num_embeddings=10, max_len=50)])
    with pytest.raises(DataError, match=r"column 'hist': sequence feature 'h' has max_len=50, so its "
                                        r"column must be a list of ids .* but it is int64"):
        spec.decode(t)
    with pytest.raises(DataError, match=r"file f.parquet, column 'hist': sequence feature 'h' has max_len=50"):
        spec.check_schema(t.schema, "f.parquet")


def test_the_reader_yields_batch_sequence_and_a_padding_batch_with_its_keys(tmp_path) -> None:
    d = tmp_path / "hour=00"
    d.mkdir()
    rng = np.random.default_rng(0)
    n = 50
    hist = [rng.integers(0, 30, size=int(k)).tolist() for k in rng.integers(0, 8, size=n)]
    pq.write_table(pa.table({"y": (np.arange(n) % 2).astype(np.float32), "hist": _lists(hist),
                             "item": np.arange(n) % 30}), os.fspath(d / "a.parquet"), row_group_size=16)
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="item_bag", column="item", num_embeddings=30)],
                       sequence=[SequenceFeature(name="item", num_embeddings=30),
                                 SequenceFeature(name="hist_item", column="hist", num_embeddings=30, max_len=5)])
    ds = ParquetWindowDataset(os.fspath(tmp_path), spec, batch_size=16, shuffle=False)
    ds.setup(0, 1)
    got: list[list[int]] = []
    for window in ds.window_ids():
        for b in ds.iter_window(window):
            assert b.sequence is not None and b.sequence.keys() == ["item", "hist_item"]
            assert b.sequence.stride() == b.batch_size
            got.extend(_jagged(b.sequence, "hist_item"))
    assert got == [h[-5:] for h in hist]
    pad = ds.padding_batch()
    assert pad is not None and pad.sequence is not None and pad.sequence.keys() == ["item", "hist_item"]
    assert pad.as_padding().sequence is pad.sequence


# ---------------------------------------------------------------------- transforms vs numpy


def _ref_hash_mod(x: np.ndarray, n: int) -> np.ndarray:
    return (stable_hash_ints(x) % np.uint64(n)).astype(np.int64)


def test_bucketize_matches_numpy_digitize_and_nulls_take_null_id() -> None:
    rng = np.random.default_rng(1)
    vals = rng.normal(30, 20, size=1000)
    vals[:4] = [10.0, 20.0, -np.inf, np.inf]  # boundaries themselves fall in the bucket above
    bounds = [0.0, 10.0, 20.0, 35.5, 60.0]
    nulls = rng.random(1000) < 0.1
    col = pa.array(vals, mask=nulls)
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="age", num_embeddings=6,
                                                           boundaries=bounds, null_id=0)])
    b = spec.decode(pa.table({"y": np.zeros(1000), "age": col}))
    ref = np.digitize(vals, bounds, right=False)  # number of boundaries <= value
    ref[nulls] = 0
    assert b.sparse.values().numpy().tolist() == ref.tolist()
    assert b.sparse.lengths().tolist() == [1] * 1000
    # Integer columns and list columns bucketize the same way; without null_id a null has no id.
    ints = pa.array([[5, 25], None, [100]], pa.list_(pa.int32()))
    spec2 = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="x", num_embeddings=6, boundaries=bounds)])
    b2 = spec2.decode(pa.table({"y": [0.0] * 3, "x": ints}))
    assert b2.sparse.values().tolist() == [1, 3, 5] and b2.sparse.lengths().tolist() == [2, 0, 1]
    b3 = spec2.decode(pa.table({"y": [0.0] * 3, "x": pa.array([1.0, None, 70.0])}))
    assert b3.sparse.values().tolist() == [1, 5] and b3.sparse.lengths().tolist() == [1, 0, 1]


@pytest.mark.parametrize("column", [pa.array([0.5, 1.5, float("nan")]),
                                    pa.array([[0.5], [1.5, 2.5], [3.0, float("nan")]], pa.list_(pa.float64()))])
def test_a_nan_to_bucketize_is_a_data_error_naming_row_and_column(column: pa.Array) -> None:
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="a", column="x", num_embeddings=3,
                                                           boundaries=[1.0, 2.0])])
    with pytest.raises(DataError, match=r"row 2, column 'x': value NaN cannot be bucketized \(1 such "):
        spec.decode(pa.table({"y": [0.0] * 3, "x": column}))


def test_div_mod_and_hash_of_integer_columns_match_numpy() -> None:
    rng = np.random.default_rng(2)
    ts = rng.integers(-10**9, 10**10, size=777)
    t = pa.table({"y": np.zeros(777), "ts": ts})
    spec = FeatureSpec(labels=["y"], sparse=[
        SparseFeature(name="hour", column="ts", num_embeddings=24, div=3600, mod=24),
        SparseFeature(name="mod", column="ts", num_embeddings=1000, mod=1000),
        SparseFeature(name="day_h", column="ts", num_embeddings=500, div=86400, hash=True),
        SparseFeature(name="raw_h", column="ts", num_embeddings=97, hash=True),
    ])
    d = spec.decode(t).sparse.to_dict()
    assert d["hour"].values().numpy().tolist() == ((ts // 3600) % 24).tolist()  # floor semantics
    assert d["mod"].values().numpy().tolist() == np.mod(ts, 1000).tolist()
    assert d["day_h"].values().numpy().tolist() == _ref_hash_mod(ts // 86400, 500).tolist()
    assert d["raw_h"].values().numpy().tolist() == _ref_hash_mod(ts, 97).tolist()


def test_a_cross_is_the_stable_hash_of_its_columns_in_order_and_nulls_take_null_id() -> None:
    from recsys_trainer.data.hashing import _POLY, _SEED, _mix64, stable_hash_strings

    city = pa.array(["a", "b", None, "a", "é"])
    item = pa.array([1, 2, 3, 1, 2], pa.int32())
    t = pa.table({"y": [0.0] * 5, "city": city, "item": item})
    spec = FeatureSpec(labels=["y"], sparse=[
        SparseFeature(name="x", num_embeddings=1000, cross=["city", "item"], null_id=7),
        SparseFeature(name="x_rev", num_embeddings=1000, cross=["item", "city"]),
    ])
    d = spec.decode(t).sparse.to_dict()
    with np.errstate(over="ignore"):
        hc = stable_hash_strings(city.fill_null(""))
        hi = stable_hash_ints(np.array([1, 2, 3, 1, 2]))
        ref = _mix64(_mix64(np.full(5, _SEED) * _POLY + hc) * _POLY + hi) % np.uint64(1000)
    ref = ref.astype(np.int64)
    ref[2] = 7
    assert d["x"].values().numpy().tolist() == ref.tolist()
    xs = d["x"].values().tolist()
    assert xs[0] == xs[3] and xs[0] != xs[1]  # same combination, same id
    assert d["x_rev"].lengths().tolist() == [1, 1, 0, 1, 1]  # a null: no id without null_id
    assert d["x_rev"].values().tolist() != [x for i, x in enumerate(xs) if i != 2]  # order matters


def test_dense_clip_log1p_standardize_match_numpy_in_that_order() -> None:
    rng = np.random.default_rng(3)
    raw = rng.exponential(50, size=500) - 5
    nulls = rng.random(500) < 0.05
    t = pa.table({"y": np.zeros(500), "c": pa.array(raw, mask=nulls)})
    spec = FeatureSpec(labels=["y"], dense=[
        DenseFeature(column="c", fill_value=3.0, clip=(0, 200), log1p=True, standardize=(2.5, 1.5)),
        DenseFeature(column="c", fill_value=0.0, clip=(None, 10)),
        "c",
    ])
    got = spec.decode(t).dense.numpy()
    x = np.where(nulls, 3.0, raw)
    ref0 = (np.log1p(np.clip(x, 0, 200)) - 2.5) / 1.5
    np.testing.assert_allclose(got[:, 0], ref0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[:, 1], np.minimum(np.where(nulls, 0.0, raw), 10), rtol=1e-6)
    np.testing.assert_allclose(got[:, 2], np.where(nulls, 0.0, raw), rtol=1e-6)
    with pytest.raises(DataError, match=r"row 1, column 'c': log1p of dense value -2 is undefined .*clip=\(0, None\)"):
        FeatureSpec(labels=["y"], dense=[DenseFeature(column="c", log1p=True)]).decode(
            pa.table({"y": [0.0, 0.0], "c": [1.0, -2.0]}))


def test_null_ids_take_the_features_null_id_in_scalars_and_lists() -> None:
    t = pa.table({"y": [0.0] * 3, "s": pa.array(["a", None, "b"]),
                  "l": pa.array([[1, None], None, [2]], pa.list_(pa.int64()))})
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="s", num_embeddings=50, null_id=0),
                                             SparseFeature(name="l", num_embeddings=5, null_id=4)])
    d = spec.decode(t).sparse.to_dict()
    assert d["s"].lengths().tolist() == [1, 1, 1] and d["s"].values()[1] == 0
    assert d["l"].values().tolist() == [1, 4, 2] and d["l"].lengths().tolist() == [2, 0, 1]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: SparseFeature(name="a", num_embeddings=4, boundaries=[1, 5, 3]),
     r"`boundaries` of sparse feature 'a' must be strictly increasing, but boundaries\[1\] = 5 >= boundaries\[2\] = 3"),
    (lambda: SparseFeature(name="a", num_embeddings=4, boundaries=[1, 1]),
     r"strictly increasing, but boundaries\[0\] = 1 >= boundaries\[1\] = 1; sort them"),
    (lambda: SequenceFeature(name="a", num_embeddings=3, boundaries=[1, 2, 3]),
     r"sequence feature 'a' bucketizes into 4 ids \(len\(boundaries\) \+ 1\), but `num_embeddings` is 3; set it to 4"),
    (lambda: SparseFeature(name="a", num_embeddings=10, mod=24),
     r"takes ids modulo 24, which gives 24 ids, but `num_embeddings` is 10"),
    (lambda: SparseFeature(name="a", num_embeddings=10, mod=5, boundaries=[1.0]),
     r"sets boundaries and mod; use one transform per feature"),
    (lambda: SparseFeature(name="a", num_embeddings=10, cross=["x"]),
     r"`cross` of sparse feature 'a' must list two or more distinct column names"),
    (lambda: SparseFeature(name="a", num_embeddings=10, cross=["x", "y"], column="x"),
     r"crosses columns \['x', 'y'\]; leave `column` unset"),
    (lambda: SparseFeature(name="a", num_embeddings=10, null_id=10),
     r"`null_id` of sparse feature 'a' must be None or an int in \[0, 10\), but is 10"),
    (lambda: SequenceFeature(name="a", num_embeddings=10, max_len=0),
     r"`max_len` of sequence feature 'a' must be an int >= 1, but is 0"),
    (lambda: DenseFeature(column="c", standardize=(0.0, 0.0)),
     r"`standardize` of dense feature 'c' must be \(mean, std\) with finite numbers and std > 0"),
    (lambda: DenseFeature(column="c", clip=(5, 1)),
     r"`clip` of dense feature 'c' must be \(low, high\)"),
    (lambda: FeatureSpec(labels=["y"], sparse=[SparseFeature(name="a", num_embeddings=3)],
                         sequence=[SequenceFeature(name="a", num_embeddings=3)]),
     r"`sequence` feature names must be unique and differ from the `sparse` ones .*\['a'\]"),
    (lambda: FeatureSpec(labels=["y"], sequence=[SequenceFeature(name="h", column="y", num_embeddings=3)]),
     r"label column 'y' is also read as sequence feature 'h''s ids"),
])
def test_transforms_that_cannot_work_are_refused_at_construction(build, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        build()


def test_transform_columns_of_the_wrong_type_are_named_by_check_schema() -> None:
    schema = pa.schema([("y", pa.float32()), ("s", pa.string()), ("l", pa.list_(pa.int64()))])
    cases = [
        (SparseFeature(name="b", column="s", num_embeddings=3, boundaries=[1.0, 2.0]),
         r"column 's': the declared bucketized column must be numeric"),
        (SparseFeature(name="m", column="s", num_embeddings=3, mod=3),
         r"column 's': the declared integer id column must be an integer"),
        (SparseFeature(name="c", num_embeddings=3, cross=["s", "l"]),
         r"column 'l': the declared crossed column must be a scalar integer or string"),
    ]
    for feature, message in cases:
        with pytest.raises(DataError, match="file f, " + message):
            FeatureSpec(labels=["y"], sparse=[feature]).check_schema(schema, "f")


# ---------------------------------------------------------------------- weighted multi-hot


def test_id_weights_reach_a_weighted_embedding_bag_collection_and_weight_its_sum() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    rng = np.random.default_rng(4)
    n = 64
    tags = [rng.integers(0, 20, size=int(k)).tolist() for k in rng.integers(0, 6, size=n)]
    w = [rng.random(len(x)).astype(np.float32).tolist() for x in tags]
    t = pa.table({"y": np.zeros(n), "tags": pa.array(tags, pa.list_(pa.int64())),
                  "w": pa.array(w, pa.list_(pa.float32())), "user": rng.integers(0, 10, size=n)})
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="tags", num_embeddings=20, weight_column="w"),
                                             SparseFeature(name="user", num_embeddings=10)])
    batch = spec.decode(t)
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_tags", embedding_dim=4, num_embeddings=20, feature_names=["tags"]),
        EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=10, feature_names=["user"]),
    ], is_weighted=True)
    out = ebc(batch.sparse).to_dict()
    table = ebc.embedding_bags["t_tags"].weight.detach().numpy()
    ref = np.stack([(np.asarray(wi, np.float32)[:, None] * table[ti]).sum(0) if ti else np.zeros(4, np.float32)
                    for ti, wi in zip(tags, w, strict=True)])
    np.testing.assert_allclose(out["tags"].detach().numpy(), ref, rtol=1e-5, atol=1e-6)
    # A feature without a weight column gets weight 1 per id (a plain sum).
    users = ebc.embedding_bags["t_user"].weight.detach().numpy()[t["user"].to_numpy()]
    np.testing.assert_allclose(out["user"].detach().numpy(), users, rtol=1e-6)


def test_weights_of_another_length_than_the_ids_are_a_data_error_naming_the_file_and_row(tmp_path) -> None:
    d = tmp_path / "hour=00"
    d.mkdir()
    t = pa.table({"y": [0.0] * 3, "tags": pa.array([[1], [1, 2], [3]], pa.list_(pa.int64())),
                  "w": pa.array([[1.0], [1.0, 2.0], [1.0, 0.5]], pa.list_(pa.float32()))})
    pq.write_table(t, os.fspath(d / "a.parquet"))
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="tags", num_embeddings=5, weight_column="w")])
    ds = ParquetWindowDataset(os.fspath(tmp_path), spec, batch_size=2)
    ds.setup(0, 1)
    with pytest.raises(DataError, match=r"a.parquet, row group 0, row 2, column 'w': has 2 weights but "
                                        r"column 'tags' has 1 ids in this row; they must match"):
        list(ds.iter_window("hour=00"))


def test_a_yaml_config_declares_sequence_features_and_transforms() -> None:
    from recsys_trainer.config import ConfigError, ParquetDataConfig

    cfg = ParquetDataConfig(train="/nonexistent", features={
        "labels": ["click"],
        "dense": [{"column": "price", "clip": [0, None], "log1p": True, "standardize": [3.0, 1.5]}],
        "sparse": [{"name": "age_b", "column": "age", "num_embeddings": 5, "boundaries": [18, 30, 45, 60]}],
        "sequence": [{"name": "hist_item", "column": "hist", "num_embeddings": 100, "max_len": 50}],
    })
    spec = cfg.feature_spec()
    assert list(spec.sequence) == [SequenceFeature(name="hist_item", column="hist", num_embeddings=100, max_len=50)]
    assert spec.dense_features[0].clip == (0.0, None) and spec.sparse[0].boundaries == (18.0, 30.0, 45.0, 60.0)
    with pytest.raises(ConfigError, match=r"unknown key `data.features.sequence\[0\].weight_column`"):
        ParquetDataConfig(train="/nonexistent", features={
            "labels": ["click"], "sequence": [{"name": "h", "num_embeddings": 3, "weight_column": "w"}]})


def test_the_model_check_routes_pooled_tables_to_sparse_features_and_unpooled_to_either() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from recsys_trainer.sharding import check_data_fits_model

    class M(torch.nn.Module):
        def __init__(self, pooled: str, unpooled: list[str], rows: int = 40) -> None:
            super().__init__()
            meta = torch.device("meta")
            self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="t_user", embedding_dim=4, num_embeddings=10, feature_names=[pooled])], device=meta)
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
                name="t_item", embedding_dim=4, num_embeddings=rows, feature_names=unpooled)], device=meta)

    class Data:
        features = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="user", num_embeddings=10)],
                               sequence=[SequenceFeature(name="item", num_embeddings=40),
                                         SequenceFeature(name="hist", num_embeddings=40, max_len=5)])

    check_data_fits_model(M("user", ["item", "hist"]), [Data()])
    check_data_fits_model(M("user", ["user", "item"]), [Data()])  # a sparse feature into an EC is fine
    with pytest.raises(ValueError, match=r"feature 'item' is a SequenceFeature \(Batch.sequence, unpooled\), "
                                         r"but table 't_user' is in an EmbeddingBagCollection"):
        check_data_fits_model(M("item", ["hist"]), [Data()])
    with pytest.raises(ValueError, match=r"declares sparse \['user'\] and sequence \['hist', 'item'\]: \['cand'\] missing"):
        check_data_fits_model(M("user", ["cand", "hist"]), [Data()])
    with pytest.raises(ValueError, match=r"sequence feature 'item' holds ids in \[0, 40\) \(its SequenceFeature "
                                         r"num_embeddings\), but the table it feeds, 't_item', has 30 rows"):
        check_data_fits_model(M("user", ["item", "hist"], rows=30), [Data()])


def test_rows_dropped_for_nan_labels_take_their_sequences_and_bags_with_them() -> None:
    t = pa.table({"y": [1.0, None, 0.0, float("nan"), 1.0],
                  "hist": _lists([[1], [2, 2], [3, 3, 3], [4], [5, 6, 7, 8]]),
                  "tags": _lists([[10], [20], [], [40], [50, 51]])})
    spec = FeatureSpec(labels=["y"], on_nan_label="drop",
                       sparse=[SparseFeature(name="tags", num_embeddings=60)],
                       sequence=[SequenceFeature(name="h", column="hist", num_embeddings=10, max_len=2)])
    chunk = spec.decode_chunk(t)
    b = chunk.batch(0, 5)
    assert b.labels.tolist() == [1.0, 0.0, 1.0]
    assert b.sequence is not None and _jagged(b.sequence, "h") == [[1], [3, 3], [7, 8]]
    assert _jagged(b.sparse, "tags") == [[10], [], [50, 51]]
    # Cutting source rows [1, 4) keeps the one surviving row, 2.
    part = chunk.batch(1, 4)
    assert part.batch_size == 1 and part.sequence is not None and _jagged(part.sequence, "h") == [[3, 3]]
