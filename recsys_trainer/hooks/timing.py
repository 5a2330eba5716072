"""``StepTimings``: where the last training step's wall time went, as the Trainer measured it.

The Trainer takes ``time.perf_counter()`` stamps around the batch fetch, the forward/backward
passes and the optimizer step (a handful of Python calls per step, no device sync). On CUDA these
are host-side times: kernels run asynchronously, so a long GPU step shows up wherever the host
next waits (usually the fetch's all-reduce or the optimizer). They are exact on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class StepTimings:
    """Seconds spent in the parts of the most recent training step (``trainer.timings``).

    Read them in ``after_step``: the Trainer zeroes them right after ``after_step`` returns.
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
