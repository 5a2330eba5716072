"""Planning a window of ``ParquetWindowDataset``: its readable units, and this rank's pieces.

* ``WindowPlanner`` lists a window's units (``Unit``: a parquet row group, a whole CSV file),
  reading every file's footer (a CSV file whole) and checking its schema, id kinds and id
  columns on the way. Every rank plans every file of the window, so every rank agrees on the
  sharding and raises the same schema errors.
* ``shard_units`` cuts the units into this rank's pieces (``sharding="rows"``: contiguous row
  ranges; ``"row_groups"``: whole units round-robin), shuffled by ``shuffle_rng``'s generator
  when shuffling: a pure function of its arguments, so every rank computes its own share of one
  agreed cut. ``shard_pieces`` does the same for the rows left of a window by ranks of earlier
  world sizes (an elastic resume: ``ParquetWindowDataset`` replays each earlier part's cut to
  find them, ``parquet_files.rows_left``).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs

from recsys_trainer import storage
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.parquet_files import Piece, Unit, open_parquet, valueless_columns
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.vocab import column_problem
from recsys_trainer.data.windows import Window

logger = logging.getLogger("recsys_trainer.data")


class WindowPlanner:
    """Lists a window's units for one ``ParquetWindowDataset`` (made per window from its
    configuration; see ``ParquetWindowDataset`` for the arguments).

    Args:
        features: the dataset's ``FeatureSpec`` (schemas are checked against it).
        id_columns: the sparse id columns (their kinds are recorded, their values checked).
        file_format, on_corrupt, csv_convert_options, filesystem: the dataset's.
        kinds: the record of id kinds the dataset reads as (``ParquetWindowDataset._kinds``):
            per column the first kind read and where; a column read first here is added to it.
    """

    def __init__(
        self,
        features: FeatureSpec,
        id_columns: list[str],
        *,
        file_format: Literal["auto", "parquet", "csv"],
        on_corrupt: Literal["error", "skip"],
        csv_convert_options: pacsv.ConvertOptions | None,
        filesystem: pafs.FileSystem | None,
        kinds: dict[str, dict[str, str]],
    ) -> None:
        self.features = features
        self.id_columns = id_columns
        self.file_format = file_format
        self.on_corrupt = on_corrupt
        self.csv_convert_options = csv_convert_options
        self.filesystem = filesystem
        self.kinds = kinds
        self.files_skipped = 0
        """Unreadable files skipped (``on_corrupt="skip"``) so far; the dataset counts them in
        its ``stats``."""

    def _format(self, path: str) -> str:
        if self.file_format != "auto":
            return self.file_format
        return "csv" if path.endswith((".csv", ".csv.gz")) else "parquet"

    def units(self, window: Window) -> list[Unit]:
        """Every readable unit of the window, in file order; checks schemas on the way."""
        units: list[Unit] = []
        for path in window.files:
            try:
                if self._format(path) == "csv":
                    with storage.open_input_stream(storage.resolve(path, self.filesystem)) as f:
                        table = pacsv.read_csv(f, convert_options=self.csv_convert_options)
                    self.features.check_schema(table.schema, path)
                    self._check_id_kinds(table.schema, window.id, path)
                    self._check_ids_present(
                        {c for c in self.id_columns if table.column(c).null_count == table.num_rows},
                        table.schema, table.num_rows, path)
                    units.append(Unit(path, 0, table.num_rows, table))
                    continue
                pf = open_parquet(path, self.filesystem)
                try:
                    md = pf.metadata
                finally:
                    pf.close(force=True)
                schema = md.schema.to_arrow_schema()
            except DataError:
                raise
            except (OSError, pa.ArrowException) as exc:
                if self.on_corrupt == "skip" and not storage.is_access_failure(exc):
                    self.files_skipped += 1
                    logger.warning("window %s: skipping unreadable file %s (%s)", window.id, path, exc)
                    continue
                raise DataError(
                    f"cannot read the file ({type(exc).__name__}: {exc}); fix or remove it, or set "
                    "on_corrupt='skip' to skip unreadable files (they are counted).", file=path,
                ) from exc
            self.features.check_schema(schema, path)
            self._check_id_kinds(schema, window.id, path)
            self._check_ids_present(valueless_columns(md, self.id_columns), schema, md.num_rows, path)
            units.extend(Unit(path, i, md.row_group(i).num_rows, metadata=md)
                         for i in range(md.num_row_groups))
        return units

    def _check_ids_present(self, valueless: set[str], schema: pa.Schema, num_rows: int,
                           path: str) -> None:
        """An id column without a value in any row of the file: ``DataError``, or a warning
        (``on_all_null``). Every rank plans every file, so every rank raises it alike."""
        for warning in self.features.check_ids_present(valueless, schema, num_rows, path):
            logger.warning("%s (on_all_null='warn': reading the file)", warning)

    def _check_id_kinds(self, schema: pa.Schema, window_id: str, path: str) -> None:
        """Record the kind of ids (integer / string) each sparse id column first holds, across
        restarts too: integer ids index the table (or hash as integers), strings hash as text,
        so a column that changes kind in a later file or window is read as the first kind
        (``ParquetWindowDataset._as_first_kinds``: strings of integers converted losslessly,
        integers in a string column or any other value refused, naming the value). Also refuses
        a column a feature's vocabulary cannot map (or strings with ``hash=False`` and no
        vocabulary)."""
        # A column of the other kind than first read is read as that kind (``_as_first_kinds``
        # converts it, or refuses it naming the value), so it is checked as that kind.
        found = self.features.id_kinds(schema)
        record = self.kinds
        kinds = {c: record[c]["kind"] if c in record else k for c, k in found.items()}
        for s in self.features.id_features:
            for c in s.sources:
                problem = column_problem(s.vocab, s.hash, kinds[c], s.name) if c in kinds else None
                if problem is not None:
                    raise DataError(problem, file=path, column=c)
        for c, k in found.items():
            record.setdefault(c, {"kind": k, "window": window_id, "file": path})


def shuffle_rng(seed: int, epoch: int, window_id: str, rank: int,
                part: int = 0) -> np.random.Generator:
    """The generator that shuffles a rank's pieces of a window: seeded from ``(seed, epoch,
    window, rank)``, so a rerun (or a resume) shuffles alike. ``part`` > 0: the part of the
    window trained after the ``part``-th change of world size (another cut, another shuffle)."""
    key = [seed, epoch, zlib.crc32(window_id.encode()), rank] + ([part] if part else [])
    return np.random.default_rng(key)


def whole_units(units: list[Unit]) -> list[Piece]:
    """Every row of the units that have rows, as one unshuffled piece per unit."""
    return [Piece(u, 0, u.num_rows, None) for u in units if u.num_rows > 0]


def shard_units(units: list[Unit], rank: int, world_size: int,
                sharding: Literal["rows", "row_groups"],
                rng: np.random.Generator | None) -> list[Piece]:
    """Rank ``rank``'s pieces of the window's ``units``, in reading order (units without rows
    are left out first): ``shard_pieces`` of every row of the window."""
    return shard_pieces(whole_units(units), rank, world_size, sharding, rng)


def shard_pieces(parts: list[Piece], rank: int, world_size: int,
                 sharding: Literal["rows", "row_groups"],
                 rng: np.random.Generator | None) -> list[Piece]:
    """Rank ``rank``'s pieces of ``parts`` (unshuffled pieces in window order: whole units, or
    what earlier world sizes left), in reading order. ``sharding="rows"``: the parts' rows, in
    order, cut into ``world_size`` contiguous ranges whose sizes differ by at most one row;
    ``"row_groups"``: part ``i`` whole to rank ``i % world_size``. With ``rng`` the pieces'
    order is permuted and each piece gets a seed for permuting its rows."""
    w, r = world_size, rank
    pieces: list[Piece] = []
    if sharding == "row_groups":
        pieces = [p for i, p in enumerate(parts) if i % w == r]
    else:
        total = sum(p.length for p in parts)
        lo, hi = total * r // w, total * (r + 1) // w
        pos = 0
        for p in parts:
            a, b = max(lo, pos), min(hi, pos + p.length)
            if a < b:
                pieces.append(dataclasses.replace(p, start=p.start + a - pos, length=b - a))
            pos += p.length
    if rng is not None:
        order = rng.permutation(len(pieces))
        seeds = rng.integers(0, 2**63 - 1, size=len(pieces))
        pieces = [dataclasses.replace(pieces[i], shuffle_seed=int(seeds[k]))
                  for k, i in enumerate(order)]
    return pieces
