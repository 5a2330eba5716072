"""Retrieval (candidate generation) models: a two-tower model and a SASRec-style sequential one.

Both follow the model contract (docs/models.md): ``forward(batch)`` returns ``(loss, outputs)`` with a
functional, padding-safe loss (``retrieval.losses``), and take their ids from
``batch.sequence`` (an ``EmbeddingCollection``) and ``batch.sparse`` (an
``EmbeddingBagCollection``). Each has **one item table** (``t_<item_feature>``) read by the
candidate item and by the history, so both towers embed items in one space; tables are on the
meta device and sharded by DMP.

``outputs`` is the dict a ``RetrievalModel`` gives its evaluation (``RetrievalMetricHook``):
``query [B, D]`` (the user embedding), ``target [B]`` (the item that followed), and
``history_lengths [B]`` / ``history_ids`` (the items already seen, for "exclude the history").
``item_embeddings(ids)`` embeds any items (the corpus, in evaluation and export); under DMP
every rank calls it together (the sharded table lookup is a collective).

Negatives (``loss=`` / ``num_uniform_negatives=``): ``"in_batch"`` uses the other rows'
items, plus ``num_uniform_negatives`` items drawn uniformly from the corpus (*mixed*
negatives), with the logQ correction from a streaming ``ItemFrequencyEstimator`` (a module of
the model, so checkpoints carry it); ``cross_rank_negatives=True`` adds the other ranks'
items (an all-gather whose backward returns every rank's gradient to each rank's items).
``"sampled"`` is a sampled softmax against the uniform negatives only. ``"full"`` is the full
softmax: every item of the corpus is a negative (no sampling, no logQ; for a corpus small
enough that a ``[queries, num_items]`` logit matrix fits); it refuses ``num_uniform_negatives
> 0`` (a ValueError) rather than ignore it. Uniformly sampled ids (and, with
``"full"``, the whole corpus) are looked up in the same call as the batch (one more row of the
sequence KJT), so the item table is read once per step.

The data-dependent parts (checks, collectives with per-rank sizes, the assembled lookup) are
``torch.fx`` leaves: TorchRec's ``pipeline="sparse_dist"`` traces the forward. The item table
is pipelined when it reads ``batch.sequence`` unchanged (in-batch negatives only); with
uniform negatives its input is assembled in the forward and TorchRec runs that lookup
unpipelined (same results, less overlap).

The models' parts live by concern: ``retrieval.base`` (the shared ``RetrievalBase``, the
towers' blocks, ``retrieval_step``), ``retrieval.catalog`` (``load_item_catalog``),
``retrieval.checks`` (the input checks), ``retrieval.kjt`` (the lookups' KJTs),
``retrieval.candidates`` (the cross-rank candidate gather, counts and logQ) and
``retrieval.protocol`` (``RetrievalModel``, ``find_retrieval_model``). Their names stay
importable from here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.retrieval.base import (
    LossKind,
    RetrievalBase,
    RetrievalOptions,
    retrieval_step,
    takes_retrieval_options,
    tower,
    user_tables,
)
from recsys_trainer.retrieval.candidates import (
    candidate_log_q,
    count_items,
    gather_candidates,
    start_candidates,
)
from recsys_trainer.retrieval.catalog import load_item_catalog
from recsys_trainer.retrieval.checks import (
    check_aligned_history,
    check_history_lengths,
    check_one_id_per_row,
    check_sequence_keys,
)
from recsys_trainer.retrieval.kjt import items_only_input, with_extra_row
from recsys_trainer.retrieval.losses import sampled_softmax_loss
from recsys_trainer.retrieval.protocol import RetrievalModel, find_retrieval_model

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions comes with torch
    from typing_extensions import Unpack

# ``torch.fx.wrap`` patches a function in the globals of the module that calls it: every leaf
# named here is registered here too (as before the split, when they were defined here), so a
# call from this module, or through ``models.<leaf>``, stays one node of the traced graph.
for _leaf in ("retrieval_step", "check_one_id_per_row", "check_history_lengths", "check_aligned_history",
              "check_sequence_keys",
              "with_extra_row", "items_only_input", "start_candidates", "gather_candidates", "count_items",
              "candidate_log_q"):
    torch.fx.wrap(_leaf)


# ----------------------------------------------------------------------------- two-tower


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
    ``retrieval.base.RetrievalOptions``, which ``SASRecModel`` takes too, with the same defaults.
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


# ----------------------------------------------------------------------------- SASRec


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

    def _sequence_loss(self, queries: torch.Tensor, positives: torch.Tensor, positive_ids: torch.Tensor,
                       weights: torch.Tensor | None, row_items: torch.Tensor, row_ids: torch.Tensor,
                       row_weights: torch.Tensor | None, negatives: torch.Tensor | None,
                       negative_ids: torch.Tensor | None) -> torch.Tensor:
        """Every position's query against its positive and the shared negatives: the batch's
        target items (``loss="in_batch"``, all ranks' with ``cross_rank_negatives``) and the
        uniform ones; with ``loss="full"`` every item of the corpus."""
        if self.loss_kind == "full":
            assert negatives is not None and negative_ids is not None
            return sampled_softmax_loss(queries, positives, positive_ids, negatives, negative_ids,
                                        weights, temperature=self.temperature)
        cand, cand_ids, cand_valid, _, num_in_batch = self._candidates(row_items, row_ids, row_weights)
        s = self.num_uniform_negatives
        parts, ids, weights_n = [], [], []
        if self.loss_kind == "in_batch":
            parts, ids, weights_n = [cand], [cand_ids], [cand_valid.to(queries.dtype)]
        if negatives is not None and negative_ids is not None:
            parts.append(negatives)
            ids.append(negative_ids)
            weights_n.append(torch.ones_like(negative_ids, dtype=queries.dtype))
        neg, neg_ids = torch.cat(parts), torch.cat(ids)
        pos_log_q = neg_log_q = None
        if self.log_q_correction:
            pos_log_q = candidate_log_q(self.frequency, positive_ids, num_in_batch, s, self.num_items)
            neg_log_q = candidate_log_q(self.frequency, neg_ids, num_in_batch, s, self.num_items)
        return sampled_softmax_loss(
            queries, positives, positive_ids, neg, neg_ids, weights, temperature=self.temperature,
            positive_log_q=pos_log_q, negative_log_q=neg_log_q,
            negative_weights=torch.cat(weights_n))


__all__ = [
    "RetrievalModel",
    "RetrievalOptions",
    "SASRecModel",
    "TwoTowerModel",
    "find_retrieval_model",
    "load_item_catalog",
    # Moved to the modules named in the docstring; importable from here as before.
    "LossKind",
    "RetrievalBase",
    "candidate_log_q",
    "check_aligned_history",
    "check_history_lengths",
    "check_one_id_per_row",
    "check_sequence_keys",
    "count_items",
    "gather_candidates",
    "items_only_input",
    "retrieval_step",
    "start_candidates",
    "tower",
    "user_tables",
    "with_extra_row",
]
