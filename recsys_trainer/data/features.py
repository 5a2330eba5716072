"""Declared features -> tensors, vectorized with pyarrow/numpy (no per-row Python loop).

A ``FeatureSpec`` names the label column(s), the dense float columns and the sparse id columns of
a table. ``FeatureSpec.decode(table)`` turns an Arrow table (one batch of rows) into a ``Batch``:

* dense: ``float32 [B, num_dense]``; nulls become ``fill_value``; NaN/Inf are filled or rejected.
* sparse: one ``KeyedJaggedTensor`` key per ``SparseFeature``, key-major, built with one
  ``np.concatenate`` (see DESIGN.md "KJT from arrow"). Integer ids are checked against the table
  size; string ids (and integer ids with ``hash=True``) are hashed with a *stable* 64-bit hash
  (defined on the UTF-8 bytes, the same on every machine and Python run) into ``[0, n)``.
  ``list<...>`` columns give several ids per row (jagged); null or empty lists give none.
* labels: ``float32 [B]`` (one label) or ``[B, T]``; NaN/null labels are rejected or dropped.

Every problem raises ``DataError`` naming the column and (through the reader) file, row group
and row; an out-of-range id never reaches FBGEMM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch


class DataError(ValueError):
    """Bad input data. The message names the file / column / row group / row and the fix."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        column: str | None = None,
        row_group: int | None = None,
        row: int | None = None,
    ) -> None:
        self.file, self.column, self.row_group, self.row = file, column, row_group, row
        self.detail = message
        where = []
        if file is not None:
            where.append(f"file {file}")
        if row_group is not None:
            where.append(f"row group {row_group}")
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


class _RowError(DataError):
    """A problem at a row of the batch being decoded; the reader maps ``row`` to its source."""


@dataclass(frozen=True, kw_only=True)
class DenseFeature:
    """A numeric column read as one float32 dense input."""

    column: str
    fill_value: float = 0.0
    """Replaces nulls (and NaN/Inf when ``on_non_finite="fill"``)."""
    on_non_finite: Literal["fill", "error"] = "fill"
    """NaN/Inf values: replace by ``fill_value``, or raise ``DataError``."""


@dataclass(frozen=True, kw_only=True)
class SparseFeature:
    """An id column (int or string, scalar or ``list<>``) read as one KJT key."""

    name: str
    """The KJT key (the embedding table's feature name)."""
    num_embeddings: int
    """Size of the table: every id reaching the model is in ``[0, num_embeddings)``."""
    column: str | None = None
    """Source column (default: ``name``)."""
    hash: bool | None = None
    """Hash ids into ``[0, num_embeddings)``. None: hash strings, check integers."""
    on_out_of_range: Literal["error", "hash"] = "error"
    """Unhashed integer ids < 0 or >= num_embeddings: raise ``DataError``, or hash them."""
    weight_column: str | None = None
    """Optional per-id float weights (same shape as the ids: scalar or list of equal lengths)."""

    @property
    def source(self) -> str:
        return self.column or self.name


@dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """What to read from each row and how to turn it into a ``Batch``."""

    labels: Sequence[str]
    """Label column(s). One gives ``labels [B]``; several give ``[B, T]``."""
    dense: Sequence[DenseFeature | str] = ()
    """Dense float columns (a plain string means ``DenseFeature(column=s)``)."""
    sparse: Sequence[SparseFeature] = ()
    weight_column: str | None = None
    """Optional per-example weight column (float >= 0)."""
    on_nan_label: Literal["error", "drop"] = "error"
    """Null/NaN labels: raise ``DataError``, or drop the row (it is then counted as not trained)."""
    dense_features: tuple[DenseFeature, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("`labels` must name at least one label column, but is empty.")
        object.__setattr__(
            self, "dense_features",
            tuple(d if isinstance(d, DenseFeature) else DenseFeature(column=d) for d in self.dense),
        )
        names = [s.name for s in self.sparse]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"`sparse` feature names must be unique; repeated: {dup}.")
        for s in self.sparse:
            if not isinstance(s.num_embeddings, int) or s.num_embeddings < 1:
                raise ValueError(
                    f"`num_embeddings` of sparse feature {s.name!r} must be an int >= 1, "
                    f"but is {s.num_embeddings!r}."
                )
        if self.on_nan_label not in ("error", "drop"):
            raise ValueError(f"`on_nan_label` must be 'error' or 'drop', but is {self.on_nan_label!r}.")

    @property
    def sparse_names(self) -> list[str]:
        return [s.name for s in self.sparse]

    @property
    def num_dense(self) -> int:
        return len(self.dense_features)

    def columns(self) -> list[str]:
        """Every column the spec reads (the reader projects on these)."""
        cols: list[str] = [*self.labels, *(d.column for d in self.dense_features)]
        for s in self.sparse:
            cols.append(s.source)
            if s.weight_column:
                cols.append(s.weight_column)
        if self.weight_column:
            cols.append(self.weight_column)
        return list(dict.fromkeys(cols))

    # ------------------------------------------------------------------ schema

    def check_schema(self, schema: pa.Schema, file: str) -> None:
        """Raise ``DataError`` if a declared column is missing or of the wrong type."""
        names = set(schema.names)

        def need(col: str, ok: bool, what: str) -> None:
            if col not in names:
                raise DataError(
                    f"the declared {what} column is missing (the file has: "
                    f"{', '.join(schema.names)}); fix the FeatureSpec or the data.",
                    file=file, column=col,
                )
            if not ok:
                raise DataError(
                    f"the declared {what} column must be {_EXPECTED[what]}, but is "
                    f"{schema.field(col).type}.", file=file, column=col,
                )

        def typ(col: str) -> pa.DataType | None:
            return schema.field(col).type if col in names else None

        for c in self.labels:
            t = typ(c)
            need(c, t is not None and _is_numeric(t), "label")
        for d in self.dense_features:
            t = typ(d.column)
            need(d.column, t is not None and _is_numeric(t), "dense")
        if self.weight_column:
            t = typ(self.weight_column)
            need(self.weight_column, t is not None and _is_numeric(t), "weight")
        for s in self.sparse:
            t = typ(s.source)
            elem = t.value_type if t is not None and _is_list(t) else t
            need(s.source, elem is not None and (_is_int(elem) or _is_str(elem)), "sparse id")
            if s.weight_column:
                wt = typ(s.weight_column)
                welem = wt.value_type if wt is not None and _is_list(wt) else wt
                need(
                    s.weight_column,
                    welem is not None and _is_numeric(welem) and (_is_list(wt) == _is_list(t)),
                    "sparse weight",
                )

    # ------------------------------------------------------------------ decode

    def decode(self, table: pa.Table) -> Batch:
        """One Arrow table (a batch of rows) -> ``Batch`` (CPU tensors).

        Raises ``DataError`` (with ``row`` = the row's index in ``table``) on bad values.
        """
        return self.decode_chunk(table).batch(0, table.num_rows)

    def decode_chunk(self, table: pa.Table) -> DecodedChunk:
        """Decode many rows at once into numpy columns; ``.batch(lo, hi)`` then cuts batches.

        Decoding several batches' rows in one go pays the per-feature Python overhead once per
        chunk instead of once per batch (the reader decodes ~16k rows at a time).
        """
        n = table.num_rows
        src_rows = n
        labels = np.empty((n, len(self.labels)), dtype=np.float32)
        for j, c in enumerate(self.labels):
            labels[:, j] = _to_float(table.column(c), np.nan)
        bad = ~np.isfinite(labels).all(axis=1)
        kept_cum: np.ndarray | None = None
        if bad.any():
            if self.on_nan_label == "error":
                row = int(np.flatnonzero(bad)[0])
                col = self.labels[int(np.flatnonzero(~np.isfinite(labels[row]))[0])]
                raise _RowError(
                    f"{int(bad.sum())} label(s) in this batch are null, NaN or Inf (first value "
                    f"{labels[row]}); clean the data or set FeatureSpec(on_nan_label='drop').",
                    column=col, row=row,
                )
            keep = np.flatnonzero(~bad)
            kept_cum = np.concatenate([[0], np.cumsum(~bad)])
            table = table.take(pa.array(keep))
            labels = labels[keep]
            n = table.num_rows

        dense = np.empty((n, self.num_dense), dtype=np.float32)
        for j, d in enumerate(self.dense_features):
            vals = _to_float(table.column(d.column), d.fill_value)
            nonfinite = ~np.isfinite(vals)
            if nonfinite.any():
                if d.on_non_finite == "error":
                    row = int(np.flatnonzero(nonfinite)[0])
                    raise _RowError(
                        f"dense value {vals[row]} is not finite; clean the data or use "
                        f"DenseFeature(column={d.column!r}, on_non_finite='fill').",
                        column=d.column, row=row,
                    )
                vals[nonfinite] = d.fill_value
            dense[:, j] = vals

        weights = None
        if self.weight_column:
            w = _to_float(table.column(self.weight_column), np.nan)
            badw = ~(np.isfinite(w) & (w >= 0))
            if badw.any():
                row = int(np.flatnonzero(badw)[0])
                raise _RowError(
                    f"example weight {w[row]} must be a finite number >= 0.",
                    column=self.weight_column, row=row,
                )
            weights = w

        values: list[np.ndarray] = []
        lengths: list[np.ndarray] = []
        id_weights: list[np.ndarray] = []
        has_weights = any(s.weight_column for s in self.sparse)
        for s in self.sparse:
            col = _combine(table.column(s.source))
            if _is_list(col.type):
                lens = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
                # flatten() honours slice offsets and skips null lists (``.values`` does not).
                flat = col.flatten()
            else:
                lens = col.is_valid().to_numpy(zero_copy_only=False)
                flat = col.drop_null() if col.null_count else col
            lens = lens.astype(np.int32, copy=False)
            ids = self._ids(s, flat, lens)
            values.append(ids)
            lengths.append(lens)
            if has_weights:
                if s.weight_column:
                    wcol = _combine(table.column(s.weight_column))
                    if _is_list(wcol.type):
                        wl = pc.list_value_length(wcol).fill_null(0).to_numpy(zero_copy_only=False)
                        if not np.array_equal(wl, lens):
                            row = int(np.flatnonzero(wl != lens)[0])
                            raise _RowError(
                                f"has {int(wl[row])} weights but column {s.source!r} has "
                                f"{int(lens[row])} ids in this row; they must match.",
                                column=s.weight_column, row=row,
                            )
                        iw = _to_float(wcol.flatten(), 1.0)
                    else:
                        iw = _to_float(wcol, 1.0)[lens.astype(bool)]
                else:
                    iw = np.ones(len(ids), dtype=np.float32)
                id_weights.append(iw)
        return DecodedChunk(
            keys=self.sparse_names, single_label=len(self.labels) == 1, num_source_rows=src_rows,
            labels=labels, dense=dense, weights=weights, values=values, lengths=lengths,
            id_weights=id_weights if has_weights else None, kept_cum=kept_cum,
        )

    @staticmethod
    def _ids(s: SparseFeature, flat: pa.Array, lens: np.ndarray) -> np.ndarray:
        """Flat ids of one feature, all in ``[0, num_embeddings)``."""
        n_emb = s.num_embeddings
        if flat.null_count:
            # A null *inside* a list has no id: reject rather than silently shift ids.
            row = int(np.searchsorted(np.cumsum(lens), int(np.flatnonzero(
                flat.is_null().to_numpy(zero_copy_only=False))[0]), side="right"))
            raise _RowError("a list of ids contains a null element.", column=s.source, row=row)
        if _is_str(flat.type):
            return (stable_hash_strings(flat) % np.uint64(n_emb)).astype(np.int64)
        ids = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        if s.hash:
            return (stable_hash_ints(ids) % np.uint64(n_emb)).astype(np.int64)
        bad = (ids < 0) | (ids >= n_emb)
        if bad.any():
            if s.on_out_of_range == "hash":
                ids = ids.copy()
                ids[bad] = (stable_hash_ints(ids[bad]) % np.uint64(n_emb)).astype(np.int64)
                return ids
            k = int(np.flatnonzero(bad)[0])
            row = int(np.searchsorted(np.cumsum(lens), k, side="right"))
            raise _RowError(
                f"id {int(ids[k])} is outside the table [0, {n_emb}) ({int(bad.sum())} such ids "
                f"in this batch); raise num_embeddings, or set SparseFeature(name={s.name!r}, "
                "on_out_of_range='hash') or hash=True.",
                column=s.source, row=row,
            )
        return ids


