"""Checks on batches that no ``FeatureSpec`` decoded: a plain iterable of ``Batch``, or a
``WindowedDataset`` that builds its own tensors.

The reader checks every id as it decodes (``decode``). Batches built by hand reach the tables
unchecked otherwise, and what goes wrong there is silent or obscure: FBGEMM trains an id outside
its table on row 0 with one log line ("Setting idx to zero"), and a feature the batch lacks fails
deep inside torchrec's KJT split with an ``IndexError``. One ``aminmax`` over a batch's ids (a
look per feature only when some id reaches the smallest table's rows) names the window, batch,
feature, row and value instead; it runs inside the dataset's iterator, so ``SyncedIterator``
raises it on every rank. Non-finite dense values are left to
``TrainingArguments.non_finite_loss``, whose policies act on the loss they cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.data.base import Segment, WindowedDataset
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.dynamic.ids import ID_SPACE

_ID_DTYPES = (torch.int64, torch.int32)
Limits = dict[str, tuple[int, str]]
"""``feature -> (rows, table)``: the smallest table reading the feature."""


def _limits(tables: Iterable[tuple[str, str, int | None]]) -> Limits:
    out: Limits = {}
    for feature, table, rows in tables:
        bound = ID_SPACE if rows is None else rows  # a dynamic table: any raw id >= 0
        if feature not in out or bound < out[feature][0]:
            out[feature] = (bound, table)
    return out


class BatchCheck:
    """What a hand-built batch must satisfy to fit a model's tables.

    ``pooled`` and ``sequence``: ``(feature, table, num_embeddings)`` for every feature a pooled
    (``EmbeddingBagCollection``) or an unpooled (``EmbeddingCollection``) table reads
    (``sharding.feature_tables``); ``num_embeddings`` None marks a dynamic table, which takes any
    id ``>= 0``. As for a ``FeatureSpec`` (``check_features_fit_tables``): a pooled table reads
    ``batch.sparse``, an unpooled one ``batch.sequence`` or, for a key that KJT lacks,
    ``batch.sparse``. Keys no table reads are not checked.
    """

    def __init__(self, pooled: Iterable[tuple[str, str, int | None]],
                 sequence: Iterable[tuple[str, str, int | None]] = ()) -> None:
        self._pooled = _limits(pooled)
        self._sequence = _limits(sequence)

    def batches(self, dataset: WindowedDataset, window_id: str, skip_batches: int = 0,
                earlier: Sequence[Segment] = ()) -> Iterator[Batch]:
        """``dataset.iter_window(window_id, skip_batches)`` (with ``earlier``, when there are
        earlier parts of the window), each batch checked as it is fetched unless the dataset
        decodes through a ``FeatureSpec`` (the reader checked every id)."""
        # Only a resumed window's earlier parts are passed: a dataset without exact_reshard
        # keeps the two-argument iter_window it was written with.
        if earlier and not dataset.exact_reshard:
            raise DataError(
                f"train window {window_id!r} was partly trained at another world size "
                f"({', '.join(f'{s.batches} batches per rank at {s.world_size}' for s in earlier)}"
                f"), but the train dataset ({type(dataset).__name__}) cannot tell which rows "
                "those were (it has no exact_reshard): resume with a dataset that has "
                "(ParquetWindowDataset), or with reshard_data_position='restart_window' or "
                "'next_window' from the checkpoint saved at the old world size.")
        it = (dataset.iter_window(window_id, skip_batches=skip_batches, earlier=earlier)
              if earlier else dataset.iter_window(window_id, skip_batches=skip_batches))
        if isinstance(dataset.features, FeatureSpec) or not (self._pooled or self._sequence):
            return it
        return _CheckedWindow(self, it, window_id, skip_batches)

    def check(self, batch: Batch, where: str = "batch") -> None:
        """Raise ``DataError`` (prefixed by ``where``) for an id outside the table reading it,
        a feature a table reads missing from its KJT, or non-integer ids."""
        sparse = set(batch.sparse.keys())
        seq = set(batch.sequence.keys()) if batch.sequence is not None else set()
        for f, (_, table) in self._pooled.items():
            if f not in sparse:
                self._missing(batch, f, table, "a pooled table (EmbeddingBagCollection), which "
                              "reads batch.sparse", where)
        for f, (_, table) in self._sequence.items():
            if f not in seq and f not in sparse:
                self._missing(batch, f, table, "a sequence table (EmbeddingCollection), which "
                              "reads batch.sequence or batch.sparse", where)
        from_sparse = {f: lim for f, lim in self._sequence.items() if f not in seq}
        self._check_ids(batch.sparse, "sparse", _smaller(self._pooled, from_sparse), where)
        if batch.sequence is not None:
            self._check_ids(batch.sequence, "sequence", self._sequence, where)

    @staticmethod
    def _missing(batch: Batch, feature: str, table: str, kind: str, where: str) -> None:
        have = f"batch.sparse keys {list(batch.sparse.keys())}" + (
            f", batch.sequence keys {list(batch.sequence.keys())}"
            if batch.sequence is not None else "")
        raise DataError(
            f"{where}: table {table!r} reads feature {feature!r}, but the batch has no such key "
            f"where it looks ({kind}; the batch has {have}). Put every feature a table reads into "
            "that KJT (an empty list per row is allowed), or leave the table out of the model.")

    def _check_ids(self, kjt: KeyedJaggedTensor, field: str, limits: Mapping[str, tuple[int, str]],
                   where: str) -> None:
        values = kjt.values()
        if values.numel() == 0:
            return
        keys = kjt.keys()
        read = [limits.get(k) for k in keys]
        if all(lim is None for lim in read):
            return
        if values.dtype not in _ID_DTYPES:
            raise DataError(
                f"{where}: batch.{field} holds {values.dtype} values (keys {keys}), but ids must "
                "be int64 (or int32) tensors; build the KJT from integer ids.")
        # Cached on the KJT; torchrec's input dist reads it next anyway.
        per_key = kjt.length_per_key()
        if sum(per_key) != values.numel():
            raise DataError(
                f"{where}: batch.{field} has {values.numel()} values, but its lengths add up to "
                f"{sum(per_key)}; build the KJT with one length per key and row.")
        # One pass over every value first: with all ids inside the smallest table read, no key
        # needs a look of its own (the common case when tables are alike).
        lo, hi = torch.aminmax(values)
        if int(lo) >= 0 and int(hi) < min(lim[0] for lim in read if lim is not None):
            return
        for j, chunk in enumerate(torch.split(values, per_key)):
            lim = read[j]
            if lim is None or chunk.numel() == 0:
                continue
            lo, hi = torch.aminmax(chunk)
            if int(lo) < 0 or int(hi) >= lim[0]:
                _raise_out_of_range(kjt, j, chunk, lim, field, where)


class _CheckedWindow(Iterator[Batch]):
    """A window's batches, each checked as it is fetched. ``close`` and ``rows_remaining`` reach
    the dataset's own iterator: ``SyncedIterator`` counts the rest of a window it stops early
    through them, unchecked, since those batches never train."""

    def __init__(self, check: BatchCheck, source: Iterator[Batch], window_id: str,
                 first: int) -> None:
        self._check, self._source = check, source
        self._window_id, self._next = window_id, first

    def __next__(self) -> Batch:
        batch = next(self._source)
        self._check.check(batch, f"window {self._window_id!r}, batch {self._next}")
        self._next += 1
        return batch

    def close(self) -> None:
        close: Any = getattr(self._source, "close", None)
        if callable(close):
            close()

    def rows_remaining(self) -> int:
        count: Any = getattr(self._source, "rows_remaining", None)
        if callable(count):
            return int(count())
        return sum(b.num_real_rows() for b in self._source)


def _smaller(a: Limits, b: Mapping[str, tuple[int, str]]) -> Limits:
    out = dict(a)
    for f, lim in b.items():
        if f not in out or lim[0] < out[f][0]:
            out[f] = lim
    return out


def _raise_out_of_range(kjt: KeyedJaggedTensor, j: int, chunk: torch.Tensor,
                        limit: tuple[int, str], field: str, where: str) -> None:
    rows, table = limit
    bad = (chunk < 0).logical_or_(chunk >= rows)
    pos = int(bad.nonzero()[0])
    key = kjt.keys()[j]
    row = int(torch.searchsorted(kjt[key].offsets()[1:], pos, right=True))
    value = int(chunk[pos])
    count = f"{int(bad.sum())} such id(s) of {key!r} in this batch"
    if value < 0:
        why = f"it is negative, and no table row is ({count})"
    else:
        why = f"outside table {table!r}, which has rows [0, {rows}) ({count})"
    fix = ("map ids into the table before building the batch (hash them, or take them "
           f"modulo {rows}), or give the table more rows (num_embeddings)"
           if rows < ID_SPACE else f"raw ids of dynamic table {table!r} must be >= 0")
    raise DataError(
        f"{where}: feature {key!r} (batch.{field}) has id {value} at row {row}: {why}. "
        f"Unchecked, FBGEMM would train it on row 0; {fix}.")
