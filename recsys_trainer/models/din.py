"""``DINClassifier``: a DLRM plus DIN-style target attention over a behaviour sequence (Zhou
et al., 2018).

Like every bundled ranking model: ``forward(batch)`` returns ``(loss, logits)``, the loss is
functional and honours ``batch.weights`` (zero-weight padding batches contribute nothing), the
KJTs reach the embedding collections unchanged and there is no data-dependent Python control
flow in ``forward``, so TorchRec's pipelines can trace it (``pipeline="sparse_dist"``).
Tables are created on the meta device; ``DistributedModelParallel`` materialises the shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch, SparseArch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_trainer.batch import Batch
from recsys_trainer.dynamic import DynamicTable, dynamic_embedding_collection
from recsys_trainer.models.blocks import init_last_bias, make_tables, mlp, stack_pooled
from recsys_trainer.models.checks import check_sequence_lengths
from recsys_trainer.models.losses import BinaryClassifier, weighted_bce_with_logits

# ``torch.fx.wrap`` patches a function in the globals of the module that calls it: the check
# stays one node of the traced graph here too.
torch.fx.wrap("check_sequence_lengths")


class TargetAttention(nn.Module):
    """DIN's activation unit: the weight of each history item is an MLP of ``[q, k, q - k,
    q * k]`` (candidate ``q``, item ``k``); the interest vector is the weighted *sum* of the
    items (no softmax, as in DIN: the sum keeps how many items relate to the candidate)."""

    def __init__(self, embedding_dim: int, arch: Sequence[int] = (32, 16)) -> None:
        super().__init__()
        self.mlp = nn.Sequential(mlp([4 * embedding_dim, *arch]), nn.Linear(arch[-1], 1))

    def forward(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``query [B, D]``, ``keys [B, L, D]``, ``mask [B, L]`` (1 for real items) -> ``[B, D]``."""
        q = query.unsqueeze(1).expand_as(keys)
        scores = self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        return torch.bmm((scores * mask).unsqueeze(1), keys).squeeze(1)


