"""``JsonlMetricsHook``: one JSON object per line for scripts (and ``python -m recsys_trainer.plot``)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import IO, Any

from recsys_trainer.hooks._interval import IntervalReporter
from recsys_trainer.hooks.base import MetricReport, TrainerView


def _clean(v: Any) -> Any:
    # Strict JSON has no NaN/Infinity: undefined metrics are written as null.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlMetricsHook(IntervalReporter):
    """Appends records to ``path`` (default ``<output_dir>/metrics.jsonl``, or under
    ``args.logging_dir`` when ``output_dir`` is on object storage) on rank 0; add it on
    every rank (the train loss is averaged over ranks with one small all-reduce per report).

    Record types (every record has ``type``, ``step`` and ``time``, a Unix timestamp):

    - ``{"type": "train", "epoch", "loss", "samples_per_s", "dense_lr", "sparse_lr",
      "data_wait_s", "forward_backward_s", "optimizer_s"}`` every ``every`` steps (default
      ``args.log_steps``) and at the end of training for a partial interval. With per-table
      sparse lrs (``Trainer(table_optimizers=...)``) ``sparse_lr`` is null and
      ``"sparse_lrs": {table: lr}`` holds them;
    - ``{"type": "metrics", "mode", "scope", "window_id", "window_index", <metric>: value...}``
      for each ``MetricReportHook`` report;
    - ``{"type": "eval", <key>: value...}``: each evaluation's ``metrics`` dict.

    Undefined values (NaN) are written as ``null``. Lines are flushed as written, so a reader
    can follow a live run; a resumed run appends to the same file.
    """

    def __init__(self, path: str | None = None, every: int | None = None) -> None:
        super().__init__(every)
        self._path = path
        self._file: IO[str] | None = None

    @property
    def path(self) -> str | None:
        return self._path

    def _write(self, trainer: TrainerView, record: dict[str, Any]) -> None:
        if not trainer.is_rank_zero:
            return
        if self._file is None:
            if self._path is None:
                self._path = os.path.join(trainer.args.local_log_dir, "metrics.jsonl")
            os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
            self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 - closed in end()
        record = {"type": record.pop("type"), "step": trainer.state.global_step, "time": time.time(), **record}
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def _report_interval(self, trainer: TrainerView, vals: dict[str, float]) -> None:
        sparse_lr = trainer.sparse_lr()
        lrs = {} if sparse_lr is not None else {"sparse_lrs": trainer.sparse_lrs()}
        self._write(trainer, {"type": "train", "epoch": trainer.state.epoch, **vals,
                              "dense_lr": trainer.dense_lr(), "sparse_lr": sparse_lr, **lrs})

    def on_metrics(self, trainer: TrainerView, report: MetricReport) -> None:
        self._write(trainer, {"type": "metrics", "mode": report.mode, "scope": report.scope,
                              "window_id": report.window_id, "window_index": report.window_index,
                              **report.values})

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._write(trainer, {"type": "eval", **metrics})

    def end(self, trainer: TrainerView) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a metrics log (a truncated last line, from a live run, is skipped)."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # still being written
            raise ValueError(f"{path}:{i + 1} is not a JSON object: {line[:80]!r}") from None
    return out
