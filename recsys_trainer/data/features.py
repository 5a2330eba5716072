"""Declared features -> tensors, vectorized with pyarrow/numpy (no per-row Python loop).

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
  ``cross``, ``null_id``) turn raw values into ids on the way; a ``vocab`` maps them through a
  vocabulary instead (``recsys_trainer.data.vocab``: entry i -> row i + 1, others -> row 0).
* sequence: ``Batch.sequence``, one KJT key per ``SequenceFeature`` (unpooled, for an
  ``EmbeddingCollection``), lists cut to their last ``max_len`` ids.
* labels: ``float32 [B]`` (one label) or ``[B, T]``; NaN/null labels are rejected or dropped.
* passthrough: raw columns (request ids, user ids) carried unchanged as ``pyarrow.Array``s on
  ``Batch.passthrough``, for hooks and offline scoring; never turned into tensors.

Every problem raises ``DataError`` naming the column and (through the reader) file, row group
and row; an out-of-range id never reaches FBGEMM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.data.vocab import (
    VocabArg,
    check_tables_share_vocabularies,
    check_vocab,
    lookup_rows,
)


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
    """A numeric column read as one float32 dense input.

    Transforms run on the reader thread, in this order: nulls -> ``fill_value`` (and NaN/Inf per
    ``on_non_finite``), then ``clip``, then ``log1p``, then ``standardize``.
    """

    column: str
    fill_value: float = 0.0
    """Replaces nulls (and NaN/Inf when ``on_non_finite="fill"``); a raw value (transformed
    like the others)."""
    on_non_finite: Literal["fill", "error"] = "fill"
    """NaN/Inf values: replace by ``fill_value``, or raise ``DataError``."""
    clip: tuple[float | None, float | None] | None = None
    """``(low, high)``: values are clipped to it (None: that side unbounded)."""
    log1p: bool = False
    """``log(1 + x)``; a value <= -1 (after ``clip``) raises ``DataError``: clip it first."""
    standardize: tuple[float, float] | None = None
    """``(mean, std)``: ``(x - mean) / std`` (std > 0), e.g. the training set's statistics."""

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"a dense feature's `column` must be a non-empty string, but is {self.column!r}.")
        if not _finite(self.fill_value):
            raise ValueError(f"`fill_value` of dense feature {self.column!r} must be a finite number, "
                             f"but is {self.fill_value!r}.")
        if self.on_non_finite not in ("fill", "error"):
            raise ValueError(f"`on_non_finite` of dense feature {self.column!r} must be 'fill' or "
                             f"'error', but is {self.on_non_finite!r}.")
        if self.clip is not None:
            c = self.clip
            if not (isinstance(c, Sequence) and len(c) == 2 and all(x is None or _finite(x) for x in c)
                    and (c[0] is None or c[1] is None or c[0] <= c[1])):
                raise ValueError(f"`clip` of dense feature {self.column!r} must be (low, high) with "
                                 f"finite numbers or None and low <= high, but is {c!r}.")
            object.__setattr__(self, "clip", tuple(None if x is None else float(x) for x in c))
        if self.log1p not in (True, False):
            raise ValueError(f"`log1p` of dense feature {self.column!r} must be True or False, "
                             f"but is {self.log1p!r}.")
        if self.standardize is not None:
            s = self.standardize
            if not (isinstance(s, Sequence) and len(s) == 2 and all(_finite(x) for x in s) and s[1] > 0):
                raise ValueError(f"`standardize` of dense feature {self.column!r} must be (mean, std) "
                                 f"with finite numbers and std > 0, but is {s!r}.")
            object.__setattr__(self, "standardize", (float(s[0]), float(s[1])))

    @property
    def transformed(self) -> bool:
        return self.clip is not None or self.log1p or self.standardize is not None


