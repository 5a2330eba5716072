"""``FeatureSpec``: which columns to read, checked against each file's schema, decoded to tensors.

A ``FeatureSpec`` names the label column(s), the dense float columns and the sparse id columns of
a table. ``FeatureSpec.decode(table)`` turns an Arrow table (one batch of rows) into a ``Batch``:

* dense: ``float32 [B, num_dense]``; nulls become ``fill_value``; NaN/Inf are filled or
  rejected; then the declared ``clip`` / ``log1p`` / ``standardize``.
* sparse: one ``KeyedJaggedTensor`` key per ``SparseFeature``, key-major, built with one
  ``np.concatenate`` (see DESIGN.md "KJT from arrow"). Integer ids are checked against the table
  size; string ids (and integer ids with ``hash=True``) are hashed with a *stable* 64-bit hash
  (defined on the UTF-8 bytes, the same on every machine and Python run) into ``[0, n)``.
  ``list<...>`` columns give several ids per row (jagged); null or empty lists give none;
  ``weight_column`` gives the KJT's weights. Declared transforms (``boundaries``, ``div``/``mod``,
  ``cross``, ``null_id``) turn raw values into ids on the way.
* sequence: ``Batch.sequence``, one KJT key per ``SequenceFeature`` (unpooled, for an
  ``EmbeddingCollection``), lists cut to their last ``max_len`` ids.
* labels: ``float32 [B]`` (one label) or ``[B, T]``; NaN/null labels are rejected or dropped.
* passthrough: raw columns (request ids, user ids) carried unchanged as ``pyarrow.Array``s on
  ``Batch.passthrough``, for hooks and offline scoring; never turned into tensors.

Every problem raises ``DataError`` naming the column and (through the reader) file, row group
and row; an out-of-range id never reaches FBGEMM.

The per-feature declarations live in ``inputs.py``, the column-level decoding in ``decode.py``
(vectorized with pyarrow/numpy: no per-row Python loop), the decoded rows in ``chunk.py`` and the
stable hash in ``hashing.py``; ``features.py`` gathers the public names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_trainer.data.chunk import DecodedChunk
from recsys_trainer.data.columns import (
    _combine,
    _float_view,
    _is_int,
    _is_list,
    _is_numeric,
    _is_str,
    _to_float,
)
from recsys_trainer.data.decode import (
    _check_non_finite,
    _jagged,
    _not_a_list,
    _one_id_per_row,
    _regular_ids,
    _transform_dense,
)
from recsys_trainer.data.errors import DataError, _RowError
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.vocab import Vocabulary, check_tables_share_vocabularies

if TYPE_CHECKING:
    # Annotation only: decoding (what the serving scorer runs) imports no torchrec.
    from recsys_trainer.batch import Batch


@dataclass(frozen=True, kw_only=True)
class FeatureSpec:
    """What to read from each row and how to turn it into a ``Batch``."""

    labels: Sequence[str]
    """Label column(s). One gives ``labels [B]``; several give ``[B, T]``."""
    dense: Sequence[DenseFeature | str] = ()
    """Dense float columns (a plain string means ``DenseFeature(column=s)``)."""
    sparse: Sequence[SparseFeature] = ()
    """Pooled id features: ``Batch.sparse`` (for ``EmbeddingBagCollection``s)."""
    sequence: Sequence[SequenceFeature] = ()
    """Unpooled id features: ``Batch.sequence``, keys in this order (for ``EmbeddingCollection``s);
    None in the batch when empty."""
    weight_column: str | None = None
    """Optional per-example weight column (float >= 0)."""
    on_nan_label: Literal["error", "drop"] = "error"
    """Null/NaN labels: raise ``DataError``, or drop the row (it is then counted as not trained)."""
    label_range: tuple[float, float] | None = None
    """``(low, high)``: a label outside ``[low, high]`` raises ``DataError`` naming the column,
    file, row and value (e.g. ``(0, 1)`` for a logistic loss). None: not checked."""
    passthrough: Sequence[str] = ()
    """Columns carried raw on ``Batch.passthrough`` (any type, nulls kept), e.g. request and
    user ids: never sent to the model, available to hooks and written next to the scores by
    ``Trainer.predict``. A column may be both an input (or a label) and passed through: the
    model sees the decoded value, the passthrough the raw one."""
    dense_features: tuple[DenseFeature, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.labels, str) or not self.labels:
            raise ValueError(f"`labels` must be a non-empty list of label columns, but is {self.labels!r}.")
        object.__setattr__(
            self, "dense_features",
            tuple(d if isinstance(d, DenseFeature) else DenseFeature(column=d) for d in self.dense),
        )
        for s in self.sparse:
            if not isinstance(s, SparseFeature):
                raise ValueError(f"`sparse` must hold SparseFeature objects, but holds {s!r}.")
        if isinstance(self.sequence, str | SequenceFeature):
            raise ValueError(f"`sequence` must be a list of SequenceFeature objects, but is {self.sequence!r}.")
        for q in self.sequence:
            if not isinstance(q, SequenceFeature):
                raise ValueError(f"`sequence` must hold SequenceFeature objects, but holds {q!r}.")
        names = [s.name for s in self.sparse]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"`sparse` feature names must be unique; repeated: {dup}.")
        seq_names = [q.name for q in self.sequence]
        dup = sorted({n for n in seq_names if seq_names.count(n) > 1} | (set(names) & set(seq_names)))
        if dup:
            raise ValueError(f"`sequence` feature names must be unique and differ from the `sparse` "
                             f"ones (a table reads a feature by name); repeated: {dup}.")
        # A label read as an input hands the model the answer (and the loss falls to ~0).
        inputs = {d.column: "a dense input" for d in self.dense_features}
        inputs.update({s.weight_column: f"sparse feature {s.name!r}'s id weights"
                       for s in self.sparse if s.weight_column})
        inputs.update({c: f"sparse feature {s.name!r}'s ids" for s in self.sparse for c in s.sources})
        inputs.update({c: f"sequence feature {q.name!r}'s ids" for q in self.sequence for c in q.sources})
        if self.weight_column:
            inputs[self.weight_column] = "the example weight"
        for label in self.labels:
            if label in inputs:
                raise ValueError(
                    f"label column {label!r} is also read as {inputs[label]}: the model would "
                    "see its own target. Remove it from the inputs (or from `labels`)."
                )
        if isinstance(self.passthrough, str) or not all(
                isinstance(c, str) and c for c in self.passthrough):
            raise ValueError(f"`passthrough` must be a list of column names, but is {self.passthrough!r}.")
        repeated = sorted({c for c in self.passthrough if list(self.passthrough).count(c) > 1})
        if repeated:
            raise ValueError(f"`passthrough` columns must be unique; repeated: {repeated}.")
        object.__setattr__(self, "passthrough", tuple(self.passthrough))
        if self.on_nan_label not in ("error", "drop"):
            raise ValueError(f"`on_nan_label` must be 'error' or 'drop', but is {self.on_nan_label!r}.")
        if self.label_range is not None:
            r = self.label_range
            if not (isinstance(r, Sequence) and len(r) == 2
                    and all(isinstance(x, int | float) and np.isfinite(x) for x in r) and r[0] <= r[1]):
                raise ValueError(
                    f"`label_range` must be None or (low, high) with finite low <= high, but is {r!r}."
                )
            object.__setattr__(self, "label_range", (float(r[0]), float(r[1])))

    @property
    def sparse_names(self) -> list[str]:
        return [s.name for s in self.sparse]

    @property
    def sequence_names(self) -> list[str]:
        return [q.name for q in self.sequence]

    @property
    def id_features(self) -> tuple[SparseFeature | SequenceFeature, ...]:
        """Every id feature: the sparse ones, then the sequence ones."""
        return (*self.sparse, *self.sequence)

    @property
    def num_dense(self) -> int:
        return len(self.dense_features)

    def columns(self) -> list[str]:
        """Every column the spec reads (the reader projects on these)."""
        cols: list[str] = [*self.labels, *(d.column for d in self.dense_features)]
        for s in self.sparse:
            cols.extend(s.sources)
            if s.weight_column:
                cols.append(s.weight_column)
        for q in self.sequence:
            cols.extend(q.sources)
        if self.weight_column:
            cols.append(self.weight_column)
        cols.extend(self.passthrough)
        return list(dict.fromkeys(cols))

    # ------------------------------------------------------------------ schema

    def id_kinds(self, schema: pa.Schema) -> dict[str, str]:
        """``{column: "integer" | "string"}`` for the id columns ``schema`` holds that are mapped
        to rows by their kind (list columns by their elements; bucketized columns, read as
        numbers, are not): what decides how an id becomes a table row."""
        kinds = {}
        for s in self.id_features:
            if s.boundaries is not None:
                continue
            for c in s.sources:
                if c in schema.names:
                    t = schema.field(c).type
                    kinds[c] = "string" if _is_str(t.value_type if _is_list(t) else t) else "integer"
        return kinds

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
                t = schema.field(col).type
                why = (" (every value is null, so the file was written without the column's "
                       "type, e.g. by pandas from a column of None); write it with its type"
                       if pa.types.is_null(t) else "")
                raise DataError(
                    f"the declared {what} column must be {_EXPECTED[what]}, but is {t}{why}.",
                    file=file, column=col,
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
        for c in self.passthrough:
            need(c, True, "passthrough")
        for s in self.id_features:
            for c in s.sources:
                t = typ(c)
                elem = t.value_type if t is not None and _is_list(t) else t
                if s.boundaries is not None:
                    need(c, elem is not None and _is_numeric(elem), "bucketized")
                elif s.div is not None or s.mod is not None:
                    need(c, elem is not None and _is_int(elem), "integer id")
                elif s.cross is not None:
                    need(c, t is not None and (_is_int(t) or _is_str(t)), "crossed")
                else:
                    need(c, elem is not None and (_is_int(elem) or _is_str(elem)), "sparse id")
            t = typ(s.source)
            if isinstance(s, SequenceFeature) and s.max_len > 1 and t is not None and not _is_list(t):
                raise DataError(_not_a_list(s, t), file=file, column=s.source)
            if isinstance(s, SparseFeature) and s.weight_column:
                wt = typ(s.weight_column)
                welem = wt.value_type if wt is not None and _is_list(wt) else wt
                need(
                    s.weight_column,
                    welem is not None and _is_numeric(welem) and t is not None
                    and (_is_list(wt) == _is_list(t)),
                    "sparse weight",
                )

    def check_ids_present(self, valueless: Collection[str], schema: pa.Schema, num_rows: int,
                          file: str) -> list[str]:
        """Refuse a file whose id column holds no value in any of its ``num_rows`` rows.

        ``valueless``: the columns of ``file`` (of type ``schema``) without a value in any row
        (for a list column: no element), as its footer tells. Raises ``DataError`` naming the
        file and the first such id column whose feature has ``on_all_null="error"``; returns one
        warning per feature with ``on_all_null="warn"`` (the reader logs them). Nulls in some rows
        only are fine (they are empty bags, or ``null_id``)."""
        warnings: list[str] = []
        if num_rows == 0:
            return warnings
        for s in self.id_features:
            for c in s.sources:
                if c not in valueless:
                    continue
                listed = c in schema.names and _is_list(schema.field(c).type)
                kind = type(s).__name__
                if s.null_id is None:
                    then = "would train on no id in any of them"
                elif listed:
                    then = f"would train on no id, or only null_id {s.null_id}, in any of them"
                else:
                    then = f"every row would take null_id {s.null_id}"
                message = (
                    f"the id column has no value in any of the file's {num_rows} rows ("
                    f"{'every list is null or empty, or holds only nulls' if listed else 'every value is null'}"
                    f"): {kind.replace('Feature', '').lower()} feature {s.name!r} {then}. This "
                    "usually means the data changed upstream (a column renamed, dropped or not "
                    "joined, written as nulls): fix the data; if the column may be empty in a "
                    f"whole file, set {kind}(name={s.name!r}, on_all_null='warn')."
                )
                if s.on_all_null == "error":
                    raise DataError(message, file=file, column=c)
                warnings.append(str(DataError(message, file=file, column=c)))
        return warnings

    def unify_columns(self, tables: list[pa.Table]) -> list[pa.Table]:
        """Tables (files of one window) about to be decoded together, with every declared column
        in one type where their types differ: numeric columns (labels, dense inputs, weights) as
        float64, which decoding reads them as anyway; a scalar id (or id weight) column as
        one-element lists when another table holds lists (a null id becomes a null list: no id,
        as before). Decoding each file alone gives the same values, so 1 rank and N ranks (each
        reading other files) train the same rows."""
        if all(t.schema.equals(tables[0].schema) for t in tables[1:]):
            return tables
        numeric = {*self.labels, *(d.column for d in self.dense_features)}
        numeric.update(c for c in (self.weight_column, *(s.weight_column for s in self.sparse)) if c)
        numeric.update(s.source for s in self.id_features if s.boundaries is not None)
        listed = {f.name for t in tables for f in t.schema if _is_list(f.type)}
        out = []
        for t in tables:
            for i, f in enumerate(t.schema):
                col: pa.ChunkedArray | pa.Array = t.column(i)
                if f.name in listed and not _is_list(f.type):
                    arr = _combine(col)
                    offsets = pa.array(np.arange(len(arr) + 1, dtype=np.int32))
                    col = pa.ListArray.from_arrays(offsets, arr, mask=arr.is_null())
                if f.name in numeric:
                    target = pa.list_(pa.float64()) if _is_list(col.type) else pa.float64()
                    col = col.cast(target) if col.type != target else col
                if col.type != f.type:
                    t = t.set_column(i, f.name, col)
            out.append(t)
        return out

    # ------------------------------------------------------------------ decode

    def decode(self, table: pa.Table) -> Batch:
        """One Arrow table (a batch of rows) -> ``Batch`` (CPU tensors).

        Raises ``DataError`` (with ``row`` = the row's index in ``table``) on bad values.
        """
        return self.decode_chunk(table).batch(0, table.num_rows)

    def decode_chunk(self, table: pa.Table, batch_rows: int | None = None) -> DecodedChunk:
        """Decode many rows at once into numpy columns; ``.batch(lo, hi)`` then cuts batches.

        Decoding several batches' rows in one go pays the per-feature Python overhead once per
        chunk instead of once per batch (the reader decodes ~16k rows at a time). With
        ``batch_rows``, the batches ``[i * batch_rows, (i + 1) * batch_rows)`` (no rows
        dropped) share the chunk's memory instead of copying it.
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
            try:
                return self._decode_kept(table, src_rows, labels, kept_cum, batch_rows)
            except _RowError as exc:
                if exc.row is None:
                    raise
                # A row of the kept rows: name it by its row in ``table`` (the source).
                raise _RowError(exc.detail, column=exc.column, row=int(keep[exc.row])) from None
        return self._decode_kept(table, src_rows, labels, kept_cum, batch_rows)

    def padding_batch(self) -> Batch:
        """An all-null row decoded through the spec: shapes a padding batch for a rank that has
        no row to give (its values never count: ``Batch.as_padding`` zeroes its weights)."""
        spec = self
        cols: dict[str, pa.Array] = {c: pa.array([0.0]) for c in spec.labels}
        for d in spec.dense_features:
            cols[d.column] = pa.array([0.0])
        if spec.weight_column:
            cols[spec.weight_column] = pa.array([0.0])
        strings = {c for s in spec.id_features for c in s.sources
                   if isinstance(s.vocab, Vocabulary) and s.vocab.kind == "string"}
        for s in spec.id_features:
            for c in s.sources:
                # A vocabulary of strings maps string ids (to row 0 here).
                cols[c] = pa.array([""]) if c in strings else pa.array([0], pa.int64())
            if isinstance(s, SparseFeature) and s.weight_column:
                cols[s.weight_column] = pa.array([1.0])
        for c in spec.passthrough:
            cols.setdefault(c, pa.nulls(1))  # dropped by Batch.as_padding anyway
        # A column a sequence of max_len > 1 reads must be a list (one id; a sparse feature
        # reading the same column takes the list too).
        for q in spec.sequence:
            if q.max_len > 1:
                cols[q.source] = (pa.array([[""]], pa.list_(pa.string())) if q.source in strings
                                  else pa.array([[0]], pa.list_(pa.int64())))
        return spec.decode(pa.table(cols))

    def _decode_kept(self, table: pa.Table, src_rows: int, labels: np.ndarray,
                     kept_cum: np.ndarray | None, batch_rows: int | None = None) -> DecodedChunk:
        """``decode_chunk`` after NaN-label rows were dropped (``_RowError.row`` counts the
        rows of ``table``)."""
        n = table.num_rows
        if self.label_range is not None:
            lo, hi = self.label_range
            outside = (labels < lo) | (labels > hi)
            if outside.any():
                row, j = (int(x[0]) for x in np.nonzero(outside))
                raise _RowError(
                    f"label {labels[row, j]:g} is outside label_range [{lo:g}, {hi:g}] "
                    f"({int(outside.any(axis=1).sum())} such row(s) in this batch); fix the data, "
                    "or the range: FeatureSpec(label_range=...), which, when unset, is the model's "
                    "label_range under the Trainer ([0, 1] for the bundled models' logistic loss).",
                    column=self.labels[j], row=row,
                )
        dense = np.empty((n, self.num_dense), dtype=np.float32)
        for j, d in enumerate(self.dense_features):
            # Written straight into the matrix (zero-copy source where arrow allows); the
            # non-finite check is one pass over the whole matrix, per column only if it fails.
            src = _float_view(table.column(d.column), d.fill_value)
            if d.transformed:
                # Transformed on a contiguous copy (~10% faster than in place on the matrix's
                # strided column); non-finite raw values are settled first (log1p reads them).
                vals = np.array(src, dtype=np.float32)
                _check_non_finite(d, vals)
                _transform_dense(d, vals)
                src = vals
            dense[:, j] = src
        if n and not np.isfinite(dense).all():
            for j, d in enumerate(self.dense_features):
                _check_non_finite(d, dense[:, j])

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
        seq_values: list[np.ndarray] = []
        seq_lengths: list[np.ndarray] = []
        for q in self.sequence:
            ids, lens = _jagged(q, table)
            seq_values.append(ids)
            seq_lengths.append(lens)
        chunk = dict(
            keys=self.sparse_names, single_label=len(self.labels) == 1, num_source_rows=src_rows,
            labels=labels, dense=dense, weights=weights, kept_cum=kept_cum,
            seq_keys=self.sequence_names, seq_values=seq_values, seq_lengths=seq_lengths,
            passthrough=self._passthrough(table),
        )
        has_weights = any(s.weight_column for s in self.sparse)
        if self.sparse and not has_weights and all(
                _one_id_per_row(s, table) for s in self.sparse):
            # The common case (e.g. Criteo): every key has exactly one id per row. All keys go
            # into one [num_keys, rows] int64 matrix, hashed in one in-place pass.
            return DecodedChunk(values=[], lengths=[], id_weights=None,
                                ids=_regular_ids(self.sparse, table, n, batch_rows), **chunk)  # type: ignore[arg-type]
        for s in self.sparse:
            ids, lens = _jagged(s, table)
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
        return DecodedChunk(values=values, lengths=lengths,
                            id_weights=id_weights if has_weights else None,
                            **chunk)  # type: ignore[arg-type]

    def _passthrough(self, table: pa.Table) -> dict[str, pa.Array]:
        # One contiguous array per column, so that each batch's slice is zero-copy.
        return {c: _combine(table.column(c)) for c in self.passthrough}


_EXPECTED = {
    "label": "numeric (int/float/bool)",
    "dense": "numeric (int/float/bool)",
    "weight": "numeric (int/float)",
    "sparse id": "an integer or string, or a list of them",
    "sparse weight": "numeric with the same list-ness as its id column",
    "passthrough": "any type",
    "bucketized": "numeric (int/float), or a list of numbers",
    "integer id": "an integer, or a list of integers (div/mod apply to integers)",
    "crossed": "a scalar integer or string (lists are not crossed)",
}


_SPEC_FROM_MODEL = "_spec_from_model"
"""The dataset attributes where ``apply_model_to_specs`` keeps ``(the user's spec, the spec it
derived)``: the next Trainer's model derives again from the user's."""


def apply_model_to_specs(datasets: Iterable[Any], *, label_range: tuple[float, float] | None,
                         row_id_features: Sequence[str] = ()) -> None:
    """Derive each dataset's ``FeatureSpec`` from its user's and what the model declares, so its
    reader refuses what the model cannot use with a ``DataError`` naming the column, file and
    row, on every rank (where the model would fail on one rank naming only a value, or train
    silently):

    - ``label_range`` (the labels the model's loss accepts, e.g. ``(0, 1)``) where the user's
      spec sets none;
    - ``hash=False`` on the ``row_id_features`` the user left at ``hash=None`` (ids the model
      treats as table rows, e.g. a retrieval model's items: its catalog, metrics and export map
      id ``i`` to row ``i``), so a string column is a named error instead of ids hashed into
      unrelated rows; ``hash=True`` on one of them is refused here. Features with a ``vocab``
      are left as they are.

    A dataset used again with another model starts from its user's spec. Datasets without a spec
    (plain iterables of ``Batch``) are left as they are."""
    wanted = set(row_id_features)
    for ds in datasets:
        spec = getattr(ds, "features", None)
        if not isinstance(spec, FeatureSpec):
            continue
        kept = getattr(ds, _SPEC_FROM_MODEL, None)
        user = kept[0] if kept is not None and kept[1] is spec else spec
        hashed = [f.name for f in (*user.sparse, *user.sequence)
                  if f.name in wanted and f.hash is True and f.vocab is None]
        if hashed:
            raise ValueError(
                f"features {hashed} set hash=True, but the model looks their ids up as rows of its "
                "tables (its item catalog, metrics and export map id i to row i): hashing sends "
                "them to other rows. Set hash=False (for string ids, give the feature a vocab).")

        def unhashed(f: Any) -> Any:
            keep = f.name not in wanted or f.hash is not None or f.vocab is not None
            return f if keep else dataclasses.replace(f, hash=False)

        derived = dataclasses.replace(
            user, sparse=[unhashed(f) for f in user.sparse],
            sequence=[unhashed(f) for f in user.sequence],
            label_range=user.label_range if user.label_range is not None else label_range)
        if derived == user:
            derived = user
        ds.features = derived
        setattr(ds, _SPEC_FROM_MODEL, (user, derived))


def check_features_fit_tables(spec: FeatureSpec, tables: Sequence[tuple[str, str, int | None]],
                              sequence_tables: Sequence[tuple[str, str, int | None]] = ()) -> None:
    """Refuse a spec whose features do not fit the model's tables it feeds.

    ``tables`` lists ``(feature, table, num_embeddings)`` for every feature a pooled table
    (``EmbeddingBagCollection``) reads, ``sequence_tables`` the same for unpooled ones
    (``EmbeddingCollection``); None: a table that takes any id, e.g. a dynamic one. A pooled
    table's feature must be a ``SparseFeature`` (``Batch.sparse``); an unpooled table's a
    ``SequenceFeature`` or a ``SparseFeature`` (a model may hand either KJT to it). TorchRec
    would otherwise fail deep inside with "'x' is not in list". The spec's bound must not exceed
    the table's rows: FBGEMM would remap larger ids to row 0 ("Setting idx to zero") and train
    them there silently. Spec features no table reads are allowed (a model may read them itself).
    """
    sparse = {s.name: s.num_embeddings for s in spec.sparse}
    sequence = {q.name: q.num_embeddings for q in spec.sequence}
    bounds = {**sparse, **sequence}
    read = sorted({feature for feature, _, _ in (*tables, *sequence_tables)})
    missing = [f for f in read if f not in bounds]
    if missing:
        declared = (f"sparse {sorted(sparse)} and sequence {sorted(sequence)}" if sequence
                    else f"{sorted(sparse)}")
        raise ValueError(
            f"the model's embedding tables read sparse features {read}, but the data's "
            f"FeatureSpec declares {declared}: {missing} missing. Name the features after the "
            "tables' feature_names (or the reverse)."
        )
    for feature, table, _ in tables:
        if feature not in sparse:
            raise ValueError(
                f"feature {feature!r} is a SequenceFeature (Batch.sequence, unpooled), but table "
                f"{table!r} is in an EmbeddingBagCollection, which pools Batch.sparse: declare "
                f"{feature!r} in FeatureSpec(sparse=...), or read it with an EmbeddingCollection."
            )
    check_tables_share_vocabularies([(f, t) for f, t, _ in (*tables, *sequence_tables)],
                                    {s.name: s.vocab for s in spec.id_features})
    for feature, table, rows in (*tables, *sequence_tables):
        if rows is not None and bounds[feature] > rows:
            kind = "sparse" if feature in sparse else "sequence"
            raise ValueError(
                f"{kind} feature {feature!r} holds ids in [0, {bounds[feature]}) (its "
                f"{kind.capitalize()}Feature num_embeddings), but the table it feeds, {table!r}, "
                f"has {rows} rows: FBGEMM would train every id >= {rows} into row 0. Give table "
                f"{table!r} {bounds[feature]} rows, or set the feature's num_embeddings to {rows}."
            )
