"""``SASRecModel``: a SASRec-style sequential retrieval model (Kang & McAuley, 2018), a causal
transformer over the history trained to predict the next item at every position. It shares the
retrieval models' contract, losses and negatives (``models.two_tower``'s docstring;
``models.retrieval_base``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.models.retrieval_base import (
    RetrievalBase,
    RetrievalOptions,
    takes_retrieval_options,
)
from recsys_trainer.retrieval.checks import check_aligned_history, check_one_id_per_row

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions comes with torch
    from typing_extensions import Unpack

# ``torch.fx.wrap`` patches a function in the globals of the module that calls it: every leaf
# this module calls by name is registered here too, so that it stays one node of the traced graph.
for _leaf in ("check_one_id_per_row", "check_aligned_history"):
    torch.fx.wrap(_leaf)


class SASRecModel(RetrievalBase):
    """A SASRec-style sequential retrieval model (Kang & McAuley, 2018): a causal transformer
    over the history, trained to predict the next item at every position.

    The input of a row is ``[BOS, h_1, ..., h_n]`` (the history, oldest first, embedded by the
    item table, plus learned positions); the output at position ``p`` is the query for the item
    that followed ``h_p``: ``h_{p+1}``, and the row's target item (``item_feature``) after the
    last. Every position is a training query (SASRec's objective), or with ``train_positions=t``
    the last ``t`` of each row (``1``: the target only; fewer queries, a cheaper loss). The loss
    scores each query against its positive and shared negatives: the batch's target items and
    ``num_uniform_negatives`` uniform items, with the logQ correction (``loss="in_batch"``;
    ``"sampled"``: the uniform items only; ``"full"``: every item of the corpus, no sampling).
    In evaluation the query is the output after the last history item, and the loss scores the
    positions ``eval_positions`` says (``1``: that query only, what the metrics rank).

    An item's vector is its row of the item table plus, with ``item_side_features``, the rows
    of its side features (one table ``t_<name>`` each): the same vector is the input at a
    history position and the candidate a query is scored against (L2-normalised when
    ``normalize``), shared as in SASRec. The candidate's side ids come from ``batch.sequence``
    (``name``, one per row), the history's from ``history_side_features[name]`` (one per
    history item, as long as the history: the data carries them so that serving, which sees
    embeddings and no ids, gets them too), and those of items outside a batch (uniform
    negatives, the corpus) from ``item_catalog``.

    With ``user_features`` (pooled tables ``t_<name>`` over ``batch.sparse``, e.g. the user id
    and segment), a linear projection of the concatenated user embeddings is added to the
    transformer's output at every position: each query is "this history, from this user".

    The ``FeatureSpec`` that feeds it: ``sparse=[SparseFeature(name=f) for f in
    user_features]``, ``sequence=[SequenceFeature(name=item_feature, num_embeddings=num_items),
    SequenceFeature(name=history_feature, num_embeddings=num_items, max_len=max_len), *one
    SequenceFeature per side feature (one id per row), *one per history side feature
    (max_len=max_len)]``, in the order of ``sequence_keys``.

    Args (besides the loss options, as ``TwoTowerModel``'s):
        num_uniform_negatives: uniform negatives per step; None: 256, or 0 with
            ``loss="full"`` (which refuses any other number: it scores every item already).
        eval_positions: the last positions of each row the evaluation's loss scores; None:
            ``train_positions``'s; ``1``: only the query the metrics rank (cheaper, and the
            loss of what is evaluated).
        user_features: pooled user features (``batch.sparse`` keys); none by default.
        user_num_embeddings: rows per user table (one int or one per feature).
        item_side_features: ``{feature: rows}`` of item side features; none by default.
        history_side_features: ``{feature: history key}``; default ``hist_<feature>`` for each
            side feature.
        item_catalog: a parquet file (or mapping of arrays) with ``item_id_column`` and one
            column per side feature, listing every item once; needed with side features.
    """

    @takes_retrieval_options
    def __init__(
        self,
        *,
        num_items: int,
        history_feature: str = "hist_item",
        user_features: Sequence[str] = (),
        item_side_features: Mapping[str, int] | None = None,
        history_side_features: Mapping[str, str] | None = None,
        num_layers: int = 2,
        num_heads: int = 2,
        dropout: float = 0.1,
        train_positions: int | None = None,
        eval_positions: int | None = None,
        num_uniform_negatives: int | None = None,
        **options: Unpack[RetrievalOptions],
    ) -> None:
        side = dict(item_side_features or {})
        hist_side = ({name: f"hist_{name}" for name in side} if history_side_features is None
                     else dict(history_side_features))
        missing = [name for name in side if name not in hist_side]
        if missing:
            raise ValueError(f"item side features {missing} have no history key in "
                             f"`history_side_features` ({hist_side}): a sequential model adds them "
                             "to every history item, so the data must carry them per history item.")
        if num_uniform_negatives is None:
            # The default sample, except with the full softmax (never the default loss), which
            # takes none.
            num_uniform_negatives = 0 if options.get("loss") == "full" else 256
        super().__init__(num_items=num_items, history_feature=history_feature,
                         user_features=user_features, side_tables=side,
                         history_side_features=hist_side,
                         num_uniform_negatives=num_uniform_negatives, **options)
        max_len, embedding_dim = self.max_len, self.embedding_dim
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"`num_layers` must be an int >= 1, but is {num_layers!r}.")
        if not isinstance(num_heads, int) or num_heads < 1 or embedding_dim % num_heads:
            raise ValueError(f"`num_heads` must divide embedding_dim={embedding_dim}, but is {num_heads!r}.")
        for name, value in (("train_positions", train_positions), ("eval_positions", eval_positions)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be an int >= 1 or None, but is {value!r}.")
        self.train_positions = train_positions
        self.eval_positions = train_positions if eval_positions is None else eval_positions
        """The last positions of each row the evaluation's loss scores (None: every one)."""
        self.user_projection = (nn.Linear(embedding_dim * len(self.user_features), embedding_dim)
                                if self.user_features else None)
        """The user features' term of every query (None without user features)."""
        self.bos = nn.Parameter(torch.zeros(embedding_dim).normal_(0, 0.02))
        self.position_embedding = nn.Embedding(max_len + 1, embedding_dim)
        nn.init.normal_(self.position_embedding.weight, 0, 0.02)
        layer = nn.TransformerEncoderLayer(embedding_dim, num_heads, dim_feedforward=2 * embedding_dim,
                                           dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(embedding_dim)
        causal = torch.triu(torch.full((max_len + 1, max_len + 1), -math.inf), diagonal=1)
        self.register_buffer("causal_mask", causal, persistent=False)

    causal_mask: torch.Tensor

    def _item_vectors(self, seq: dict[str, JaggedTensor], rows: slice) -> torch.Tensor:
        """``[n, D]`` item vectors of the lookup's one-id-per-row ``rows``: the item's row plus
        its side features' rows."""
        out = seq[self.item_feature].values()[rows]
        for name in self.side_features:
            out = out + seq[name].values()[rows]
        return self._out(out)

    def encode(self, history: torch.Tensor, lengths: torch.Tensor,
               user: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, L + 1, D]`` outputs for ``[BOS, history]`` (``history [B, L, D]``: item vectors,
        left-aligned; positions after ``lengths`` are padding, which the causal mask keeps out
        of every real position's view), plus the projection of ``user [B, F * D]`` (the pooled
        user features, in ``user_features`` order) when the model has user features."""
        if (user is None) != (self.user_projection is None):
            raise ValueError(f"this model's user features are {self.user_features}: give `user` "
                             "(their pooled embeddings) exactly when it has some.")
        b = history.shape[0]
        x = torch.cat([self.bos.expand(b, 1, -1), history], dim=1)
        x = x + self.position_embedding(self.positions).unsqueeze(0)
        out = self.final_norm(self.encoder(x, mask=self.causal_mask, is_causal=True))
        if self.user_projection is not None and user is not None:
            out = out + self.user_projection(user).unsqueeze(1)
        return out

    def serving_sequence_lengths(self) -> dict[str, int]:
        """The serving contract (``recsys_trainer.serving``): the history's padded length (and
        its side features')."""
        assert self.history_feature is not None
        return {self.history_feature: self.max_len,
                **{key: self.max_len for key in self.history_side_features.values()}}

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        """The serving contract: the query embedding ``[B, D]`` after the last history item
        (the evaluation's query), from the scorer's lookups; export it with
        ``activation="none"``."""
        assert self.history_feature is not None
        hist, lens = sequences[self.history_feature], lengths[self.history_feature]
        for key in self.history_side_features.values():
            hist = hist + sequences[key]  # zero-padded as the history: padding stays zero
        out = self.encode(hist, lens, self._serving_user(pooled))
        last = out.gather(1, lens.long().view(-1, 1, 1).expand(-1, 1, out.shape[-1])).squeeze(1)
        return self._out(last)

    def _step(self, batch: Batch, seq_out: Any, pooled: Any,
              neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.sequence is not None and self.history_feature is not None
        b = batch.labels.shape[0]
        seq = self._by_key(seq_out)
        cand = seq[self.item_feature]
        check_one_id_per_row(cand.lengths()[:b], self.item_feature)
        for name in self.side_features:
            check_one_id_per_row(seq[name].lengths()[:b], name)
        target_ids = batch.sequence[self.item_feature].values()
        hist, lengths = self._history(seq, b)
        for key in self.history_side_features.values():
            side = seq[key]
            check_aligned_history(side.lengths()[:b], lengths, key, self.history_feature)
            hist = hist + JaggedTensor(values=side.values(), lengths=lengths).to_padded_dense(self.max_len)
        hist_ids_jt = batch.sequence[self.history_feature]
        out = self.encode(hist, lengths, self._pooled_user(pooled))  # [B, L+1, D]
        last = out[torch.arange(b, device=out.device), lengths.long()]  # after the last item
        query = self._out(last)
        target_emb = self._item_vectors(seq, slice(0, b))
        negatives = self._item_vectors(seq, slice(b, None)) if neg_ids is not None else None
        weights = batch.weights
        # Positions 0..n-1 predict h_1..h_n; position n (after the last item) the target.
        valid = self.positions[: self.max_len].unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]: p < n
        scored = self.train_positions if self.training else self.eval_positions
        if scored is not None:  # only the last t positions (the target's included)
            first = lengths.unsqueeze(1) + 1 - scored
            valid = valid & (self.positions[: self.max_len].unsqueeze(0) >= first)
        hist_ids = JaggedTensor(values=hist_ids_jt.values(), lengths=lengths).to_padded_dense(
            self.max_len, padding_value=0)
        row = torch.arange(b, device=out.device).unsqueeze(1).expand(b, self.max_len)[valid]
        loss = self._sequence_loss(
            torch.cat([self._out(out[:, :-1][valid]), query]),
            torch.cat([self._out(hist[valid]), target_emb]),
            torch.cat([hist_ids[valid], target_ids]),
            None if weights is None else torch.cat([weights[row], weights]),
            target_emb, target_ids, weights, negatives, neg_ids)
        outputs = {"query": query.detach(), "target": target_ids, "history_lengths": lengths,
                   "history_ids": hist_ids_jt.values()}
        return loss, outputs


__all__ = ["SASRecModel"]
