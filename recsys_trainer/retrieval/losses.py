"""Retrieval losses: a softmax of each query's positive item against negative candidates.

Functional and padding-safe like ``models.weighted_bce_with_logits``: every loss is the
``weights``-weighted mean over the query rows, a batch whose weights are all 0 (an evaluation
padding batch) gives 0, and a zero-weight row is never a negative for another row.

* ``in_batch_softmax_loss``: the candidates are the batch's own positive items (row ``i``'s
  positive is candidate ``positive_offset + i``), optionally extended by shared ``negatives``
  (*mixed* negatives: in-batch plus items sampled uniformly from the corpus, Yang et al. 2020)
  and by other ranks' items (``collectives.start_gather_with_grad``).
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

from typing import Any

import torch


def check_temperature(temperature: float) -> None:
    """Refuse a temperature that is not a positive number (the logits are divided by it)."""
    if not isinstance(temperature, int | float) or not temperature > 0:
        raise ValueError(f"`temperature` must be a number > 0, but is {temperature!r}.")


def _weighted_mean(per_row: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:  # a batch with no rows costs 0, as an all-padding one (mean() gives NaN)
        return per_row.sum() / max(per_row.shape[0], 1)
    w = weights.to(per_row.dtype)
    total = w.sum()
    # where, not a product: a padding row's loss may be anything, its weight makes it vanish.
    per_row = torch.where(w > 0, per_row, torch.zeros_like(per_row))
    return torch.where(total > 0, (per_row * w).sum() / total.clamp_min(1e-12), total)


def _masked_pairs(candidate_ids: torch.Tensor | None, positive_ids: torch.Tensor,
                  positive_cols: torch.Tensor | None, invalid: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``(row, column)`` entries of a ``[B, C]`` logit matrix to mask, as index pairs: the
    accidental hits (``candidate_ids[c] == positive_ids[r]``, when ``candidate_ids`` is given)
    and the ``invalid [C]`` columns, never a row's own positive (``positive_cols [B]``).

    Sparse, not a ``[B, C]`` boolean mask: both sets are small (a popular item's repeats, a
    short batch's padding), and the dense mask's compare, fill and or-ing cost as much as the
    softmax itself. Hits come from one sort of the candidates and a binary search per row."""
    parts_r, parts_c = [], []
    b, device = positive_ids.shape[0], positive_ids.device
    if candidate_ids is not None:
        sorted_ids, order = torch.sort(candidate_ids)
        lo = torch.searchsorted(sorted_ids, positive_ids)
        counts = torch.searchsorted(sorted_ids, positive_ids, right=True) - lo
        r = torch.repeat_interleave(torch.arange(b, device=device), counts)
        # Position of each pair inside its row's run of equal ids: a global arange minus the
        # run's start in the pair list.
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        within = torch.arange(r.shape[0], device=device) - first
        parts_r.append(r)
        parts_c.append(order[torch.repeat_interleave(lo, counts) + within])
    if invalid is not None:
        cols = torch.nonzero(invalid).reshape(-1)
        if cols.numel():  # a short batch's padding rows: every row masks those columns
            parts_r.append(torch.arange(b, device=device).repeat_interleave(cols.numel()))
            parts_c.append(cols.repeat(b))
    if not parts_r:
        return None
    r, c = torch.cat(parts_r), torch.cat(parts_c)
    if positive_cols is not None:
        keep = c != positive_cols[r]
        r, c = r[keep], c[keep]
    return r, c


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """The softmax in at least float32 (half-precision logits would round the logQ terms)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class _MaskedLogSumExp(torch.autograd.Function):
    """``logsumexp`` over each row of ``scaled @ candidates.t() - log_q`` with the ``pairs``
    entries left out, and its gradient, without autograd's copies of the ``[B, C]`` matrix.

    The matrix is the cost of a softmax over many candidates; autograd's chain (a bias copy
    into ``addmm``, the masked copy, ``log_softmax``, a zero-filled ``nll`` gradient, the masked
    gradient's copy) writes it about nine times. Here the matmul makes it (the logQ term inside
    it), it is masked and exponentiated in place, and backward scales it into the softmax
    (``d lse / d logits = softmax``) that feeds the two gradient matmuls. A masked entry gets
    no gradient, as with a masked fill."""

    @staticmethod
    def forward(ctx: Any, scaled: torch.Tensor, candidates: torch.Tensor, log_q: torch.Tensor | None,
                rows: torch.Tensor | None, cols: torch.Tensor | None) -> torch.Tensor:
        if log_q is None:
            logits = scaled @ candidates.t()
        else:  # the logQ term inside the matmul: [scaled, -1] . [candidate, log_q]
            logits = torch.cat([scaled, scaled.new_full((scaled.shape[0], 1), -1.0)], 1) @ torch.cat(
                [candidates, log_q.to(candidates.dtype).reshape(-1, 1)], 1).t()
        logits = _upcast(logits)
        if rows is not None and cols is not None and rows.numel():
            # Very negative but finite, not -inf: exp() underflows to exactly 0, and a row whose
            # every entry is masked still has a finite logsumexp (no NaN in any gradient).
            fill = torch.tensor(torch.finfo(logits.dtype).min / 2, dtype=logits.dtype, device=logits.device)
            logits.index_put_((rows, cols), fill)
        # No candidates (a rank with no rows and nothing gathered, no sampled negatives): the
        # logsumexp of nothing is -inf (log 0), as torch.logsumexp's; amax has no such case.
        top = (logits.amax(dim=1, keepdim=True) if logits.shape[1]
               else logits.new_zeros((logits.shape[0], 1)))
        exp = logits.sub_(top).exp_()  # in place: the matrix becomes exp(logit - row max)
        total = exp.sum(dim=1, keepdim=True)
        ctx.save_for_backward(scaled, candidates, exp, total, rows, cols)
        return (top + total.log()).squeeze(1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                        None, None, None]:
        if torch.is_grad_enabled():  # backward(create_graph=True): a second derivative
            # exp was made without a graph, so the ops below would record a derivative that
            # misses its dependence on the inputs: refuse rather than return a wrong one.
            raise RuntimeError(
                "the retrieval softmax losses compute their gradient by hand and are "
                "differentiable once: backward with create_graph=True (a second derivative, "
                "e.g. a gradient penalty) is not supported through them.")
        scaled, candidates, exp, total, rows, cols = ctx.saved_tensors
        # d logsumexp / d logit = softmax = exp / total, times the incoming gradient (a new
        # matrix, not in place: a second backward, retain_graph=True, finds exp intact).
        p = exp * (grad.to(exp.dtype).unsqueeze(1) / total)
        if rows is not None and cols is not None and rows.numel():
            # A masked entry's softmax is already 0 unless its whole row is masked (then the
            # row is uniform over fill values); a masked entry never passes a gradient on.
            p.index_put_((rows, cols), p.new_zeros(()))
        p = p.to(scaled.dtype)
        grad_scaled = p @ candidates if ctx.needs_input_grad[0] else None
        grad_candidates = p.t() @ scaled if ctx.needs_input_grad[1] else None
        return grad_scaled, grad_candidates, None, None, None


def _masked_logsumexp(scaled: torch.Tensor, candidates: torch.Tensor, log_q: torch.Tensor | None,
                      pairs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``[B]``: per row, ``log sum_c exp(scaled . candidates[c] - log_q[c])`` over the columns
    not masked by ``pairs`` (``_MaskedLogSumExp``)."""
    rows, cols = pairs if pairs is not None else (None, None)
    return _MaskedLogSumExp.apply(scaled, candidates, log_q, rows, cols)  # type: ignore[no-any-return]


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
    positive = torch.arange(b, device=query.device) + positive_offset
    if item_weights is None and weights is not None and items.shape[0] == b:
        item_weights = weights
    candidates, candidate_ids, log_q = items, item_ids, item_log_q
    invalid = None if item_weights is None else ~(item_weights > 0)
    if negatives is not None:
        if negative_ids is None:
            raise ValueError("`negatives` need `negative_ids` (for accidental hits).")
        # One [C + S] candidate set: one matmul and one softmax pass, not two and a concat.
        candidates = torch.cat([items, negatives.to(items.dtype)])
        candidate_ids = torch.cat([item_ids, negative_ids.to(item_ids.dtype)])
        if log_q is not None or negative_log_q is not None:
            log_q = torch.cat([
                log_q if log_q is not None else items.new_zeros(items.shape[0]),
                negative_log_q if negative_log_q is not None else items.new_zeros(negatives.shape[0])])
        if invalid is not None:
            invalid = torch.cat([invalid, invalid.new_zeros(negatives.shape[0])])
    # Divide the [B, D] query, not the [B, C] logits, by the temperature.
    scaled = query / temperature
    pairs = _masked_pairs(candidate_ids if remove_accidental_hits else None,
                          item_ids[positive], positive, invalid)
    # -log softmax at the positive = logsumexp over the candidates - the positive's logit.
    own = _upcast((scaled * items[positive]).sum(-1))
    if item_log_q is not None:
        own = own - item_log_q[positive].to(own.dtype)
    per_row = _masked_logsumexp(scaled, candidates, log_q, pairs) - own
    return _weighted_mean(per_row, weights)


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
    pos = (scaled * positives).sum(-1)
    if positive_log_q is not None:
        pos = pos - positive_log_q.to(pos.dtype)
    invalid = None if negative_weights is None else ~(negative_weights > 0)
    pairs = _masked_pairs(negative_ids if remove_accidental_hits else None, positive_ids, None, invalid)
    # -log softmax of the positive against [pos, neg] without concatenating them:
    # log(e^pos + sum e^neg) - pos.
    pos = _upcast(pos)
    per_row = torch.logaddexp(_masked_logsumexp(scaled, negatives, negative_log_q, pairs), pos) - pos
    return _weighted_mean(per_row, weights)


__all__ = [
    "check_temperature",
    "expected_candidate_log_q",
    "in_batch_softmax_loss",
    "sampled_softmax_loss",
]
