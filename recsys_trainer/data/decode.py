"""One feature's column(s) -> numpy: dense values and their transforms, ids and their
transforms (bucketize, div/mod, cross, hash, null_id), lists cut to ``max_len``.

Vectorized with pyarrow/numpy (no per-row Python loop). Every problem raises ``_RowError``
(``DataError`` with the row in the decoded table; the reader maps it to its source) naming the
column; an out-of-range id never leaves this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_trainer.data.columns import _combine, _is_list, _is_str
from recsys_trainer.data.errors import DataError, _RowError
from recsys_trainer.data.hashing import (
    _POLY,
    _SEED,
    _hash_mod_rows_inplace,
    _mix64_inplace,
    _mod_inplace,
    stable_hash_ints,
    stable_hash_strings,
)
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature, _IdFeature
from recsys_trainer.data.vocab import column_problem, lookup_rows

_INT64_MAX = 2**63 - 1
_FEW_ROWS = 64
"""Up to this many rows, ``_regular_ids`` hashes all string columns in one call."""


def _not_a_list(s: SequenceFeature, t: pa.DataType) -> str:
    return (f"sequence feature {s.name!r} has max_len={s.max_len}, so its column must be a list "
            f"of ids (a behaviour sequence), but it is {t}. Write the column as a list, or use "
            f"max_len=1 for one id per row.")


def _one_id_per_row(s: _IdFeature, table: pa.Table) -> bool:
    """Every row of ``table`` gives ``s`` exactly one id (scalar columns whose nulls, if
    any, take ``null_id``)."""
    for c in s.sources:
        col = table.column(c)
        if _is_list(col.type) or (col.null_count and s.null_id is None):
            return False
    return True


def _regular_ids(sparse: Sequence[SparseFeature], table: pa.Table, n: int,
                 batch_rows: int | None = None) -> np.ndarray:
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
    k = len(sparse)
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
    # Few rows (a serving request): the string columns are hashed in one call, not one call
    # per column, whose fixed numpy cost dominated (26 columns x 1 row: 1.0 ms -> 0.1 ms).
    # Each string's hash is its own, so the ids are the same either way.
    strings: list[tuple[int, pa.Array]] = []
    for j, s in enumerate(sparse):
        col = _combine(table.column(s.source))
        if _transformed(s) or col.null_count:
            put(j, _jagged(s, table)[0])
            continue
        if _is_str(col.type):
            if n <= _FEW_ROWS:
                strings.append((j, col))
            else:
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
            row = _out_of_range(s, row, np.ones(n, dtype=np.int32), vals)
        put(j, row)
    if strings:
        hashed = stable_hash_strings(pa.concat_arrays([c.cast(pa.large_string()) for _, c in strings]))
        for i, (j, _) in enumerate(strings):
            put(j, _mod_inplace(hashed[i * n:(i + 1) * n], sparse[j].num_embeddings).view(np.int64))
    # Runs of consecutive hashed keys are one contiguous block of each batch block (of the
    # whole buffer when every key is hashed): one pass each.
    for a, b in _runs(to_hash):
        sizes = [sparse[j].num_embeddings for j in range(a, b)]
        if (a, b) == (0, k) and len(set(sizes)) == 1:
            _mix64_inplace(u.reshape(-1), sizes[0])
            continue
        for blk in u:
            _hash_mod_rows_inplace(blk[a:b], sizes)
    return ids


def _jagged(s: _IdFeature, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
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
    return _ids(s, flat, lens), lens


def _out_of_range(s: _IdFeature, ids: np.ndarray, lens: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """Unhashed ids known to have some outside ``[0, num_embeddings)``: hash them in place
    (``on_out_of_range="hash"``) or raise naming the first one as ``raw`` (the column's values
    as stored, before the int64 cast and ``div``) holds it, with a fix that exists for it."""
    n_emb = s.num_embeddings
    bad = (ids < 0) | (ids >= n_emb)
    if s.on_out_of_range == "hash":
        ids[bad] = (stable_hash_ints(ids[bad]) % np.uint64(n_emb)).astype(np.int64)
        return ids
    k = int(np.flatnonzero(bad)[0])
    kind = "SequenceFeature" if isinstance(s, SequenceFeature) else "SparseFeature"
    stored = raw[k].item()  # a uint64 id >= 2**63 as written, not its int64 wrap
    this = f"id {stored}" if s.div is None else f"value {stored} (id {int(ids[k])} after div={s.div})"
    count = f"{int(bad.sum())} such ids in this batch"
    hash_it = (f"set {kind}(name={s.name!r}, hash=True) to hash every id into [0, {n_emb}), or "
               "on_out_of_range='hash' to hash only the ids outside it")
    if stored > _INT64_MAX:
        why = f": it is above 2**63 - 1, int64's largest value, and ids are int64 ({count}); {hash_it}."
    elif ids[k] < 0:
        why = (f": it is negative, and no table row is ({count}); {hash_it}, or take ids modulo "
               f"the table size (mod={n_emb}).")
    elif n_emb < _INT64_MAX:
        why = f" ({count}); raise num_embeddings, or {hash_it}."
    else:
        why = f" ({count}); {hash_it}."
    raise _RowError(f"{this} is outside the table [0, {n_emb}){why}", column=s.source,
                    row=_row_of(lens, k))


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
        ids = lookup_rows(s.vocab, flat, s.name)
    elif _is_str(flat.type):
        if s.hash is False:
            raise DataError(str(column_problem(None, False, "string", s.name)), column=s.source)
        ids = _mod_inplace(stable_hash_strings(flat), n_emb).view(np.int64)
    else:
        raw = flat.to_numpy(zero_copy_only=False)
        ids = raw.astype(np.int64, copy=False)
        if s.div is not None:
            ids = np.floor_divide(ids, s.div)
        if s.mod is not None:
            ids = np.mod(ids, s.mod)
        if s.hash:
            h = np.array(ids, dtype=np.int64, copy=True).view(np.uint64)
            _mix64_inplace(h, n_emb)
            ids = h.view(np.int64)
        elif len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n_emb):
            ids = _out_of_range(s, ids.copy(), lens, raw)
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


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as ``[a, b)`` runs of consecutive values."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out

