"""``ProfilerHook``: a ``torch.profiler`` trace of a chosen range of training steps."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from recsys_trainer.hooks.base import Hook, StepOutput, TrainerView
from recsys_trainer.hooks.tensorboard import default_tensorboard_dir

logger = logging.getLogger("recsys_trainer")


class ProfilerHook(Hook):
    """Profiles training steps ``start_step .. start_step + num_steps - 1`` (1-based global
    step numbers, as ``after_step`` sees them) and writes a Chrome/Perfetto trace
    (``*.pt.trace.json``, one per rank) with ``torch.profiler.tensorboard_trace_handler``.

    The default ``trace_dir`` is ``<output_dir>/tensorboard/profiler``, inside the TensorBoard
    log dir, where the PyTorch profiler TensorBoard plugin finds it (``pip install
    torch-tb-profiler``); chrome://tracing and ui.perfetto.dev open the files directly.

    Args:
        ranks: which ranks profile (default: all; each writes its own trace).
        record_shapes / profile_memory / with_stack: passed to ``torch.profiler.profile``.
    """

    def __init__(
        self,
        start_step: int = 10,
        num_steps: int = 5,
        trace_dir: str | None = None,
        ranks: Sequence[int] | None = None,
        record_shapes: bool = True,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        if start_step < 1:
            raise ValueError(f"`start_step` must be >= 1, but is {start_step!r}.")
        if num_steps < 1:
            raise ValueError(f"`num_steps` must be >= 1, but is {num_steps!r}.")
        self.start_step, self.num_steps = start_step, num_steps
        self._trace_dir = trace_dir
        self._ranks = None if ranks is None else set(ranks)
        self._record_shapes, self._profile_memory = record_shapes, profile_memory
        self._with_stack = with_stack
        self._prof: Any = None
        self._done = False

    @property
    def trace_dir(self) -> str | None:
        return self._trace_dir

    def trace_files(self) -> list[str]:
        """The trace files written so far in ``trace_dir``."""
        if self._trace_dir is None or not os.path.isdir(self._trace_dir):
            return []
        return sorted(os.path.join(self._trace_dir, f) for f in os.listdir(self._trace_dir)
                      if f.endswith(".pt.trace.json") or f.endswith(".pt.trace.json.gz"))

    def before_step(self, trainer: TrainerView) -> None:
        if self._done or self._prof is not None:
            return
        if trainer.state.global_step + 1 != self.start_step:
            return
        if self._ranks is not None and trainer.rank not in self._ranks:
            return
        if self._trace_dir is None:
            self._trace_dir = os.path.join(default_tensorboard_dir(trainer), "profiler")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                self._trace_dir, worker_name=f"rank{trainer.rank}"
            ),
            record_shapes=self._record_shapes,
            profile_memory=self._profile_memory,
            with_stack=self._with_stack,
        )
        self._prof.start()

    def after_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if self._prof is not None and trainer.state.global_step >= self.start_step + self.num_steps - 1:
            self._stop(trainer)

    def after_train(self, trainer: TrainerView) -> None:
        self._stop(trainer)  # training ended inside the range: keep what was recorded

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self._stop(trainer)

    def _stop(self, trainer: TrainerView) -> None:
        if self._prof is None:
            return
        self._prof.stop()  # runs on_trace_ready: writes the trace
        self._prof = None
        self._done = True
        logger.info("rank %d: profiler trace written to %s", trainer.rank, self._trace_dir)
