"""Retrieval losses: a softmax of each query's positive item against negative candidates.

Functional and padding-safe like ``models.weighted_bce_with_logits``: every loss is the
``weights``-weighted mean over the query rows, a batch whose weights are all 0 (an evaluation
padding batch) gives 0, and a zero-weight row is never a negative for another row.

* ``in_batch_softmax_loss``: the candidates are the batch's own positive items (row ``i``'s
  positive is candidate ``positive_offset + i``), optionally extended by shared ``negatives``
  (*mixed* negatives: in-batch plus items sampled uniformly from the corpus, Yang et al. 2020)
  and by other ranks' items (``collectives.all_gather_with_grad``).
* ``sampled_softmax_loss``: each query against its own positive and one shared set of sampled
  negatives (from a shared item table; the sequential model scores every position this way).

Both take the logQ correction as ``log_q`` per candidate: ``log`` of the expected number of
times the item is a candidate in the set, subtracted from its logit (Yi et al. 2019; the
positive's own term included, as in sampled softmax). ``expected_candidate_log_q`` computes it
from an item-frequency estimate and the sizes of the two sources. Without the correction an
in-batch softmax penalises popular items for being popular: on a Zipf-popular log the measured
Recall@50 of a two-tower roughly halves (docs/retrieval.md).

A negative with the same item id as the row's positive (a popular item twice in one batch, or
a sampled negative that is the positive) is an *accidental hit* and is masked out
(``remove_accidental_hits``), as TensorFlow's sampled softmax does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not a positive number (the logits are divided by it)."""
    if not isinstance(temperature, int | float) or not temperature > 0:
        raise ValueError(f"`temperature` must be a number > 0, but is {temperature!r}.")