@dataclass(frozen=True, kw_only=True)
class _IdFeature:
    """What ``SparseFeature`` and ``SequenceFeature`` share: where ids come from and how a raw
    value becomes a row of ``[0, num_embeddings)``.

    At most one transform: ``boundaries`` (bucketize a numeric column), ``div``/``mod`` (integer
    arithmetic, ``div`` first; the result is then hashed if ``hash=True`` or checked), ``cross``
    (several columns into one hashed id), or none (ids as they are, strings hashed).
    """

    name: str
    """The KJT key (the embedding table's feature name)."""
    num_embeddings: int = 0
    """Size of the table: every id reaching the model is in ``[0, num_embeddings)``. Required,
    except with a ``vocab`` list or file (then 0, the default, means ``len(vocab) + 1``)."""
    column: str | None = None
    """Source column (default: ``name``; must be None with ``cross``)."""
    hash: bool | None = None
    """Hash ids into ``[0, num_embeddings)``. None: hash strings, check integers. False: never
    hash (a string column then needs a ``vocab``)."""
    on_out_of_range: Literal["error", "hash"] = "error"
    """Unhashed integer ids < 0 or >= num_embeddings: raise ``DataError``, or hash them."""
    boundaries: Sequence[float] | None = None
    """Bucketize a numeric column: the id is the number of boundaries <= the value, so
    ``len(boundaries) + 1`` ids (``(-inf, b0)`` is 0, ``[b0, b1)`` is 1, ...). Strictly
    increasing; a NaN value raises ``DataError`` (null values take ``null_id``)."""
    div: int | None = None
    """Integer ids floor-divided by this (e.g. a timestamp in seconds -> hours)."""
    mod: int | None = None
    """Integer ids modulo this (after ``div``), into ``[0, mod)`` (negative ids too)."""
    cross: Sequence[str] | None = None
    """Two or more scalar id columns (integers or strings) crossed into one id: the stable hash
    of the combination, modulo ``num_embeddings``. A row with a null in any of them takes
    ``null_id`` (or has no id)."""
    null_id: int | None = None
    """The id a null value (a null scalar, or a null element inside a list) gets; None: a null
    scalar has no id (an empty bag) and a null inside a list is an error. Not hashed."""
    vocab: VocabArg = None
    """Map ids through a vocabulary: a list of values, a text file (path or URL, one value per
    line) or ``VocabFromData(...)`` (built from the first training windows, checkpointed; in
    YAML a mapping of its fields). Entry i is row i + 1; every other value row 0 (OOV). No other
    transform applies. See ``recsys_trainer.data.vocab``."""

    def __post_init__(self) -> None:
        kind = type(self).__name__.replace("Feature", "").lower()
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a {kind} feature's `name` must be a non-empty string, but is {self.name!r}.")
        vocab, n = check_vocab(
            self.vocab, where=f"{kind} feature {self.name!r}", num_embeddings=self.num_embeddings,
            hash=self.hash, on_out_of_range=self.on_out_of_range, null_id=self.null_id,
            transforms=[k for k in ("boundaries", "div", "mod", "cross") if getattr(self, k) is not None])
        object.__setattr__(self, "vocab", vocab)
        object.__setattr__(self, "num_embeddings", n)
        if not _is_pos_int(n):
            raise ValueError(f"`num_embeddings` of {kind} feature {self.name!r} must be an int >= 1, but is {n!r}.")
        if self.hash not in (None, True, False):
            raise ValueError(f"`hash` of {kind} feature {self.name!r} must be None, True or False, "
                             f"but is {self.hash!r}.")
        if self.on_out_of_range not in ("error", "hash"):
            raise ValueError(f"`on_out_of_range` of {kind} feature {self.name!r} must be 'error' or "
                             f"'hash', but is {self.on_out_of_range!r}.")
        where = f"{kind} feature {self.name!r}"
        transforms = [k for k in ("boundaries", "div", "mod", "cross") if getattr(self, k) is not None]
        if len(transforms) > 1 and set(transforms) != {"div", "mod"}:
            raise ValueError(f"{where} sets {' and '.join(transforms)}; use one transform per feature "
                             "(only div and mod combine: div first).")
        if self.boundaries is not None:
            b = self.boundaries
            if isinstance(b, str | bytes) or not isinstance(b, Sequence) or not b \
                    or not all(_finite(x) for x in b):
                raise ValueError(f"`boundaries` of {where} must be a non-empty list of finite "
                                 f"numbers, but is {b!r}.")
            b = tuple(float(x) for x in b)
            bad = [i for i in range(1, len(b)) if not b[i - 1] < b[i]]
            if bad:
                i = bad[0]
                raise ValueError(f"`boundaries` of {where} must be strictly increasing, but "
                                 f"boundaries[{i - 1}] = {b[i - 1]:g} >= boundaries[{i}] = {b[i]:g}; "
                                 "sort them (and drop repeats).")
            object.__setattr__(self, "boundaries", b)
            if self.hash:
                raise ValueError(f"{where} bucketizes (`boundaries`); `hash=True` does not apply.")
            if n < len(b) + 1:
                raise ValueError(f"{where} bucketizes into {len(b) + 1} ids (len(boundaries) + 1), "
                                 f"but `num_embeddings` is {n}; set it to {len(b) + 1}.")
        for key in ("div", "mod"):
            v = getattr(self, key)
            if v is not None and not _is_pos_int(v):
                raise ValueError(f"`{key}` of {where} must be an int >= 1, but is {v!r}.")
        if self.mod is not None:
            if self.hash:
                raise ValueError(f"{where} sets `mod` and `hash=True`; use one of them.")
            if n < self.mod:
                raise ValueError(f"{where} takes ids modulo {self.mod}, which gives {self.mod} ids, "
                                 f"but `num_embeddings` is {n}; set it to {self.mod}.")
        if self.cross is not None:
            c = self.cross
            if isinstance(c, str) or not isinstance(c, Sequence) or len(c) < 2 \
                    or not all(isinstance(x, str) and x for x in c) or len(set(c)) != len(c):
                raise ValueError(f"`cross` of {where} must list two or more distinct column names, "
                                 f"but is {c!r}.")
            object.__setattr__(self, "cross", tuple(c))
            if self.column is not None:
                raise ValueError(f"{where} crosses columns {list(c)}; leave `column` unset.")
            if self.hash is False:
                raise ValueError(f"{where} crosses columns, which is always hashed; `hash=False` "
                                 "does not apply.")
        if self.null_id is not None and not (isinstance(self.null_id, int) and not isinstance(
                self.null_id, bool) and 0 <= self.null_id < n):
            raise ValueError(f"`null_id` of {where} must be None or an int in [0, {n}), but is "
                             f"{self.null_id!r}.")

    @property
    def source(self) -> str:
        """The id column (the first crossed column for a cross)."""
        return self.cross[0] if self.cross else (self.column or self.name)

    @property
    def sources(self) -> tuple[str, ...]:
        """Every column the ids are computed from."""
        return tuple(self.cross) if self.cross else (self.column or self.name,)


