"""A user's own model, trained from YAML by import path (``examples/configs/custom_model.yaml``):

    PYTHONPATH=examples torchrun --standalone --nproc_per_node=2 -m recsys_trainer \\
        examples/configs/custom_model.yaml

Any ``nn.Module`` whose constructor takes plain keyword arguments works the same way; the
config's ``model`` section is ``{class: my_models.WideAndDeep, <its arguments>}``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_trainer.batch import Batch
from recsys_trainer.models import BINARY_LABELS, weighted_bce_with_logits


class WideAndDeep(nn.Module):
    """Wide: a summed small embedding per feature (a hashed linear model); deep: an MLP over the
    concatenated embeddings and the log1p of the dense counts. Tables on the meta device:
    the Trainer shards them."""

    label_range = BINARY_LABELS  # its loss's labels: the reader names a row outside them

    def __init__(self, sparse_features: list[str], num_embeddings: int, num_dense: int,
                 embedding_dim: int = 16, hidden: list[int] | None = None) -> None:
        super().__init__()

        def tables(prefix: str, dim: int) -> EmbeddingBagCollection:
            return EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=f"{prefix}_{f}", embedding_dim=dim,
                                           num_embeddings=num_embeddings, feature_names=[f])
                        for f in sparse_features],
                device=torch.device("meta"))

        self.deep_tables = tables("deep", embedding_dim)
        # Width 4, summed: FBGEMM needs table widths divisible by 4 (1 is refused).
        self.wide_tables = tables("wide", 4)
        layers: list[nn.Module] = []
        width = num_dense + embedding_dim * len(sparse_features)
        for h in hidden or [64, 32]:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.deep = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        dense = torch.log1p(batch.dense.clamp_min(0))  # counts span orders of magnitude
        deep = self.deep(torch.cat([dense, self.deep_tables(batch.sparse).values()], dim=1))
        wide = self.wide_tables(batch.sparse).values().sum(dim=1, keepdim=True)
        logits = (deep + wide).squeeze(-1)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()
