"""The unit of data the Trainer consumes: dense features, sparse ids as KJTs, labels, weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


@dataclass
class Batch(Pipelineable):
    """One batch for a sparse/dense model.

    Attributes:
        dense: float tensor ``[B, num_dense]`` (``num_dense`` may be 0).
        sparse: ids per pooled sparse feature, key-major, stride ``B``; passed to the
            ``EmbeddingBagCollection`` unchanged (TorchRec pipelines rely on that).
        labels: ``[B]`` (one task) or ``[B, T]`` float labels.
        weights: optional ``[B]`` per-example weights. Evaluation pads exhausted ranks with
            batches whose weights are all zero; models and metrics must honour them.
        sequence: optional ids per *unpooled* feature (behaviour sequences, and any feature
            sharing a table with one), stride ``B``; passed to an ``EmbeddingCollection``
            unchanged, so TorchRec pipelines shard and prefetch it like ``sparse``.
        passthrough: optional raw columns carried next to the tensors (request ids, user ids)
            for hooks and offline scoring; one sequence of length ``B`` per column. Never moved
            to a device and never seen by TorchRec's pipeline tracing.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    weights: torch.Tensor | None = None
    sequence: KeyedJaggedTensor | None = None
    passthrough: Mapping[str, Any] = field(default_factory=dict)

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
            sequence=None
            if self.sequence is None
            else self.sequence.to(device=device, non_blocking=non_blocking),
            passthrough=self.passthrough,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.dense.record_stream(stream)  # type: ignore[arg-type]
        self.sparse.record_stream(stream)  # type: ignore[arg-type]
        self.labels.record_stream(stream)  # type: ignore[arg-type]
        if self.weights is not None:
            self.weights.record_stream(stream)  # type: ignore[arg-type]
        if self.sequence is not None:
            self.sequence.record_stream(stream)  # type: ignore[arg-type]

    def pin_memory(self) -> Batch:
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            labels=self.labels.pin_memory(),
            weights=None if self.weights is None else self.weights.pin_memory(),
            sequence=None if self.sequence is None else self.sequence.pin_memory(),
            passthrough=self.passthrough,
        )

    def as_padding(self) -> Batch:
        """The same shapes with every weight 0: what an exhausted rank feeds during evaluation
        so that collectives inside the model stay matched while other ranks finish. Its
        passthrough columns are empty: padding rows are not data and are never written out."""
        return Batch(
            dense=self.dense,
            sparse=self.sparse,
            labels=self.labels,
            weights=torch.zeros(self.batch_size, dtype=torch.float32, device=self.labels.device),
            sequence=self.sequence,
            passthrough={},
        )