@dataclass(frozen=True, kw_only=True)
class SparseFeature(_IdFeature):
    """An id column (int or string, scalar or ``list<>``) read as one key of ``Batch.sparse``
    (pooled by an ``EmbeddingBagCollection``)."""

    weight_column: str | None = None
    """Optional per-id float weights (same shape as the ids: scalar or list of equal lengths);
    they become the KJT's weights, which a table with ``is_weighted=True`` pools by."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_column is not None and self.cross is not None:
            raise ValueError(f"sparse feature {self.name!r} crosses columns; it takes no `weight_column`.")


@dataclass(frozen=True, kw_only=True)
class SequenceFeature(_IdFeature):
    """Ids read as one key of ``Batch.sequence`` (unpooled, for an ``EmbeddingCollection``).

    A ``list<>`` column is a behaviour sequence, assumed in time order (oldest first): rows
    longer than ``max_len`` keep their *last* ``max_len`` ids (the most recent). A scalar column
    gives one id per row (e.g. the candidate item, which can share the history's table:
    ``EmbeddingConfig(feature_names=["item", "hist_item"])``); it needs ``max_len=1``.
    Transforms (``hash``, ``mod``, ``boundaries``, ...) apply as for ``SparseFeature``.
    """

    max_len: int = 1
    """Most ids per row (the most recent ones are kept). Above 1 the column must be a list."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_pos_int(self.max_len):
            raise ValueError(f"`max_len` of sequence feature {self.name!r} must be an int >= 1, "
                             f"but is {self.max_len!r}.")


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
                    f"({int(outside.any(axis=1).sum())} such row(s) in this batch); fix the data "
                    "or the FeatureSpec's label_range.", column=self.labels[j], row=row,
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
            ids, lens = self._jagged(q, table)
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
                self._one_id_per_row(s, table) for s in self.sparse):
            # The common case (e.g. Criteo): every key has exactly one id per row. All keys go
            # into one [num_keys, rows] int64 matrix, hashed in one in-place pass.
            return DecodedChunk(values=[], lengths=[], id_weights=None,
                                ids=self._regular_ids(table, n, batch_rows), **chunk)  # type: ignore[arg-type]
        for s in self.sparse:
            ids, lens = self._jagged(s, table)
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

    @staticmethod
    def _one_id_per_row(s: _IdFeature, table: pa.Table) -> bool:
        """Every row of ``table`` gives ``s`` exactly one id (scalar columns whose nulls, if
        any, take ``null_id``)."""
        for c in s.sources:
            col = table.column(c)
            if _is_list(col.type) or (col.null_count and s.null_id is None):
                return False
        return True

    def _regular_ids(self, table: pa.Table, n: int, batch_rows: int | None = None) -> np.ndarray:
        """``[blocks, num_keys, batch_rows]`` int64 ids of sparse features with one id per row:
        block ``i`` holds rows ``[i * batch_rows, (i + 1) * batch_rows)`` key-major, which is
        exactly a batch's KJT values (a view, no copy); the last block's unused tail is
        garbage. Without ``batch_rows`` one block holds all ``n`` rows.

        Same ids as ``_jagged`` feature by feature: integers are copied into the blocks once
        (int64), the hashed keys are mixed in place in cache-sized blocks (no full-size
        temporaries) and reduced modulo each table's size in the same pass. String columns are
        hashed one by one: concatenating them into one ``stable_hash_strings`` call was measured
        slower (its per-byte temporaries outgrow the cache). Transformed features (and those
        with nulls) go through ``_jagged``.
        """
        k = len(self.sparse)
        bs = min(batch_rows or n, n) or 1
        full, tail = divmod(n, bs)
        ids = np.empty((full + (tail > 0), k, bs), dtype=np.int64)
        u = ids.view(np.uint64)

        def put(j: int, vals: np.ndarray) -> None:
            """Logical row ``j`` (all ``n`` rows of key ``j``) into the blocks."""
            if full:
                np.copyto(ids[:full, j], vals[:full * bs].reshape(full, bs), casting="unsafe")
            if tail:
                np.copyto(ids[full, j, :tail], vals[full * bs:], casting="unsafe")

        to_hash: list[int] = []
        for j, s in enumerate(self.sparse):
            col = _combine(table.column(s.source))
            if _transformed(s) or col.null_count:
                put(j, self._jagged(s, table)[0])
                continue
            if _is_str(col.type):
                put(j, _mod_inplace(stable_hash_strings(col), s.num_embeddings).view(np.int64))
                continue
            vals = col.to_numpy(zero_copy_only=False)
            if s.hash:
                put(j, vals)
                to_hash.append(j)
                continue
            row = np.empty(n, dtype=np.int64)
            np.copyto(row, vals, casting="unsafe")
            if n and (int(row.min()) < 0 or int(row.max()) >= s.num_embeddings):
                row = self._out_of_range(s, row, np.ones(n, dtype=np.int32))
            put(j, row)
        # Runs of consecutive hashed keys are one contiguous block of each batch block (of the
        # whole buffer when every key is hashed): one pass each.
        for a, b in _runs(to_hash):
            sizes = [self.sparse[j].num_embeddings for j in range(a, b)]
            if (a, b) == (0, k) and len(set(sizes)) == 1:
                _mix64_inplace(u.reshape(-1), sizes[0])
                continue
            for blk in u:
                _hash_mod_rows_inplace(blk[a:b], sizes)
        return ids

    def _jagged(self, s: _IdFeature, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """Flat ids (int64, all in ``[0, num_embeddings)``) and per-row id counts (int32) of one
        feature over ``table``'s rows; a sequence feature's lists cut to their last ``max_len``."""
        if s.cross is not None:
            return _cross_ids(s, table)
        col = _combine(table.column(s.source))
        max_len = s.max_len if isinstance(s, SequenceFeature) else None
        if _is_list(col.type):
            lens = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
            lens = lens.astype(np.int32, copy=False)
            # flatten() honours slice offsets and skips null lists (``.values`` does not).
            flat = col.flatten()
            if max_len is not None and len(lens) and int(lens.max()) > max_len:
                flat, lens = _keep_last(flat, lens, max_len)
        elif isinstance(s, SequenceFeature) and s.max_len > 1:
            raise DataError(_not_a_list(s, col.type), column=s.source)
        elif col.null_count and s.null_id is None:
            lens = col.is_valid().to_numpy(zero_copy_only=False).astype(np.int32)
            flat = col.drop_null()
        else:
            lens = np.ones(len(col), dtype=np.int32)
            flat = col
        return self._ids(s, flat, lens), lens

    @staticmethod
    def _out_of_range(s: _IdFeature, ids: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Unhashed ids known to have some outside ``[0, num_embeddings)``: hash them in place
        (``on_out_of_range="hash"``) or raise naming the first one."""
        n_emb = s.num_embeddings
        bad = (ids < 0) | (ids >= n_emb)
        if s.on_out_of_range == "hash":
            ids[bad] = (stable_hash_ints(ids[bad]) % np.uint64(n_emb)).astype(np.int64)
            return ids
        k = int(np.flatnonzero(bad)[0])
        kind = "SequenceFeature" if isinstance(s, SequenceFeature) else "SparseFeature"
        raise _RowError(
            f"id {int(ids[k])} is outside the table [0, {n_emb}) ({int(bad.sum())} such ids "
            f"in this batch); raise num_embeddings, or set {kind}(name={s.name!r}, "
            "on_out_of_range='hash') or hash=True.",
            column=s.source, row=_row_of(lens, k),
        )

    @staticmethod
    def _ids(s: _IdFeature, flat: pa.Array, lens: np.ndarray) -> np.ndarray:
        """Flat ids of one feature, all in ``[0, num_embeddings)``: ``s``'s transform applied,
        nulls (only where ``null_id`` is set) as ``null_id``."""
        n_emb = s.num_embeddings
        nulls: np.ndarray | None = None
        if flat.null_count:
            where = flat.is_null().to_numpy(zero_copy_only=False)
            if s.null_id is None:
                # A null *inside* a list has no id: reject rather than silently shift ids.
                raise _RowError(
                    "a list of ids contains a null element; clean the data or give the feature "
                    "a null_id.", column=s.source, row=_row_of(lens, int(np.flatnonzero(where)[0])),
                )
            nulls, null_id = where, s.null_id
            flat = flat.fill_null("" if _is_str(flat.type) else 0)
        if s.boundaries is not None:
            vals = flat.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
            nan = np.isnan(vals)
            if nan.any():
                k = int(np.flatnonzero(nan)[0])
                raise _RowError(
                    f"value NaN cannot be bucketized ({int(nan.sum())} such value(s) in this "
                    "batch); clean the data (a null value takes the feature's null_id).",
                    column=s.source, row=_row_of(lens, k),
                )
            ids = np.searchsorted(np.asarray(s.boundaries), vals, side="right").astype(np.int64)
        elif s.vocab is not None:
            ids = lookup_rows(s.vocab, flat, stable_hash_strings, s.name)
        elif _is_str(flat.type):
            if s.hash is False:
                raise DataError(f"feature {s.name!r} sets hash=False, but its column holds strings; "
                                "give it a `vocab` (or hash=True).", column=s.source)
            ids = _mod_inplace(stable_hash_strings(flat), n_emb).view(np.int64)
        else:
            ids = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            if s.div is not None:
                ids = np.floor_divide(ids, s.div)
            if s.mod is not None:
                ids = np.mod(ids, s.mod)
            if s.hash:
                h = np.array(ids, dtype=np.int64, copy=True).view(np.uint64)
                _mix64_inplace(h, n_emb)
                ids = h.view(np.int64)
            elif len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n_emb):
                ids = FeatureSpec._out_of_range(s, ids.copy(), lens)
        if nulls is not None:
            ids = np.where(nulls, np.int64(null_id), ids)
        return ids


def _transformed(s: _IdFeature) -> bool:
    return s.hash is False or any(
        v is not None for v in (s.boundaries, s.div, s.mod, s.cross, s.null_id, s.vocab))


def _row_of(lens: np.ndarray, k: int) -> int:
    """The row holding flat id ``k``, given per-row id counts."""
    return int(np.searchsorted(np.cumsum(lens), k, side="right"))


def _keep_last(flat: pa.Array, lens: np.ndarray, max_len: int) -> tuple[pa.Array, np.ndarray]:
    """Each row's last ``max_len`` elements (lists are in time order: the most recent)."""
    kept = np.minimum(lens, max_len)
    ends = np.cumsum(lens, dtype=np.int64)
    out_starts = np.cumsum(kept, dtype=np.int64) - kept
    # Element i of the output comes from (its row's first kept element) + (its index in the row).
    idx = np.repeat(ends - kept - out_starts, kept) + np.arange(int(kept.sum()), dtype=np.int64)
    return flat.take(pa.array(idx)), kept.astype(np.int32, copy=False)


def _cross_ids(s: _IdFeature, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """A cross feature's ids: per row, the stable hash of its columns' values in order (each
    value hashed as its kind: integer or UTF-8 string), modulo ``num_embeddings``."""
    n = table.num_rows
    h = np.full(n, _SEED, dtype=np.uint64)
    valid: np.ndarray | None = None
    for c in s.cross or ():
        col = _combine(table.column(c))
        if _is_list(col.type):
            raise DataError(f"crossed feature {s.name!r} reads a list column; crosses take "
                            f"scalar columns (is {col.type}).", column=c)
        if col.null_count:
            ok = col.is_valid().to_numpy(zero_copy_only=False)
            valid = ok if valid is None else valid & ok
            col = col.fill_null("" if _is_str(col.type) else 0)
        hc = stable_hash_strings(col) if _is_str(col.type) else stable_hash_ints(
            col.to_numpy(zero_copy_only=False))
        # Order-sensitive combination (a polynomial in the columns' hashes), mixed each step.
        h *= _POLY
        h += hc
        _mix64_inplace(h)
    ids = _mod_inplace(h, s.num_embeddings).view(np.int64)
    if valid is None or valid.all():
        return ids, np.ones(n, dtype=np.int32)
    if s.null_id is not None:
        ids[~valid] = s.null_id
        return ids, np.ones(n, dtype=np.int32)
    return ids[valid], valid.astype(np.int32)


def _check_non_finite(d: DenseFeature, vals: np.ndarray) -> None:
    """NaN/Inf values of one dense column: filled in place, or a ``_RowError``."""
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


def _transform_dense(d: DenseFeature, vals: np.ndarray) -> None:
    """``DenseFeature``'s clip -> log1p -> standardize, in place on one (finite) column."""
    if d.clip is not None:
        np.clip(vals, d.clip[0], d.clip[1], out=vals)
    if d.log1p:
        low = vals <= -1
        if low.any():
            row = int(np.flatnonzero(low)[0])
            raise _RowError(
                f"log1p of dense value {vals[row]:g} is undefined (values must be > -1); clip "
                f"them first, e.g. DenseFeature(column={d.column!r}, log1p=True, clip=(0, None)).",
                column=d.column, row=row,
            )
        np.log1p(vals, out=vals)
    if d.standardize is not None:
        vals -= np.float32(d.standardize[0])
        vals /= np.float32(d.standardize[1])


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


@dataclass
class DecodedChunk:
    """Decoded rows as numpy columns; ``batch(lo, hi)`` cuts source rows ``[lo, hi)``.

    Sparse ids are either ``ids`` (``[blocks, num_keys, block_rows]``, see
    ``FeatureSpec._regular_ids``: every key has exactly one id per row, no id weights) or, in general, per-key flat ``values`` / ``lengths`` / ``id_weights``.
    Sequence ids are per-key flat ``seq_values`` / ``seq_lengths`` (keys ``seq_keys``).
    """

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
    ids: np.ndarray | None = None
    passthrough: Mapping[str, pa.Array] = field(default_factory=dict)
    """The spec's passthrough columns (kept rows only)."""
    seq_keys: list[str] = field(default_factory=list)
    seq_values: list[np.ndarray] = field(default_factory=list)
    seq_lengths: list[np.ndarray] = field(default_factory=list)
    offsets: list[np.ndarray] = field(init=False)
    seq_offsets: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in self.lengths]
        self.seq_offsets = [np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in self.seq_lengths]

    def batch(self, lo: int, hi: int) -> Batch:
        """The ``Batch`` of source rows ``[lo, hi)`` (rows dropped for NaN labels left out)."""
        if self.kept_cum is not None:
            lo, hi = int(self.kept_cum[lo]), int(self.kept_cum[hi])
        n = hi - lo
        labels = self.labels[lo:hi]
        if self.ids is not None:
            # A whole block is the key-major values as they are; every length is 1. (numpy,
            # not torch.ones: torch's intra-op thread pool costs milliseconds per call on a
            # busy host.)
            k = len(self.keys)
            kjt = KeyedJaggedTensor(
                keys=self.keys,
                values=torch.from_numpy(self._block_ids(lo, hi)),
                lengths=torch.from_numpy(np.ones(k * n, dtype=np.int32)),
                stride=n,
                length_per_key=[n] * k,
                offset_per_key=list(range(0, k * n + 1, n)) if n else [0] * (k + 1),
            )
        elif self.keys:
            kjt = _jagged_kjt(self.keys, self.values, self.lengths, self.offsets, self.id_weights, lo, hi)
        else:
            kjt = KeyedJaggedTensor.empty(values_dtype=torch.int64)
        # Views of the chunk's arrays (contiguous row ranges; each batch has its own rows).
        return Batch(
            dense=torch.from_numpy(self.dense[lo:hi]),
            sparse=kjt,
            labels=torch.from_numpy(labels[:, 0] if self.single_label else labels),
            weights=None if self.weights is None else torch.from_numpy(self.weights[lo:hi]),
            passthrough={c: a.slice(lo, n) for c, a in self.passthrough.items()},
            sequence=_jagged_kjt(self.seq_keys, self.seq_values, self.seq_lengths, self.seq_offsets,
                                 None, lo, hi) if self.seq_keys else None,
        )


    def _block_ids(self, lo: int, hi: int) -> np.ndarray:
        """Key-major flat ids of kept rows ``[lo, hi)``: a view when they are one whole block."""
        assert self.ids is not None
        bs = self.ids.shape[2]
        first, last = lo // bs, -(-hi // bs)
        if hi - lo == bs and lo % bs == 0:
            return self.ids[first].reshape(-1)
        if hi == lo:
            return np.empty(0, dtype=np.int64)
        parts = [self.ids[b, :, max(lo - b * bs, 0):min(hi - b * bs, bs)] for b in range(first, last)]
        return np.concatenate(parts, axis=1).reshape(-1)


def _jagged_kjt(keys: list[str], values: list[np.ndarray], lengths: list[np.ndarray],
                offsets: list[np.ndarray], weights: list[np.ndarray] | None,
                lo: int, hi: int) -> KeyedJaggedTensor:
    """Rows ``[lo, hi)`` of per-key flat ids as one key-major KJT (one concatenate per field)."""
    bounds = [(int(o[lo]), int(o[hi])) for o in offsets]
    per_key = [b - a for a, b in bounds]

    def cat(parts: list[np.ndarray]) -> torch.Tensor:
        # One key's rows are a contiguous range of its arrays: a view, no copy (unless it is
        # Arrow's read-only memory, which a tensor must not alias).
        if len(parts) == 1 and parts[0].flags.writeable:
            return torch.from_numpy(parts[0])
        return torch.from_numpy(np.concatenate(parts))

    return KeyedJaggedTensor(
        keys=keys,
        values=cat([v[a:b] for v, (a, b) in zip(values, bounds, strict=True)]),
        lengths=cat([x[lo:hi] for x in lengths]),
        weights=None if weights is None else cat(
            [w[a:b] for w, (a, b) in zip(weights, bounds, strict=True)]),
        stride=hi - lo,
        length_per_key=per_key,
        offset_per_key=np.concatenate([[0], np.cumsum(per_key)]).astype(np.int64).tolist(),
    )


# ---------------------------------------------------------------------- stable hashing

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_POLY = np.uint64(0x100000001B3)  # FNV-64 prime, used as the polynomial base
_SEED = np.uint64(0x9E3779B97F4A7C15)  # keeps the empty string away from hash 0


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_BLOCK = 32768
"""Elements per step of the in-place hash pass: two 256 KiB buffers stay in L2 (16k-64k measured alike). (Whole-array
numpy expressions allocate a fresh temporary per operator; for a chunk of 16k rows x 26 keys that
was slower than hashing each key separately.)"""


def _mix64_inplace(x: np.ndarray, mod: int | None = None) -> None:
    """splitmix64's finalizer, in place on a contiguous 1-D uint64 array (uint64 wraps); then,
    if ``mod`` is given, the result modulo ``mod``: one cache-blocked pass for both."""
    tmp = np.empty(min(_BLOCK, len(x)), dtype=np.uint64)
    for a in range(0, len(x), _BLOCK):
        v = x[a:a + _BLOCK]
        t = tmp[:len(v)]
        np.right_shift(v, _S30, out=t)
        v ^= t
        v *= _M1
        np.right_shift(v, _S27, out=t)
        v ^= t
        v *= _M2
        np.right_shift(v, _S31, out=t)
        v ^= t
        if mod is not None:
            _mod_inplace(v, mod, t)


def _mod_inplace(v: np.ndarray, mod: int, tmp: np.ndarray | None = None) -> np.ndarray:
    """``v %= mod`` for uint64 ``v``, as ``v - (v // mod) * mod``: the same values, but numpy's
    floor division by a scalar is vectorized (libdivide) and ~5x faster than ``np.remainder``."""
    m = np.uint64(mod)
    t = np.empty_like(v) if tmp is None else tmp
    np.floor_divide(v, m, out=t)
    t *= m
    v -= t
    return v


def _hash_mod_rows_inplace(u: np.ndarray, sizes: list[int]) -> None:
    """Hash row ``i`` of the C-contiguous uint64 matrix ``u`` into ``[0, sizes[i])``, in place."""
    if len(set(sizes)) == 1:
        _mix64_inplace(u.reshape(-1), sizes[0])
    else:
        for row, size in zip(u, sizes, strict=True):
            _mix64_inplace(row, size)


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as ``[a, b)`` runs of consecutive values."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads every input bit over the output (uint64 wraps)."""
    x = np.array(x, dtype=np.uint64, copy=True)
    _mix64_inplace(x.reshape(-1))
    return x


def stable_hash_ints(ids: np.ndarray) -> np.ndarray:
    """A stable 64-bit hash of int64 ids (uint64), the same on every machine and run."""
    return _mix64(ids.astype(np.int64, copy=False).view(np.uint64))


def stable_hash_strings(arr: pa.Array) -> np.ndarray:
    """A stable 64-bit hash of each string's UTF-8 bytes, vectorized over the Arrow buffers.

    h = mix64(sum_i byte_i * P^(len-1-i) + len + C) mod 2^64: a polynomial over the bytes computed
    with one gather and one running sum (differenced at the string boundaries; uint64 wraps, so
    the differences are exact), so the cost is O(total bytes) in numpy.
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
    powers = _powers(int(lens.max()))
    # Each byte's distance to the end of its string, then byte * P^distance.
    pos = np.repeat(rel[1:] - 1, lens)
    pos -= np.arange(total)
    terms = powers[pos]
    terms *= data
    running = np.empty(total + 1, dtype=np.uint64)
    running[0] = 0
    np.cumsum(terms, out=running[1:])
    sums = np.diff(running[rel])  # per string (0 for empty ones)
    sums += lens.astype(np.uint64)
    sums += _SEED
    _mix64_inplace(sums)
    return sums


def _powers(k: int) -> np.ndarray:
    """``P^0 .. P^(k-1)`` mod 2^64 (by doubling: O(log k) numpy calls)."""
    powers = np.empty(max(k, 1), dtype=np.uint64)
    powers[0] = 1
    have = 1
    with np.errstate(over="ignore"):
        while have < k:
            step = min(have, k - have)
            np.multiply(powers[:step], powers[have - 1] * _POLY, out=powers[have:have + step])
            have += step
    return powers[:k]


# ---------------------------------------------------------------------- arrow helpers

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


def _not_a_list(s: SequenceFeature, t: pa.DataType) -> str:
    return (f"sequence feature {s.name!r} has max_len={s.max_len}, so its column must be a list "
            f"of ids (a behaviour sequence), but it is {t}. Write the column as a list, or use "
            f"max_len=1 for one id per row.")


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and bool(np.isfinite(x))


def _is_pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


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


def _float_view(col: pa.ChunkedArray | pa.Array, fill: float) -> np.ndarray:
    """A numeric column as numpy (zero-copy where Arrow allows, possibly read-only), nulls
    replaced by ``fill``; the caller casts while copying it into its own array."""
    arr = _combine(col)
    if arr.null_count:
        # Unchecked like the numpy cast of null-free columns (a safe cast rejects ints > 2**24).
        arr = arr.cast(pa.float32(), safe=False).fill_null(pa.scalar(fill, pa.float32()))
    return arr.to_numpy(zero_copy_only=False)


def _to_float(col: pa.ChunkedArray | pa.Array, fill: float) -> np.ndarray:
    """float32 numpy copy of a numeric column with nulls replaced by ``fill``."""
    return np.array(_float_view(col, fill), dtype=np.float32, copy=True)
