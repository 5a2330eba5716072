"""``SparseDistPipeline``: a window trained through TorchRec's ``TrainPipelineSparseDist``.

The pipeline copies batch i+2 to the device and starts batch i+1's sparse input all-to-all
while batch i runs forward and backward. It pulls batches ahead from the iterator it is given,
which is why the cross-rank exit flag lives inside ``SyncedIterator.__next__``: all ranks still
stop at the same fetch and train the same number of batches. It calls ``DenseStep`` as its
optimizer (``zero_grad`` before the forward, ``step`` after the backward), so the dense update
is the plain loop's, and runs the caller's ``forward`` (hooks, autocast) on each batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from recsys_trainer.batch import Batch
from recsys_trainer.hooks.base import MicroBatchOutput
from recsys_trainer.step import DenseStep


class SparseDistPipeline:
    """Trains windows of a sharded model with ``TrainPipelineSparseDist``.

    Args:
        model: the ``DistributedModelParallel`` model (fx-traceable: docs/models.md, "The model
            contract").
        dense_step: the dense update the pipeline runs after each backward.
        device: the model's device.
        forward: ``batch -> (loss, outputs)``, called once per trained batch, in order.
    """

    def __init__(self, model: nn.Module, dense_step: DenseStep, device: torch.device,
                 forward: Callable[[Batch], tuple[torch.Tensor, Any]]) -> None:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self._forward = forward
        self._last: MicroBatchOutput | None = None
        self._pipe = TrainPipelineSparseDist(
            model, dense_step, device, execute_all_batches=True,  # type: ignore[arg-type]
            custom_model_fwd=self._record_forward,  # type: ignore[arg-type]
        )

    def _record_forward(self, batch: Batch) -> tuple[torch.Tensor, Any]:
        loss, outputs = self._forward(batch)
        self._last = MicroBatchOutput(batch, loss.detach(), outputs)
        return loss, outputs

    def train_window(self, batches: Iterator[Batch],
                     after_batch: Callable[[MicroBatchOutput], bool]) -> bool:
        """Train every batch of ``batches``; ``after_batch`` runs after each one's dense update
        and returns True to end the window early. Returns True when it did.

        The sharded modules' own forward is restored on the way out (evaluation uses it).
        Batches fetched ahead and not trained are not counted: the data position counts
        *trained* batches, so they are read again on resume.
        """
        self._pipe.reset()
        try:
            while True:
                try:
                    self._pipe.progress(batches)
                except StopIteration:
                    return False
                assert self._last is not None
                if after_batch(self._last):
                    return True
        finally:
            self._pipe.detach()
