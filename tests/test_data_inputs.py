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

from recsys_trainer.data.features import (
    DataError,
    FeatureSpec,
    SequenceFeature,
    SparseFeature,
    stable_hash_ints,
)
from recsys_trainer.data.parquet import ParquetWindowDataset


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
