"""Passthrough columns: raw columns ride on ``Batch.passthrough`` through the reader, its
prefetch threads, padding, both training loops and into hooks; never into the model."""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import make_trainer
from predict_utils import request_ids_of, scoring_spec, write_scoring_windows

from recsys_trainer import Hook
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.sync import SyncedIterator
from recsys_trainer.distributed import FakeGang


def _check_aligned(batch: Any) -> list[int]:
    ids = batch.passthrough["request_id"].to_pylist()
    assert ids == request_ids_of(batch)  # row i of the passthrough is row i of the tensors
    assert batch.passthrough["user"].to_pylist() == [f"u{i % 11}" for i in ids]
    return ids


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_passthrough_columns_stay_aligned_with_their_rows_through_the_reader(tmp_path, prefetch, shuffle) -> None:
    all_ids = write_scoring_windows(str(tmp_path), [[7, 12], [3]])
    ds = ParquetWindowDataset(str(tmp_path), scoring_spec(), batch_size=4, shuffle=shuffle,
                              prefetch_batches=prefetch)
    seen = [i for w in ds.window_ids() for b in ds.iter_window(w) for i in _check_aligned(b)]
    assert sorted(seen) == all_ids


def test_passthrough_keeps_only_the_rows_kept_when_nan_labels_are_dropped(tmp_path) -> None:
    t = pa.table({"request_id": [1, 2, 3, 4], "user": ["a", "b", "c", "d"],
                  "y": [1.0, None, 0.0, float("nan")], "d0": [1 / 4096, 2 / 4096, 3 / 4096, 4 / 4096],
                  **{f"d{i}": [0.0] * 4 for i in range(1, 4)}, **{f"f{j}": [1, 2, 3, 4] for j in range(4)}})
    os.makedirs(tmp_path / "hour=00")
    pq.write_table(t, tmp_path / "hour=00" / "a.parquet")
    ds = ParquetWindowDataset(str(tmp_path), scoring_spec(on_nan_label="drop"), batch_size=4)
    (batch,) = list(ds.iter_window("hour=00"))
    assert batch.passthrough["request_id"].to_pylist() == [1, 3] == request_ids_of(batch)
    assert batch.passthrough["user"].to_pylist() == ["a", "c"]


def test_a_missing_passthrough_column_is_a_data_error_naming_the_column_and_file(tmp_path) -> None:
    write_scoring_windows(str(tmp_path), [[5]])
    ds = ParquetWindowDataset(str(tmp_path), scoring_spec(passthrough=["request_id", "session"]), batch_size=4)
    with pytest.raises(DataError, match=r"hour=00/part-0.parquet, column 'session': the declared "
                                        r"passthrough column is missing \(the file has: request_id, user"):
        next(ds.iter_window("hour=00"))


def test_a_label_or_an_input_may_also_be_passed_through_raw(tmp_path) -> None:
    write_scoring_windows(str(tmp_path), [[6]])
    ds = ParquetWindowDataset(str(tmp_path), scoring_spec(passthrough=["y", "f0", "request_id"]), batch_size=6)
    (batch,) = list(ds.iter_window("hour=00"))
    assert batch.passthrough["y"].to_pylist() == batch.labels.tolist()
    assert batch.passthrough["f0"].to_pylist() == batch.sparse["f0"].values().tolist()


@pytest.mark.parametrize("bad", ["request_id", ["a", "a"], [""]])
def test_passthrough_must_be_a_list_of_distinct_column_names(bad: Any) -> None:
    with pytest.raises(ValueError, match="`passthrough`"):
        FeatureSpec(labels=["y"], passthrough=bad)


def test_padding_batches_carry_no_passthrough(tmp_path) -> None:
    write_scoring_windows(str(tmp_path), [[2]])
    ds = ParquetWindowDataset(str(tmp_path), scoring_spec(), batch_size=4)
    # Rank 0 of 2 with no rows left while the other rank still has data: it pads.
    it = SyncedIterator(iter([]), FakeGang(0, 2, peer_max=[[0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]), pad=True,
                        padding_batch=ds.padding_batch)
    pad = next(it)
    assert it.last_was_padding and pad.passthrough == {} and pad.num_real_rows() == 0
    assert next(it, None) is None


class _Collect(Hook):
    def __init__(self) -> None:
        self.ids: list[int] = []

    def after_step(self, trainer: Any, output: Any) -> None:
        for micro in output.micro_batches:
            self.ids.extend(_check_aligned(micro.batch))

    def after_eval_step(self, trainer: Any, output: Any) -> None:
        if not output.is_padding:
            for micro in output.micro_batches:
                self.ids.extend(_check_aligned(micro.batch))


@pytest.mark.parametrize("pipeline", ["none", "sparse_dist"])
def test_hooks_see_the_passthrough_of_every_trained_and_evaluated_row(tmp_path, pipeline: str) -> None:
    all_ids = write_scoring_windows(str(tmp_path / "data"), [[9, 14], [11]])
    hook = _Collect()
    ds = ParquetWindowDataset(str(tmp_path / "data"), scoring_spec(), batch_size=8, prefetch_batches=2)
    ev = ParquetWindowDataset(str(tmp_path / "data"), scoring_spec(), batch_size=8, prefetch_batches=2)
    trainer = make_trainer(train=ds, eval_=ev, hooks=[hook], pipeline=pipeline,
                           output_dir=str(tmp_path / "out"), resume_from=None)
    trainer.train()
    assert sorted(hook.ids) == all_ids and trainer.state.global_step == 5
    hook.ids.clear()
    trainer.evaluate()
    assert sorted(hook.ids) == all_ids
