"""``TensorBoardHook``: loss, metrics, learning rates, throughput and time breakdown as TB scalars."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from recsys_trainer.hooks._interval import IntervalReporter
from recsys_trainer.hooks.base import MetricReport, TrainerView


def default_tensorboard_dir(trainer: TrainerView) -> str:
    """``<output_dir>/tensorboard``: where ``TensorBoardHook`` and ``ProfilerHook`` write (under
    ``args.logging_dir`` instead when ``output_dir`` is on object storage)."""
    return os.path.join(trainer.args.local_log_dir, "tensorboard")


class TensorBoardHook(IntervalReporter):
    """Writes scalars to an event file under ``log_dir`` (default ``<output_dir>/tensorboard``)
    on rank 0. Add it on every rank (as all hooks): the train loss and samples/s are reduced over
    ranks with one small all-reduce every ``every`` steps (default ``args.log_steps``).

    Tags (x axis: global step unless said otherwise):

    - ``train/loss`` (mean over ranks and steps of the interval), ``perf/samples_per_s`` (global),
      ``lr/dense``, ``lr/sparse`` (``lr/sparse/<table>`` with per-table lrs);
    - ``time/data_wait_s``, ``time/forward_backward_s``, ``time/optimizer_s``: rank 0's mean
      seconds per step over the interval (``Trainer.timings``);
    - ``checkpoint/save_s``: from ``before_save_checkpoint`` to ``after_save_checkpoint`` (for
      async saves that includes the background write, up to commit);
    - from ``MetricReportHook``: ``train/<metric>`` (interval), ``eval/<metric>``, and per data
      window ``train_window/<metric>``, ``eval_window/<metric>`` with the window's ordinal as x;
    - ``eval/<key>`` for any other key of ``after_evaluate``'s metrics (``eval/loss``...).
    """

    def __init__(self, log_dir: str | None = None, every: int | None = None) -> None:
        super().__init__(every)
        self._log_dir = log_dir
        self._writer: Any = None
        self._save_t0: dict[str, float] = {}
        self._eval_written: set[str] = set()

    @property
    def log_dir(self) -> str | None:
        return self._log_dir

    def _w(self, trainer: TrainerView) -> Any:
        if not trainer.is_rank_zero:
            return None
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if self._log_dir is None:
                self._log_dir = default_tensorboard_dir(trainer)
            self._writer = SummaryWriter(log_dir=self._log_dir)
        return self._writer

    def _scalar(self, trainer: TrainerView, tag: str, value: float, step: int) -> None:
        w = self._w(trainer)
        if w is not None and value is not None and not (isinstance(value, float) and math.isnan(value)):
            w.add_scalar(tag, value, step)

    def after_train(self, trainer: TrainerView) -> None:
        super().after_train(trainer)
        if self._writer is not None:
            self._writer.flush()

    def _report_interval(self, trainer: TrainerView, vals: dict[str, float]) -> None:
        step = trainer.state.global_step
        self._scalar(trainer, "train/loss", vals["loss"], step)
        self._scalar(trainer, "perf/samples_per_s", vals["samples_per_s"], step)
        self._scalar(trainer, "lr/dense", trainer.dense_lr(), step)
        sparse_lr = trainer.sparse_lr()
        if sparse_lr is not None:
            self._scalar(trainer, "lr/sparse", sparse_lr, step)
        else:  # per-table lrs (Trainer(table_optimizers=...))
            for table, lr in trainer.sparse_lrs().items():
                self._scalar(trainer, f"lr/sparse/{table}", lr, step)
        for k in ("data_wait_s", "forward_backward_s", "optimizer_s"):
            self._scalar(trainer, f"time/{k}", vals[k], step)

    def on_metrics(self, trainer: TrainerView, report: MetricReport) -> None:
        if report.scope == "window":
            group, x = f"{report.mode}_window", report.window_index or 0
        else:
            group, x = report.mode, report.step
        for k, v in report.values.items():
            self._scalar(trainer, f"{group}/{k}", v, x)
            if report.scope == "eval":
                self._eval_written.add(k)

    def before_evaluate(self, trainer: TrainerView) -> None:
        self._eval_written = set()

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if k not in self._eval_written:
                self._scalar(trainer, f"eval/{k}", float(v), trainer.state.global_step)
        if self._writer is not None:
            self._writer.flush()

    def before_save_checkpoint(self, trainer: TrainerView, path: str) -> None:
        self._save_t0[path] = time.perf_counter()

    def after_save_checkpoint(self, trainer: TrainerView, path: str) -> None:
        t0 = self._save_t0.pop(path, None)
        if t0 is not None:
            self._scalar(trainer, "checkpoint/save_s", time.perf_counter() - t0, trainer.state.global_step)

    def end(self, trainer: TrainerView) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
