"""Arrow columns as numpy: type predicates, one contiguous array, floats with nulls filled; id
columns conformed to the kind of ids (integer / string) training read."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_trainer.data.errors import DataError


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


_CANONICAL_INT = r"^(0|-?[1-9][0-9]*)$"
"""An integer written as ``str(int)`` writes it: no sign '+', no leading zeros or spaces, no
"-0", so the conversion back is lossless ("079" and "79", or "-0" and "0", are different strings,
but would be one integer)."""


def _id_kind(t: pa.DataType) -> str | None:
    """``"integer"`` / ``"string"`` for an id column's type (a list by its elements), else None."""
    elem = t.value_type if _is_list(t) else t
    return "integer" if _is_int(elem) else "string" if _is_str(elem) else None


def _as_id_kind(col: pa.ChunkedArray | pa.Array, kind: str) -> tuple[pa.Array | None, int | None, str]:
    """An id column (or a list of ids) converted losslessly to the ``kind`` of ids it held in
    training. Returns ``(converted, None, "")``, or ``(None, row, value)`` naming the first value
    refused. Only integers written as strings (``str(int)``'s form, within int64) convert, to
    int64. Integers never convert to strings: ``str(int)`` cannot restore what the integer lost
    (pyarrow's CSV reader reads "02134" as 2134, a client may send 7 for "007"), so the first
    non-null integer is refused; a column without a value converts (there is nothing to change)."""
    arr = _combine(col)
    listed = _is_list(arr.type)
    flat = arr.flatten() if listed else arr
    bad: int | None = None
    if kind == "string":
        valid = flat.is_valid().to_numpy(zero_copy_only=False)
        if valid.any():
            bad = int(np.flatnonzero(valid)[0])
        else:
            out = flat.cast(pa.string())
    else:
        ok = pc.fill_null(pc.match_substring_regex(flat.cast(pa.string()), _CANONICAL_INT), True)
        ok_np = ok.to_numpy(zero_copy_only=False)
        bad = None if ok_np.all() else int(np.flatnonzero(~ok_np)[0])
        if bad is None:
            try:
                out = flat.cast(pa.int64())
            except pa.ArrowInvalid:  # all digits, but beyond int64
                big = [i for i, v in enumerate(flat.to_pylist())
                       if v is not None and not -2**63 <= int(v) < 2**63]
                bad = big[0]
    if bad is not None:
        if listed:
            lens = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
            row = int(np.searchsorted(np.cumsum(lens), bad, side="right"))
        else:
            row = bad
        return None, row, repr(flat[bad].as_py())
    if not listed:
        return out, None, ""
    lens = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, out, mask=arr.is_null()), None, ""


class IdKindError(DataError):
    """An id value ``conform_id_kinds`` refused: ``column`` held ``want`` ids where they were
    first read (training), this table holds ``got`` ids, and ``value`` (its ``repr``) at table
    row ``row`` does not convert losslessly. Callers catch it to say where the rows came from
    (a file and row group, the rows to score) and what to do; uncaught it is still a
    ``DataError`` naming the column and row."""

    column: str  # always set here (``DataError``'s may be None)
    row: int

    def __init__(self, *, column: str, row: int, value: str, want: str, got: str) -> None:
        self.value, self.want, self.got = value, want, got
        super().__init__(
            f"the id column holds {got} ids, but held {want} ids where it was first read, and "
            f"value {value} does not convert to a {want} id losslessly (integer and string ids "
            "map to different rows).", column=column, row=row)


def conform_id_kinds(table: pa.Table, kinds: Mapping[str, str]) -> pa.Table:
    """``table`` with each id column (a column of integers or strings, or lists of them) named
    in ``kinds`` whose kind differs from ``kinds[name]`` (``"integer"`` / ``"string"``)
    converted to it by ``_as_id_kind``: integers written as strings (``str(int)``'s form)
    become int64. Anything else is refused with ``IdKindError`` for the column's first value
    refused: integer and string ids map to different rows, so a silent mismatch would read
    another id. Columns not named, or not ids, are left as they are."""
    for i, f in enumerate(table.schema):
        want = kinds.get(f.name)
        got = _id_kind(f.type)
        if want is None or got is None or got == want:
            continue
        col, row, value = _as_id_kind(table.column(i), want)
        if col is None:
            assert row is not None
            raise IdKindError(column=f.name, row=row, value=value, want=want, got=got)
        table = table.set_column(i, f.name, col)
    return table
