"""``NonFiniteLossHook``: stop, or skip steps, when the training loss is NaN or infinite."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

import torch

from recsys_trainer.hooks.base import Hook, StepOutput

if TYPE_CHECKING:
    from recsys_trainer.trainer import Trainer

logger = logging.getLogger("recsys_trainer")


class NonFiniteLossHook(Hook):
    """Guards training against a non-finite loss on any rank; the decision is the same on all.

    ``action="stop"`` (cheap): after each step the loss is checked (a device sync on CUDA, none
    on CPU) and a non-finite one is reported to the Trainer, whose per-fetch all-reduce already
    carries the flag: every rank stops after that same step, with stop reason "non-finite loss".
    The bad step itself has been applied: the sparse optimizer runs *inside* backward, so its
    embedding rows may hold NaN. Keep a checkpoint from before it.

    ``action="skip"`` (opt-in, costs one extra 1-int all-reduce per micro-batch plus a device
    sync on CUDA): the Trainer checks each micro-batch's loss *before* backward and the ranks
    agree; if any rank's is non-finite, every rank skips that micro-batch's backward (so no NaN
    reaches the tables or DDP's gradient all-reduce) and the step's dense update (its accumulated
    gradients would be partial or unsynchronised). The step still counts in ``global_step``.
    ``max_skips`` stops the run (on all ranks together) after that many skipped steps.
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_skips: int | None = None) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"`action` must be 'stop' or 'skip', but is {action!r}.")
        if max_skips is not None and (action != "skip" or max_skips < 1):
            raise ValueError(f"`max_skips` needs action='skip' and a value >= 1, but is {max_skips!r}.")
        self.action = action
        self.max_skips = max_skips
        self.num_skipped = 0
        self.skipped_steps: list[int] = []

    def before_train(self, trainer: Trainer) -> None:
        trainer.skip_non_finite_loss = self.action == "skip"

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        if self.action == "stop":
            if not bool(torch.isfinite(output.loss).all()):
                # Logged by the rank that saw it (the others only learn it at the next fetch).
                logger.warning("rank %d: non-finite loss at step %d; stopping all ranks",
                               trainer.rank, trainer.state.global_step)
                trainer.report_non_finite_loss()
            return
        if trainer.last_step_skipped:
            self.num_skipped += 1
            self.skipped_steps.append(trainer.state.global_step)
            if trainer.is_rank_zero:
                logger.warning("non-finite loss on some rank: step %d skipped (%d so far)",
                               trainer.state.global_step, self.num_skipped)
            if self.max_skips is not None and self.num_skipped >= self.max_skips:
                trainer.request_stop(f"{self.num_skipped} steps skipped for a non-finite loss "
                                     f"(max_skips={self.max_skips})")

    def after_train(self, trainer: Trainer) -> None:
        trainer.skip_non_finite_loss = False

    def state_dict(self) -> dict[str, Any]:
        return {"num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_skipped = int(state["num_skipped"])
