"""``DLRMClassifier``: torchrec's DLRM (bottom MLP, pairwise interactions, top MLP) with a
weighted BCE loss. Its ``forward(batch)`` returns ``(loss, logits)``; the loss is functional and
honours ``batch.weights`` (``models.losses``), so the model stays fx-traceable for TorchRec's
pipelines."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchrec.models.dlrm import DLRM

from recsys_trainer.batch import Batch
from recsys_trainer.dynamic import DynamicTable
from recsys_trainer.models.blocks import (
    TableInit,
    init_last_bias,
    pooled_tables,
    stack_pooled,
)
from recsys_trainer.models.losses import BinaryClassifier, weighted_bce_with_logits


class DLRMClassifier(BinaryClassifier):
    """torchrec's DLRM (bottom MLP, pairwise interactions, top MLP) with a weighted BCE loss.

    Tables are created on the meta device: ``DistributedModelParallel`` materialises only the
    shards each rank owns, initialised by ``embedding_init`` (one ``TableInit`` or one per table
    name, see ``make_tables``; default torchrec's U(-sqrt(1/rows), sqrt(1/rows))).

    ``dynamic`` (``recsys_trainer.dynamic``): one ``DynamicTable`` makes every table dynamic
    (raw ids, ``num_slots`` rows each; ``num_embeddings`` is not used); ``{feature:
    DynamicTable}`` makes only those features' tables dynamic, each with its own settings, and
    the others stay hashed with their ``num_embeddings`` rows (feed those ids below it, as
    without ``dynamic``).
    """

    def __init__(
        self,
        sparse_features: list[str],
        num_dense: int,
        num_embeddings: int | list[int] = 10_000,
        embedding_dim: int = 16,
        dense_arch: tuple[int, ...] = (64,),
        over_arch: tuple[int, ...] = (64, 1),
        table_device: str = "meta",
        dense_log1p: bool = False,
        prior_ctr: float | None = None,
        dynamic: DynamicTable | Mapping[str, DynamicTable] | None = None,
        embedding_init: TableInit | Mapping[str, TableInit] | None = None,
        embedding_dtype: str | Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        # Count-valued dense inputs (Criteo's I1..I13) span orders of magnitude; log1p is the
        # usual normalisation and keeps the bottom MLP well conditioned.
        self.dense_log1p = dense_log1p
        if dense_arch[-1] != embedding_dim:
            dense_arch = (*dense_arch, embedding_dim)
        ebc = pooled_tables(sparse_features, num_embeddings, embedding_dim, dynamic, embedding_init,
                            table_device, embedding_dtype)
        self.dlrm = DLRM(
            embedding_bag_collection=ebc,  # type: ignore[arg-type]  # dynamic: EBC look-alikes
            dense_in_features=num_dense,
            dense_arch_layer_sizes=list(dense_arch),
            over_arch_layer_sizes=list(over_arch),
        )
        if prior_ctr is not None:
            # Start at the base rate instead of 0.5: with rare clicks (CTR ~0.5%) the first
            # windows' log loss is otherwise dominated by unlearning the bias.
            init_last_bias(self.dlrm.over_arch, prior_ctr, "`prior_ctr`")

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(batch.dense, self.dlrm.sparse_arch(batch.sparse))
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()

    def _logits(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """torchrec ``DLRM.forward`` after its sparse arch (``embedded``: ``[B, F, D]``): the
        part training and serving share."""
        dense = torch.log1p(dense.clamp_min(0)) if self.dense_log1p else dense
        d = self.dlrm
        return d.over_arch(d.inter_arch(dense_features=d.dense_arch(dense),
                                        sparse_features=embedded)).squeeze(-1)

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor],
                       ) -> torch.Tensor:
        """The logits of ``forward`` from looked-up embeddings (``pooled``: ``[B, D]`` per
        feature): the serving contract (``recsys_trainer.serving.exporting.export``)."""
        return self._logits(dense, stack_pooled(self.dlrm.sparse_arch, pooled))


__all__ = ["DLRMClassifier"]
