"""``EarlyStoppingHook``: stop training when an evaluation metric stops improving."""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from recsys_trainer.hooks.base import Hook, TrainerView, overridden_events

logger = logging.getLogger("recsys_trainer")


class EarlyStoppingHook(Hook):
    """After each evaluation, compares ``metrics[metric]`` with the best so far; after
    ``patience`` evaluations in a row without an improvement of more than ``min_delta``, asks
    the Trainer to stop.

    Every rank sees the same evaluation metrics (they are reduced over ranks), so every rank
    makes the same decision; the stop is also agreed at the next batch fetch, so all ranks stop
    after the same step. Metrics other than ``loss``/``num_samples`` come from other hooks
    (``MetricReportHook`` adds ``auc``, ``ne``...), which must come *before* this one in the
    hook list. Its counters are saved in checkpoints (``state_dict``).

    Args:
        metric: key of the evaluation metrics, e.g. "auc", "ne", "loss".
        mode: "max" (higher is better, e.g. AUC) or "min" (e.g. NE, loss).
        patience: evaluations without improvement tolerated before stopping (>= 1).
        min_delta: an improvement must exceed this (>= 0).
    """

    def __init__(self, metric: str = "auc", mode: Literal["min", "max"] = "max", patience: int = 3,
                 min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"`mode` must be 'min' or 'max', but is {mode!r}.")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"`patience` must be an int >= 1, but is {patience!r}.")
        if min_delta < 0:
            raise ValueError(f"`min_delta` must be >= 0, but is {min_delta!r}.")
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.best: float | None = None
        self.num_bad = 0
        self.stopped_at_step: int | None = None

    def before_train(self, trainer: TrainerView) -> None:
        if self.metric in ("loss", "num_samples"):
            return
        hooks = list(trainer.hooks)
        mine = next(i for i, h in enumerate(hooks) if h is self)
        if not any("after_evaluate" in overridden_events(h) for h in hooks[:mine]):
            raise ValueError(
                f"EarlyStoppingHook monitors {self.metric!r}, which only a hook listed before it "
                "can add to the evaluation metrics: put a MetricReportHook before it in `hooks`."
            )

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if self.metric not in metrics:
            per_task = sorted(k for k in metrics if k.startswith(f"{self.metric}/"))
            fix = (f"with several tasks each metric is reported per task: monitor one of {per_task}"
                   if per_task else "add the hook that computes it (before this one)")
            raise KeyError(
                f"EarlyStoppingHook: metric {self.metric!r} is not in the evaluation metrics "
                f"{sorted(metrics)}; {fix}."
            )
        value = float(metrics[self.metric])
        if math.isnan(value):
            # Undefined (e.g. AUC of an eval window without clicks): neither better nor worse.
            return
        if self._improved(value):
            self.best, self.num_bad = value, 0
            return
        self.num_bad += 1
        if self.num_bad >= self.patience and trainer.state.mode != "idle":
            self.stopped_at_step = trainer.state.global_step
            reason = (f"early stopping: {self.metric} did not improve on {self.best:.6g} for "
                      f"{self.num_bad} evaluations")
            if trainer.is_rank_zero:
                logger.info("%s (step %d)", reason, trainer.state.global_step)
            trainer.request_stop(reason)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "num_bad": self.num_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.num_bad = state["best"], int(state["num_bad"])
