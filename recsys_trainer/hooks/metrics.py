"""``MetricReportHook``: streaming train and eval click metrics, exact across ranks.

The math (``ClickMetrics``, ``click_metrics``, AUC/GAUC) lives in ``recsys_trainer.metrics``;
this hook decides which rows go into which store and when the stores report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from recsys_trainer.hooks.base import Hook, MetricReport, MicroBatchOutput, StepOutput

# The metric math moved to recsys_trainer.metrics; these names stay importable from here too.
from recsys_trainer.metrics import (
    METRIC_NAMES,
    ClickMetrics,
    click_metrics,
    grouped_auc,
    weighted_auc,
)
from recsys_trainer.periods import report_due

if TYPE_CHECKING:
    from recsys_trainer.batch import Batch
    from recsys_trainer.trainer import Trainer

logger = logging.getLogger("recsys_trainer")


# ----------------------------------------------------------------------------- the hook


def sigmoid_of_outputs(mb: MicroBatchOutput) -> torch.Tensor:
    """Default ``predictions_fn``: the model's second output read as logits."""
    if not isinstance(mb.outputs, torch.Tensor):
        raise TypeError(
            "MetricReportHook needs predictions: the model's forward must return (loss, logits), "
            f"but its outputs are {type(mb.outputs).__name__}; pass predictions_fn= to map them."
        )
    return torch.sigmoid(mb.outputs.detach().float()).reshape(-1)


def single_task_labels(batch: Batch) -> torch.Tensor:
    """Default ``labels_fn``: ``batch.labels`` for one task."""
    labels = batch.labels
    if labels.dim() > 1 and labels.shape[1] != 1:
        raise ValueError(
            f"batch.labels has {labels.shape[1]} tasks; MetricReportHook reports one task: pass "
            "labels_fn= and predictions_fn= that select it (one hook per task, with a prefix)."
        )
    return labels.reshape(-1)


