"""Eviction policies of dynamic tables, as torchrec ``MCHEvictionPolicy`` objects: ``decayed_lfu``
(ours) and torchrec's ``distance_lfu``, ``lfu`` and ``lru`` with admission by count and the
protected fallback slots."""

from __future__ import annotations

import torch
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHEvictionPolicy,
    MCHEvictionPolicyMetadataInfo,
)

from recsys_trainer.dynamic.config import DynamicTable

COUNT_ONE = 1 << 16
"""``decayed_lfu`` keeps counts in fixed point: one sighting is ``COUNT_ONE``."""

TRIM_TIES_MIN = 1024
"""``rank_new_ids``: from this many candidate slots up, the slots tied at the boundary score are
cut by index before the candidates are sorted (below it, sorting them all costs fewer ops)."""


class DecayedLFUEvictionPolicy(MCHEvictionPolicy):
    """LFU with decay, as a torchrec ``MCHEvictionPolicy``: an id's score is its count of
    sightings, multiplied by ``2 ** (-1 / half_life)`` at every pass (``decay``), kept in fixed
    point (``COUNT_ONE`` per sighting).

    Metadata: per slot ``counts`` (float32, see ``id_map.compact_map``) and
    ``last_access_iter`` (the forward that last saw the id; expiry reads it), which
    ``DynamicMCHModule`` updates in every training forward; per history
    entry ``counts`` (the history holds the ids without a row; an entry may stand for several
    sightings: the module coalesces its history in place, and ids that did not get a row wait
    there with their decayed count). A new id whose count is below
    ``admission_threshold`` never takes a slot, not even an empty one; the last ``protected``
    slots of the map (the fallback rows) are never given to an id."""

    def __init__(self, half_life: float, admission_threshold: float) -> None:
        super().__init__(metadata_info=[
            MCHEvictionPolicyMetadataInfo("counts", is_mch_metadata=True,
                                          is_history_metadata=True),
            MCHEvictionPolicyMetadataInfo("last_access_iter", is_mch_metadata=True,
                                          is_history_metadata=False),
        ])
        self.factor = 2.0 ** (-1.0 / half_life)
        self.threshold = int(round(admission_threshold * COUNT_ONE))
        self.protected = 1
        """Slots at the end of the sorted map that are never assigned (set by the module)."""
        self.last_admitted = 0

    @property
    def metadata_info(self) -> list[MCHEvictionPolicyMetadataInfo]:
        return self._metadata_info

    def record_history_metadata(self, current_iter: int, incoming_ids: torch.Tensor,
                                history_metadata: dict[str, torch.Tensor]) -> None:
        history_metadata["counts"][:] = COUNT_ONE

    def coalesce_history_metadata(
        self, current_iter: int, history_metadata: dict[str, torch.Tensor],
        unique_ids_counts: torch.Tensor, unique_inverse_mapping: torch.Tensor,
        additional_ids: torch.Tensor | None = None, threshold_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        counts = history_metadata["counts"]
        if additional_ids is not None:
            counts = torch.cat([counts, counts.new_full(additional_ids.shape, COUNT_ONE)])
        summed = counts.new_zeros(unique_ids_counts.shape).scatter_add_(
            0, unique_inverse_mapping, counts)
        return {"counts": summed if threshold_mask is None else summed[threshold_mask]}

    @staticmethod
    @torch.no_grad()
    def rank_new_ids(scores: torch.Tensor, new_scores: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """torchrec's ``_compute_selected_eviction_and_replacement_indices(n,
        cat([scores, new_scores]))`` (``n = len(scores)``: the slots that may lose their id, new
        ids after them) without its stable descending argsort of all ``n + k`` scores: the same
        (evicted slots, selected positions in ``new_scores``), in the same order.

        Only the ``k`` new ids and the ``k`` weakest slots can trade places: the ``j``-th
        best new id (by score, then position) takes a slot iff it beats the ``j``-th weakest
        slot (slots win ties), so sorting the new ids and a ``topk`` of the slots' scores give
        how many (``s``) are admitted; the ``s`` weakest slots are those scored below the
        ``s``-th weakest score and, among those at it, the last ones. Both come out in the
        argsort's order (best first; ties by index), so the pairs match torchrec's.

        Counts are decayed sightings, so many slots tie at the boundary score (70-80k of a
        100,000-slot map whose pass admits 2-4k ids): from ``TRIM_TIES_MIN`` candidates up,
        the tied ones that cannot lose are dropped before the sort, which then sorts ``s``."""
        k = min(new_scores.numel(), scores.numel())
        order = torch.argsort(new_scores, descending=True, stable=True)
        if k == 0:
            return order[:0], order[:0]
        weakest = torch.topk(scores, k, largest=False).values  # ascending
        s = int(new_scores.index_select(0, order[:k]).gt(weakest).sum())
        if s == 0:
            return order[:0], order[:0]
        boundary = weakest[s - 1]
        low = scores.le(boundary).nonzero().squeeze(1)
        if low.numel() >= TRIM_TIES_MIN and low.numel() > s:
            # Every slot below the boundary loses its id; of the tied ones, the last by index,
            # as many as are left (usually none is below: then the last s candidates).
            below = scores.index_select(0, low).lt(boundary)
            n_below = int(below.sum())
            if n_below == 0:
                low = low[low.numel() - s:]
            else:
                tied = below.logical_not().nonzero().squeeze(1)
                low = low.masked_select(
                    below.index_fill_(0, tied[tied.numel() - (s - n_below):], True))
        # Best first, ties by index (as torchrec's argsort): the last s are the weakest.
        ranked = torch.argsort(scores.index_select(0, low), descending=True, stable=True)
        return low.index_select(0, ranked[low.numel() - s:]), order[:s]

    @torch.no_grad()
    def decay(self, mch_metadata: dict[str, torch.Tensor]) -> None:
        """One pass of decay for the resident ids' counts, rounded down to whole ``COUNT_ONE``
        units (so a count seen once reaches 0, and float32 counts stay exact integers)."""
        counts = mch_metadata["counts"]
        counts.copy_(counts.double().mul_(self.factor).floor_())

    def update_metadata_and_generate_eviction_scores(
        self, current_iter: int, mch_size: int,
        coalesced_history_argsort_mapping: torch.Tensor,
        coalesced_history_sorted_unique_ids_counts: torch.Tensor,
        coalesced_history_mch_matching_elements_mask: torch.Tensor,
        coalesced_history_mch_matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor],
        coalesced_history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The module passes decayed counts (fixed point) as the "unique ids' counts".
        counts, last = mch_metadata["counts"], mch_metadata["last_access_iter"]
        found = coalesced_history_mch_matching_elements_mask
        sorted_counts = coalesced_history_sorted_unique_ids_counts
        counts[coalesced_history_mch_matching_indices] += sorted_counts[found]
        last[coalesced_history_mch_matching_indices] = current_iter
        new_counts = sorted_counts[~found]
        # Below the threshold: below an empty slot's 0, so never selected.
        new_scores = torch.where(new_counts >= self.threshold, new_counts,
                                 torch.full_like(new_counts, -1))
        scores = counts.clone()
        scores[mch_size - self.protected:] = _highest(scores.dtype)
        evicted, selected = self._compute_selected_eviction_and_replacement_indices(
            mch_size, torch.cat([scores, new_scores]))
        counts[evicted] = new_counts[selected]
        last[evicted] = current_iter
        self.last_admitted = int(selected.numel())
        return evicted, selected


def _highest(dtype: torch.dtype) -> float | int:
    """The best score of ``dtype`` (protected slots get it: they are never evicted)."""
    return float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max


class _Legacy:
    """Mixed into torchrec's policies: admission by count within the interval, the protected
    fallback slots, and the number admitted by the last pass.

    torchrec ranks resident slots and new ids together by score and keeps the top
    ``num_slots``. A new id seen fewer than ``admission_threshold`` times gets count 0, hence
    score 0; empty slots score 0 too and, ranked first by the stable sort, win every tie, so the
    id never enters. torchrec protects the last slot of the sorted map (the default row); the
    ``protected - 1`` before it (more fallback rows) get the best score the same way."""

    admission_threshold: int = 1
    protected: int = 1
    last_admitted: int = 0

    def update_metadata_and_generate_eviction_scores(
        self, current_iter: int, mch_size: int, argsort_mapping: torch.Tensor,
        sorted_counts: torch.Tensor, matching_mask: torch.Tensor, matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor], history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.admission_threshold > 1:
            sorted_counts = torch.where(
                ~matching_mask & (sorted_counts < self.admission_threshold),
                torch.zeros_like(sorted_counts), sorted_counts)
        lo = mch_size - self.protected
        if "counts" in mch_metadata:
            mch_metadata["counts"][lo:] = torch.iinfo(torch.int64).max
        if "last_access_iter" in mch_metadata:
            mch_metadata["last_access_iter"][lo:] = current_iter
        evicted, selected = super().update_metadata_and_generate_eviction_scores(  # type: ignore[misc]
            current_iter, mch_size, argsort_mapping, sorted_counts, matching_mask,
            matching_indices, mch_metadata, history_metadata)
        self.last_admitted = int(selected.numel())
        return evicted, selected


class _DistanceLFU(_Legacy, DistanceLFU_EvictionPolicy):
    pass


class _LFU(_Legacy, LFU_EvictionPolicy):
    pass


class _LRU(_Legacy, LRU_EvictionPolicy):
    pass


def make_eviction_policy(spec: DynamicTable) -> MCHEvictionPolicy:
    """A fresh torchrec policy for one table, with admission and the protected fallback slots."""
    threshold = spec.admission_threshold
    assert threshold is not None
    if spec.eviction_policy == "decayed_lfu":
        return DecayedLFUEvictionPolicy(spec.count_half_life, threshold)
    policy: _Legacy
    if spec.eviction_policy == "distance_lfu":
        policy = _DistanceLFU(decay_exponent=spec.decay_exponent)
    elif spec.eviction_policy == "lfu":
        policy = _LFU()
    else:
        policy = _LRU(decay_exponent=spec.decay_exponent)
    policy.admission_threshold = int(threshold)
    return policy  # type: ignore[return-value]