class DINClassifier(BinaryClassifier):
    """A DLRM plus DIN-style target attention over a behaviour sequence (Zhou et al., 2018).

    Inputs: ``batch.dense`` and ``batch.sparse`` as for ``DLRMClassifier`` (pooled tables, one
    per name in ``sparse_features``), and ``batch.sequence`` with two keys read by *one* item
    table (``t_<item_feature>``, an unpooled ``EmbeddingCollection``):
    ``item_feature`` (the candidate, exactly one id per row) and ``history_feature`` (the past
    items, most recent last, at most ``max_len`` per row; an empty history attends to nothing).
    The attention-pooled history and the candidate join the pooled embeddings as two more
    vectors of the DLRM's pairwise interaction. Output: one logit per row; loss: weighted BCE.
    ``item_init_max``: the item table starts uniform in ``[-item_init_max, item_init_max]``.
    ``dynamic``: make the item table a dynamic table (``recsys_trainer.dynamic``; raw item ids,
    ``dynamic.num_slots`` rows, ``num_items`` unused) read by both features.

    The ``FeatureSpec`` that feeds it: ``sequence=[SequenceFeature(name="item",
    num_embeddings=num_items), SequenceFeature(name="hist_item", num_embeddings=num_items,
    max_len=max_len)]``.
    """

    positions: torch.Tensor

    def __init__(
        self,
        sparse_features: list[str],
        num_dense: int,
        *,
        num_items: int,
        item_feature: str = "item",
        history_feature: str = "hist_item",
        max_len: int = 50,
        num_embeddings: int | list[int] = 10_000,
        embedding_dim: int = 16,
        dense_arch: tuple[int, ...] = (64,),
        attention_arch: tuple[int, ...] = (32, 16),
        over_arch: tuple[int, ...] = (64, 1),
        item_init_max: float = 0.5,
        dense_log1p: bool = False,
        prior_ctr: float | None = None,
        table_device: str = "meta",
        dynamic: DynamicTable | None = None,
    ) -> None:
        super().__init__()
        if max_len < 1 or num_items < 1:
            raise ValueError(f"`max_len` and `num_items` must be >= 1, but are {max_len} and {num_items}.")
        self.item_feature, self.history_feature, self.max_len = item_feature, history_feature, max_len
        self.dense_log1p = dense_log1p
        if dense_arch[-1] != embedding_dim:
            dense_arch = (*dense_arch, embedding_dim)
        device = torch.device(table_device)
        self.dense_arch = DenseArch(num_dense, list(dense_arch))
        self.sparse_arch = SparseArch(EmbeddingBagCollection(
            tables=make_tables(sparse_features, num_embeddings, embedding_dim), device=device))
        # One table for the candidate and the history: the attention compares them in one space.
        items = [EmbeddingConfig(
            name=f"t_{item_feature}", embedding_dim=embedding_dim,
            num_embeddings=num_items if dynamic is None else dynamic.num_slots,
            feature_names=[item_feature, history_feature],
            # Uniform(+-item_init_max): torchrec's default, +-sqrt(1/num_items), starts every
            # item near 0, where [q, k, q - k, q * k] carries no signal for the attention.
            weight_init_min=-item_init_max, weight_init_max=item_init_max)]
        self.dynamic_items = dynamic is not None
        self.items: nn.Module = (EmbeddingCollection(tables=items, device=device) if dynamic is None
                                 else dynamic_embedding_collection(items, dynamic, device))
        self.attention = TargetAttention(embedding_dim, attention_arch)
        num_vectors = len(sparse_features) + 2  # pooled tables, candidate, interest
        self.interaction = InteractionArch(num_sparse_features=num_vectors)
        self.over_arch = OverArch(
            embedding_dim + num_vectors * (num_vectors + 1) // 2, list(over_arch))
        # Positions 0..max_len-1, to mask the padding of shorter histories (not saved).
        self.register_buffer("positions", torch.arange(max_len), persistent=False)
        if prior_ctr is not None:
            init_last_bias(self.over_arch, prior_ctr, "`prior_ctr`")

    def logits(self, batch: Batch) -> torch.Tensor:
        """``[B]`` click logits."""
        dense = torch.log1p(batch.dense.clamp_min(0)) if self.dense_log1p else batch.dense
        if batch.sequence is None:  # (always false while fx traces: a Proxy is not None)
            raise ValueError(
                f"DINClassifier reads batch.sequence (keys {self.item_feature!r}, "
                f"{self.history_feature!r}), but the batch has none: declare them as "
                "FeatureSpec(sequence=[SequenceFeature(...), ...]).")
        seq = self.items(batch.sequence)
        if self.dynamic_items:
            seq = seq[0]  # a managed-collision collection returns (embeddings, remapped ids)
        cand_jt, hist_jt = seq[self.item_feature], seq[self.history_feature]
        hist_len = hist_jt.lengths()
        check_sequence_lengths(cand_jt.lengths(), hist_len, self.max_len, self.item_feature,
                               self.history_feature, model=type(self).__name__)
        candidate = cand_jt.to_padded_dense(desired_length=1).squeeze(1)  # [B, D]
        history = hist_jt.to_padded_dense(desired_length=self.max_len)  # [B, L, D]
        return self._logits(dense, self.sparse_arch(batch.sparse), candidate, history, hist_len)

    def _logits(self, dense: torch.Tensor, pooled: torch.Tensor, candidate: torch.Tensor,
                history: torch.Tensor, hist_len: torch.Tensor) -> torch.Tensor:
        """After the lookups (dense already transformed): the part training and serving share."""
        mask = (self.positions.unsqueeze(0) < hist_len.unsqueeze(1)).to(history.dtype)
        interest = self.attention(candidate, history, mask)
        vectors = torch.cat([pooled, candidate.unsqueeze(1), interest.unsqueeze(1)], dim=1)
        return self.over_arch(self.interaction(self.dense_arch(dense), vectors)).squeeze(-1)

    def serving_sequence_lengths(self) -> dict[str, int]:
        """The padded length of each sequence feature ``serving_logits`` reads."""
        return {self.item_feature: 1, self.history_feature: self.max_len}

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor],
                       ) -> torch.Tensor:
        """The logits of ``forward`` from looked-up embeddings: the serving contract
        (``recsys_trainer.serving.exporting.export``). Rows without exactly one candidate id fail as in
        training (an assert kept in the exported program)."""
        # A fixed message (the program holds no row); the Scorer names the column and row.
        torch._assert_async((lengths[self.item_feature] == 1).all(),
                            f"DIN: the candidate feature {self.item_feature!r} must have exactly "
                            "one id per row (a null in its column gives none)")
        dense = torch.log1p(dense.clamp_min(0)) if self.dense_log1p else dense
        return self._logits(dense, stack_pooled(self.sparse_arch, pooled),
                            sequences[self.item_feature].squeeze(1), sequences[self.history_feature],
                            lengths[self.history_feature])

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(batch)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()


__all__ = ["DINClassifier", "TargetAttention"]
