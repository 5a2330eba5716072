"""``LoggerHook``: loss, samples/s and learning rates every ``log_steps`` on rank 0."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from recsys_trainer.hooks._interval import IntervalStats
from recsys_trainer.hooks.base import Hook, StepOutput, TrainerView
from recsys_trainer.periods import report_due

logger = logging.getLogger("recsys_trainer")


def describe_lrs(lrs: Mapping[str, float], names_per_lr: int = 3) -> str:
    """Per-table lrs for a log line, grouped by value (most tables first): ``"0.05 (25
    tables), 0.005 (t_user)"``; one lr for every table is just that number."""
    groups: dict[float, list[str]] = {}
    for table, lr in sorted(lrs.items()):
        groups.setdefault(lr, []).append(table)
    if len(groups) == 1:
        return f"{next(iter(groups)):.3g}"
    parts = []
    for lr, tables in sorted(groups.items(), key=lambda g: (-len(g[1]), g[0])):
        who = ", ".join(tables) if len(tables) <= names_per_lr else f"{len(tables)} tables"
        parts.append(f"{lr:.3g} ({who})")
    return ", ".join(parts)


class LoggerHook(Hook):
    """Logs ``step, loss, samples/s, dense lr, sparse lr`` every ``every`` steps (default:
    ``args.log_steps``) on rank 0, plus each evaluation's metrics. With per-table sparse lrs
    (``Trainer(table_optimizers=...)``) the line shows each lr and its tables, and ``records``
    hold ``sparse_lr/<table>``.

    Samples/s counts the global batch (this rank's samples times world size). The loss shown is
    rank 0's mean over the logged interval; reading it is a device sync, done only here.
    """

    def __init__(self, every: int | None = None) -> None:
        if every is not None and every < 1:
            raise ValueError(f"`every` must be >= 1 or None, but is {every!r}.")
        self._every = every
        self._stats = IntervalStats()
        self.records: list[dict[str, float]] = []

    def before_train(self, trainer: TrainerView) -> None:
        self._stats.start()

    def after_step(self, trainer: TrainerView, output: StepOutput) -> None:
        self._stats.add(trainer, output)
        if not report_due(self._every, trainer.args.log_period, trainer.state):
            return
        # This rank's losses only: the default hook must not add a collective to the loop.
        vals = self._stats.flush(trainer, across_ranks=False)
        loss, sps = vals["loss"], vals["samples_per_s"]
        rec = {
            "step": float(trainer.state.global_step),
            "loss": loss,
            "samples_per_s": sps,
            "dense_lr": trainer.dense_lr(),
        }
        sparse_lr = trainer.sparse_lr()
        if sparse_lr is not None:
            rec["sparse_lr"] = sparse_lr
        else:
            rec.update({f"sparse_lr/{t}": lr for t, lr in trainer.sparse_lrs().items()})
        self.records.append(rec)
        if trainer.is_rank_zero:
            logger.info(
                "step %d | epoch %d | loss %.5f | %.0f samples/s | lr dense %.3g sparse %s",
                trainer.state.global_step,
                trainer.state.epoch,
                loss,
                sps,
                rec["dense_lr"],
                f"{sparse_lr:.3g}" if sparse_lr is not None else describe_lrs(trainer.sparse_lrs()),
            )

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if trainer.is_rank_zero:
            shown = " | ".join(f"{k} {v:.5g}" for k, v in sorted(metrics.items()))
            logger.info("eval @ step %d | %s", trainer.state.global_step, shown)
