"""Land a Criteo-schema click stream: a new hourly window every few seconds, with a planted
effect that changes over time (online learning's test bed).

    python -m recsys_trainer.data.generators.stream_writer --out /tmp/stream --every-s 10 --windows 0
    python -m recsys_trainer.data.generators.stream_writer --out s3://bucket/stream --windows 12 --shift-at 4

Window ``w`` (0-based) is ``OUT/dt=YYYY-MM-DD/hour=HH/`` (``--start`` plus ``w`` hours), landed
at ``w * every_s`` seconds after the writer starts: its parquet file (the
``recsys_trainer.data.generators.criteo_synthetic`` schema and signal), then its
``_signal.json`` (the window's planted truth), then ``_SUCCESS``, last (what ``StreamingWindows`` /
``partitioned_windows(ready_marker="_SUCCESS")`` wait for). After ``--windows N`` windows it
writes ``OUT/_END`` (the end marker a streaming job stops at) and exits; ``--windows 0`` lands
windows until it is stopped.

The planted change: from window ``--shift-at K`` on, one categorical value (``--shift-column``,
by default ``C10``'s third most frequent value, in about 5% of the rows) gains
``--shift-strength`` (default 2.5) on its hidden click logit: an item that suddenly becomes
strongly clicked. A model that keeps training learns it within a window or two; a frozen one
does not. Everything else is the stationary ``criteo_synthetic`` signal.

Deterministic per ``--seed``: window ``w`` is drawn from its own generator (``[seed, w]``), so a
writer restarted on the same ``OUT`` skips the windows that have ``_SUCCESS`` and lands the
rest exactly as an uninterrupted one would. ``OUT/_signal.json`` describes the stream (the
shifted column and value, so a request can probe them) and is rewritten after every window with
the list of windows landed so far.

``OUT`` is a local directory or a URL (``s3://bucket/prefix``; credentials and endpoint from the
environment, as ``recsys_trainer.storage`` resolves them). Locally each file is written to a
temporary name and renamed; on object storage each object appears whole when its upload ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from recsys_trainer import storage
from recsys_trainer.data.generators.criteo_synthetic import (
    DENSE_COLUMNS,
    SPARSE_COLUMNS,
    CriteoSignal,
    criteo_features,
    generate_hour,
)
from recsys_trainer.data.generators.generated import SIGNAL_FILE, write_whole
from recsys_trainer.data.inputs import DenseFeature
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.windows import (
    SUCCESS_MARKER,
    StreamingWindows,
    Window,
    partitioned_windows,
)
from recsys_trainer.metrics import weighted_auc

log = logging.getLogger(__name__)

END_MARKER = "_END"
"""Written at the stream's root after its last window (``--windows N``)."""

DEFAULT_START = dt.datetime(2026, 11, 20)


@dataclass(frozen=True)
class StreamConfig:
    """What the writer lands; see the module docstring."""

    rows_per_window: int = 10_000
    seed: int = 0
    signal_seed: int = 2024
    shift_at: int = 3
    """The first window (0-based) with the changed effect; < 0: never."""
    shift_column: str = "C10"
    shift_rank: int = 2
    """Which value of ``shift_column`` changes: its popularity rank (0: the most frequent)."""
    shift_strength: float = 2.5
    """Added to that value's hidden click logit from window ``shift_at`` on."""
    start: dt.datetime = DEFAULT_START
    row_group_size: int = 8192

    def __post_init__(self) -> None:
        if self.rows_per_window < 1:
            raise ValueError(f"`rows_per_window` must be >= 1, but is {self.rows_per_window}.")
        if self.shift_column not in SPARSE_COLUMNS:
            raise ValueError(f"`shift_column` must be one of C1..C26, not {self.shift_column!r}.")
        if self.shift_rank < 0:
            raise ValueError(f"`shift_rank` must be >= 0, but is {self.shift_rank}.")