@dataclass
class DecodedChunk:
    """Decoded rows as numpy columns; ``batch(lo, hi)`` cuts source rows ``[lo, hi)``."""

    keys: list[str]
    single_label: bool
    num_source_rows: int
    labels: np.ndarray
    dense: np.ndarray
    weights: np.ndarray | None
    values: list[np.ndarray]
    lengths: list[np.ndarray]
    id_weights: list[np.ndarray] | None
    kept_cum: np.ndarray | None
    """Rows kept before each source row (when NaN-label rows were dropped), else None."""
    offsets: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in self.lengths]

    def batch(self, lo: int, hi: int) -> Batch:
        """The ``Batch`` of source rows ``[lo, hi)`` (rows dropped for NaN labels left out)."""
        if self.kept_cum is not None:
            lo, hi = int(self.kept_cum[lo]), int(self.kept_cum[hi])
        n = hi - lo
        labels = self.labels[lo:hi]
        bounds = [(int(o[lo]), int(o[hi])) for o in self.offsets]
        if self.keys:
            kjt = KeyedJaggedTensor(
                keys=self.keys,
                values=torch.from_numpy(np.concatenate(
                    [v[a:b] for v, (a, b) in zip(self.values, bounds, strict=True)])),
                lengths=torch.from_numpy(np.concatenate([x[lo:hi] for x in self.lengths])),
                weights=None if self.id_weights is None else torch.from_numpy(np.concatenate(
                    [w[a:b] for w, (a, b) in zip(self.id_weights, bounds, strict=True)])),
                stride=n,
                length_per_key=[b - a for a, b in bounds],
                offset_per_key=np.concatenate([[0], np.cumsum([b - a for a, b in bounds])]).tolist(),
            )
        else:
            kjt = KeyedJaggedTensor.empty(values_dtype=torch.int64)
        return Batch(
            dense=torch.from_numpy(self.dense[lo:hi].copy()),
            sparse=kjt,
            labels=torch.from_numpy(labels[:, 0].copy() if self.single_label else labels.copy()),
            weights=None if self.weights is None else torch.from_numpy(self.weights[lo:hi].copy()),
        )


