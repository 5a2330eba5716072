"""The item catalog of the retrieval models: each item's side-feature ids, read on the host
(a parquet file or a mapping of arrays) and registered by the model as buffers, so that items
outside a batch (uniform negatives, the corpus) can be embedded with their side features."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


def load_item_catalog(source: str | os.PathLike[str] | Mapping[str, Any], id_column: str,
                      columns: Sequence[str], num_items: int) -> dict[str, torch.Tensor]:
    """``{column: int64 [num_items]}``: each item's side-feature id, from a parquet file (or a
    mapping of arrays) with ``id_column`` and ``columns``. Every item id in ``[0, num_items)``
    must appear exactly once: an item without side features could not be embedded."""
    if isinstance(source, Mapping):
        table = {k: np.asarray(v) for k, v in source.items()}
        where = "the item catalog"
    else:
        import pyarrow.parquet as pq

        where = f"item catalog {os.fspath(source)!r}"
        # Check the schema first: reading a missing column raises an ArrowInvalid naming
        # neither the catalog nor the feature.
        have = pq.read_schema(source).names
        absent = [c for c in (id_column, *columns) if c not in have]
        if absent:
            raise ValueError(f"{where} lacks column(s) {absent}; it has {sorted(have)}.")
        read = pq.read_table(source, columns=[id_column, *columns])
        table = {c: read.column(c).to_numpy() for c in read.column_names}
    missing = [c for c in (id_column, *columns) if c not in table]
    if missing:
        raise ValueError(f"{where} lacks column(s) {missing}; it has {sorted(table)}.")
    ids = table[id_column].astype(np.int64)
    if len(ids) != num_items or not np.array_equal(np.sort(ids), np.arange(num_items)):
        raise ValueError(
            f"{where} must list every item id in [0, {num_items}) exactly once (column "
            f"{id_column!r}), but has {len(ids)} rows with {len(np.unique(ids))} distinct ids in "
            f"[{ids.min() if len(ids) else 0}, {ids.max() if len(ids) else 0}].")
    order = np.argsort(ids)
    return {c: torch.from_numpy(table[c].astype(np.int64)[order].copy()) for c in columns}


__all__ = ["load_item_catalog"]
