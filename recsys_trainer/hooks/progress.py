"""``ProgressHook``: tqdm progress bars for training and evaluation on rank 0."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from recsys_trainer.hooks.base import Hook, StepOutput, TrainerView


class ProgressHook(Hook):
    """A tqdm bar for training (step, samples/s, loss) and one per evaluation, on rank 0.

    Args:
        enabled: True/False to force; None (default): on only when ``stream`` is a terminal,
            so logs of batch jobs and CI stay free of bar redraws.
        stream: where the bar is drawn (default ``sys.stderr``).
        postfix_every: refresh loss and samples/s every this many steps. The loss shown is rank
            0's (no collective), read as a float only then (a device sync on CUDA).
    """

    def __init__(self, enabled: bool | None = None, stream: IO[str] | None = None,
                 postfix_every: int = 10) -> None:
        if postfix_every < 1:
            raise ValueError(f"`postfix_every` must be >= 1, but is {postfix_every!r}.")
        self._enabled = enabled
        self._stream = stream
        self._postfix_every = postfix_every
        self.train_bar: Any = None
        self.eval_bar: Any = None
        self._samples = 0
        self._t0 = 0.0

    def active(self, trainer: TrainerView) -> bool:
        """Whether bars are drawn in this process."""
        if not trainer.is_rank_zero:
            return False
        if self._enabled is not None:
            return self._enabled
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    def _bar(self, desc: str, total: int | None, initial: int = 0) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, file=self.stream, dynamic_ncols=True,
                    leave=desc == "train", unit="step")

    def before_train(self, trainer: TrainerView) -> None:
        if self.active(trainer):
            self.train_bar = self._bar("train", trainer.args.train_steps, trainer.state.global_step)
        self._samples, self._t0 = 0, time.perf_counter()

    def after_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if self.train_bar is None:
            return
        self._samples += output.num_samples
        self.train_bar.update(1)
        if trainer.state.global_step % self._postfix_every == 0:
            now = time.perf_counter()
            sps = self._samples * trainer.world_size / max(now - self._t0, 1e-9)
            self.train_bar.set_postfix(loss=f"{float(output.loss):.4f}", samples_s=f"{sps:.0f}",
                                       refresh=False)
            self._samples, self._t0 = 0, now

    def before_evaluate(self, trainer: TrainerView) -> None:
        if self.active(trainer):
            self.eval_bar = self._bar("eval", trainer.args.eval_steps)

    def after_eval_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if self.eval_bar is not None:
            self.eval_bar.update(1)

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        if self.eval_bar is not None:
            self.eval_bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}")
            self.eval_bar.close()
            self.eval_bar = None

    def after_train(self, trainer: TrainerView) -> None:
        self._close()

    def end(self, trainer: TrainerView) -> None:
        self._close()

    def _close(self) -> None:
        for name in ("train_bar", "eval_bar"):
            bar = getattr(self, name)
            if bar is not None:
                bar.close()
                setattr(self, name, None)
