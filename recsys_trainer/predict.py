"""Offline scoring: the model's outputs for every row of a windowed dataset, as parquet.

``Trainer.predict(dataset, output_dir)`` calls ``predict`` here. Per window, every rank writes
its rows to its own file and rank 0 commits the window with a marker written last::

    output_dir/<window id>/part-00000-of-00002.parquet   rank 0's rows: passthrough columns, then
    output_dir/<window id>/part-00001-of-00002.parquet   one float32 column per output (task)
    output_dir/<window id>/_SUCCESS                       JSON: the files and their row counts

A window counts as scored only when its ``_SUCCESS`` exists, and then only the files it lists
(``read_predictions`` reads exactly those). A re-run skips committed windows without reading
them, and redoes the others from scratch: rank 0 first deletes what an interrupted attempt left
in the window's directory, so no row is written twice. Every write goes through
``storage.resolve`` and ``pyarrow.fs``: ``output_dir`` may be any URL ``resolve`` maps (a plain
path, ``file://``, ``s3://``, ...); nothing relies on a rename, which object stores lack.

Ranks out of data pad with zero-weight batches until every rank is done (as evaluation does):
a sharded model's forward runs collectives, so every rank must run the same number of forwards.
Padding batches are not written. A write that fails on one rank (a full disk, a denied bucket)
asks every rank to stop at the next fetch, and every rank raises naming that rank's error.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from recsys_trainer.batch import Batch
from recsys_trainer.data.base import WindowedDataset
from recsys_trainer.data.batch_check import BatchCheck
from recsys_trainer.data.sync import SyncedIterator
from recsys_trainer.distributed import Gang
from recsys_trainer.storage import Location, resolve, storage_error, write_bytes
from recsys_trainer.validation import check_choice, check_int, check_type

logger = logging.getLogger("recsys_trainer")

MARKER = "_SUCCESS"
"""The commit marker of a scored window (written last, by rank 0)."""

Activation = Literal["sigmoid", "none"]

_ROWS_PER_ROW_GROUP = 65536
"""Scored rows buffered per rank before a parquet row group is written (batches are small)."""


@dataclass(kw_only=True)
class PredictOptions:
    """What ``Trainer.predict`` writes and where (also the CLI's ``predict:`` section)."""

    output_dir: str
    """Where the scored windows go: a path or a URL (``s3://bucket/scores``); created if absent.
    Keep it apart from the checkpoints' ``args.output_dir``."""
    activation: Activation = "sigmoid"
    """Applied to the model's outputs before they are written. ``"sigmoid"``: the outputs are
    logits (the bundled models' are) and probabilities are written; ``"none"``: written as the
    model returns them (a model that returns probabilities already, or a regression)."""
    output_names: Sequence[str] | None = None
    """Names of the output columns, one per task. None: the dataset's label columns when their
    number matches the outputs' (``click``, ``like``), else ``score`` (one output) or
    ``score_0``, ``score_1``, ...; a model that returns a mapping of outputs names them itself."""
    rows_per_row_group: int = _ROWS_PER_ROW_GROUP
    """Rows each rank buffers before writing a parquet row group."""

    def __post_init__(self) -> None:
        check_type("output_dir", self.output_dir, (str,), "a path or URL")
        if not self.output_dir:
            raise ValueError("`output_dir` must be a path or URL, but is ''.")
        check_choice("activation", self.activation, ("sigmoid", "none"))
        if self.output_names is not None:
            names = self.output_names
            if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"`output_names` must be None or a list of column names, but is {names!r}.")
            if len(set(names)) != len(names):
                raise ValueError(f"`output_names` must be unique, but is {list(names)!r}.")
            self.output_names = list(names)
        check_int("rows_per_row_group", self.rows_per_row_group)


@dataclass
class PredictSummary:
    """What ``predict`` did (the same on every rank, but for ``seconds``)."""

    windows_written: list[str] = field(default_factory=list)
    windows_skipped: list[str] = field(default_factory=list)
    """Windows already committed by an earlier run (not read again)."""
    rows_written: int = 0
    """Rows written in this run, all ranks together."""
    seconds: float = 0.0
    """Wall time of this rank's ``predict`` call."""


Forward = Callable[[Batch], tuple[torch.Tensor, Any]]


