"""``MetricReportHook``: streaming train and eval click metrics, exact across ranks.

The math (``ClickMetrics``, ``click_metrics``, AUC/GAUC) lives in ``recsys_trainer.metrics``;
this hook decides which rows go into which store and when the stores report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from recsys_trainer.hooks.base import Hook, MetricReport, MicroBatchOutput, StepOutput, TrainerView
from recsys_trainer.metrics import METRIC_NAMES, ClickMetrics
from recsys_trainer.periods import report_due

if TYPE_CHECKING:
    from recsys_trainer.batch import Batch

logger = logging.getLogger("recsys_trainer")


# ----------------------------------------------------------------------------- the hook


def sigmoid_of_outputs(mb: MicroBatchOutput) -> torch.Tensor:
    """Default ``predictions_fn``: the model's second output read as logits (``[B]`` or
    ``[B, 1]`` for one task, ``[B, T]`` for T tasks)."""
    if not isinstance(mb.outputs, torch.Tensor):
        raise TypeError(
            "MetricReportHook needs predictions: the model's forward must return (loss, logits), "
            f"but its outputs are {type(mb.outputs).__name__}; pass predictions_fn= to map them."
        )
    return torch.sigmoid(mb.outputs.detach().float())


def single_task_labels(batch: Batch) -> torch.Tensor:
    """Default ``labels_fn`` for one task: ``batch.labels``."""
    labels = batch.labels
    if labels.dim() > 1 and labels.shape[1] != 1:
        raise ValueError(
            f"batch.labels has {labels.shape[1]} tasks, but this MetricReportHook reports one: "
            "give it tasks=[...] (one name per label column; by default the names come from the "
            "dataset's FeatureSpec.labels), or labels_fn= and predictions_fn= that select one task."
        )
    return labels.reshape(-1)


def dataset_tasks(trainer: TrainerView) -> tuple[str, ...] | None:
    """The task names of a multi-task run: the train (else eval) dataset's
    ``FeatureSpec.labels`` when it has two or more; None for one task or no spec."""
    for ds in (getattr(trainer, "train_dataset", None), getattr(trainer, "eval_dataset", None)):
        labels = getattr(getattr(ds, "features", None), "labels", None)
        if labels is not None:
            return tuple(labels) if len(labels) > 1 else None
    return None


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

    Multi-task (``batch.labels`` ``[B, T]``, logits ``[B, T]``): each metric is reported per
    task as ``name/task`` (``auc/click``, ``auc/like``), each over the rows with a non-zero
    example weight; ``num_samples``/``weight_sum`` stay unsuffixed. The task names are
    ``tasks``, or by default the dataset's ``FeatureSpec.labels`` when it has two or more.
    With one task the names are the plain ones (``auc``).

    Args:
        group_fn: ``Batch -> int64 [B]`` group (user) ids; enables ``gauc``.
        predictions_fn: ``MicroBatchOutput -> [B]`` probabilities (default: sigmoid of outputs).
        labels_fn: ``Batch -> [B]`` 0/1 labels (``[B, T]`` multi-task; default:
            ``batch.labels``).
        metrics: which of ``METRIC_NAMES`` to report (default: all that apply).
        prefix: prepended to the keys added to eval ``metrics`` (e.g. "ctr_task/").
        tasks: the names of the label columns, in order (default: the dataset's
            ``FeatureSpec.labels`` when it has two or more, else one task).

    Cost: the rows are kept until their report (see ``ClickMetrics``); each report is one
    all-gather of the rows per task, on every rank, at a step or window end that all ranks
    share.
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
        labels_fn: Callable[[Batch], torch.Tensor] | None = None,
        metrics: Sequence[str] | None = None,
        prefix: str = "",
        log: bool = True,
        tasks: Sequence[str] | None = None,
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
        if tasks is not None and (isinstance(tasks, str) or len(set(tasks)) != len(tasks) or not tasks):
            raise ValueError(f"`tasks` must be distinct label names, one per label column, but is {tasks!r}.")
        self._group_fn = group_fn
        self._predictions_fn = predictions_fn
        self._labels_fn = labels_fn
        self._names = tuple(n for n in chosen if n != "gauc" or group_fn is not None)
        self._prefix = prefix
        self._log = log
        self._given_tasks = tuple(tasks) if tasks is not None else None
        self.tasks: tuple[str, ...] | None = None
        """The task names reported (``name/task``), or None for one task; set at the first
        event (from ``tasks`` or the dataset's ``FeatureSpec.labels``)."""
        self._stores: dict[str, list[ClickMetrics]] = {}
        self._window_counts = {"train": 0, "eval": 0}
        self._last_report_step = -1
        self.reports: list[MetricReport] = []

    # -- events --
    def _setup(self, trainer: TrainerView) -> None:
        if self._stores:
            return
        given = self._given_tasks
        if given is None:
            self.tasks = dataset_tasks(trainer)
        else:
            self.tasks = given if len(given) > 1 else None
        with_groups = self._group_fn is not None
        # On the model's device: a rank with no rows pads its stores with empty tensors on the
        # metric's device, which must be where its peers' rows are for the gather (NCCL).
        device = trainer.device
        self._stores = {
            key: [ClickMetrics(with_groups=with_groups).to(device) for _ in (self.tasks or ("",))]
            for key in ("train_interval", "train_window", "eval", "eval_window")
        }

    def before_train(self, trainer: TrainerView) -> None:
        self._setup(trainer)
        for m in self._stores["train_interval"]:
            m.reset()
        self._last_report_step = trainer.state.global_step

    def before_window(self, trainer: TrainerView, window_id: str) -> None:
        self._setup(trainer)
        for m in self._stores[f"{trainer.state.mode}_window"]:
            m.reset()

    def after_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if not self._train:
            return
        for mb in output.micro_batches:
            self._update(mb, ("train_interval", "train_window"))
        if report_due(self._every, trainer.args.log_period, trainer.state):
            self._report(trainer, "train", "interval", "train_interval")
            self._last_report_step = trainer.state.global_step

    def after_train(self, trainer: TrainerView) -> None:
        # global_step is the same on every rank, so all ranks agree on this (collective) report.
        if self._train and trainer.state.global_step != self._last_report_step:
            self._report(trainer, "train", "interval", "train_interval")
            self._last_report_step = trainer.state.global_step

    def after_window(self, trainer: TrainerView, window_id: str) -> None:
        mode = trainer.state.mode
        if mode not in ("train", "eval") or not self._per_window:
            return
        if (mode == "train" and not self._train) or (mode == "eval" and not self._eval):
            return
        self._report(trainer, mode, "window", f"{mode}_window", window_id, self._window_counts[mode])
        self._window_counts[mode] += 1

    def before_evaluate(self, trainer: TrainerView) -> None:
        self._setup(trainer)
        for m in self._stores["eval"]:
            m.reset()

    def after_eval_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if self._eval and not output.is_padding:
            for mb in output.micro_batches:
                self._update(mb, ("eval", "eval_window"))

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if not self._eval:
            return
        report = self._report(trainer, "eval", "eval", "eval")
        for name, value in report.values.items():
            if name.split("/")[0] in self._names:
                metrics[self._prefix + name] = value

    # -- internals --
    def _update(self, mb: MicroBatchOutput, keys: tuple[str, ...]) -> None:
        preds = self._predictions_fn(mb)
        groups = self._group_fn(mb.batch) if self._group_fn is not None else None
        if self.tasks is None:
            labels = (self._labels_fn or single_task_labels)(mb.batch)
            for key in keys:
                # The same tensors go into both stores: no copy.
                self._stores[key][0].update(preds, labels, mb.batch.weights, groups)
            return
        labels = self._labels_fn(mb.batch) if self._labels_fn is not None else mb.batch.labels
        n = len(self.tasks)
        for what, x in (("predictions", preds), ("labels", labels)):
            if x.dim() != 2 or x.shape[1] != n:
                raise ValueError(
                    f"MetricReportHook reports {n} tasks ({', '.join(self.tasks)}), but the "
                    f"{what} have shape {tuple(x.shape)}, not [B, {n}]: return one logit per task "
                    "(in FeatureSpec.labels order), or set tasks= / predictions_fn= / labels_fn=."
                )
        for t in range(n):
            for key in keys:
                self._stores[key][t].update(preds[:, t], labels[:, t], mb.batch.weights, groups)

    def _report(
        self,
        trainer: TrainerView,
        mode: str,
        scope: str,
        store: str,
        window_id: str | None = None,
        window_index: int | None = None,
    ) -> MetricReport:
        kept: dict[str, float] = {}
        for t, metric in enumerate(self._stores[store]):
            # The rows are tensors on the model's device: gathered on the model's group (nccl on
            # CUDA), not on the gang's gloo group, which cannot all-gather CUDA tensors.
            values = metric.result(trainer.process_group)
            metric.reset()
            suffix = f"/{self.tasks[t]}" if self.tasks is not None else ""
            for k, v in values.items():
                if k in ("num_samples", "weight_sum"):
                    kept.setdefault(k, v)  # the same rows for every task
                elif k in self._names or (k == "gauc_num_groups" and "gauc" in self._names):
                    kept[k + suffix] = v
        report = MetricReport(mode, scope, trainer.state.global_step, kept, window_id, window_index)
        self.reports.append(report)
        if self._log and trainer.is_rank_zero:
            shown = " | ".join(f"{k} {v:.5g}" for k, v in kept.items())
            where = f" {window_id}" if window_id is not None else ""
            logger.info("%s metrics [%s%s] @ step %d | %s", mode, scope, where, report.step, shown)
        trainer.hooks.fire("on_metrics", trainer, report)
        return report


__all__ = ["MetricReportHook", "dataset_tasks", "sigmoid_of_outputs", "single_task_labels"]