# ---------------------------------------------------------------------- stable hashing

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_POLY = np.uint64(0x100000001B3)  # FNV-64 prime, used as the polynomial base
_SEED = np.uint64(0x9E3779B97F4A7C15)  # keeps the empty string away from hash 0


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads every input bit over the output (uint64 wraps)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def stable_hash_ints(ids: np.ndarray) -> np.ndarray:
    """A stable 64-bit hash of int64 ids (uint64), the same on every machine and run."""
    return _mix64(ids.astype(np.int64, copy=False).view(np.uint64))


def stable_hash_strings(arr: pa.Array) -> np.ndarray:
    """A stable 64-bit hash of each string's UTF-8 bytes, vectorized over the Arrow buffers.

    h = mix64(sum_i byte_i * P^(len-1-i) + len + C) mod 2^64: a polynomial over the bytes computed
    with one gather and one ``np.add.reduceat``, so the cost is O(total bytes) in numpy.
    """
    if arr.null_count:
        raise ValueError("stable_hash_strings needs an array without nulls")
    if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
        off_dtype: type[np.integer] = np.int64
    else:
        arr = arr.cast(pa.string()) if pa.types.is_string_view(arr.type) else arr
        off_dtype = np.int32
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_dtype, count=n + 1 + arr.offset)[arr.offset:]
    start, end = int(offsets[0]), int(offsets[-1])
    data = (np.frombuffer(bufs[2], dtype=np.uint8, count=end)[start:]
            if bufs[2] is not None and end > start else np.zeros(0, np.uint8))
    rel = (offsets - start).astype(np.int64)
    lens = np.diff(rel)
    total = int(rel[-1])
    if total == 0:
        with np.errstate(over="ignore"):
            return _mix64(lens.astype(np.uint64) + _SEED)
    max_len = int(lens.max())
    powers = np.empty(max_len, dtype=np.uint64)
    powers[0] = 1
    with np.errstate(over="ignore"):
        for i in range(1, max_len):  # at most the longest string's length, not per row
            powers[i] = powers[i - 1] * _POLY
    owner = np.repeat(np.arange(n), lens)
    pos_from_end = rel[1:][owner] - np.arange(total) - 1
    with np.errstate(over="ignore"):
        terms = data.astype(np.uint64) * powers[pos_from_end]
    nonempty = lens > 0
    sums = np.zeros(n, dtype=np.uint64)
    if nonempty.any():
        # reduceat over the start of each non-empty string (empty ones would repeat an element).
        sums[nonempty] = np.add.reduceat(terms, rel[:-1][nonempty])
    with np.errstate(over="ignore"):
        return _mix64(sums + lens.astype(np.uint64) + _SEED)


# ---------------------------------------------------------------------- arrow helpers

_EXPECTED = {
    "label": "numeric (int/float/bool)",
    "dense": "numeric (int/float/bool)",
    "weight": "numeric (int/float)",
    "sparse id": "an integer or string, or a list of them",
    "sparse weight": "numeric with the same list-ness as its id column",
}


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def _is_int(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t))


def _is_str(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _is_numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _combine(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


def _to_float(col: pa.ChunkedArray | pa.Array, fill: float) -> np.ndarray:
    """float32 numpy copy of a numeric column with nulls replaced by ``fill``."""
    arr = _combine(col)
    if arr.null_count:
        arr = arr.cast(pa.float32()).fill_null(pa.scalar(fill, pa.float32()))
    out = arr.to_numpy(zero_copy_only=False)
    return np.array(out, dtype=np.float32, copy=True)
