"""Loss, throughput and step-time means over a reporting interval (shared by reporters)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from recsys_trainer.hooks.base import StepOutput

if TYPE_CHECKING:
    from recsys_trainer.trainer import Trainer


class IntervalStats:
    """Accumulates steps between two reports. ``flush`` with ``across_ranks=True`` is a small
    all-reduce: call it on every rank at the same step."""

    def __init__(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._times = {"data_wait_s": 0.0, "forward_backward_s": 0.0, "optimizer_s": 0.0}
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._losses.clear()
        self._samples = 0
        self._times = dict.fromkeys(self._times, 0.0)
        self._t0 = time.perf_counter()

    def add(self, trainer: Trainer, output: StepOutput) -> None:
        # Keep the tensor: reading it now would be a device sync on every step.
        self._losses.append(output.loss)
        self._samples += output.num_samples
        for k, v in trainer.timings.as_dict().items():
            self._times[k] += v

    def __len__(self) -> int:
        return len(self._losses)

    def flush(self, trainer: Trainer, across_ranks: bool) -> dict[str, float]:
        """Means since the last flush: ``loss`` (over ranks too when ``across_ranks``),
        ``samples_per_s`` (all ranks' samples over this rank's elapsed time), mean seconds per
        step of each ``StepTimings`` part (this rank's)."""
        now = time.perf_counter()
        steps = len(self._losses)
        loss_sum = float(torch.stack(self._losses).float().sum().item()) if steps else 0.0
        samples = float(self._samples)
        if across_ranks:
            loss_sum, count, samples = trainer.gang.all_reduce_sum_float(
                [loss_sum, float(steps), samples]
            )
        else:
            count, samples = float(steps), samples * trainer.world_size
        out = {
            "loss": loss_sum / count if count else float("nan"),
            "samples_per_s": samples / max(now - self._t0, 1e-9),
        }
        for k, v in self._times.items():
            out[k] = v / steps if steps else 0.0
        self.start()
        return out