class StreamWriter:
    """Generates and lands the stream's windows (``land(w)``, or ``run()`` on a clock)."""

    def __init__(self, out: str, config: StreamConfig | None = None, *,
                 filesystem: pafs.FileSystem | None = None) -> None:
        self.out = out
        self.config = config or StreamConfig()
        self.root = storage.resolve(out, filesystem)
        self.signal = CriteoSignal.make(self.config.signal_seed)
        c = SPARSE_COLUMNS.index(self.config.shift_column)
        vocab = self.signal.vocab[c]
        self._col = c
        self._index = self.config.shift_rank % len(vocab)  # Zipf rank r is index r
        self.shift_value = str(vocab[self._index])
        scores = [s.copy() for s in self.signal.scores]
        scores[c][self._index] += np.float32(self.config.shift_strength)
        self._shifted = dataclasses.replace(self.signal, scores=scores)
        self.landed: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ naming

    def window_id(self, w: int) -> str:
        t = self.config.start + dt.timedelta(hours=w)
        return f"dt={t:%Y-%m-%d}/hour={t:%H}"

    def shifted(self, w: int) -> bool:
        return 0 <= self.config.shift_at <= w

    def is_landed(self, w: int) -> bool:
        return self._info(self.root.join(*self.window_id(w).split("/"), SUCCESS_MARKER)) \
            == pafs.FileType.File

    def _info(self, loc: storage.Location) -> pafs.FileType:
        return storage.file_info(loc).type

    # ------------------------------------------------------------------ generating

    def generate(self, w: int) -> tuple[pa.Table, dict[str, Any]]:
        """Window ``w``'s rows and its planted truth (deterministic in ``seed`` and ``w``)."""
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, w])
        signal = self._shifted if self.shifted(w) else self.signal
        table, probs = generate_hour(signal, cfg.rows_per_window, rng,
                                     first_row_id=w * cfg.rows_per_window)
        p, y = probs["label"], table.column("label").to_numpy()
        hit = table.column(cfg.shift_column).to_numpy(zero_copy_only=False) == self.shift_value
        truth = {
            "window": self.window_id(w), "index": w, "rows": cfg.rows_per_window,
            "shifted": self.shifted(w), "ctr": float(y.mean()),
            "oracle_auc": weighted_auc(torch.from_numpy(p), torch.from_numpy(y.copy()),
                                       torch.ones(len(y))),
            "shift_rows": int(hit.sum()),
            "shift_ctr": float(y[hit].mean()) if hit.any() else None,
            "other_ctr": float(y[~hit].mean()) if (~hit).any() else None,
        }
        return table, truth

    # ------------------------------------------------------------------ landing

    def describe(self) -> dict[str, Any]:
        """The stream's ``_signal.json`` (without the landed windows)."""
        cfg = self.config
        return {"rows_per_window": cfg.rows_per_window, "seed": cfg.seed,
                "signal_seed": cfg.signal_seed, "start": cfg.start.isoformat(),
                "shift": {"at": cfg.shift_at, "column": cfg.shift_column,
                          "value": self.shift_value, "rank": cfg.shift_rank,
                          "strength": cfg.shift_strength,
                          "first_window": self.window_id(cfg.shift_at)
                          if cfg.shift_at >= 0 else None}}

    def land(self, w: int) -> dict[str, Any]:
        """Write window ``w``: the parquet file, its ``_signal.json``, ``_SUCCESS`` last. Returns
        its truth (with ``landed_at``, the unix time ``_SUCCESS`` was written)."""
        table, truth = self.generate(w)
        part = self.root.join(*self.window_id(w).split("/"))
        if self.root.is_local:
            Path(part.path).mkdir(parents=True, exist_ok=True)
            write_whole(Path(part.path) / "part-0.parquet", table, self.config.row_group_size)
        else:
            with storage.errors_named(part.url, "write"):
                pq.write_table(table, part.join("part-0.parquet").path,
                               filesystem=part.filesystem,
                               row_group_size=self.config.row_group_size)
        self._put(part.join(SIGNAL_FILE), json.dumps(truth, indent=1).encode())
        truth["landed_at"] = time.time()
        self._put(part.join(SUCCESS_MARKER), b"")
        self.landed.append(truth)
        self._put(self.root.join(SIGNAL_FILE),
                  json.dumps({**self.describe(), "windows": self.landed}, indent=1).encode())
        log.info("landed window %d (%s): %d rows, ctr %.3f%s", w, truth["window"], truth["rows"],
                 truth["ctr"], f", shifted value ctr {truth['shift_ctr']:.3f}"
                 if truth["shifted"] and truth["shift_ctr"] is not None else "")
        return truth

    def _landed_before(self, n: int) -> list[dict[str, Any]]:
        """The truths of windows ``0..n-1`` from the root ``_signal.json`` a previous writer
        left (regenerated where it lacks them)."""
        try:
            with storage.open_input_stream(self.root.join(SIGNAL_FILE)) as f:
                old = json.loads(f.read())
            if {k: v for k, v in old.items() if k != "windows"} == self.describe():
                kept = [t for t in old.get("windows", []) if t.get("index", n) < n]
                if [t["index"] for t in kept] == list(range(n)):
                    return kept
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return [self.generate(i)[1] for i in range(n)]

    def end(self) -> None:
        """Write the end marker (``OUT/_END``)."""
        self._put(self.root.join(END_MARKER), b"")

    def _put(self, loc: storage.Location, data: bytes) -> None:
        with storage.errors_named(loc.url, "write"):
            storage.make_dir(storage.parent(loc))
            storage.write_bytes(loc, data, durable=False)

    def run(self, windows: int, every_s: float, *,
            sleep: Any = time.sleep, clock: Any = time.monotonic) -> Iterator[dict[str, Any]]:
        """Land windows ``0..windows-1`` (``windows=0``: forever), window ``w`` at ``w * every_s``
        seconds after the first one not yet landed (already landed windows are skipped, not
        rewritten); then the end marker. Yields each window's truth as it lands."""
        if windows < 0 or every_s < 0:
            raise ValueError(f"`windows` and `every_s` must be >= 0, but are {windows}, {every_s}.")
        w = 0
        while (windows == 0 or w < windows) and self.is_landed(w):
            w += 1
        if w:
            self.landed = self._landed_before(w)
            log.info("windows 0..%d are landed already; continuing at window %d", w - 1, w)
        t0, first = clock(), w
        while windows == 0 or w < windows:
            wait = t0 + (w - first) * every_s - clock()
            if wait > 0:
                sleep(wait)
            yield self.land(w)
            w += 1
        self.end()


