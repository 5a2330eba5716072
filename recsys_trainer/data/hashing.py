"""Stable 64-bit hashing of ids and strings (the same on every machine and Python run).

Ids are hashed with splitmix64's finalizer; strings with a polynomial over their UTF-8 bytes,
then the same finalizer. Everything is vectorized numpy over whole columns (uint64 wraps).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

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


_POWERS_CACHE = np.ones(1, dtype=np.uint64)


def _powers(k: int) -> np.ndarray:
    """``P^0 .. P^(k-1)`` mod 2^64, from a table kept across calls (strings are short: the
    table stops growing after the first batches; rebuilding it per call cost a tenth of
    hashing one short string). Read-only to callers; replaced whole when it grows, so reader
    threads can share it."""
    global _POWERS_CACHE
    table = _POWERS_CACHE
    if len(table) < k:
        table = _compute_powers(max(k, 2 * len(table)))
        _POWERS_CACHE = table
    return table[:k]


def _compute_powers(k: int) -> np.ndarray:
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

