"""The parquet reader's file access and piece arithmetic, without dataset state.

* ``Unit`` (a row group of a parquet file, or a whole CSV file) and ``Piece`` (a rank's rows of
  a unit): what ``parquet_plan`` plans and ``ParquetWindowDataset`` reads.
* ``open_parquet`` / ``OpenFiles``: a parquet file over a random-access handle of its
  filesystem, and the last one kept open between consecutive pieces.
* ``valueless_columns``: columns without a value in a file, from its footer alone.
* ``concat_rows``: rows of several files as one table (types promoted, or an error naming both).
* ``skip_rows``: the piece stream without its first rows (a resume; counts only).
* ``rows_left``: what several ranks' piece streams left unread, as pieces in window order (an
  elastic resume re-plans those rows over the new ranks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from recsys_trainer import storage
from recsys_trainer.data.errors import DataError


@dataclass(frozen=True)
class Unit:
    """One readable unit of a window: a row group of a parquet file, or a whole CSV file."""

    file: str
    row_group: int
    num_rows: int
    table: pa.Table | None = field(default=None, compare=False, repr=False)
    """A CSV file's rows, read when the window was planned."""
    metadata: pq.FileMetaData | None = field(default=None, compare=False, repr=False)
    """A parquet file's footer, read when the window was planned (not fetched again to read)."""


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + length)`` of a unit, permuted by ``shuffle_seed`` if set.

    With ``selection`` the piece draws from those rows of the unit only (what ranks of an
    earlier world size left of it): ``start`` and ``length`` then index into ``selection``."""

    unit: Unit
    start: int
    length: int
    shuffle_seed: int | None
    skip: int = 0
    """Rows already consumed at the front (in shuffled order; a resume inside the piece)."""
    selection: np.ndarray | None = field(default=None, compare=False, repr=False)
    """Ascending row numbers of the unit this piece draws from; None: all of them."""

    @property
    def rows(self) -> int:
        """The rows still to read: ``length`` less the ``skip`` rows already consumed."""
        return self.length - self.skip

    @property
    def is_range(self) -> bool:
        """Whether the piece reads a contiguous range of the unit in order (a slice)."""
        return self.selection is None and self.shuffle_seed is None

    def row_numbers(self) -> np.ndarray:
        """The unit's row numbers this piece reads, in reading order (permuted by
        ``shuffle_seed``, less the ``skip`` rows consumed)."""
        rows = (np.arange(self.start, self.start + self.length) if self.selection is None
                else self.selection[self.start:self.start + self.length])
        if self.shuffle_seed is None:
            return rows[self.skip:]
        return np.random.default_rng(self.shuffle_seed).permutation(rows)[self.skip:]


def open_parquet(path: str, filesystem: pafs.FileSystem | None,
                 metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """``path`` (a local path or URL) as a ``ParquetFile`` over a random-access handle of its
    filesystem: reading a row group fetches only its byte ranges, never the whole file. On
    remote storage the column chunks a read needs are fetched together (``pre_buffer``: a few
    coalesced requests per row group instead of one per column)."""
    loc = storage.resolve(path, filesystem)
    handle = storage.open_input_file(loc)
    try:
        return pq.ParquetFile(handle, metadata=metadata, pre_buffer=not loc.is_local)
    except BaseException:
        handle.close()
        raise


class OpenFiles:
    """The last opened parquet file, kept open while consecutive pieces read from it (a fresh
    ``ParquetFile`` per row group re-reads and re-parses the footer)."""

    def __init__(self, filesystem: pafs.FileSystem | None = None) -> None:
        self._filesystem = filesystem
        self._path: str | None = None
        self._file: pq.ParquetFile | None = None

    def get(self, path: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
        """The file at ``path``: the one already open, or (closing that) a newly opened one;
        ``metadata`` (its footer, read when planning) spares fetching the footer again."""
        if self._file is None or self._path != path:
            self.close()
            self._file = open_parquet(path, self._filesystem, metadata)
            self._path = path
        return self._file

    def close(self) -> None:
        """Close the open file, if any."""
        if self._file is not None:
            self._file.close(force=True)  # also the handle it was given
        self._file = self._path = None


def valueless_columns(md: pq.FileMetaData, columns: list[str]) -> set[str]:
    """The ``columns`` without a value in any row of the file (a list column: without an
    element), from the footer's statistics: no data is read. Null lists, empty lists and null
    elements all count as nulls of a list's leaf column. A column whose statistics are missing
    (a writer may omit them) or that is not one leaf (a struct) is not listed."""
    if md.num_rows == 0:
        return set()
    paths = [md.schema.column(j).path for j in range(md.num_columns)]
    out = set()
    for c in columns:
        leaves = [j for j, p in enumerate(paths) if p == c or p.startswith(c + ".")]
        if len(leaves) != 1:
            continue
        j = leaves[0]
        for i in range(md.num_row_groups):
            chunk = md.row_group(i).column(j)
            stats = chunk.statistics
            if stats is None or not stats.has_null_count or stats.null_count != chunk.num_values:
                break
        else:
            out.add(c)
    return out


def concat_rows(parts: list[pa.Table], files: list[str]) -> pa.Table:
    """Rows of several files (``FeatureSpec.unify_columns`` applied) as one table; integer
    widths and string kinds are promoted to a common type. Types with none left (e.g. integer
    ids beside strings, which planning refuses first) are an error naming both files."""
    try:
        return pa.concat_tables(parts, promote_options="permissive")
    except pa.ArrowException as exc:
        other = next(f for f, p in zip(files, parts, strict=True) if not p.schema.equals(parts[0].schema))
        raise DataError(
            f"its rows cannot be combined with those of {files[0]} ({exc}); write each column "
            "with one type in every file of a window.", file=other,
        ) from None


def skip_rows(pieces: list[Piece], rows: int) -> tuple[list[Piece], int]:
    """Drop the first ``rows`` rows of the piece stream (counts only, nothing is read); returns
    the pieces left and their total rows."""
    out: list[Piece] = []
    for p in pieces:
        if rows >= p.rows:
            rows -= p.rows
            continue
        if rows and p.shuffle_seed is None:
            p = dataclasses.replace(p, start=p.start + p.skip + rows,
                                    length=p.length - p.skip - rows, skip=0)
        elif rows:
            p = dataclasses.replace(p, skip=p.skip + rows)
        out.append(p)
        rows = 0
    return out, sum(p.rows for p in out)


def rows_left(units: list[Unit], left: list[list[Piece]]) -> list[Piece]:
    """The rows the ranks' piece streams ``left`` (one list per rank: what each had not read)
    still hold, as unshuffled pieces in window order: by unit (``units``' order), then by row.
    A contiguous range stays a range; the rest of a shuffled piece becomes a ``selection``.
    Every row is in at most one rank's stream, so the pieces are disjoint."""
    order = {u: i for i, u in enumerate(units)}
    out: list[Piece] = []
    for pieces in left:
        for p in pieces:
            if p.rows == 0:
                continue
            if p.is_range:
                out.append(dataclasses.replace(p, start=p.start + p.skip,
                                               length=p.length - p.skip, skip=0))
            elif p.skip == 0:  # untouched: all of its rows, whatever their order
                out.append(dataclasses.replace(p, shuffle_seed=None))
            else:
                rows = np.sort(p.row_numbers())
                if int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # contiguous after all
                    out.append(Piece(p.unit, int(rows[0]), len(rows), None))
                else:
                    out.append(Piece(p.unit, 0, len(rows), None, selection=rows))
    out.sort(key=lambda p: (order[p.unit], p.start if p.selection is None
                            else int(p.selection[p.start])))
    return out
