"""Small parquet windows with a ``row_id`` column, for data tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.spec import FeatureSpec


def row_id_spec() -> FeatureSpec:
    """``row_id`` as the only dense input: every decoded batch says which rows it holds."""
    return FeatureSpec(labels=["y"], dense=["row_id"],
                       sparse=[SparseFeature(name="item", num_embeddings=100),
                               SparseFeature(name="tag", num_embeddings=50)])


def write_windows(root: str, rows_per_file: Sequence[Sequence[int]], row_group_size: int = 8,
                  first_row_id: int = 0) -> int:
    """``rows_per_file[w][f]`` rows in file f of window ``hour=w``; returns the total rows.

    Row ids are unique over all windows (they double as exact float32 dense values)."""
    def table(ids: np.ndarray) -> pa.Table:
        return pa.table({
            "row_id": ids,
            "y": (ids % 3 == 0).astype(np.float32),
            "item": ids % 100,
            "tag": pa.array([f"t{i % 7}" for i in ids], pa.string()),
        })

    return len(write_window_files(root, rows_per_file, table, row_group_size, first_row_id))


def write_window_files(root: str, rows_per_file: Sequence[Sequence[int]],
                       table: Callable[[np.ndarray], pa.Table], row_group_size: int,
                       first_row_id: int) -> list[int]:
    """``rows_per_file[w][f]`` rows, ``table(row_ids)``, in file f of window ``hour=w``; row ids
    count up from ``first_row_id`` over all windows. Returns every row id written."""
    rid = first_row_id
    for w, files in enumerate(rows_per_file):
        d = os.path.join(root, f"hour={w:02d}")
        os.makedirs(d, exist_ok=True)
        for f, n in enumerate(files):
            ids = np.arange(rid, rid + n, dtype=np.int64)
            rid += n
            pq.write_table(table(ids), os.path.join(d, f"part-{f}.parquet"), row_group_size=row_group_size)
    return list(range(first_row_id, rid))


def row_ids(batch) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(x) for x in batch.dense[:, 0].tolist()]


def train_interrupted_then_resumed(dataset: Callable[[], Any], trainer: Callable[..., Any],
                                   stop_after: int, hook: Any) -> tuple[Any, dict[str, Any]]:
    """Train ``stop_after`` steps on a fresh ``dataset()``, then train to the end on another
    fresh one resumed from the first run's trainer and dataset state (``hook`` in both runs;
    ``trainer(ds, hooks=[...], **args)`` builds a Trainer). Returns the second trainer and the
    trainer state saved at the interruption."""
    ds = dataset()
    first = trainer(ds, hooks=[hook], train_steps=stop_after)
    first.train()
    saved_trainer, saved_data = first.state.state_dict(), ds.state_dict()
    ds2 = dataset()
    second = trainer(ds2, hooks=[hook])
    ds2.load_state_dict(saved_data)
    second.state.load_state_dict(saved_trainer)
    second.train()
    return second, saved_trainer
