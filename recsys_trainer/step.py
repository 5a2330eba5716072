"""The parts of one training step that the plain loop and the pipelined loop share.

* ``split_output``: what the model's forward returned -> ``(loss, outputs)``.
* ``DenseStep``: the dense half of an optimizer step (partial-accumulation rescale, unscale and
  clip, optimizer step through the precision module, lr scheduler, ``zero_grad``). The plain
  loop calls it after its micro-batches; ``TrainPipelineSparseDist`` calls it as its optimizer.
  The sparse half already ran inside backward (fused optimizers).
* ``NonFiniteGuard``: the non-finite-loss policy (``TrainingArguments.non_finite_loss``).
* ``StepTimings``: where the last step's wall time went, as the Trainer measured it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from recsys_trainer.args import NonFiniteLoss
from recsys_trainer.distributed import Gang
from recsys_trainer.precision import Precision

logger = logging.getLogger("recsys_trainer")


def split_output(out: Any) -> tuple[torch.Tensor, Any]:
    """``(loss, outputs)`` from a forward that returned the loss or a ``(loss, outputs)`` pair."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        return out[0], out[1]
    raise TypeError(
        "the model's forward(batch) must return the loss tensor or a (loss, outputs) pair; "
        f"got {type(out).__name__}."
    )


@dataclass
class StepTimings:
    """Seconds spent in the parts of the most recent training step (``trainer.timings``).

    Read them in ``after_step``: the Trainer zeroes them right after ``after_step`` returns.
    The Trainer takes ``time.perf_counter()`` stamps (no device sync), so on CUDA these are
    host-side times: a long GPU step shows up wherever the host next waits. With
    ``pipeline="sparse_dist"`` only ``optimizer_s`` is measured (the pipeline interleaves the
    fetch, forward and backward of different batches).
    """

    data_wait_s: float = 0.0
    """Fetching this step's batches, including the per-fetch cross-rank agreement (so it also
    counts waiting for slower ranks)."""
    forward_backward_s: float = 0.0
    """Forward and backward passes of all micro-batches (fused sparse updates run in backward)."""
    optimizer_s: float = 0.0
    """Gradient clipping, the dense optimizer step, the lr scheduler and ``zero_grad``."""

    def add_data_wait(self, start: float) -> None:
        """Add the time since ``start`` (a ``perf_counter`` stamp) to ``data_wait_s``."""
        self.data_wait_s += time.perf_counter() - start

    def reset(self) -> None:
        self.data_wait_s = self.forward_backward_s = self.optimizer_s = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "data_wait_s": self.data_wait_s,
            "forward_backward_s": self.forward_backward_s,
            "optimizer_s": self.optimizer_s,
        }


class DenseStep:
    """The dense optimizer step, one implementation for both training loops.

    ``step()`` is what ``TrainPipelineSparseDist`` calls as its optimizer's step, and what the
    plain loop calls after its micro-batches (with how many ran, and whether the step was
    skipped for a non-finite loss). ``zero_grad()`` is the pipeline's other optimizer call.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        precision: Precision,
        *,
        accumulation_steps: int,
        max_grad_norm: float | None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        timings: StepTimings,
    ) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.precision = precision
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.lr_scheduler = lr_scheduler
        self.timings = timings

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, num_micro_batches: int | None = None, skipped: bool = False) -> None:
        """Update the dense parameters from their accumulated gradients.

        ``num_micro_batches`` below ``accumulation_steps`` (a window ended mid-accumulation)
        rescales the gradients to the mean over the micro-batches that ran (the sparse updates
        already used loss/k). ``skipped``: a micro-batch's backward was skipped on every rank,
        so the accumulated gradients are partial, and unsynchronised if the skipped one was the
        one that would all-reduce: drop them, no update, no scheduler step.
        """
        t0 = time.perf_counter()
        if skipped:
            self.zero_grad()
            self.timings.optimizer_s += time.perf_counter() - t0
            return
        k = self.accumulation_steps
        if num_micro_batches is not None and num_micro_batches < k:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(k / num_micro_batches)
        if self.max_grad_norm is not None:
            # DDP already averaged the grads, so every rank computes the same global norm.
            self.precision.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.precision.step(self.optimizer)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()
        self.timings.optimizer_s += time.perf_counter() - t0


class NonFiniteGuard:
    """What a non-finite training loss does (``TrainingArguments.non_finite_loss``); the same
    decision on every rank.

    "stop": ``after_step`` checks the step's loss (a device sync on CUDA) and says to report it;
    the Trainer folds that into its per-fetch all-reduce, so every rank stops after that step.
    "skip": ``skip_backward`` checks each micro-batch's loss before backward and the ranks agree
    (one 1-int all-reduce); the fused sparse update runs inside backward, so skipping it on every
    rank is the only way to keep a NaN out of the tables and the collectives matched. The guard
    counts skipped steps (a ``Stateful``: the count survives a resume) and asks for a stop after
    ``max_skips`` of them.
    """

    def __init__(self, action: NonFiniteLoss = "ignore", max_skips: int | None = None) -> None:
        self.action: NonFiniteLoss = action
        self.max_skips = max_skips
        self.num_skipped = 0
        """Steps skipped in this run (restored on resume)."""
        self.skipped_steps: list[int] = []
        """The global steps skipped by this process."""

    def configure(self, action: NonFiniteLoss, max_skips: int | None = None) -> None:
        """Switch the policy (``NonFiniteLossHook`` does, at ``before_train``)."""
        self.action, self.max_skips = action, max_skips

    def skip_backward(self, loss: torch.Tensor, gang: Gang) -> bool:
        """Under "skip": whether any rank's micro-batch loss is non-finite (one all-reduce on
        every rank, a device sync on CUDA); False without a collective otherwise."""
        if self.action != "skip":
            return False
        bad = not bool(torch.isfinite(loss.detach()).all())
        return bool(gang.all_reduce_max([int(bad)])[0])

    def after_step(self, loss: torch.Tensor, step: int, skipped: bool, *,
                   rank: int) -> tuple[bool, str | None]:
        """After a counted step: ``(report, stop_reason)``. ``report``: under "stop", this
        rank's loss is non-finite. ``stop_reason``: under "skip", ``max_skips`` is reached."""
        if self.action == "stop":
            if bool(torch.isfinite(loss).all()):
                return False, None
            # Logged by the rank that saw it (the others only learn it at the next fetch).
            logger.warning("rank %d: non-finite loss at step %d; stopping all ranks", rank, step)
            return True, None
        if not skipped:
            return False, None
        self.num_skipped += 1
        self.skipped_steps.append(step)
        if rank == 0:
            logger.warning("non-finite loss on some rank: step %d skipped (%d so far)", step,
                           self.num_skipped)
        if self.max_skips is not None and self.num_skipped >= self.max_skips:
            return False, (f"{self.num_skipped} steps skipped for a non-finite loss "
                           f"(max_skips={self.max_skips})")
        return False, None

    def state_dict(self) -> dict[str, Any]:
        return {"num_skipped": self.num_skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_skipped = int(state_dict["num_skipped"])
