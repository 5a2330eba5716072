"""``DCNClassifier``: DCN-v2 (Wang et al., 2021, "DCN V2: Improved Deep & Cross Network"), the
explicit-cross ranking model TorchRec ships as ``DLRM_DCN`` and MLPerf trains as DLRM-dcnv2.

The input of the cross network is one vector per row, ``x0 = [dense_arch(dense), e_1, ...,
e_F]`` (the bottom MLP's output and the pooled embeddings, each ``embedding_dim`` wide, as in
torchrec's ``InteractionDCNArch``). A cross layer is ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``:
each layer raises the degree of the feature crosses by one, ``num_cross_layers`` layers model
crosses up to degree ``num_cross_layers + 1`` explicitly. ``W_l`` is full rank
(``cross="full"``: torchrec's ``CrossNet``), the product ``U_l V_l`` of rank ``low_rank``
(``"low_rank"``: ``LowRankCrossNet``) or a gated mixture of ``num_experts`` such products with a
non-linearity in the low-rank space (``"mixture"``: ``LowRankMixtureCrossNet``, DCN-v2's
"DCN-Mix"). The deep part (an MLP) either follows the cross network (``structure="stacked"``)
or reads ``x0`` beside it, the two outputs concatenated (``"parallel"``), then one logit.

Like ``DLRMClassifier``: tables ``t_<feature>`` on the meta device (DMP materialises the
shards), per-table optimizers by those names, ``dynamic`` tables, ``(loss, logits)`` with the
weighted BCE, and the serving contract (``serving_logits``) shared with training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, SparseArch
from torchrec.modules.crossnet import CrossNet, LowRankCrossNet, LowRankMixtureCrossNet

from recsys_trainer.batch import Batch
from recsys_trainer.dynamic import DynamicTable
from recsys_trainer.models.blocks import (
    TableInit,
    init_last_bias,
    mlp,
    pooled_tables,
    stack_pooled,
)
from recsys_trainer.models.losses import BinaryClassifier, weighted_bce_with_logits

CrossKind = Literal["full", "low_rank", "mixture"]
Structure = Literal["stacked", "parallel"]


def cross_network(kind: CrossKind, width: int, num_layers: int, low_rank: int,
                  num_experts: int) -> nn.Module:
    """TorchRec's cross network of ``kind`` over ``width`` inputs (see the module docstring)."""
    if kind == "full":
        return CrossNet(in_features=width, num_layers=num_layers)
    if kind == "low_rank":
        return LowRankCrossNet(in_features=width, num_layers=num_layers, low_rank=low_rank)
    return LowRankMixtureCrossNet(in_features=width, num_layers=num_layers,
                                  num_experts=num_experts, low_rank=low_rank)


class DCNClassifier(BinaryClassifier):
    """DCN-v2 over pooled tables and dense features, one logit per row (module docstring).

    Args:
        sparse_features: one pooled table ``t_<name>`` per feature (``batch.sparse`` keys).
        num_dense: dense inputs (``batch.dense`` width).
        num_embeddings: rows per table (one int, or one per feature).
        embedding_dim: the width of every table and of the bottom MLP's output.
        dense_arch: the bottom MLP (its last width is set to ``embedding_dim``).
        cross: ``"full"``, ``"low_rank"`` or ``"mixture"``.
        num_cross_layers: cross layers (the highest explicit cross has degree layers + 1).
        low_rank: the rank of ``"low_rank"`` / ``"mixture"`` layers.
        num_experts: the experts of a ``"mixture"`` layer.
        structure: ``"stacked"`` (cross, then deep) or ``"parallel"`` (side by side).
        deep_arch: the deep MLP's widths (ReLU after each); ``()``: no deep part.
        dense_log1p, prior_ctr, table_device, dynamic, embedding_init, embedding_dtype: as
            ``DLRMClassifier``'s.
    """

    def __init__(
        self,
        sparse_features: list[str],
        num_dense: int,
        num_embeddings: int | list[int] = 10_000,
        embedding_dim: int = 16,
        dense_arch: tuple[int, ...] = (64,),
        *,
        cross: CrossKind = "mixture",
        num_cross_layers: int = 3,
        low_rank: int = 64,
        num_experts: int = 4,
        structure: Structure = "stacked",
        deep_arch: tuple[int, ...] = (128, 64),
        dense_log1p: bool = False,
        prior_ctr: float | None = None,
        table_device: str = "meta",
        dynamic: DynamicTable | Mapping[str, DynamicTable] | None = None,
        embedding_init: TableInit | Mapping[str, TableInit] | None = None,
        embedding_dtype: str | Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if cross not in ("full", "low_rank", "mixture"):
            raise ValueError(f"`cross` must be 'full', 'low_rank' or 'mixture', but is {cross!r}.")
        if structure not in ("stacked", "parallel"):
            raise ValueError(f"`structure` must be 'stacked' or 'parallel', but is {structure!r}.")
        for name, value in (("num_cross_layers", num_cross_layers), ("low_rank", low_rank),
                            ("num_experts", num_experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, but is {value!r}.")
        if structure == "parallel" and not deep_arch:
            raise ValueError("structure='parallel' puts a deep part beside the cross network: "
                             "give `deep_arch` (e.g. (128, 64)), or use structure='stacked'.")
        self.dense_log1p, self.structure = dense_log1p, structure
        if dense_arch[-1] != embedding_dim:
            dense_arch = (*dense_arch, embedding_dim)
        ebc = pooled_tables(sparse_features, num_embeddings, embedding_dim, dynamic, embedding_init,
                            table_device, embedding_dtype)
        self.sparse_arch = SparseArch(ebc)  # type: ignore[arg-type]  # dynamic: EBC look-alikes
        self.dense_arch = DenseArch(num_dense, list(dense_arch))
        width = embedding_dim * (len(sparse_features) + 1)
        self.cross = cross_network(cross, width, num_cross_layers, low_rank, num_experts)
        deep_in = width
        self.deep = mlp([deep_in, *deep_arch])
        deep_out = deep_arch[-1] if deep_arch else width
        self.head = nn.Linear(deep_out + (width if structure == "parallel" else 0), 1)
        if prior_ctr is not None:
            init_last_bias(self.head, prior_ctr, "`prior_ctr`")

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(batch.dense, self.sparse_arch(batch.sparse))
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()

    def _logits(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """After the lookups (``embedded``: ``[B, F, D]``): the part training and serving share."""
        dense = torch.log1p(dense.clamp_min(0)) if self.dense_log1p else dense
        x0 = torch.cat([self.dense_arch(dense), embedded.flatten(1)], dim=1)
        if self.structure == "stacked":
            out = self.deep(self.cross(x0))
        else:
            out = torch.cat([self.cross(x0), self.deep(x0)], dim=1)
        return self.head(out).squeeze(-1)

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor],
                       ) -> torch.Tensor:
        """The logits of ``forward`` from looked-up embeddings (``pooled``: ``[B, D]`` per
        feature): the serving contract (``recsys_trainer.serving.exporting.export``)."""
        return self._logits(dense, stack_pooled(self.sparse_arch, pooled))


__all__ = ["CrossKind", "DCNClassifier", "Structure", "cross_network"]
