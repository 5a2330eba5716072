"""Loss, throughput and step-time means over a reporting interval (shared by reporters)."""

from __future__ import annotations

import time

import torch

from recsys_trainer.hooks.base import Hook, StepOutput, TrainerView
from recsys_trainer.periods import report_due


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

    def add(self, trainer: TrainerView, output: StepOutput) -> None:
        # Keep the tensor: reading it now would be a device sync on every step.
        self._losses.append(output.loss)
        self._samples += output.num_samples
        for k, v in trainer.timings.as_dict().items():
            self._times[k] += v

    def __len__(self) -> int:
        return len(self._losses)

    def flush(self, trainer: TrainerView, across_ranks: bool) -> dict[str, float]:
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


class IntervalReporter(Hook):
    """A hook that reports interval means every ``every`` steps (default ``args.log_steps``)
    and once at the end of training for a partial interval. Subclasses implement
    ``_report_interval``; it runs on every rank (the flush is a small all-reduce)."""

    def __init__(self, every: int | None = None) -> None:
        if every is not None and every < 1:
            raise ValueError(f"`every` must be >= 1 or None, but is {every!r}.")
        self._every = every
        self._stats = IntervalStats()

    def before_train(self, trainer: TrainerView) -> None:
        self._stats.start()

    def after_step(self, trainer: TrainerView, output: StepOutput) -> None:
        self._stats.add(trainer, output)
        if report_due(self._every, trainer.args.log_period, trainer.state):
            self._report_interval(trainer, self._stats.flush(trainer, across_ranks=True))

    def after_train(self, trainer: TrainerView) -> None:
        if len(self._stats):  # same step count on every rank: the all-reduce stays matched
            self._report_interval(trainer, self._stats.flush(trainer, across_ranks=True))

    def _report_interval(self, trainer: TrainerView, vals: dict[str, float]) -> None:
        raise NotImplementedError
