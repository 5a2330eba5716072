"""``MMoEClassifier``: a multi-gate mixture of experts (Ma et al., 2018) on a DLRM bottom, one
logit per task (shared-bottom with one expert). The loss is the task-weighted sum of each
task's weighted BCE (``models.losses.multi_task_bce_with_logits``); like every bundled ranking
model it is functional and the model fx-traceable."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, SparseArch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_trainer.batch import Batch
from recsys_trainer.models.blocks import (
    check_task_weights,
    check_tasks,
    init_task_priors,
    make_tables,
    mlp,
    stack_pooled,
    tower,
)
from recsys_trainer.models.losses import BinaryClassifier, multi_task_bce_with_logits


class MMoEClassifier(BinaryClassifier):
    """Multi-gate mixture of experts (Ma et al., 2018) on a DLRM bottom: one logit per task.

    The DLRM's dense arch, pooled tables and pairwise interaction make one shared vector; each
    of ``num_experts`` expert MLPs maps it, each task mixes the experts with its own softmax
    gate and ends in its own tower. ``num_experts=1`` is the shared-bottom model. Labels:
    ``batch.labels [B, len(tasks)]`` in ``tasks`` order (``FeatureSpec(labels=tasks)``).
    Output: logits ``[B, len(tasks)]``; loss: the ``task_weights``-weighted sum of each task's
    weighted BCE (``models.multi_task_bce_with_logits``).
    """

    def __init__(
        self,
        sparse_features: list[str],
        num_dense: int,
        tasks: Sequence[str],
        *,
        num_embeddings: int | list[int] = 10_000,
        embedding_dim: int = 16,
        dense_arch: tuple[int, ...] = (64,),
        num_experts: int = 4,
        expert_arch: tuple[int, ...] = (64, 32),
        tower_arch: tuple[int, ...] = (16,),
        task_weights: Sequence[float] | None = None,
        prior_rates: Sequence[float] | None = None,
        dense_log1p: bool = False,
        table_device: str = "meta",
    ) -> None:
        super().__init__()
        self.tasks = check_tasks(tasks)
        if num_experts < 1:
            raise ValueError(f"`num_experts` must be >= 1, but is {num_experts}.")
        self.task_weights = check_task_weights(task_weights, self.tasks)
        self.dense_log1p = dense_log1p
        if dense_arch[-1] != embedding_dim:
            dense_arch = (*dense_arch, embedding_dim)
        self.dense_arch = DenseArch(num_dense, list(dense_arch))
        self.sparse_arch = SparseArch(EmbeddingBagCollection(
            tables=make_tables(sparse_features, num_embeddings, embedding_dim),
            device=torch.device(table_device)))
        f = len(sparse_features)
        self.interaction = InteractionArch(num_sparse_features=f)
        width = embedding_dim + f * (f + 1) // 2
        self.experts = nn.ModuleList(mlp([width, *expert_arch]) for _ in range(num_experts))
        self.gates = nn.ModuleList(nn.Linear(width, num_experts) for _ in self.tasks)
        self.towers = nn.ModuleList(tower([expert_arch[-1], *tower_arch, 1]) for _ in self.tasks)
        init_task_priors(self.towers, prior_rates, self.tasks)

    def logits(self, batch: Batch) -> torch.Tensor:
        """``[B, T]`` logits, one column per task."""
        return self._logits(batch.dense, self.sparse_arch(batch.sparse))

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor],
                       ) -> torch.Tensor:
        """The logits of ``forward`` from looked-up embeddings: the serving contract
        (``recsys_trainer.serving.exporting.export``)."""
        return self._logits(dense, stack_pooled(self.sparse_arch, pooled))

    def _logits(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """After the lookups (``embedded``: ``[B, F, D]``): the part training and serving share."""
        dense = torch.log1p(dense.clamp_min(0)) if self.dense_log1p else dense
        shared = self.interaction(self.dense_arch(dense), embedded)
        experts = torch.stack([e(shared) for e in self.experts], dim=1)  # [B, E, H]
        out = []
        for gate, head in zip(self.gates, self.towers, strict=True):
            mix = torch.softmax(gate(shared), dim=-1).unsqueeze(1)  # [B, 1, E]
            out.append(head(torch.bmm(mix, experts).squeeze(1)))
        return torch.cat(out, dim=1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(batch)
        loss = multi_task_bce_with_logits(logits, batch.labels, batch.weights, self.task_weights)
        return loss, logits.detach()


__all__ = ["MMoEClassifier"]