def predict(forward: Forward, dataset: WindowedDataset, gang: Gang, device: torch.device,
            options: PredictOptions, filesystem: pafs.FileSystem | None = None, *,
            max_windows: int | None = None, max_batches: int | None = None,
            batch_check: BatchCheck | None = None) -> PredictSummary:
    """Score every window of ``dataset`` into ``options.output_dir``; all ranks call this.

    ``forward(batch)`` returns ``(loss, outputs)`` under ``torch.no_grad`` (the Trainer's
    forward: autocast included). ``dataset`` is set up for this rank. ``max_windows`` and
    ``max_batches`` (per window, per rank) cut the run short: the test mode's ``predict`` phase.
    ``batch_check`` checks batches that no ``FeatureSpec`` decoded against the model's tables.
    """
    t0 = time.perf_counter()
    root = resolve(options.output_dir, filesystem)
    summary = PredictSummary()
    for window_id in itertools.islice(dataset.window_ids(), max_windows):
        out = root.join(*window_dir(window_id))
        if _committed(out, gang):
            summary.windows_skipped.append(window_id)
            continue
        _clear(out, gang)
        result = _score_window(forward, dataset, window_id, gang, device, out, options, max_batches,
                               batch_check)
        summary.rows_written += _commit(out, window_id, result, gang)
        summary.windows_written.append(window_id)
    summary.seconds = time.perf_counter() - t0
    if gang.rank == 0:
        logger.info("predict: %d rows in %d window(s) written to %s in %.1f s (%d window(s) "
                    "already committed, skipped)", summary.rows_written,
                    len(summary.windows_written), root.url, summary.seconds,
                    len(summary.windows_skipped))
    return summary


def window_dir(window_id: str) -> list[str]:
    """The path segments under ``output_dir`` of a window's files: its id's ``/``-separated
    parts (``dt=2019-11-24/hour=05`` stays a partitioned layout), each percent-encoded where it
    is not a plain name (glob ids, leading ``_`` or ``.`` that readers would hide)."""
    parts = [p for p in window_id.split("/") if p]
    if not parts:
        raise ValueError(f"window id {window_id!r} names no directory.")
    out = []
    for p in parts:
        q = quote(p, safe="=-_.,+")
        if q[0] in "_.":
            q = f"%{ord(q[0]):02X}{q[1:]}"
        out.append(q)
    return out


def part_name(rank: int, world_size: int) -> str:
    return f"part-{rank:05d}-of-{world_size:05d}.parquet"


# ---------------------------------------------------------------------- per window


def _on_rank_zero(gang: Gang, action: Callable[[], Any], verb: str, url: str, note: str = "") -> Any:
    """``action()`` on rank 0, its result on every rank; a storage error is raised on every rank
    (the others would otherwise wait in the next collective for a rank that is gone), worded
    by ``storage.storage_error`` (``cannot {verb} {url}: ...``, with its advice for a denied,
    missing or unreachable store), then ``note``."""
    result, error = None, None
    if gang.rank == 0:
        try:
            result = action()
        except (OSError, pa.ArrowException) as exc:
            error = f"rank 0 {storage_error(exc, url, verb)}{note}"
    result, error = gang.broadcast_object((result, error))
    if error is not None:
        raise OSError(f"predict: {error}")
    return result


def _committed(out: Location, gang: Gang) -> bool:
    """Whether the window's marker exists, as rank 0 sees it (one listing, so ranks agree)."""
    marker = out.join(MARKER)
    return bool(_on_rank_zero(
        gang, lambda: out.filesystem.get_file_info(marker.path).type == pafs.FileType.File,
        "look for", marker.url))


def _clear(out: Location, gang: Gang) -> None:
    """Rank 0 deletes an interrupted attempt's files (another world size may have written other
    part names) and creates the directory; the others wait, then write into it."""
    def clear() -> None:
        out.filesystem.create_dir(out.path, recursive=True)
        out.filesystem.delete_dir_contents(out.path, missing_dir_ok=True)

    _on_rank_zero(gang, clear, "prepare the output directory", out.url)


@dataclass
class _PartResult:
    file: str | None
    rows: int
    error: str | None


