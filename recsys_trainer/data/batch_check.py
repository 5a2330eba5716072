"""Checks on batches that no ``FeatureSpec`` decoded: a plain iterable of ``Batch``, or a
``WindowedDataset`` that builds its own tensors.

The reader checks every column as it decodes (``decode``). Batches built by hand reach the model
unchecked otherwise, and what goes wrong there is silent or obscure: FBGEMM trains an id outside
its table on row 0 with one log line ("Setting idx to zero"), a NaN dense value turns every
dense weight NaN under the default ``non_finite_loss="ignore"``, and a feature the batch lacks
fails deep inside torchrec's KJT split with an ``IndexError``. One vectorized pass per batch (a
bound per value, one compare) names the window, batch, feature, row and value instead; it runs
inside the dataset's iterator, so ``SyncedIterator`` raises it on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.data.base import WindowedDataset
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.spec import FeatureSpec

_ID_SPACE = 2**63 - 1
"""A dynamic table's bound: any raw id in ``[0, 2**63 - 1)``, as the reader allows."""
_ID_DTYPES = (torch.int64, torch.int32)


class BatchCheck:
    """What a hand-built batch must satisfy to fit a model's tables.

    ``tables``: ``(feature, table, num_embeddings)`` for every feature an embedding table reads
    (``sharding.feature_tables``); ``num_embeddings`` None marks a dynamic table, which takes
    any id ``>= 0``. A feature read by two tables is held to the smaller one.
    """

    def __init__(self, tables: Iterable[tuple[str, str, int | None]]) -> None:
        self._limit: dict[str, tuple[int, str]] = {}
        """``feature -> (rows, table)`` of the smallest table reading it."""
        for feature, table, rows in tables:
            bound = _ID_SPACE if rows is None else rows
            if feature not in self._limit or bound < self._limit[feature][0]:
                self._limit[feature] = (bound, table)
        self._bounds: dict[tuple[str, ...], torch.Tensor] = {}
        """Per-key bounds of each KJT key layout seen (keys rarely change between batches)."""

    def batches(self, dataset: WindowedDataset, window_id: str,
                skip_batches: int = 0) -> Iterator[Batch]:
        """``dataset.iter_window(window_id, skip_batches)``, each batch checked unless the
        dataset decodes through a ``FeatureSpec`` (the reader checked it column by column)."""
        it = dataset.iter_window(window_id, skip_batches=skip_batches)
        if isinstance(dataset.features, FeatureSpec):
            return it
        return self._checked(it, window_id, skip_batches)

    def _checked(self, it: Iterator[Batch], window_id: str, first: int) -> Iterator[Batch]:
        for i, batch in enumerate(it, first):
            self.check(batch, f"window {window_id!r}, batch {i}")
            yield batch

    def check(self, batch: Batch, where: str = "batch") -> None:
        """Raise ``DataError`` (prefixed by ``where``) for an id outside its table, a missing
        or non-integer id feature, or a non-finite dense value."""
        kjts = {"sparse": batch.sparse, "sequence": batch.sequence}
        present: set[str] = set()
        for field, kjt in kjts.items():
            if kjt is not None:
                present.update(kjt.keys())
                self._check_ids(kjt, field, where)
        missing = [f for f in self._limit if f not in present]
        if missing:
            f = missing[0]
            have = {field: list(k.keys()) for field, k in kjts.items() if k is not None}
            raise DataError(
                f"{where}: table {self._limit[f][1]!r} reads feature {f!r}, but the batch has no "
                f"such key ({len(missing)} missing: {missing}; the batch has "
                f"{', '.join(f'{n} keys {k}' for n, k in have.items())}). Put every feature a "
                "table reads into the batch's KJTs (an empty list per row is allowed), or leave "
                "the table out of the model.")
        dense = batch.dense
        if dense.numel() and not bool(torch.isfinite(dense).all()):
            row, col = (int(i) for i in (~torch.isfinite(dense)).nonzero()[0])
            raise DataError(
                f"{where}: dense value {float(dense[row, col])} at row {row}, column {col} is "
                "not finite; one such value turns the dense weights it reaches NaN. Clean or "
                "fill it before building the batch, or read the data through a FeatureSpec "
                "with DenseFeature(on_non_finite='fill').")

    def _check_ids(self, kjt: KeyedJaggedTensor, field: str, where: str) -> None:
        values = kjt.values()
        if values.numel() == 0:
            return
        if values.dtype not in _ID_DTYPES:
            raise DataError(
                f"{where}: batch.{field} holds {values.dtype} values (keys {kjt.keys()}), but "
                "ids must be int64 (or int32) tensors; build the KJT from integer ids.")
        keys = tuple(kjt.keys())
        bounds = self._bounds.get(keys)
        if bounds is None:
            bounds = self._bounds[keys] = torch.tensor(
                [self._limit.get(k, (_ID_SPACE, ""))[0] for k in keys], dtype=torch.int64)
        # length_per_key is cached on the KJT, and torchrec's input dist reads it next anyway.
        per_key = torch.tensor(kjt.length_per_key(), dtype=torch.int64)
        hi = torch.repeat_interleave(bounds.to(values.device), per_key.to(values.device))
        bad = (values < 0).logical_or_(values >= hi)
        if bool(bad.any()):
            self._raise_out_of_range(kjt, field, bad, where)

    def _raise_out_of_range(self, kjt: KeyedJaggedTensor, field: str, bad: torch.Tensor,
                            where: str) -> None:
        first = int(bad.nonzero()[0])
        starts = torch.tensor([0, *kjt.length_per_key()]).cumsum(0)
        j = int(torch.searchsorted(starts, first, right=True)) - 1
        key = kjt.keys()[j]
        pos = first - int(starts[j])
        offsets = kjt[key].offsets()
        row = int(torch.searchsorted(offsets[1:], pos, right=True))
        value = int(kjt.values()[first])
        rows, table = self._limit.get(key, (_ID_SPACE, "?"))
        count = f"{int(bad.sum())} such id(s) in this batch"
        if value < 0:
            why = f"it is negative, and no table row is ({count})"
        else:
            why = f"outside table {table!r}, which has rows [0, {rows}) ({count})"
        fix = ("map ids into the table before building the batch (hash them, or take them "
               f"modulo {rows}), or give the table more rows (num_embeddings)"
               if rows < _ID_SPACE else "raw ids of a dynamic table must be >= 0")
        raise DataError(
            f"{where}: feature {key!r} (batch.{field}) has id {value} at row {row}: {why}. "
            f"Unchecked, FBGEMM would train it on row 0; {fix}.")
