"""``ParquetWindowDataset``: windows of parquet (or CSV) files, sharded by rows, prefetched.

Under the Trainer, rank 0 lists the windows and every rank reads rank 0's listing (see
``windows.agreed_windows``): a lagging listing on one rank cannot split the ranks. Per window,
every rank reads the footers of all the window's files (cheap; it makes every rank agree on
the sharding and on schema errors) and takes its share of the window's rows:

* ``sharding="rows"`` (default): the window's rows, in file / row-group order, are cut into
  ``world_size`` contiguous ranges whose sizes differ by at most one row, so even a window with
  one row group splits. A rank reads only the row groups that overlap its range.
* ``sharding="row_groups"``: row group ``i`` of the window goes whole to rank ``i % world_size``
  (fewer partial reads; uneven when row groups are few or uneven).

Each row is read by exactly one rank. With ``shuffle=True`` the order of the rank's pieces and of
the rows inside each piece is permuted with a seed from ``(seed, epoch, window, rank)``.

Batches are the rank's row stream cut every ``batch_size`` rows (the last one of a window may be
short), so ``iter_window(w, skip_batches=k)`` starts exactly ``k * batch_size`` rows in, found
from row counts without decoding the skipped rows. The position itself belongs to the Trainer
(``TrainerState.window_index`` / ``batches_in_window``: *trained* micro-batches); this dataset's
``state_dict`` holds the epoch and a fingerprint of its configuration, so a resume with another
world size, seed, batch size or source fails loudly instead of reading other rows.

**At another world size** (an elastic job that lost or gained a node mid-window) the Trainer
passes the window's earlier parts (``Segment``: world size, batches per rank) to
``iter_window``. The rows each earlier rank consumed follow from that part's plan (its cut of the
rows, its shuffle) and its batch count, so the dataset replays the cuts and plans this rank's
share over exactly the rows no earlier rank consumed: every row of the window is trained once.
The batch count maps to rows by arithmetic (``batch_size`` rows per batch), except with
``on_nan_label="drop"`` or ``on_corrupt="skip"``, where a batch may stand for more rows: then the
earlier ranks' batches are read again (not trained) to count them, once per resume.

CSV files are read whole with ``pyarrow.csv`` when their window is planned (one "row group" per
file); use parquet for large data.

Where each part lives: this module holds the dataset (``ParquetWindowDataset``, its options and
``WindowStats``), reading and decoding (``WindowIterator``); ``recsys_trainer.data.parquet_plan``
plans a window (listing its units, sharding them into this rank's pieces);
``recsys_trainer.data.parquet_files`` holds the units and pieces, file access and the piece
arithmetic, without dataset state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.fs as pafs

from recsys_trainer import storage
from recsys_trainer.batch import Batch
from recsys_trainer.data.base import Segment, WindowedDataset
from recsys_trainer.data.columns import IdKindError, conform_id_kinds
from recsys_trainer.data.errors import DataError, _RowError
from recsys_trainer.data.parquet_files import (
    OpenFiles,
    Piece,
    Unit,
    concat_rows,
    rows_left,
    skip_rows,
)
from recsys_trainer.data.parquet_plan import WindowPlanner, shard_pieces, shuffle_rng, whole_units
from recsys_trainer.data.prefetch import BatchStream, Prefetcher
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.windows import Window, WindowSource, agreed_windows, describe_source
from recsys_trainer.validation import check_choice, check_int, check_type

logger = logging.getLogger("recsys_trainer.data")

_CHUNK_ROWS = 16384
"""Rows decoded at once (rounded to whole batches)."""

_READ_AHEAD_PIECES = 1
"""Pieces (row groups) read ahead of the one being decoded when prefetching is on."""


@dataclass
class WindowStats:
    """Counters of problems met so far (per dataset instance, this rank)."""

    corrupt_files_skipped: int = 0
    corrupt_rows_skipped: int = 0
    empty_windows: int = 0


@dataclass(kw_only=True)
class ParquetReadOptions:
    """How ``ParquetWindowDataset`` reads and batches its windows (its keyword arguments; also
    the fields of the CLI's ``data: kind: parquet`` section)."""

    batch_size: int = 512
    """Rows per batch (per rank)."""
    sharding: Literal["rows", "row_groups"] = "rows"
    """``"rows"`` (contiguous row ranges per rank) or ``"row_groups"`` (whole row groups)."""
    shuffle: bool = False
    """Permute rows within the window (per rank; seeded, reproducible)."""
    seed: int = 0
    """The shuffle seed (combined with the epoch and the window id)."""
    prefetch_batches: int = 4
    """Decoded batches read ahead on a background thread (0: no threads)."""
    on_corrupt: Literal["error", "skip"] = "error"
    """An unreadable file or row group: raise ``DataError``, or skip it (counted and logged).
    Storage that cannot be reached or is denied is always an error, never skipped."""
    file_format: Literal["auto", "parquet", "csv"] = "auto"
    """``"auto"`` (by extension), ``"parquet"`` or ``"csv"``."""

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size)
        check_choice("sharding", self.sharding, ("rows", "row_groups"))
        check_type("shuffle", self.shuffle, (bool,), "true or false")
        check_int("prefetch_batches", self.prefetch_batches, minimum=0)
        check_choice("on_corrupt", self.on_corrupt, ("error", "skip"))
        check_choice("file_format", self.file_format, ("auto", "parquet", "csv"))