def _score_window(forward: Forward, dataset: WindowedDataset, window_id: str, gang: Gang,
                  device: torch.device, out: Location, options: PredictOptions,
                  max_batches: int | None = None,
                  batch_check: BatchCheck | None = None) -> _PartResult:
    """Score this rank's rows of one window (at most ``max_batches`` forwards) into its part
    file."""
    names = _default_names(dataset, options)
    writer = _PartWriter(out.join(part_name(gang.rank, gang.world_size)), options, names)
    batches = (dataset.iter_window(window_id) if batch_check is None
               else batch_check.batches(dataset, window_id))
    it = SyncedIterator(batches, gang, pad=True,
                        padding_batch=dataset.padding_batch,
                        local_flags=lambda: (writer.error is not None, False))
    try:
        for n, raw in enumerate(it, 1):
            _, outputs = forward(raw.to(device, non_blocking=True))
            if not it.last_was_padding:
                writer.write(raw, outputs)
            if max_batches is not None and n >= max_batches:
                break  # every rank at the same forward: they advance in lockstep
    finally:
        it.close()
        writer.close()
    return _PartResult(writer.file_name, writer.rows, writer.error)


def _commit(out: Location, window_id: str, mine: _PartResult, gang: Gang) -> int:
    """Gather every rank's file; rank 0 writes the marker, last. Returns the window's rows."""
    parts: list[_PartResult] = gang.all_gather_object(mine)
    failed = [(r, p.error) for r, p in enumerate(parts) if p.error is not None]
    if failed:
        rank, what = failed[0]
        raise OSError(f"predict: rank {rank} could not write its rows of window {window_id!r} to "
                      f"{out.url}: {what}. The window is not committed; a re-run redoes it.")
    total = sum(p.rows for p in parts)
    marker = {"window": window_id, "world_size": gang.world_size, "rows": total,
              "files": [{"name": p.file, "rows": p.rows} for p in parts if p.file is not None]}

    def write_marker() -> None:  # whole or not at all: the marker is the window's commit
        write_bytes(out.join(MARKER), json.dumps(marker, indent=1).encode())

    _on_rank_zero(gang, write_marker, "write", out.join(MARKER).url,
                  " (the window is not committed; a re-run redoes it)")
    return total


# ---------------------------------------------------------------------- outputs -> columns


def _default_names(dataset: WindowedDataset, options: PredictOptions) -> list[str] | None:
    if options.output_names is not None:
        return list(options.output_names)
    spec = dataset.features
    return list(spec.labels) if spec is not None else None


def output_columns(outputs: Any, names: Sequence[str] | None, activation: Activation,
                   num_rows: int) -> dict[str, np.ndarray]:
    """The model's outputs for a batch as ``{column: float32 [B]}``.

    ``outputs`` is a tensor ``[B]`` or ``[B, T]``, or a mapping of names to ``[B]`` tensors.
    ``names`` (one per task) names a tensor's columns when its count matches; otherwise
    ``score`` / ``score_<t>`` (a mapping keeps its own keys).
    """
    if outputs is None:
        raise ValueError("the model's forward returned only the loss; to predict it must return "
                         "(loss, outputs), e.g. (loss, logits).")
    if isinstance(outputs, Mapping):
        cols = {str(k): _column(v, num_rows, f"outputs[{k!r}]") for k, v in outputs.items()}
    elif isinstance(outputs, torch.Tensor):
        t = outputs.detach()
        if t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1):
            values = [t.reshape(-1)]
        elif t.dim() == 2:
            values = list(t.unbind(1))
        else:
            raise ValueError(f"the model's outputs must be [B] or [B, T] per batch, but have shape "
                             f"{tuple(t.shape)}.")
        if names is not None and len(names) == len(values):
            keys = list(names)
        elif len(values) == 1:
            keys = ["score"]
        else:
            keys = [f"score_{i}" for i in range(len(values))]
        cols = {k: _column(v, num_rows, k) for k, v in zip(keys, values, strict=True)}
    else:
        raise TypeError(f"the model's outputs must be a tensor or a mapping of tensors to predict, "
                        f"but are {type(outputs).__name__}.")
    if activation == "sigmoid":
        cols = {k: _sigmoid(v) for k, v in cols.items()}
    return cols


def _column(t: Any, num_rows: int, what: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor) or t.reshape(-1).shape[0] != num_rows:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what} must be a tensor of one value per row ({num_rows}), but is {shape}.")
    return t.detach().reshape(-1).float().cpu().numpy()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(torch.sigmoid(torch.from_numpy(x)).numpy(), dtype=np.float32)


