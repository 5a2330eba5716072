"""The in-batch candidates of the retrieval losses: the cross-rank gather of every rank's
positives (``cross_rank_negatives``), the frequency count of a step's positives and the logQ
of candidates. ``torch.fx`` leaves: collectives with per-rank sizes and masks that depend on
data.

``torch.fx.wrap`` patches the function in the globals of the module that calls it: a module
that calls these by name (``models.retrieval_base``, ``models.sasrec``, ...) registers them again.
"""

from __future__ import annotations

import torch

from recsys_trainer.retrieval import collectives
from recsys_trainer.retrieval.frequency import ItemFrequencyEstimator
from recsys_trainer.retrieval.losses import expected_candidate_log_q


def start_candidates(items: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                     cross_rank: bool) -> collectives.PendingRows | None:
    """Launch the gather of every rank's in-batch candidates (items, with their ids and
    validity in the same message) when ``cross_rank``; the model computes its user tower while
    it is in flight and ``gather_candidates`` waits for it. None without ``cross_rank``."""
    if not cross_rank:
        return None
    meta = torch.stack([ids.to(torch.int64), valid.to(torch.int64)], 1)
    return collectives.start_gather_with_grad(items, meta)


def gather_candidates(items: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, cross_rank: bool,
                      pending: collectives.PendingRows | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The in-batch candidates: this rank's, or every rank's (differentiable: every rank's loss
    reaches every rank's items; ``pending``: the gather ``start_candidates`` launched). Returns
    ``(items, ids, valid, offset of this rank's rows)``."""
    if not cross_rank:
        return items, ids, valid, 0
    if pending is None:
        pending = start_candidates(items, ids, valid, True)
    assert pending is not None
    all_items, meta, offset = pending.wait()
    assert meta is not None
    return all_items, meta[:, 0], meta[:, 1] > 0, offset


def count_items(estimator: ItemFrequencyEstimator, ids: torch.Tensor, valid: torch.Tensor,
                gathered: bool) -> None:
    """Count a training step's positive items of *every* rank (so all ranks' estimators stay
    identical): ``ids``/``valid`` are every rank's when ``gathered``, else this rank's."""
    mine = ids[valid]
    if not gathered:
        mine, _ = collectives.all_gather_rows(mine)
    estimator.update(mine)


def candidate_log_q(estimator: ItemFrequencyEstimator, ids: torch.Tensor, num_in_batch: torch.Tensor,
                    num_uniform: int, num_items: int) -> torch.Tensor:
    """logQ of ``ids`` as candidates: ``num_in_batch`` frequency-drawn plus ``num_uniform``
    uniform draws (``losses.expected_candidate_log_q``)."""
    return expected_candidate_log_q(estimator.probability(ids), num_in_batch, num_uniform, num_items)


for _leaf in ("start_candidates", "gather_candidates", "count_items", "candidate_log_q"):
    torch.fx.wrap(_leaf)


__all__ = ["candidate_log_q", "count_items", "gather_candidates", "start_candidates"]