# ---------------------------------------------------------------------- the reading side


def stream_windows(root: str, *, poll_interval_s: float = 1.0, timeout_s: float = 600.0,
                   filesystem: pafs.FileSystem | None = None) -> StreamingWindows:
    """The stream at ``root`` as ``StreamingWindows``: a window once its ``_SUCCESS`` exists,
    the end at ``root/_END``. A root that does not exist yet (the writer has not started) has
    no windows yet."""

    def discover() -> list[Window]:
        try:
            return partitioned_windows(root, ready_marker=SUCCESS_MARKER, filesystem=filesystem)
        except FileNotFoundError:
            return []

    end = storage.resolve(root, filesystem).join(END_MARKER).url
    return StreamingWindows(discover, end_marker=end, poll_interval_s=poll_interval_s,
                            timeout_s=timeout_s, filesystem=filesystem)


def stream_features(num_embeddings: int = 20_000) -> FeatureSpec:
    """The stream's ``FeatureSpec``: ``criteo_features`` with ``log1p`` of the counts."""
    base = criteo_features(num_embeddings)
    return FeatureSpec(labels=base.labels, sparse=base.sparse,
                       dense=[DenseFeature(column=c, log1p=True) for c in DENSE_COLUMNS])


def stream_dataset(root: str, *, batch_size: int = 512, num_embeddings: int = 20_000,
                   poll_interval_s: float = 1.0, timeout_s: float = 600.0,
                   **options: Any) -> Any:
    """A ``ParquetWindowDataset`` over the stream at ``root`` (``stream_windows``,
    ``stream_features``); ``options``: the dataset's other keyword arguments. The YAML form:
    ``data: {class: recsys_trainer.data.generators.stream_writer.stream_dataset, root: ...}``."""
    from recsys_trainer.data.parquet import ParquetWindowDataset

    return ParquetWindowDataset(
        stream_windows(root, poll_interval_s=poll_interval_s, timeout_s=timeout_s,
                       filesystem=options.get("filesystem")),
        stream_features(num_embeddings), batch_size=batch_size, **options)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="stream root: a directory or s3://bucket/prefix")
    ap.add_argument("--every-s", type=float, default=10.0, help="seconds between windows")
    ap.add_argument("--windows", type=int, default=0,
                    help="windows to land, then write _END and stop (0: forever)")
    ap.add_argument("--rows-per-window", type=int, default=StreamConfig.rows_per_window)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shift-at", type=int, default=StreamConfig.shift_at,
                    help="first window (0-based) where the planted value becomes strongly "
                         "clicked (-1: never)")
    ap.add_argument("--shift-column", default=StreamConfig.shift_column)
    ap.add_argument("--shift-rank", type=int, default=StreamConfig.shift_rank,
                    help="popularity rank of the value that changes (0: most frequent)")
    ap.add_argument("--shift-strength", type=float, default=StreamConfig.shift_strength)
    ap.add_argument("--start", type=dt.datetime.fromisoformat, default=DEFAULT_START,
                    help="the first window's hour (ISO time)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s stream_writer %(message)s")
    # SIGTERM ends the stream quietly between (or in) writes: a window without _SUCCESS is
    # not a window, and a restarted writer lands it again.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    writer = StreamWriter(a.out, StreamConfig(
        rows_per_window=a.rows_per_window, seed=a.seed, shift_at=a.shift_at,
        shift_column=a.shift_column, shift_rank=a.shift_rank, shift_strength=a.shift_strength,
        start=a.start))
    print(json.dumps(writer.describe()), flush=True)
    for truth in writer.run(a.windows, a.every_s):
        print(json.dumps({k: truth[k] for k in ("window", "index", "shifted", "ctr",
                                                 "shift_ctr")}), flush=True)


__all__ = ["DEFAULT_START", "END_MARKER", "StreamConfig", "StreamWriter", "main", "stream_dataset",
           "stream_features", "stream_windows"]


if __name__ == "__main__":
    main()
