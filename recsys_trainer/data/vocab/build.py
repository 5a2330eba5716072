"""Building a ``VocabFromData`` vocabulary: one rank's value counts over its share of the
first training windows, and the merge of every rank's counts into the frozen vocabulary.

No gang and no state here: ``Vocabularies.build`` (``recsys_trainer.data.vocab.state``) calls
``count_windows`` on every rank, all-gathers the counts and merges them with
``merge_and_freeze``, a pure function, so every rank gets the same vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from recsys_trainer.data.columns import _is_str
from recsys_trainer.data.vocab.lookup import Kind, VocabFromData, Vocabulary

logger = logging.getLogger("recsys_trainer.data")


class ColumnReader(Protocol):
    """What counting reads of a dataset (``WindowedDataset`` provides it)."""

    def read_columns(self, window_id: str, columns: Sequence[str]) -> Iterator[pa.Table]: ...


def count_windows(dataset: ColumnReader, windows: list[str], depth: Mapping[Any, int],
                  columns: Mapping[Any, list[str]]) -> dict[Any, tuple[pa.Array, pa.Array, Kind | None]]:
    """This rank's value counts per vocabulary over its share of the first windows."""
    parts: dict[Any, list[tuple[pa.Array, pa.Array]]] = {key: [] for key in columns}
    kinds: dict[Any, Kind | None] = {key: None for key in columns}
    for i, window in enumerate(windows):
        keys = [k for k in columns if i < depth[k]]
        needed = sorted({c for k in keys for c in columns[k]})
        if not needed:
            continue
        for table in dataset.read_columns(window, needed):
            for k in keys:
                for c in columns[k]:
                    values, counts, kind = _value_counts(table.column(c))
                    if kinds[k] is not None and kind != kinds[k]:
                        raise ValueError(f"column {c!r} holds {kind} ids, but the other columns "
                                         f"of its vocabulary hold {kinds[k]} ids; one vocabulary "
                                         "maps one kind.")
                    kinds[k] = kind
                    parts[k].append((values, counts))
    return {k: (*_sum_counts(parts[k], kinds[k]), kinds[k]) for k in columns}


def _value_counts(col: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, pa.Array, Kind]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = arr.flatten()
    if _is_str(arr.type):
        kind: Kind = "string"
        arr = arr.cast(pa.string()) if arr.type != pa.string() else arr
    elif pa.types.is_integer(arr.type):
        kind = "integer"
        arr = arr.cast(pa.int64()) if arr.type != pa.int64() else arr
    else:
        raise ValueError(f"a vocabulary maps integer or string ids, but a column holds {arr.type}.")
    vc = pc.value_counts(arr.drop_null())
    return vc.field("values"), vc.field("counts"), kind


def _sum_counts(parts: Sequence[tuple[pa.Array, pa.Array]], kind: Kind | None) -> tuple[pa.Array, pa.Array]:
    typ = pa.string() if kind == "string" else pa.int64()
    if not parts:
        return pa.array([], typ), pa.array([], pa.int64())
    t = pa.table({"value": pa.concat_arrays([p[0] for p in parts]),
                  "count": pa.concat_arrays([p[1] for p in parts])})
    g = t.group_by("value").aggregate([("count", "sum")])
    return g.column("value").combine_chunks(), g.column("count_sum").combine_chunks()


def merge_and_freeze(per_rank: Sequence[tuple[pa.Array, pa.Array, Kind | None]], cfg: VocabFromData,
                     capacity: int, windows: list[str], features: list[str]) -> Vocabulary:
    """Every rank's counts (in rank order) -> the frozen vocabulary: values seen at least
    ``min_count`` times, most frequent first, ties by value; a pure function of its input, so
    every rank that merges the same gathered counts gets the same vocabulary."""
    kinds = {k for _, _, k in per_rank if k is not None}
    if len(kinds) > 1:
        raise ValueError(f"the columns of {features} hold integer ids on some ranks and strings on "
                         "others; write them with one type in every file.")
    kind: Kind | None = kinds.pop() if kinds else None
    # A rank that read no value of the columns has no kind (and nothing to add).
    values, counts = _sum_counts([(v, c) for v, c, k in per_rank if k is not None], kind)
    distinct = len(values)
    table = pa.table({"value": values, "count": counts})
    table = table.filter(pc.greater_equal(table.column("count"), cfg.min_count))
    frequent = table.num_rows
    order = pc.sort_indices(table, sort_keys=[("count", "descending"), ("value", "ascending")])
    kept = table.take(order).slice(0, capacity).column("value").to_pylist()
    source = (f"built from train window(s) {windows}: {distinct} distinct values, {frequent} seen "
              f">= {cfg.min_count} times, {len(kept)} kept (at most {capacity})")
    if not kept:
        logger.warning("the vocabulary of %s built from window(s) %s is empty (%d distinct "
                       "values, none seen %d times): every id maps to the OOV row", features,
                       windows, distinct, cfg.min_count)
    return Vocabulary(kept, kind=kind, source=source, built_from=cfg)



__all__ = ["ColumnReader", "count_windows", "merge_and_freeze"]
