"""Parquet windows for the tiny test model (``helpers.tiny_model``) with passthrough columns."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
from data_utils import write_window_files
from helpers import FEATURES, NUM_DENSE, ROWS

from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.spec import FeatureSpec

PASSTHROUGH = ["request_id", "user"]


def scoring_spec(**kw) -> FeatureSpec:  # type: ignore[no-untyped-def]
    """The tiny model's features (labels ``y``, dense ``d0``.. with ``d0`` = the request id,
    sparse ``f0``..), passing the request id and a string user id through."""
    kw.setdefault("passthrough", PASSTHROUGH)
    return FeatureSpec(labels=["y"], dense=[f"d{i}" for i in range(NUM_DENSE)],
                       sparse=[SparseFeature(name=f, num_embeddings=ROWS) for f in FEATURES], **kw)


def _table(ids: np.ndarray) -> pa.Table:
    cols: dict[str, pa.Array] = {
        "request_id": pa.array(ids),
        "user": pa.array([f"u{i % 11}" for i in ids], pa.string()),
        "y": pa.array((ids % 3 == 0).astype(np.float32)),
        "d0": pa.array(ids / 4096.0),  # exact in float32
    }
    for i in range(1, NUM_DENSE):
        cols[f"d{i}"] = pa.array(((ids * (i + 3)) % 17 / 17.0).astype(np.float32))
    for j, f_name in enumerate(FEATURES):
        cols[f_name] = pa.array((ids * (j + 1)) % ROWS)
    return pa.table(cols)


def write_scoring_windows(root: str, rows_per_file: Sequence[Sequence[int]],
                          row_group_size: int = 5) -> list[int]:
    """``rows_per_file[w][f]`` rows in file f of window ``hour=w``; returns every request id.

    Request ids are unique over all windows and ``d0 * 4096`` (float32-exact), so a batch's
    passthrough column can be checked against the rows it holds (``request_ids_of``)."""
    return write_window_files(root, rows_per_file, _table, row_group_size, first_row_id=1000)


def request_ids_of(batch) -> list[int]:  # type: ignore[no-untyped-def]
    """The request ids of a batch's rows, read from its dense input (not its passthrough)."""
    return [int(round(x * 4096)) for x in batch.dense[:, 0].tolist()]
