"""FeatureSpec decoding: dense/sparse/labels from Arrow, stable hashing, and bad-value errors."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from recsys_trainer.data.errors import DataError
from recsys_trainer.data.hashing import stable_hash_ints, stable_hash_strings
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec


def _table(**cols: list) -> pa.Table:
    return pa.table({k: pa.array(v) for k, v in cols.items()})


def test_decode_builds_dense_labels_and_a_key_major_kjt_with_jagged_list_columns() -> None:
    t = pa.table({
        "y": [1.0, 0.0, 1.0], "d": [1.5, None, 3.0], "i": pa.array([1, None, 3], pa.int64()),
        "l": pa.array([[1, 2], None, []], pa.list_(pa.int64())),
    })
    spec = FeatureSpec(labels=["y"], dense=[DenseFeature(column="d", fill_value=-1.0)],
                       sparse=[SparseFeature(name="i", num_embeddings=10),
                               SparseFeature(name="l", num_embeddings=5)])
    b = spec.decode(t)
    assert b.dense.tolist() == [[1.5], [-1.0], [3.0]]
    assert b.labels.tolist() == [1.0, 0.0, 1.0]
    kjt = b.sparse
    assert kjt.keys() == ["i", "l"] and kjt.stride() == 3
    assert kjt.values().dtype == torch.int64
    assert kjt.lengths().tolist() == [1, 0, 1, 2, 0, 0]
    assert kjt.values().tolist() == [1, 3, 1, 2]
    assert kjt.weights_or_none() is None


def test_sliced_list_columns_decode_only_the_slice() -> None:
    # ListArray.values ignores slice offsets; the decoder must not.
    t = pa.table({"y": [0.0] * 4, "l": pa.array([[9], [1, 2], [3], [4]], pa.list_(pa.int64()))}).slice(1, 2)
    b = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="l", num_embeddings=10)]).decode(t)
    assert b.sparse.values().tolist() == [1, 2, 3]


def test_string_ids_hash_stably_into_the_table_and_slices_hash_like_the_original() -> None:
    arr = pa.array(["a", "bb", "", "a", "ééé"])
    h = stable_hash_strings(arr)
    assert h[0] == h[3] and len(set(h.tolist())) == 4
    # Pinned: the hash is defined on the bytes and must never change between versions or runs
    # (embedding rows trained under one hash are meaningless under another).
    assert stable_hash_strings(arr.slice(1)).tolist() == h[1:].tolist()
    assert int(stable_hash_strings(pa.array(["a"]))[0]) == PINNED_HASH_OF_A
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="s", num_embeddings=7)])
    b = spec.decode(pa.table({"y": [0.0] * 5, "s": arr}))
    assert ((b.sparse.values() >= 0) & (b.sparse.values() < 7)).all()


PINNED_HASH_OF_A = 17360999193197444373


def test_sparse_weight_columns_become_kjt_weights_and_must_match_the_ids() -> None:
    t = pa.table({"y": [0.0, 1.0], "l": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
                  "w": pa.array([[0.5, 0.25], [2.0]], pa.list_(pa.float32()))})
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="l", num_embeddings=5, weight_column="w")])
    assert spec.decode(t).sparse.weights().tolist() == [0.5, 0.25, 2.0]
    bad = t.set_column(2, "w", pa.array([[0.5], [2.0]], pa.list_(pa.float32())))
    with pytest.raises(DataError, match=r"row 0, column 'w': has 1 weights but column 'l' has 2 ids"):
        spec.decode(bad)


def test_out_of_range_and_negative_ids_are_rejected_or_hashed_never_passed_through() -> None:
    t = _table(y=[0.0, 0.0, 0.0], i=[1, -4, 12])
    with pytest.raises(DataError, match=r"row 1, column 'i': id -4 is outside the table \[0, 10\)"):
        FeatureSpec(labels=["y"], sparse=[SparseFeature(name="i", num_embeddings=10)]).decode(t)
    hashed = FeatureSpec(labels=["y"], sparse=[
        SparseFeature(name="i", num_embeddings=10, on_out_of_range="hash")]).decode(t)
    v = hashed.sparse.values()
    assert v[0] == 1 and ((v >= 0) & (v < 10)).all()


@pytest.mark.parametrize("listed", [False, True])  # scalar ids and list ids decode apart
def test_an_id_outside_the_table_is_named_as_stored_with_a_fix_that_exists(listed: bool) -> None:
    def spec(**kw: object) -> FeatureSpec:
        return FeatureSpec(labels=["y"], sparse=[SparseFeature(name="u", **kw)])  # type: ignore[arg-type]

    def table(ids: list[int], typ: pa.DataType) -> pa.Table:
        col = pa.array([[i] for i in ids], pa.list_(typ)) if listed else pa.array(ids, typ)
        return pa.table({"y": [0.0] * len(ids), "u": col})

    big = 2**63 + 36  # a uint64 id above int64's range (it used to read as -9223372036854775772)
    with pytest.raises(DataError) as e:
        spec(num_embeddings=10).decode(table([3, big], pa.uint64()))
    msg = str(e.value)
    assert msg.startswith(f"row 1, column 'u': id {big} is outside the table [0, 10): ")
    assert "above 2**63 - 1, int64's largest value" in msg and "SparseFeature(name='u', hash=True)" in msg
    assert "raise num_embeddings" not in msg  # no table has that many rows
    hashed = spec(num_embeddings=10, hash=True).decode(table([3, big], pa.uint64())).sparse.values()
    assert ((hashed >= 0) & (hashed < 10)).all()
    # A negative id: no table row has it, however large the table.
    with pytest.raises(DataError) as e:
        spec(num_embeddings=2**63 - 1).decode(table([3, -4], pa.int64()))
    msg = str(e.value)
    assert msg.startswith("row 1, column 'u': id -4 is outside the table [0, 9223372036854775807): "
                          "it is negative")
    assert "hash=True" in msg and "on_out_of_range='hash'" in msg and "raise num_embeddings" not in msg
    # Too large for this table: raising num_embeddings is a fix; the stored value is named.
    with pytest.raises(DataError, match=r"row 0, column 'u': id 12 is outside the table \[0, 10\) "
                                        r"\(1 such ids in this batch\); raise num_embeddings"):
        spec(num_embeddings=10).decode(table([12, 3], pa.uint64()))
    # After a transform, the value as stored and the id it became.
    with pytest.raises(DataError, match=r"row 1, column 'u': value -40 \(id -4 after div=10\) is outside"):
        spec(num_embeddings=10, div=10).decode(table([30, -40], pa.int64()))


def test_nan_dense_values_are_filled_or_rejected_per_config() -> None:
    t = _table(y=[0.0, 1.0], d=[float("nan"), float("inf")])
    filled = FeatureSpec(labels=["y"], dense=[DenseFeature(column="d", fill_value=7.0)]).decode(t)
    assert filled.dense.tolist() == [[7.0], [7.0]]
    with pytest.raises(DataError, match=r"row 0, column 'd': dense value nan is not finite"):
        FeatureSpec(labels=["y"], dense=[DenseFeature(column="d", on_non_finite="error")]).decode(t)


def test_nan_labels_are_rejected_by_default_or_dropped_on_request() -> None:
    t = _table(y=[1.0, float("nan"), None, 0.0], d=[1.0, 2.0, 3.0, 4.0])
    with pytest.raises(DataError, match=r"row 1, column 'y': 2 label\(s\) in this batch are null, NaN"):
        FeatureSpec(labels=["y"], dense=["d"]).decode(t)
    b = FeatureSpec(labels=["y"], dense=["d"], on_nan_label="drop").decode(t)
    assert b.labels.tolist() == [1.0, 0.0] and b.dense[:, 0].tolist() == [1.0, 4.0]


def test_schema_check_names_the_file_and_the_missing_or_mistyped_column() -> None:
    spec = FeatureSpec(labels=["y"], dense=["d"], sparse=[SparseFeature(name="s", num_embeddings=3)])
    with pytest.raises(DataError, match=r"file f.parquet, column 'd': the declared dense column is missing"):
        spec.check_schema(pa.schema([("y", pa.float32()), ("s", pa.string())]), "f.parquet")
    with pytest.raises(DataError, match=r"column 's': the declared sparse id column must be an integer or "
                                        r"string.*but is double"):
        spec.check_schema(pa.schema([("y", pa.float32()), ("d", pa.float32()), ("s", pa.float64())]), "f")
    with pytest.raises(DataError, match=r"column 'd': the declared dense column must be numeric"):
        spec.check_schema(pa.schema([("y", pa.float32()), ("d", pa.string()), ("s", pa.string())]), "f")


def test_multi_label_specs_give_a_label_matrix_and_example_weights_are_checked() -> None:
    t = _table(a=[1.0, 0.0], b=[0.0, 1.0], w=[1.0, -1.0])
    assert FeatureSpec(labels=["a", "b"]).decode(t).labels.shape == (2, 2)
    with pytest.raises(DataError, match=r"row 1, column 'w': example weight -1.0 must be"):
        FeatureSpec(labels=["a"], weight_column="w").decode(t)


def test_decoding_is_vectorized_fast_enough_for_a_criteo_sized_batch() -> None:
    rng = np.random.default_rng(0)
    n = 2048
    cols = {"y": rng.integers(0, 2, n).astype(np.float32)}
    cols |= {f"d{i}": rng.random(n) for i in range(13)}
    cols |= {f"s{i}": rng.integers(0, 10**6, n) for i in range(26)}
    spec = FeatureSpec(labels=["y"], dense=[f"d{i}" for i in range(13)],
                       sparse=[SparseFeature(name=f"s{i}", num_embeddings=1000, hash=True) for i in range(26)])
    t = pa.table(cols)
    import time

    spec.decode(t)
    t0 = time.perf_counter()
    for _ in range(5):
        spec.decode(t)
    per_batch = (time.perf_counter() - t0) / 5
    # A per-row Python loop takes ~20 ms for this shape; vectorized is a few ms even on a busy host.
    assert per_batch < 0.015, per_batch


def test_a_bad_value_after_dropped_nan_label_rows_names_its_own_row() -> None:
    spec = FeatureSpec(labels=["y"], dense=[DenseFeature(column="d", on_non_finite="error")],
                       sparse=[SparseFeature(name="a", num_embeddings=10)], on_nan_label="drop")
    y = [0.0, float("nan"), float("nan"), 1.0, 0.0, 1.0]
    with pytest.raises(DataError, match=r"row 4, column 'd'"):
        spec.decode(pa.table({"y": y, "d": [0.0, 1, 2, 3, float("inf"), 5], "a": [0, 1, 2, 3, 4, 5]}))
    with pytest.raises(DataError, match=r"row 5, column 'a': id 10 is outside"):
        spec.decode(pa.table({"y": y, "d": [0.0] * 6, "a": [0, 1, 2, 3, 4, 10]}))
    with pytest.raises(DataError, match=r"row 5, column 'a': id 10 is outside"):
        spec.decode(pa.table({"y": y, "d": [0.0] * 6, "a": [[0], [], None, [3], [4, 1], [10]]}))


def test_integer_dense_columns_with_nulls_convert_like_those_without() -> None:
    spec = FeatureSpec(labels=["y"], dense=[DenseFeature(column="d", fill_value=-1.0)])
    big = 2**40 + 1
    with_null = spec.decode(pa.table({"y": [0.0, 1.0], "d": pa.array([big, None], pa.int64())}))
    without = spec.decode(pa.table({"y": [0.0, 1.0], "d": pa.array([big, 7], pa.int64())}))
    assert with_null.dense[0, 0].item() == without.dense[0, 0].item() == float(np.float32(big))
    assert with_null.dense[1, 0].item() == -1.0


def test_fast_path_hashing_matches_a_plain_reference_on_edge_and_random_ids() -> None:
    rng = np.random.default_rng(0)
    edge = [0, 1, -1, 2**63 - 1, -2**63, -2**63 + 1, 2**62, -2**62, 2**32, -2**32]
    ids = np.concatenate([np.array(edge, np.int64), rng.integers(-2**63, 2**63 - 1, 5000, dtype=np.int64)])
    for n in (1, 2, 3, 1000, 2**31 - 1, 2**40 + 7, 2**63 - 1):
        ref = [int(h) % n for h in stable_hash_ints(ids)]
        spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="a", num_embeddings=n, hash=True),
                                                 SparseFeature(name="b", num_embeddings=n, hash=True)])
        for col in (pa.array(ids), pa.array(ids.view(np.uint64)), pa.array(ids).slice(0)):
            kjt = spec.decode(pa.table({"y": np.zeros(len(ids)), "a": col, "b": col})).sparse
            assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32
            assert kjt.values().tolist() == ref + ref, n
        # The general path (list column) gives the same ids.
        spec1 = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="a", num_embeddings=n, hash=True)])
        lists = pa.array([[int(v)] for v in ids[:200]])
        assert spec1.decode(pa.table({"y": np.zeros(200), "a": lists})).sparse.values().tolist() == ref[:200]


def test_label_range_refuses_labels_outside_it_naming_the_column_row_and_value() -> None:
    t = _table(y=[1.0, 0.0, 2.0, -1.0], d=[1.0, 2.0, 3.0, 4.0])
    spec = FeatureSpec(labels=["y"], dense=["d"], label_range=[0, 1])  # a YAML list works too
    assert spec.label_range == (0.0, 1.0)
    with pytest.raises(DataError, match=r"row 2, column 'y': label 2 is outside label_range \[0, 1\] "
                                        r"\(2 such row\(s\) in this batch\)"):
        spec.decode(t)
    # Checked after NaN rows are dropped: the row named is still the source row.
    t2 = _table(y=[float("nan"), 0.0, 5.0], d=[1.0, 2.0, 3.0])
    with pytest.raises(DataError, match=r"row 2, column 'y': label 5 is outside"):
        FeatureSpec(labels=["y"], dense=["d"], label_range=(0, 1), on_nan_label="drop").decode(t2)
    assert FeatureSpec(labels=["y"], dense=["d"]).decode(t).labels.tolist() == [1.0, 0.0, 2.0, -1.0]
    with pytest.raises(ValueError, match=r"`label_range` must be None or \(low, high\) with finite low <= high"):
        FeatureSpec(labels=["y"], label_range=(1, 0))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SparseFeature(name="item", num_embeddings=0),
     "`num_embeddings` of sparse feature 'item' must be an int >= 1, but is 0."),
    (lambda: SparseFeature(name="item", num_embeddings=True),
     "`num_embeddings` of sparse feature 'item' must be an int >= 1, but is True."),
    (lambda: SparseFeature(name="", num_embeddings=5), "`name` must be a non-empty string"),
    (lambda: SparseFeature(name="item", num_embeddings=5, on_out_of_range="clip"),  # type: ignore[arg-type]
     "`on_out_of_range` of sparse feature 'item' must be 'error' or 'hash', but is 'clip'."),
    (lambda: DenseFeature(column="d", on_non_finite="zero"),  # type: ignore[arg-type]
     "`on_non_finite` of dense feature 'd' must be 'fill' or 'error', but is 'zero'."),
    (lambda: DenseFeature(column="d", fill_value=float("nan")), "`fill_value` of dense feature 'd' must be a finite"),
    (lambda: FeatureSpec(labels=["click"], dense=["price", "click"]),
     "label column 'click' is also read as a dense input: the model would see its own target."),
    (lambda: FeatureSpec(labels=["click"], sparse=[SparseFeature(name="c", column="click", num_embeddings=2)]),
     "label column 'click' is also read as sparse feature 'c''s ids"),
    (lambda: FeatureSpec(labels=["click"], weight_column="click"), "label column 'click' is also read as the example weight"),
    (lambda: FeatureSpec(labels="click"), "`labels` must be a non-empty list of label columns, but is 'click'."),
])
def test_invalid_feature_declarations_are_refused_when_declared(make, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value)


def test_chunk_batches_are_the_rows_own_batches_and_independent_of_each_other() -> None:
    # decode_chunk(batch_rows=k) lays the ids out batch-major so whole batches are views: any
    # range of rows (whole batch, the short tail, across blocks) must equal decoding those rows
    # alone, and writing into one batch must not change another.
    rng = np.random.default_rng(3)
    n = 11
    table = pa.table({
        "label": rng.integers(0, 2, n).astype(np.float32), "d": rng.random(n).astype(np.float32),
        "a": rng.integers(0, 10**9, n), "b": rng.integers(0, 50, n), "c": rng.integers(0, 10**9, n),
        "hist": pa.array([list(range(i)) for i in range(n)], pa.list_(pa.int64())),
    })
    spec = FeatureSpec(labels=["label"], dense=["d"],
                       sparse=[SparseFeature(name="a", num_embeddings=97, hash=True),
                               SparseFeature(name="b", num_embeddings=50),
                               SparseFeature(name="c", num_embeddings=13, hash=True)],
                       sequence=[SequenceFeature(name="hist", num_embeddings=7, hash=True, max_len=3)])
    chunk = spec.decode_chunk(table, batch_rows=4)
    for lo, hi in [(0, 4), (4, 8), (8, 11), (2, 7), (3, 11), (5, 5)]:
        got, want = chunk.batch(lo, hi), spec.decode(table.slice(lo, hi - lo))
        assert torch.equal(got.sparse.values(), want.sparse.values()), (lo, hi)
        assert torch.equal(got.sparse.lengths(), want.sparse.lengths())
        assert torch.equal(got.dense, want.dense) and torch.equal(got.labels, want.labels)
        assert got.sequence is not None and want.sequence is not None
        assert torch.equal(got.sequence.values(), want.sequence.values())
    first, second = chunk.batch(0, 4), chunk.batch(4, 8)
    before = [second.sparse.values().clone(), second.dense.clone(), second.labels.clone()]
    first.sparse.values().add_(1)
    first.dense.add_(1)
    first.labels.add_(1)
    assert torch.equal(second.sparse.values(), before[0])
    assert torch.equal(second.dense, before[1]) and torch.equal(second.labels, before[2])
