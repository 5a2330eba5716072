"""A synthetic click stream over raw 64-bit ids with a planted per-id signal.

Each sparse feature draws ids from ``num_ids`` distinct raw ids spread over the int64 range
(``base + k * stride``, k Zipf-distributed so a few ids are frequent and most are rare, as in
real logs). Every id has its own effect on the click logit, drawn once; the label is Bernoulli
of the sigmoid of the sum of the row's id effects. A model can only learn an id's effect if the
id has its own row: that is what separates a hashed table that shares rows from a dynamic one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch

_BASE = 1_000_000_007_000_000_000  # ids far above any table size: they must not be row numbers
_STRIDE = 7_919_000_003


@dataclass(frozen=True)
class IdStream:
    """``num_ids`` distinct ids per feature, Zipf exponent ``zipf``, effect scale ``strength``."""

    features: tuple[str, ...]
    num_ids: int
    num_dense: int = 4
    zipf: float = 1.05
    strength: float = 1.5
    seed: int = 0

    def _effects(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        return rng.normal(0.0, self.strength, size=(len(self.features), self.num_ids))

    def raw_id(self, k: np.ndarray) -> np.ndarray:
        """The raw id of the k-th id (any int64 in ``[0, 2**63 - 1)``)."""
        return (np.int64(_BASE) + k.astype(np.int64) * np.int64(_STRIDE)).astype(np.int64)

    def batches(self, num_batches: int, batch_size: int, seed: int) -> list[Batch]:
        """``num_batches`` batches, one id per feature per row; ``seed`` picks the rows."""
        rng = np.random.default_rng(seed)
        effects = self._effects()
        p = 1.0 / np.arange(1, self.num_ids + 1) ** self.zipf
        p /= p.sum()
        # A fixed random order so the frequent ids are not the smallest ones.
        order = np.random.default_rng(self.seed + 1).permutation(self.num_ids)
        out: list[Batch] = []
        nf = len(self.features)
        for _ in range(num_batches):
            k = order[rng.choice(self.num_ids, size=(nf, batch_size), p=p)]
            logit = effects[np.arange(nf)[:, None], k].sum(axis=0) - 0.5
            labels = rng.random(batch_size) < 1.0 / (1.0 + np.exp(-logit))
            ids = torch.from_numpy(self.raw_id(k).reshape(-1))
            sparse = KeyedJaggedTensor(
                keys=list(self.features), values=ids,
                lengths=torch.ones(nf * batch_size, dtype=torch.int32), stride=batch_size)
            out.append(Batch(
                dense=torch.from_numpy(rng.normal(size=(batch_size, self.num_dense)).astype(np.float32)),
                sparse=sparse, labels=torch.from_numpy(labels.astype(np.float32))))
        return out