class MetricReportHook(Hook):
    """Streaming train and eval click metrics (AUC, GAUC, log loss, NE, calibration, CTR), exact
    across ranks.

    Reports (each a ``MetricReport``, fired to every hook's ``on_metrics`` on every rank, logged
    on rank 0, and kept in ``self.reports``):

    - train, scope "interval": rows trained since the previous train report, every ``every``
      steps (default ``args.log_steps``) and once at the end of training for a partial interval;
    - scope "window": each data window's rows, in train and in eval (``per_window``);
    - eval, scope "eval": the whole evaluation; its values are also added to the ``metrics``
      dict of ``after_evaluate`` (as ``prefix + name``) so later hooks (``EarlyStoppingHook``)
      and ``evaluate()``'s return value carry them.

    Args:
        group_fn: ``Batch -> int64 [B]`` group (user) ids; enables ``gauc``.
        predictions_fn: ``MicroBatchOutput -> [B]`` probabilities (default: sigmoid of outputs).
        labels_fn: ``Batch -> [B]`` 0/1 labels (default: ``batch.labels``, one task).
        metrics: which of ``METRIC_NAMES`` to report (default: all that apply).
        prefix: prepended to the keys added to eval ``metrics`` (e.g. "ctr_task/").

    Cost: the rows are kept until their report (see ``ClickMetrics``); each report is one
    all-gather of the rows, on every rank, at a step or window end that all ranks share.
    """

    def __init__(
        self,
        *,
        every: int | None = None,
        train: bool = True,
        eval: bool = True,
        per_window: bool = True,
        group_fn: Callable[[Batch], torch.Tensor] | None = None,
        predictions_fn: Callable[[MicroBatchOutput], torch.Tensor] = sigmoid_of_outputs,
        labels_fn: Callable[[Batch], torch.Tensor] = single_task_labels,
        metrics: Sequence[str] | None = None,
        prefix: str = "",
        log: bool = True,
    ) -> None:
        if every is not None and every < 1:
            raise ValueError(f"`every` must be >= 1 or None, but is {every!r}.")
        chosen = tuple(metrics) if metrics is not None else METRIC_NAMES
        unknown = sorted(set(chosen) - set(METRIC_NAMES))
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; choose from {', '.join(METRIC_NAMES)}.")
        if "gauc" in chosen and metrics is not None and group_fn is None:
            raise ValueError("metric 'gauc' needs group_fn= (Batch -> per-row user ids).")
        self._every = every
        self._train, self._eval, self._per_window = train, eval, per_window
        self._group_fn = group_fn
        self._predictions_fn = predictions_fn
        self._labels_fn = labels_fn
        self._names = tuple(n for n in chosen if n != "gauc" or group_fn is not None)
        self._prefix = prefix
        self._log = log
        with_groups = group_fn is not None
        self._stores = {
            key: ClickMetrics(with_groups=with_groups)
            for key in ("train_interval", "train_window", "eval", "eval_window")
        }
        self._window_counts = {"train": 0, "eval": 0}
        self._last_report_step = -1
        self.reports: list[MetricReport] = []

    # -- events --
    def before_train(self, trainer: Trainer) -> None:
        self._stores["train_interval"].reset()
        self._last_report_step = trainer.state.global_step

    def before_window(self, trainer: Trainer, window_id: str) -> None:
        self._stores[f"{trainer.state.mode}_window"].reset()

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        if not self._train:
            return
        for mb in output.micro_batches:
            self._update(mb, ("train_interval", "train_window"))
        if report_due(self._every, trainer.args.log_period, trainer.state):
            self._report(trainer, "train", "interval", "train_interval")
            self._last_report_step = trainer.state.global_step

    def after_train(self, trainer: Trainer) -> None:
        # global_step is the same on every rank, so all ranks agree on this (collective) report.
        if self._train and trainer.state.global_step != self._last_report_step:
            self._report(trainer, "train", "interval", "train_interval")
            self._last_report_step = trainer.state.global_step

    def after_window(self, trainer: Trainer, window_id: str) -> None:
        mode = trainer.state.mode
        if mode not in ("train", "eval") or not self._per_window:
            return
        if (mode == "train" and not self._train) or (mode == "eval" and not self._eval):
            return
        self._report(trainer, mode, "window", f"{mode}_window", window_id, self._window_counts[mode])
        self._window_counts[mode] += 1

    def before_evaluate(self, trainer: Trainer) -> None:
        self._stores["eval"].reset()

    def after_eval_step(self, trainer: Trainer, output: StepOutput) -> None:
        if self._eval and not output.is_padding:
            for mb in output.micro_batches:
                self._update(mb, ("eval", "eval_window"))

    def after_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if not self._eval:
            return
        report = self._report(trainer, "eval", "eval", "eval")
        for name in self._names:
            metrics[self._prefix + name] = report.values[name]

    # -- internals --
    def _update(self, mb: MicroBatchOutput, keys: tuple[str, ...]) -> None:
        preds = self._predictions_fn(mb)
        labels = self._labels_fn(mb.batch)
        groups = self._group_fn(mb.batch) if self._group_fn is not None else None
        for key in keys:
            # The same tensors go into both stores: no copy.
            self._stores[key].update(preds, labels, mb.batch.weights, groups)

    def _report(
        self,
        trainer: Trainer,
        mode: str,
        scope: str,
        store: str,
        window_id: str | None = None,
        window_index: int | None = None,
    ) -> MetricReport:
        metric = self._stores[store]
        # The rows are tensors on the model's device: gathered on the model's group (nccl on
        # CUDA), not on the gang's gloo group, which cannot all-gather CUDA tensors.
        values = metric.result(trainer.process_group)
        metric.reset()
        kept = {k: v for k, v in values.items() if k in self._names or k in ("num_samples", "weight_sum")}
        if "gauc_num_groups" in values and "gauc" in self._names:
            kept["gauc_num_groups"] = values["gauc_num_groups"]
        report = MetricReport(mode, scope, trainer.state.global_step, kept, window_id, window_index)
        self.reports.append(report)
        if self._log and trainer.is_rank_zero:
            shown = " | ".join(f"{k} {v:.5g}" for k, v in kept.items())
            where = f" {window_id}" if window_id is not None else ""
            logger.info("%s metrics [%s%s] @ step %d | %s", mode, scope, where, report.step, shown)
        trainer.hooks.fire("on_metrics", trainer, report)
        return report


__all__ = [
    "METRIC_NAMES",
    "ClickMetrics",
    "MetricReportHook",
    "click_metrics",
    "grouped_auc",
    "sigmoid_of_outputs",
    "single_task_labels",
    "weighted_auc",
]
