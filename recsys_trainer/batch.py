"""The unit of data the Trainer consumes: dense features, sparse ids as a KJT, labels, weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    """One batch for a sparse/dense model.

    Attributes:
        dense: float tensor ``[B, num_dense]`` (``num_dense`` may be 0).
        sparse: ids per sparse feature, key-major, stride ``B``; passed to the embedding
            collection unchanged (TorchRec pipelines rely on that).
        labels: ``[B]`` (one task) or ``[B, T]`` float labels.
        weights: optional ``[B]`` per-example weights. Evaluation pads exhausted ranks with
            batches whose weights are all zero; models and metrics must honour them.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def num_real_rows(self) -> int:
        """Rows that carry data (weight > 0); padding batches have 0. A CPU-side count."""
        if self.weights is None:
            return self.batch_size
        return int((self.weights > 0).sum().item())

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            weights=None
            if self.weights is None
            else self.weights.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)  # type: ignore[arg-type]
        self.sparse.record_stream(stream)  # type: ignore[arg-type]
        self.labels.record_stream(stream)  # type: ignore[arg-type]
        if self.weights is not None:
            self.weights.record_stream(stream)  # type: ignore[arg-type]

    def pin_memory(self) -> Batch:
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            labels=self.labels.pin_memory(),
            weights=None if self.weights is None else self.weights.pin_memory(),
        )

    def as_padding(self) -> Batch:
        """The same shapes with every weight 0: what an exhausted rank feeds during evaluation
        so that collectives inside the model stay matched while other ranks finish."""
        return Batch(
            dense=self.dense,
            sparse=self.sparse,
            labels=self.labels,
            weights=torch.zeros(self.batch_size, dtype=torch.float32, device=self.labels.device),
        )