class _PartWriter:
    """One rank's parquet file of one window, written through ``pyarrow.fs`` as rows arrive.

    Opened at the first real row (a rank with no rows writes no file). Any failure is kept in
    ``error`` instead of raised: the rank keeps taking part in the ranks' agreement, asks them to
    stop, and every rank raises it at the commit.
    """

    def __init__(self, location: Location, options: PredictOptions, names: list[str] | None) -> None:
        self.location = location
        self.options = options
        self.names = names
        self.rows = 0
        self.error: str | None = None
        self.file_name: str | None = None
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self._stream: Any = None
        self._writer: pq.ParquetWriter | None = None

    def write(self, batch: Batch, outputs: Any) -> None:
        if self.error is not None:
            return
        try:
            scores = output_columns(outputs, self.names, self.options.activation, batch.batch_size)
            clash = sorted(set(scores) & set(batch.passthrough))
            if clash:
                raise ValueError(
                    f"output column(s) {clash} clash with passthrough column(s) of the same name; "
                    "name the outputs otherwise (predict(output_names=[...]), e.g. ['p_click'])")
            table = pa.table({**{c: _as_array(v, c, batch.batch_size)
                                 for c, v in batch.passthrough.items()}, **scores})
            self._buffer.append(table)
            self._buffered += table.num_rows
            self.rows += table.num_rows
            if self._buffered >= self.options.rows_per_row_group:
                self._flush()
        except Exception as exc:  # noqa: BLE001 - reported through the ranks' commit
            self.error = f"{type(exc).__name__}: {exc}"

    def _flush(self) -> None:
        if not self._buffer:
            return
        table = pa.concat_tables(self._buffer, promote_options="permissive")
        self._buffer, self._buffered = [], 0
        if self._writer is None:
            self._stream = self.location.filesystem.open_output_stream(self.location.path)
            self._writer = pq.ParquetWriter(self._stream, table.schema)
            self.file_name = self.location.path.rsplit("/", 1)[-1]
        elif not table.schema.equals(self._writer.schema):
            table = table.cast(self._writer.schema)  # e.g. int32 ids in one file, int64 in the next
        self._writer.write_table(table)

    def close(self) -> None:
        """Write what is buffered and close the file (on an error: close what is open)."""
        try:
            if self.error is None:
                self._flush()
        except Exception as exc:  # noqa: BLE001 - reported through the ranks' commit
            self.error = f"{type(exc).__name__}: {exc}"
        for closing in (self._writer, self._stream):
            if closing is None:
                continue
            try:
                closing.close()
            except Exception as exc:  # noqa: BLE001 - a failed close leaves an incomplete file
                self.error = self.error or f"{type(exc).__name__}: {exc}"
        self._writer = self._stream = None


def _as_array(values: Any, column: str, num_rows: int) -> pa.Array | pa.ChunkedArray:
    arr = values if isinstance(values, pa.Array | pa.ChunkedArray) else pa.array(values)
    if len(arr) != num_rows:
        raise ValueError(f"passthrough column {column!r} has {len(arr)} values for a batch of "
                         f"{num_rows} rows.")
    return arr


# ---------------------------------------------------------------------- reading back


def committed_windows(output_dir: str, filesystem: pafs.FileSystem | None = None) -> dict[str, dict[str, Any]]:
    """``{window id: marker}`` for every committed window under ``output_dir``."""
    root = resolve(output_dir, filesystem)
    selector = pafs.FileSelector(root.path, recursive=True, allow_not_found=True)
    markers = [i for i in root.filesystem.get_file_info(selector)
               if i.type == pafs.FileType.File and i.base_name == MARKER]
    out: dict[str, dict[str, Any]] = {}
    for info in sorted(markers, key=lambda i: i.path):
        with root.filesystem.open_input_stream(info.path) as f:
            marker = json.loads(f.read())
        marker["dir"] = info.path.rsplit("/", 1)[0]
        out[marker["window"]] = marker
    return out


def read_predictions(output_dir: str, filesystem: pafs.FileSystem | None = None) -> pa.Table:
    """Every committed window's rows (only the files their markers list), with a ``window``
    column first. Uncommitted windows (an interrupted run) are left out."""
    root = resolve(output_dir, filesystem)
    tables = []
    for window_id, marker in committed_windows(output_dir, filesystem).items():
        for f in marker["files"]:
            t = pq.read_table(f"{marker['dir']}/{f['name']}", filesystem=root.filesystem)
            tables.append(t.add_column(0, "window", pa.array([window_id] * t.num_rows, pa.string())))
    if not tables:
        return pa.table({"window": pa.array([], pa.string())})
    return pa.concat_tables(tables, promote_options="permissive")


__all__ = ["MARKER", "PredictOptions", "PredictSummary", "committed_windows", "output_columns",
           "part_name", "predict", "read_predictions", "window_dir"]