def _weighted_mean(per_row: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return per_row.mean()
    w = weights.to(per_row.dtype)
    total = w.sum()
    # where, not a product: a padding row's loss may be anything, its weight makes it vanish.
    per_row = torch.where(w > 0, per_row, torch.zeros_like(per_row))
    return torch.where(total > 0, (per_row * w).sum() / total.clamp_min(1e-12), total)


def _softmax_loss(logits: torch.Tensor, positive: torch.Tensor, masked: torch.Tensor | None,
                  weights: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy of ``logits [B, C]`` against the column ``positive [B]``, with the
    ``masked [B, C]`` entries removed (never a row's own positive)."""
    logits = logits.float()
    if masked is not None:
        # A very negative finite value, not -inf: exp() underflows to 0 exactly, and no NaN can
        # reach a gradient (every row keeps its positive).
        logits = logits.masked_fill(masked, torch.finfo(logits.dtype).min / 2)
    per_row = F.cross_entropy(logits, positive, reduction="none")
    return _weighted_mean(per_row, weights)


def expected_candidate_log_q(probability: torch.Tensor, num_in_batch: int | torch.Tensor,
                             num_uniform: int = 0, corpus_size: int = 1) -> torch.Tensor:
    """``log`` of the expected count of each item in a candidate set made of ``num_in_batch``
    interactions (each item ``j`` with probability ``probability[j]``, its share of the
    stream: ``ItemFrequencyEstimator.probability``) and ``num_uniform`` items drawn uniformly
    from a corpus of ``corpus_size``. float32, the shape of ``probability``."""
    expected = probability.to(torch.float64) * num_in_batch + num_uniform / corpus_size
    return torch.log(expected.clamp_min(1e-30)).float()


def in_batch_softmax_loss(
    query: torch.Tensor,
    items: torch.Tensor,
    item_ids: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    positive_offset: int = 0,
    item_weights: torch.Tensor | None = None,
    item_log_q: torch.Tensor | None = None,
    negatives: torch.Tensor | None = None,
    negative_ids: torch.Tensor | None = None,
    negative_log_q: torch.Tensor | None = None,
    remove_accidental_hits: bool = True,
) -> torch.Tensor:
    """Softmax of each query row against the batch's positive items (and shared negatives).

    Args:
        query: ``[B, D]`` user (query) embeddings.
        items: ``[C, D]`` candidate item embeddings, ``C >= B``; row ``i``'s positive is
            ``items[positive_offset + i]``. Locally ``items`` is the batch's positives
            (``C = B``); with cross-rank negatives it is every rank's, this rank's at the offset.
        item_ids: ``[C]`` their item ids (for accidental hits).
        weights: ``[B]`` query weights (0: a padding row), or None.
        temperature: logits are ``query . item / temperature``.
        item_weights: ``[C]`` candidate weights: a candidate of weight 0 (another rank's or
            this batch's padding row) is never a negative. Default: ``weights`` when ``C = B``.
        item_log_q: ``[C]`` logQ correction per candidate (``expected_candidate_log_q``).
        negatives: ``[S, D]`` extra negatives shared by every row (mixed negatives), with
            ``negative_ids [S]`` and ``negative_log_q [S]``.
        remove_accidental_hits: mask candidates whose id equals the row's positive id.

    Returns the weighted mean loss (0 for an all-zero-weight batch).
    """
    check_temperature(temperature)
    b = query.shape[0]
    rows = torch.arange(b, device=query.device)
    positive = rows + positive_offset
    scaled = query / temperature  # [B, D]: cheaper than dividing the [B, C] logits
    logits = scaled @ items.t()
    if item_log_q is not None:
        logits = logits - item_log_q.to(logits.dtype)
    candidate_ids = item_ids
    if item_weights is None and weights is not None and items.shape[0] == b:
        item_weights = weights
    valid = None if item_weights is None else item_weights > 0
    if negatives is not None:
        if negative_ids is None:
            raise ValueError("`negatives` need `negative_ids` (for accidental hits).")
        neg_logits = scaled @ negatives.t()
        if negative_log_q is not None:
            neg_logits = neg_logits - negative_log_q.to(neg_logits.dtype)
        logits = torch.cat([logits, neg_logits], dim=1)
        candidate_ids = torch.cat([item_ids, negative_ids])
        if valid is not None:
            valid = torch.cat([valid, torch.ones_like(negative_ids, dtype=torch.bool)])
    masked = None
    if remove_accidental_hits:
        masked = candidate_ids[None, :] == item_ids[positive][:, None]
    if valid is not None:
        invalid = ~valid[None, :]
        masked = invalid.expand(b, -1).clone() if masked is None else masked | invalid
    if masked is not None:
        masked[rows, positive] = False  # never a row's own positive
    return _softmax_loss(logits, positive, masked, weights)


def sampled_softmax_loss(
    query: torch.Tensor,
    positives: torch.Tensor,
    positive_ids: torch.Tensor,
    negatives: torch.Tensor,
    negative_ids: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    positive_log_q: torch.Tensor | None = None,
    negative_log_q: torch.Tensor | None = None,
    negative_weights: torch.Tensor | None = None,
    remove_accidental_hits: bool = True,
) -> torch.Tensor:
    """Softmax of each query's positive against ``S`` negatives shared by all queries.

    Args:
        query: ``[P, D]`` query embeddings (one per row, or per sequence position).
        positives: ``[P, D]`` each query's positive item embedding, ids ``positive_ids [P]``.
        negatives: ``[S, D]`` shared negatives (sampled from the item table, or another
            batch's items), ids ``negative_ids [S]``.
        weights: ``[P]`` query weights (0: padding), or None.
        positive_log_q / negative_log_q: logQ correction of the positives ``[P]`` and of the
            negatives ``[S]`` (``expected_candidate_log_q``), or None.
        negative_weights: ``[S]``: a negative of weight 0 is left out (e.g. a padding row's
            item used as a negative).
        remove_accidental_hits: mask negatives whose id equals the query's positive id.

    Returns the weighted mean loss (0 for an all-zero-weight batch).
    """
    check_temperature(temperature)
    scaled = query / temperature
    pos = (scaled * positives).sum(-1, keepdim=True)
    neg = scaled @ negatives.t()
    if positive_log_q is not None:
        pos = pos - positive_log_q.to(pos.dtype)[:, None]
    if negative_log_q is not None:
        neg = neg - negative_log_q.to(neg.dtype)[None, :]
    masked = None
    if remove_accidental_hits:
        masked = negative_ids[None, :] == positive_ids[:, None]
    if negative_weights is not None:
        invalid = ~(negative_weights > 0)[None, :]
        masked = invalid if masked is None else masked | invalid
    logits = torch.cat([pos, neg], dim=1)
    if masked is not None:
        masked = torch.cat([torch.zeros_like(masked[:, :1]), masked.expand(neg.shape)], dim=1)
    positive = torch.zeros(query.shape[0], dtype=torch.int64, device=query.device)
    return _softmax_loss(logits, positive, masked, weights)


__all__ = [
    "check_temperature",
    "expected_candidate_log_q",
    "in_batch_softmax_loss",
    "sampled_softmax_loss",
]
