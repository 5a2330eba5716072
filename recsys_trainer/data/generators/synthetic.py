"""In-memory synthetic click data with a planted, learnable signal (for tests and examples).

Each sparse feature's id carries a fixed hidden score; the label is Bernoulli(sigmoid(sum of the
ids' scores + w . dense + bias)). A model that learns the id scores beats chance by a margin the
generator can report (``oracle_auc``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch


@dataclass(frozen=True)
class PlantedSignal:
    """The hidden parameters of the generator (same on every rank for the same seed)."""

    id_scores: np.ndarray  # [num_sparse, num_embeddings]
    dense_w: np.ndarray  # [num_dense]
    bias: float

    @staticmethod
    def make(num_sparse: int, num_dense: int, num_embeddings: int, seed: int = 1234,
             strength: float = 1.0, bias: float = -1.0) -> PlantedSignal:
        rng = np.random.default_rng(seed)
        return PlantedSignal(
            id_scores=rng.normal(0.0, strength, size=(num_sparse, num_embeddings)).astype(np.float32),
            dense_w=rng.normal(0.0, strength / max(1, num_dense) ** 0.5, size=num_dense).astype(np.float32),
            bias=bias,
        )


def synthetic_batches(
    num_batches: int,
    batch_size: int,
    sparse_features: list[str],
    num_dense: int,
    num_embeddings: int,
    *,
    seed: int = 0,
    signal: PlantedSignal | None = None,
    signal_seed: int = 1234,
) -> list[Batch]:
    """``num_batches`` batches, one id per sparse feature per row (pooling factor 1)."""
    sig = signal or PlantedSignal.make(len(sparse_features), num_dense, num_embeddings, signal_seed)
    rng = np.random.default_rng(seed)
    out: list[Batch] = []
    f = len(sparse_features)
    for _ in range(num_batches):
        dense = rng.normal(size=(batch_size, num_dense)).astype(np.float32)
        # Zipf-like popularity, as in real id logs.
        ids = (rng.zipf(1.3, size=(f, batch_size)) - 1) % num_embeddings
        logit = sig.id_scores[np.arange(f)[:, None], ids].sum(0) + dense @ sig.dense_w + sig.bias
        labels = (rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        kjt = KeyedJaggedTensor(
            keys=list(sparse_features),
            values=torch.from_numpy(ids.reshape(-1).astype(np.int64)),
            lengths=torch.ones(f * batch_size, dtype=torch.int32),
            stride=batch_size,
        )
        out.append(Batch(dense=torch.from_numpy(dense), sparse=kjt, labels=torch.from_numpy(labels)))
    return out


__all__ = ["PlantedSignal", "synthetic_batches"]