class ParquetWindowDataset(WindowedDataset):
    """A windowed dataset over parquet or CSV files (see the module docstring).

    Args:
        windows: a partitioned root directory, a list of globs, a list of ``Window``, a callable
            returning windows, or ``StreamingWindows``.
        features: the ``FeatureSpec`` (label, dense and sparse columns).
        batch_size, sharding, shuffle, seed, prefetch_batches, on_corrupt, file_format: see
            ``ParquetReadOptions`` (validated there). ``prefetch_batches`` > 0 also reads the
            next row group on a second thread while decoding one; skipped files are counted in
            ``stats``.
        csv_convert_options: passed to ``pyarrow.csv.read_csv`` (e.g. column types).
        filesystem: a ``pyarrow.fs`` filesystem holding the windows (their root, globs and
            files are paths in it); default: each path's URL scheme and the environment select
            it (``recsys_trainer.storage.resolve``: local paths, ``s3://``, ``gs://``,
            ``hdfs://``, ``file://``, fsspec schemes).
    """

    features: FeatureSpec
    exact_reshard = True

    def __init__(
        self,
        windows: WindowSource,
        features: FeatureSpec,
        batch_size: int,
        *,
        sharding: Literal["rows", "row_groups"] = "rows",
        shuffle: bool = False,
        seed: int = 0,
        prefetch_batches: int = 4,
        on_corrupt: Literal["error", "skip"] = "error",
        file_format: Literal["auto", "parquet", "csv"] = "auto",
        csv_convert_options: pacsv.ConvertOptions | None = None,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        ParquetReadOptions(batch_size=batch_size, sharding=sharding, shuffle=shuffle, seed=seed,
                           prefetch_batches=prefetch_batches, on_corrupt=on_corrupt,
                           file_format=file_format)  # validates them
        self.windows = windows
        self.features = features
        self.batch_size = batch_size
        self.sharding = sharding
        self.shuffle = shuffle
        self.seed = seed
        self.prefetch_batches = prefetch_batches
        self.on_corrupt = on_corrupt
        self.file_format = file_format
        self.csv_convert_options = csv_convert_options
        self.filesystem = filesystem
        self.rank, self.world_size = 0, 1
        self.epoch = 0
        self.stats = WindowStats()
        self._columns = features.columns()
        self._id_columns = sorted({c for s in features.id_features for c in s.sources})
        self._known: dict[str, Window] = {}
        self._pending_state: dict[str, Any] | None = None
        self._id_kinds: dict[str, dict[str, str]] = {}
        """Per sparse id column: the kind of ids first read ("integer"/"string"), and the window
        and file it was first read from (saved in ``state_dict``)."""
        self._kinds_of: ParquetWindowDataset | None = None
        """The dataset whose ``_id_kinds`` this one reads and records into (``follow_id_kinds``);
        held as the dataset, not its dict, because a resume replaces that dict."""

    # ------------------------------------------------------------------ WindowedDataset

    def setup(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` must be in [0, {world_size}), but is {rank}.")
        self.rank, self.world_size = rank, world_size
        if self._pending_state is not None:
            self._check_fingerprint(self._pending_state)
            self._pending_state = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def window_ids(self) -> Iterator[str]:
        for w in agreed_windows(self.windows, self._gang, self.filesystem, stop=self._stop,
                                on_wait=self._on_wait):
            self._known[w.id] = w
            yield w.id

    def landed_at(self, window_id: str) -> float | None:
        """The modification time of the window's ready marker (``_SUCCESS``), from the listing
        that found it (``Window.landed_at``); None for a window listed without one (globs, a
        list of ``Window``) or not listed yet."""
        w = self._known.get(window_id)
        return w.landed_at if w is not None else None

    def iter_window(self, window_id: str, skip_batches: int = 0, *,
                    earlier: Sequence[Segment] = ()) -> WindowIterator:
        """This rank's batches of the window (with ``earlier``: of the rows the window's earlier
        parts left, see the module docstring). Errors found while planning it (an unreadable
        file, a mistyped column) are raised by the iterator's first ``next()``."""
        try:
            window = self._window(window_id)
            pieces, total = self._plan(window, earlier)
        except Exception as exc:  # noqa: BLE001 - raised by the iterator's first next()
            # Planning reads every file's footer: a file this rank cannot open fails here. The
            # error surfaces at the first fetch, inside the ranks' agreement on it, so every
            # rank stops with it instead of the others waiting for this one.
            return WindowIterator(self, [], 0, window_id, error=exc)
        replay = 0
        if skip_batches and self._batches_may_skip_rows():
            # Dropped rows (NaN labels) and skipped unreadable row groups can empty whole
            # batches, which are never yielded nor trained: batch k then starts after more than
            # k * batch_size rows, and only reading tells where. Re-read and discard k batches.
            replay, rows = skip_batches, total
        else:
            pieces, rows = skip_rows(pieces, skip_batches * self.batch_size)
        if total == 0:
            self.stats.empty_windows += 1
            # Not skipped: the window still takes its place (an eval window evaluates as 0 rows), so
            # train/eval pairs keep their ids.
            logger.warning("window %s has no rows (files: %d): it is read as 0 rows", window_id,
                           len(window.files))
        return WindowIterator(self, pieces, rows, window_id, discard=replay)

    def padding_batch(self) -> Batch | None:
        """An all-null row decoded through the spec (``FeatureSpec.padding_batch``): shapes a
        padding batch for a rank that has no eval data at all."""
        return self.features.padding_batch()

    def read_columns(self, window_id: str, columns: Sequence[str]) -> Iterator[pa.Table]:
        """This rank's share of the window's rows (the rows it trains on, unshuffled), raw and
        projected on ``columns``: what a vocabulary built from the data counts."""
        pieces, _ = self._plan(self._window(window_id))
        plain = [dataclasses.replace(p, shuffle_seed=None, skip=0) for p in pieces]
        for _, got in self._read_pieces(plain, columns=list(columns)):
            if got is not None:
                yield got[0]

    def follow_id_kinds(self, train: WindowedDataset | None) -> None:
        """Share ``train``'s record of id kinds (an eval or predict dataset: one kind per column
        across the run, whichever dataset reads the column first records it)."""
        self._kinds_of = train if isinstance(train, ParquetWindowDataset) and train is not self else None

    def _kinds(self) -> dict[str, dict[str, str]]:
        """The record of id kinds this dataset reads as: the followed dataset's, else its own."""
        return self._kinds_of._id_kinds if self._kinds_of is not None else self._id_kinds

    def load_resharded_state_dict(self, state: dict[str, Any], world_size: int) -> None:
        """Restore rank 0's state saved at ``world_size`` ranks: the epoch and the id kinds
        read so far (every rank plans every file, so they are the same on every rank); the
        configuration must match but for the world size and rank. The corrupt-data counters
        (``stats``) are per rank and start again at zero."""
        self.load_state_dict({**state, "stats": {}, "fingerprint": {
            **state["fingerprint"], "world_size": self.world_size, "rank": self.rank}})

    def state_dict(self) -> dict[str, Any]:
        return {"version": 2, "epoch": self.epoch, "fingerprint": self._fingerprint(),
                "stats": dict(vars(self.stats)), "id_kinds": {k: dict(v) for k, v in self._id_kinds.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"version", "epoch", "fingerprint", "stats"}
        if state.get("version") != 1:  # version 1 (older checkpoints) had no id_kinds
            expected.add("id_kinds")
        if set(state) != expected:
            raise ValueError(
                f"ParquetWindowDataset state keys differ: missing {sorted(expected - set(state))}, "
                f"unexpected {sorted(set(state) - expected)}."
            )
        self._check_fingerprint(state)
        self.epoch = int(state["epoch"])
        self.stats = WindowStats(**state["stats"])  # {} (a resharded resume): zeros
        self._id_kinds = {k: dict(v) for k, v in state.get("id_kinds", {}).items()}

    # ------------------------------------------------------------------ planning

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "source": describe_source(self.windows), "world_size": self.world_size,
            "rank": self.rank, "seed": self.seed, "batch_size": self.batch_size,
            "shuffle": self.shuffle, "sharding": self.sharding, "columns": list(self._columns),
        }

    def _check_fingerprint(self, state: dict[str, Any]) -> None:
        mine, saved = self._fingerprint(), dict(state["fingerprint"])
        diff = {k: (saved.get(k), mine.get(k)) for k in set(mine) | set(saved) if saved.get(k) != mine.get(k)}
        if diff:
            detail = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"cannot resume this dataset from a state saved with another configuration ({detail}); "
                "a resumed run must use the same seed, batch size, sharding and data to read every "
                "row exactly once (the world size may change: an elastic resume)."
            )

    def _window(self, window_id: str) -> Window:
        if window_id not in self._known:
            for _ in self.window_ids():
                if window_id in self._known:
                    break
        if window_id not in self._known:
            raise KeyError(f"unknown window {window_id!r}; window_ids() does not list it.")
        return self._known[window_id]

    def _batches_may_skip_rows(self) -> bool:
        """Whether a batch can stand for more than ``batch_size`` rows: dropped rows (NaN
        labels) and skipped unreadable row groups are consumed without being batched, so only
        reading tells where batch ``k`` starts."""
        return self.features.on_nan_label == "drop" or self.on_corrupt == "skip"

    def _rng(self, window_id: str, rank: int, part: int) -> np.random.Generator | None:
        return shuffle_rng(self.seed, self.epoch, window_id, rank, part) if self.shuffle else None

    def _plan(self, window: Window, earlier: Sequence[Segment] = ()) -> tuple[list[Piece], int]:
        """This rank's pieces of the window, in reading order, and their total rows. With
        ``earlier`` parts (an elastic resume), the rows they left: each part's cut is replayed
        for every rank it had, that rank's consumed rows taken off, and the rest cut again."""
        units = self._units(window)
        parts = whole_units(units)
        for i, segment in enumerate(earlier):
            left = []
            for r in range(segment.world_size):
                theirs = shard_pieces(parts, r, segment.world_size, self._sharding(i),
                                      self._rng(window.id, r, i))
                left.append(skip_rows(theirs, self._rows_consumed(theirs, segment.batches))[0])
            parts = rows_left(units, left)
        pieces = shard_pieces(parts, self.rank, self.world_size, self._sharding(len(earlier)),
                              self._rng(window.id, self.rank, len(earlier)))
        return pieces, sum(p.rows for p in pieces)

    def _sharding(self, part: int) -> Literal["rows", "row_groups"]:
        """How part ``part`` of a window is cut: as configured, but by rows after a change of
        world size. What earlier ranks left is a few half-read pieces beside whole ones; dealt
        whole (``"row_groups"``) they would give the new ranks very different row counts, and
        the ranks stop together when the first runs out, dropping the others' rest."""
        return self.sharding if part == 0 else "rows"

    def _rows_consumed(self, pieces: list[Piece], batches: int) -> int:
        """The rows of the piece stream ``pieces`` that its first ``batches`` batches consumed
        (counted by reading them again when a batch can stand for more rows)."""
        if not self._batches_may_skip_rows():
            return min(batches * self.batch_size, sum(p.rows for p in pieces))
        # Re-reading another rank's rows is not reading them: its problems were counted then.
        stats = dataclasses.replace(self.stats)
        consumed = 0
        # Closed by the with: its finally closes the open file and stops its read-ahead.
        with contextlib.closing(self._batches(pieces)) as read:
            for _, (_, rows) in zip(range(batches), read, strict=False):
                consumed += rows
        self.stats = stats
        return consumed

    def _units(self, window: Window) -> list[Unit]:
        """The window's readable units, in file order (``WindowPlanner.units``)."""
        planner = WindowPlanner(
            self.features, self._id_columns, file_format=self.file_format,
            on_corrupt=self.on_corrupt, csv_convert_options=self.csv_convert_options,
            filesystem=self.filesystem, kinds=self._kinds())
        try:
            return planner.units(window)
        finally:
            # Counted also when a later file of the window fails the planning.
            self.stats.corrupt_files_skipped += planner.files_skipped

    # ------------------------------------------------------------------ reading

    def _read_piece(self, piece: Piece, files: OpenFiles, use_threads: bool = True,
                    columns: list[str] | None = None) -> tuple[pa.Table, np.ndarray] | None:
        """The piece's rows (projected on ``columns``, default the spec's) and their row numbers
        in the unit (``use_threads``: decode the row group's columns on pyarrow's thread pool)."""
        u = piece.unit
        columns = self._columns if columns is None else columns
        try:
            if u.table is not None:
                table = u.table.select(columns)
            else:
                table = files.get(u.file, u.metadata).read_row_group(
                    u.row_group, columns=columns, use_threads=use_threads)
        except (OSError, pa.ArrowException) as exc:
            if self.on_corrupt == "skip" and not storage.is_access_failure(exc):
                self.stats.corrupt_rows_skipped += piece.rows
                logger.warning("skipping unreadable row group %d of %s (%s)", u.row_group, u.file, exc)
                return None
            raise DataError(
                f"cannot read the row group ({type(exc).__name__}: {exc}); fix or remove the file, "
                "or set on_corrupt='skip'.", file=u.file, row_group=u.row_group,
            ) from exc
        rows = piece.row_numbers()
        if piece.is_range:
            return self._as_first_kinds(table.slice(piece.start + piece.skip, piece.rows), u,
                                        rows), rows
        return self._as_first_kinds(table.take(pa.array(rows)), u, rows), rows

    def _as_first_kinds(self, table: pa.Table, unit: Unit, rows: np.ndarray) -> pa.Table:
        """Id columns of the other kind than first read (``_id_kinds``) converted to it
        losslessly, as the serving Scorer converts a request's (both by
        ``columns.conform_id_kinds``): integers written as strings (``str(int)``'s form) back to
        integers. Integer and string ids map to different rows, so anything else is a
        ``DataError`` naming the file, row and value; integers in a column first read as strings
        always are: ``str(int)`` cannot restore the leading zeros a reader dropped (pyarrow's CSV
        reader reads an all-digit "02134" as 2134)."""
        record = self._kinds()
        try:
            return conform_id_kinds(
                table, {c: first["kind"] for c, first in record.items() if c in self._id_columns})
        except IdKindError as exc:
            first, name, row = record[exc.column], exc.column, int(rows[exc.row])
            where = f"in window {first['window']!r} (file {first['file']})"
            if exc.want == "string":
                raise DataError(
                    f"the sparse id column holds integer ids (value {exc.value}), but held string "
                    f"ids {where}: an integer cannot be turned back into the string it was "
                    "read from (\"02134\" and \"2134\" are different ids, a CSV reader reads "
                    "both as 2134), so it is refused rather than trained as another id. Write "
                    "the ids as strings (for CSV set csv_convert_options.column_types = "
                    f"{{{name!r}: pa.string()}} so the column stays a string), or start a new "
                    "run, in a new output_dir, for integer ids.",
                    file=unit.file, row_group=unit.row_group, row=row, column=name) from None
            raise DataError(
                f"the sparse id column holds {exc.got} ids, but held {exc.want} ids {where}, "
                f"and value {exc.value} is no integer written as str(int) writes it (no '+', "
                "'-0', leading zeros or spaces): integer and string ids map to different rows. "
                "Write the column with one type in every window (or start a new run, in a new "
                "output_dir, for the new type).",
                file=unit.file, row_group=unit.row_group, row=row, column=name) from None

    def _read_pieces(self, pieces: list[Piece], use_threads: bool = True,
                     columns: list[str] | None = None) -> Iterator[
            tuple[Piece, tuple[pa.Table, np.ndarray] | None]]:
        """Each piece with its rows (``_read_piece``), reusing the open file between pieces."""
        files = OpenFiles(self.filesystem)
        try:
            for piece in pieces:
                yield piece, self._read_piece(piece, files, use_threads, columns)
        finally:
            files.close()

    def _batches(self, pieces: list[Piece]) -> Generator[tuple[Batch, int], None, None]:
        """(batch, source rows it consumed) for the pieces, cut every ``batch_size`` rows.

        Rows are decoded in chunks of whole batches (about ``_CHUNK_ROWS`` rows): one decode per
        chunk amortises the per-feature overhead; the chunk is then cut into batches. With
        prefetching on, the next piece is read on another thread while this one is decoded
        (parquet decoding and numpy both release the GIL, so the two overlap on two cores). That
        thread reads each row group's columns one after another: on pyarrow's thread pool as
        well, the read competes with the decoding for the cores and costs more CPU in all
        (measured: the whole reader 0.40x -> 0.45x raw ``read_table``, 2 cores).
        """
        bs = self.batch_size
        chunk = bs * max(1, _CHUNK_ROWS // bs)
        parts: list[pa.Table] = []
        prov: list[tuple[Unit, np.ndarray]] = []
        n = 0
        carried = 0  # source rows consumed without a batch before this chunk
        skipped: list[tuple[int, int]] = []  # this chunk's unreadable pieces: (at row, rows)
        reader: Prefetcher[tuple[Piece, tuple[pa.Table, np.ndarray] | None]] | None = None
        read: Iterator[tuple[Piece, tuple[pa.Table, np.ndarray] | None]]
        if self.prefetch_batches > 0 and len(pieces) > 1:
            read = reader = Prefetcher(lambda: self._read_pieces(pieces, use_threads=False),
                                       _READ_AHEAD_PIECES, name="read-ahead")
        else:
            read = self._read_pieces(pieces)
        try:
            for piece, got in read:
                if got is None:
                    # Counted with the batch that holds the chunk's next row (an elastic
                    # remap sums batches' rows to find where a rank's reading stopped).
                    skipped.append((n, piece.rows))
                    continue
                table, rows = got
                off = 0
                while off < table.num_rows:
                    take = min(chunk - n, table.num_rows - off)
                    parts.append(table.slice(off, take))
                    prov.append((piece.unit, rows[off:off + take]))
                    n += take
                    off += take
                    if n == chunk:
                        carried = yield from self._decode(parts, prov, n, carried, skipped)
                        parts, prov, n, skipped = [], [], 0, []
            yield from self._decode(parts, prov, n, carried, skipped)
        finally:
            if reader is not None:
                reader.close()

    def _decode(self, parts: list[pa.Table], prov: list[tuple[Unit, np.ndarray]],
                n: int, carried: int = 0, skipped: Sequence[tuple[int, int]] = (),
                ) -> Generator[tuple[Batch, int], None, int]:
        """Yield the chunk's batches, each with the source rows it consumed: its own (dropped
        ones included), ``carried`` (rows consumed before the chunk) for the first, and the
        rows of the unreadable pieces ``skipped`` met just before one of its rows (``(row of
        the chunk, rows)``). Return the rows consumed since the last batch yielded (this
        chunk's all-dropped batches and unreadable pieces at its end)."""
        if n == 0:
            return carried + sum(rows for _, rows in skipped)
        table = parts[0] if len(parts) == 1 else concat_rows(
            self.features.unify_columns(parts), [unit.file for unit, _ in prov])
        try:
            decoded = self.features.decode_chunk(table, self.batch_size)
        except _RowError as exc:
            row = exc.row or 0
            for unit, rows in prov:
                if row < len(rows):
                    raise DataError(exc.detail, file=unit.file, row_group=unit.row_group,
                                    row=int(rows[row]), column=exc.column) from None
                row -= len(rows)
            raise
        # Rows of all-dropped batches (on_nan_label="drop") still count as consumed.
        for lo in range(0, n, self.batch_size):
            hi = min(n, lo + self.batch_size)
            carried += sum(rows for at, rows in skipped if lo <= at < hi)
            batch = decoded.batch(lo, hi)
            if batch.batch_size > 0:
                yield batch, hi - lo + carried
                carried = 0
            else:
                carried += hi - lo
        return carried + sum(rows for at, rows in skipped if at >= n)


def _discard(batches: Iterator[tuple[Batch, int]], k: int) -> Iterator[tuple[Batch, int]]:
    """``batches`` without the first ``k`` (their rows are added to the next one's count)."""
    skipped = 0
    try:
        for i, (batch, rows) in enumerate(batches):
            if i < k:
                skipped += rows
                continue
            yield batch, rows + skipped
            skipped = 0
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


class WindowIterator(BatchStream):
    """This rank's batches of one window; reading runs ahead on a bounded background thread
    (``BatchStream``: ``rows_remaining()``, ``close()``). An error met while planning the window
    is raised by the first ``next()``."""

    def __init__(self, ds: ParquetWindowDataset, pieces: list[Piece], rows: int, window_id: str,
                 discard: int = 0, error: Exception | None = None) -> None:
        self.window_id = window_id
        self._error = error
        make = lambda: _discard(ds._batches(pieces), discard) if discard else ds._batches(pieces)  # noqa: E731
        super().__init__(make, rows, ds.prefetch_batches if rows > 0 else 0,
                         name=f"read-{window_id}")

    def __next__(self) -> Batch:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return super().__next__()
