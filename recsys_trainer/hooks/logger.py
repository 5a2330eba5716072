"""``LoggerHook``: loss, samples/s and learning rates every ``log_steps`` on rank 0."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from recsys_trainer.hooks.base import Hook, StepOutput

if TYPE_CHECKING:
    from recsys_trainer.trainer import Trainer

logger = logging.getLogger("recsys_trainer")


class LoggerHook(Hook):
    """Logs ``step, loss, samples/s, dense lr, sparse lr`` every ``every`` steps (default:
    ``args.log_steps``) on rank 0, plus each evaluation's metrics.

    Samples/s counts the global batch (this rank's samples times world size). The loss shown is
    rank 0's mean over the logged interval; reading it is a device sync, done only here.
    """

    def __init__(self, every: int | None = None) -> None:
        if every is not None and every < 1:
            raise ValueError(f"`every` must be >= 1 or None, but is {every!r}.")
        self._every = every
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._t0 = 0.0
        self.records: list[dict[str, float]] = []

    def before_train(self, trainer: Trainer) -> None:
        self._losses.clear()
        self._samples = 0
        self._t0 = time.perf_counter()

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        self._losses.append(output.loss)
        self._samples += output.num_samples
        every = self._every or trainer.args.log_steps
        if trainer.state.global_step % every != 0:
            return
        now = time.perf_counter()
        loss = float(torch.stack(self._losses).float().mean().item())
        sps = self._samples * trainer.world_size / max(now - self._t0, 1e-9)
        rec = {
            "step": float(trainer.state.global_step),
            "loss": loss,
            "samples_per_s": sps,
            "dense_lr": trainer.dense_lr(),
        }
        sparse_lr = trainer.sparse_lr()
        if sparse_lr is not None:
            rec["sparse_lr"] = sparse_lr
        self.records.append(rec)
        if trainer.is_rank_zero:
            logger.info(
                "step %d | epoch %d | loss %.5f | %.0f samples/s | lr dense %.3g sparse %s",
                trainer.state.global_step,
                trainer.state.epoch,
                loss,
                sps,
                rec["dense_lr"],
                f"{sparse_lr:.3g}" if sparse_lr is not None else "-",
            )
        self._losses.clear()
        self._samples = 0
        self._t0 = now

    def after_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if trainer.is_rank_zero:
            shown = " | ".join(f"{k} {v:.5g}" for k, v in sorted(metrics.items()))
            logger.info("eval @ step %d | %s", trainer.state.global_step, shown)
