"""Arrow columns as numpy: type predicates, one contiguous array, floats with nulls filled."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


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
