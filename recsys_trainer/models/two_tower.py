"""``TwoTowerModel``: a two-tower retrieval (candidate generation) model. It follows the
retrieval models' contract, losses and negatives (``models.retrieval_base``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.models.blocks import tower
from recsys_trainer.models.retrieval_base import (
    RetrievalBase,
    RetrievalOptions,
    takes_retrieval_options,
)
from recsys_trainer.retrieval.checks import check_one_id_per_row

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions comes with torch
    from typing_extensions import Unpack

# ``torch.fx.wrap`` patches a function in the globals of the module that calls it: a leaf this
# module calls by name is registered here too, so that it stays one node of the traced graph.
torch.fx.wrap("check_one_id_per_row")


class TwoTowerModel(RetrievalBase):
    """A two-tower retrieval model (DSSM / YouTube-DNN style) over sharded tables.

    * User tower: the pooled user features (``batch.sparse``, one table ``t_<name>`` each, in
      an ``EmbeddingBagCollection``), the mean of the history items (``history_feature``,
      looked up in the item table) and, with ``recent_items=r``, the last ``r`` history items
      one by one (zeros where the history is shorter; YouTube-DNN's "last watched"), through
      an MLP to ``tower_dims[-1]``.
    * Item tower: the item's embedding (``item_feature``, the item table) and its side
      features (``item_side_features``: ``{name: rows}``, one id per row, in
      ``batch.sequence``; for items outside a batch they come from ``item_catalog``), through
      an MLP to the same width.
    * Score: the dot product of the two, L2-normalised when ``normalize`` (then cosine), over
      ``temperature``; loss and negatives as in the module docstring.

    The ``FeatureSpec`` that feeds it: ``sparse=[SparseFeature(name=f) for f in
    user_features]``, ``sequence=[SequenceFeature(name=item_feature, num_embeddings=num_items),
    SequenceFeature(name=history_feature, num_embeddings=num_items, max_len=max_len), *one
    SequenceFeature per side feature]``, in the order of ``sequence_keys``.

    Args:
        user_features: pooled user features (``batch.sparse`` keys).
        num_items: rows of the item table; the corpus is item ids ``[0, num_items)``.
        user_num_embeddings: rows per user table (one int or one per feature).
        item_side_features: ``{feature: rows}`` of item side features.
        item_catalog: a parquet file (or mapping of arrays) with ``item_id_column`` and one
            column per side feature, listing every item once (``load_item_catalog``); needed
            with side features.
        history_feature: the history key, or None for a user tower without history.
        recent_items: how many of the most recent history items the user tower also sees
            individually (0: the mean only, an order-free user tower).
        tower_dims: hidden widths and the output width of both towers.

    The other keywords (``embedding_dim``, ``max_len``, ``temperature``, ``loss``, ...) are
    ``models.retrieval_base.RetrievalOptions``, which ``SASRecModel`` takes too, with the same defaults.
    """

    @takes_retrieval_options
    def __init__(
        self,
        user_features: Sequence[str],
        *,
        num_items: int,
        history_feature: str | None = "hist_item",
        item_side_features: Mapping[str, int] | None = None,
        recent_items: int = 0,
        tower_dims: Sequence[int] = (64, 32),
        num_uniform_negatives: int = 0,
        **options: Unpack[RetrievalOptions],
    ) -> None:
        side = dict(item_side_features or {})
        super().__init__(num_items=num_items, history_feature=history_feature,
                         user_features=user_features, side_tables=side, history_side_features={},
                         num_uniform_negatives=num_uniform_negatives, **options)
        max_len, embedding_dim = self.max_len, self.embedding_dim
        if not self.user_features and history_feature is None:
            raise ValueError("the user tower needs user features, a history feature, or both.")
        if not isinstance(recent_items, int) or not 0 <= recent_items <= max_len or (
                recent_items and history_feature is None):
            raise ValueError(f"`recent_items` must be an int in [0, max_len={max_len}] (0 without a "
                             f"history feature), but is {recent_items!r}.")
        self.recent_items = recent_items
        dims = list(tower_dims)
        user_in = embedding_dim * (len(self.user_features) + (history_feature is not None) + recent_items)
        self.user_tower = tower([user_in, *dims])
        self.item_tower = tower([embedding_dim * (1 + len(side)), *dims])

    def _item_vectors(self, seq: dict[str, JaggedTensor], rows: slice) -> torch.Tensor:
        parts = [seq[self.item_feature].values()[rows]]
        parts += [seq[name].values()[rows] for name in self.side_features]
        return self._out(self.item_tower(torch.cat(parts, dim=1)))

    def _user_query(self, pooled: torch.Tensor | None, hist: torch.Tensor | None,
                    lengths: torch.Tensor | None) -> torch.Tensor:
        """``[B, D]`` user-tower output from the pooled user features ``[B, F * E]`` (in
        ``user_features`` order) and the left-aligned history ``[B, max_len, E]`` with its
        lengths ``[B]``: the code training and the serving export share."""
        user_parts = [] if pooled is None else [pooled]
        if hist is not None and lengths is not None:
            mask = (self.positions[: self.max_len].unsqueeze(0) < lengths.unsqueeze(1)).to(hist.dtype)
            mean = (hist * mask.unsqueeze(-1)).sum(1) / lengths.clamp_min(1).unsqueeze(1).to(hist.dtype)
            user_parts.append(mean)
            if self.recent_items:
                # The j-th most recent item sits at index length - 1 - j (left-aligned history).
                back = lengths.unsqueeze(1) - 1 - self.positions[: self.recent_items].unsqueeze(0)
                recent = torch.gather(hist, 1, back.clamp_min(0).unsqueeze(-1).expand(-1, -1, hist.shape[-1]))
                recent = recent * (back >= 0).unsqueeze(-1).to(hist.dtype)
                user_parts.append(recent.flatten(1))
        return self._out(self.user_tower(torch.cat(user_parts, dim=1)))

    def serving_sequence_lengths(self) -> dict[str, int]:
        """The serving contract (``recsys_trainer.serving``): the history's padded length."""
        return {self.history_feature: self.max_len} if self.history_feature is not None else {}

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        """The serving contract: the user tower's query embedding ``[B, D]`` (what the item
        export's vectors are scored against), from the scorer's lookups; export it with
        ``activation="none"``. The candidate item and its side features are not read."""
        hf = self.history_feature
        return self._user_query(self._serving_user(pooled), sequences[hf] if hf is not None else None,
                                lengths[hf] if hf is not None else None)

    def _step(self, batch: Batch, seq_out: Any, pooled: Any,
              neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.sequence is not None
        b = batch.labels.shape[0]
        seq = self._by_key(seq_out)
        cand = seq[self.item_feature]
        check_one_id_per_row(cand.lengths()[:b], self.item_feature)
        target_ids = batch.sequence[self.item_feature].values()
        # The item tower first (the batch's items and the uniform negatives in one call), so
        # that the cross-rank gather of the items is in flight while the user tower runs (and
        # in backward, the all-reduce of their gradient while the user tower's backward runs).
        vectors = self._item_vectors(seq, slice(None))
        items = vectors[:b]
        negatives = vectors[b:] if neg_ids is not None else None
        weights = batch.weights
        pending = self._launch_candidates(items, target_ids, weights)
        outputs: dict[str, torch.Tensor] = {}
        hist = lengths = None
        if self.history_feature is not None:
            hist, lengths = self._history(seq, b)
            outputs["history_lengths"] = lengths
            outputs["history_ids"] = batch.sequence[self.history_feature].values()
        query = self._user_query(self._pooled_user(pooled), hist, lengths)
        loss = self._loss(query, items, target_ids, weights, negatives, neg_ids, pending)
        outputs["query"] = query.detach()
        outputs["target"] = target_ids
        return loss, outputs


__all__ = ["TwoTowerModel"]
