"""Dynamic embedding tables: raw 64-bit ids mapped without collisions into a fixed capacity.

Built on torchrec's managed-collision modules, not a home-made table:

* ``ManagedCollisionEmbeddingCollection`` holds an ``EmbeddingCollection`` (the rows, a fused
  FBGEMM table with its in-backward sparse optimizer) and a ``ManagedCollisionCollection`` with
  one ``MCHManagedCollisionModule`` per table: a sorted id -> slot map with per-slot metadata.
* ``DynamicMCHModule`` is torchrec's ``MCHManagedCollisionModule`` with these changes:

  - **passes** (admission and eviction) run every ``eviction_interval_rows`` training rows (all
    ranks' rows together), every ``eviction_interval_seconds``, or every ``eviction_interval``
    optimizer steps (the Trainer marks the micro-batches that do not end one,
    ``StepBoundaries``), at the end of a step;
  - the default policy, ``decayed_lfu`` (``DecayedLFUEvictionPolicy``, a torchrec
    ``MCHEvictionPolicy``), ranks ids by a count that halves every ``count_half_life`` passes;
    ids that did not get a row keep their decayed count in the **history** for the next pass,
    so admission (``admission_threshold``) is counted over a decaying window, not one interval.
    The history is bounded (``history_slots``): when full it is coalesced in place and, if still
    too full, its least-seen ids are dropped (counted as ``dropped``);
  - **fallback rows**: an id without a row reads one of ``fallback_rows`` rows of its table
    (the last rows of each shard), chosen by its position in the id space, instead of one
    shared default row per shard. They train like any row;
  - **expiry**: ids unseen for ``expire_after_windows`` train windows or
    ``expire_after_seconds`` lose their row even when the table is not full;
  - the legacy policies (torchrec's ``distance_lfu``, ``lfu``, ``lru``) keep torchrec's own pass
    over a history that grows (it never drops ids; torchrec sizes it from the first batch).

Pooled features use the same unpooled collection plus a sum/mean pool
(``DynamicEmbeddingBagCollection``): ``ManagedCollisionEmbeddingBagCollection`` cannot be
sharded on CPU (torchrec issue 2958). Sequence features use the collection directly
(``dynamic_embedding_collection``). A table may be read by several features (a candidate item
and a history sequence): they share its ids, rows and passes.

Sharding: managed collision exists only ``row_wise`` in torchrec (each rank owns a contiguous
slot range and the ids of its block of the (mixed) id space), with the ``fused`` kernel on CPU.
On CUDA the planner picks the kernel (``fused``, UVM caching...); that path has **not run on a
GPU**.

Eviction resets an evicted slot's row and optimizer state with FBGEMM's
``reset_weight_momentum`` op, which has only a CUDA kernel and takes a *feature* index where
torchrec passes a *table* index. ``install_eviction_reset`` gives each table-batched module of a
sharded dynamic collection a reset that maps the table to its first feature: on CPU our
implementation of the kernel (``reset_rows_cpu``), on CUDA FBGEMM's own op. Instance attributes:
nothing global is patched.

Checkpoints: ``DynamicTablesState`` saves what torchrec keeps outside ``state_dict()``; a
checkpoint of another world size (or fallback layout) is re-routed on load (``_relayout``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHEvictionPolicy,
    MCHEvictionPolicyMetadataInfo,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsys_trainer.validation import check_choice, check_int, check_number, fail

logger = logging.getLogger("recsys_trainer")

ID_SPACE = 2**63 - 1
"""Ids a dynamic table accepts: ``[0, ID_SPACE)``. ``2**63 - 1`` (int64 max) marks an empty slot
in torchrec's map. Use it as ``SparseFeature(num_embeddings=ID_SPACE)`` so the data layer hashes
strings into the whole space and passes integer ids unchanged."""

EMPTY_SLOT = torch.iinfo(torch.int64).max

EvictionPolicyName = Literal["decayed_lfu", "distance_lfu", "lfu", "lru"]
EVICTION_POLICIES: tuple[str, ...] = ("decayed_lfu", "distance_lfu", "lfu", "lru")
DYNAMIC_SPARSE_OPTIMIZERS: tuple[str, ...] = ("sgd", "rowwise_adagrad")
"""Sparse optimizers whose state an eviction resets (FBGEMM's reset covers row-wise Adagrad's
one value per row; SGD has none). Full Adagrad keeps a stale accumulator on an evicted slot in
FBGEMM's own CUDA path, so it is refused."""

# Defaults measured with benchmarks/bench_dynamic.py (docs/dynamic.md, "Choosing the defaults").
DEFAULT_INTERVAL_ROWS = 2048
"""``eviction_interval_rows`` defaults to ``max(DEFAULT_INTERVAL_ROWS, num_slots)``: a pass
sorts the map, so larger tables pass less often (the same cost per row)."""
DEFAULT_HALF_LIFE = 4.0
DEFAULT_ADMISSION = 2.0
DEFAULT_HISTORY_FRACTION = 2
"""``history_slots`` defaults to ``num_slots // DEFAULT_HISTORY_FRACTION``."""

COUNT_ONE = 1 << 16
"""``decayed_lfu`` keeps counts in fixed point: one sighting is ``COUNT_ONE``."""


@dataclass(frozen=True, kw_only=True)
class DynamicTable:
    """Makes an embedding table dynamic: raw ids get their own row, up to ``num_slots`` rows.

    The defaults were measured on a churny stream (``benchmarks/bench_dynamic.py``; see
    docs/dynamic.md): a decaying-count policy (admission at 2 sightings, half-life 4 passes), a
    pass every ``max(2048, num_slots)`` rows, a history of ``num_slots / 2`` ids, one fallback
    row per shard."""

    num_slots: int
    """Rows in the table (its memory), the fallback rows included."""
    eviction_policy: EvictionPolicyName = "decayed_lfu"
    """Who keeps a row: ``decayed_lfu`` (the count of sightings, halving every
    ``count_half_life`` passes; default), or torchrec's ``distance_lfu`` (count /
    age^decay), ``lfu`` (count), ``lru`` (last access)."""
    eviction_interval_rows: int | None = None
    """Training rows (all ranks together) between admission/eviction passes. Default
    ``max(2048, num_slots)`` unless ``eviction_interval`` or ``eviction_interval_seconds`` is
    set (at most one of the three). A pass runs at the end of the step that reaches it."""
    eviction_interval_seconds: float | None = None
    """Seconds (wall clock, per rank) between passes instead; not reproducible on resume."""
    eviction_interval: int | None = None
    """Optimizer steps between passes instead (with gradient accumulation a step is all its
    micro-batches): the unit before ``eviction_interval_rows``; its meaning in data depends on
    the batch size."""
    admission_threshold: float | None = None
    """Sightings before a new id competes for its own row. ``decayed_lfu``: its decayed count
    (carried over passes) must reach it, default ``DEFAULT_ADMISSION``; the legacy policies:
    sightings within one interval, an int, default 1."""
    count_half_life: float = DEFAULT_HALF_LIFE
    """``decayed_lfu``: passes over which a count halves (resident ids' and waiting ids')."""
    history_slots: int | None = None
    """``decayed_lfu``: ids without a row (with their counts) the table holds between passes,
    split over its shards; 32 bytes each (the buffer is twice that: half for new sightings).
    Default ``num_slots // 2`` (at least 64). When full it is coalesced, then the least-seen ids are dropped.
    The legacy policies keep torchrec's history of every sighting, which grows instead."""
    fallback_rows: int = 1
    """Rows that ids without their own row read (by their position in the id space), split
    over the shards and rounded up to at least one per shard. The default, 1, is one shared
    default row per shard, as torchrec; more measured worse on the benchmark (docs/dynamic.md).
    """
    expire_after_windows: int | None = None
    """Evict ids unseen for this many train windows, at the end of a window (table full or
    not). Not with ``lfu``."""
    expire_after_seconds: float | None = None
    """Evict ids unseen for this many seconds (wall clock), at a pass. Not with ``lfu``."""
    decay_exponent: float = 1.0
    """Age exponent of ``distance_lfu`` and ``lru``."""
    buckets: int | None = None
    """Id buckets for torchrec's planner (a multiple of the world size). None: the world size
    when the model is built (the process group's, else the ``WORLD_SIZE`` variable)."""

    def __post_init__(self) -> None:
        check_int("DynamicTable.num_slots", self.num_slots, minimum=2)
        check_choice("DynamicTable.eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        check_int("DynamicTable.eviction_interval", self.eviction_interval, allow_none=True)
        check_int("DynamicTable.eviction_interval_rows", self.eviction_interval_rows,
                  allow_none=True)
        check_number("DynamicTable.eviction_interval_seconds", self.eviction_interval_seconds,
                     above=0.0, allow_none=True)
        given = [n for n in ("eviction_interval", "eviction_interval_rows",
                             "eviction_interval_seconds") if getattr(self, n) is not None]
        if len(given) > 1:
            fail("DynamicTable.eviction_interval*", "one of eviction_interval (steps), "
                 "eviction_interval_rows or eviction_interval_seconds", {n: getattr(self, n)
                                                                          for n in given})
        if not given:
            object.__setattr__(self, "eviction_interval_rows",
                               max(DEFAULT_INTERVAL_ROWS, self.num_slots))
        decayed = self.eviction_policy == "decayed_lfu"
        if self.admission_threshold is None:
            object.__setattr__(self, "admission_threshold", DEFAULT_ADMISSION if decayed else 1)
        if decayed:
            check_number("DynamicTable.admission_threshold", self.admission_threshold, above=0.0)
        else:
            check_int("DynamicTable.admission_threshold", self.admission_threshold)
        check_number("DynamicTable.count_half_life", self.count_half_life, above=0.0)
        if self.history_slots is not None and not decayed:
            fail("DynamicTable.history_slots", f"None with eviction_policy="
                 f"{self.eviction_policy!r} (torchrec's history grows as needed)",
                 self.history_slots)
        if decayed and self.history_slots is None:
            object.__setattr__(self, "history_slots",
                               max(64, self.num_slots // DEFAULT_HISTORY_FRACTION))
        check_int("DynamicTable.history_slots", self.history_slots, minimum=2, allow_none=True)
        check_int("DynamicTable.fallback_rows", self.fallback_rows)
        if self.fallback_rows >= min(self.num_slots, 2**31):
            fail("DynamicTable.fallback_rows", f"less than num_slots ({self.num_slots}) and "
                 "2**31: ids need rows of their own too", self.fallback_rows)
        check_int("DynamicTable.expire_after_windows", self.expire_after_windows,
                  allow_none=True)
        check_number("DynamicTable.expire_after_seconds", self.expire_after_seconds, above=0.0,
                     allow_none=True)
        if self.expire_after_windows is not None and self.expire_after_seconds is not None:
            fail("DynamicTable.expire_after_*", "one of expire_after_windows or "
                 "expire_after_seconds", (self.expire_after_windows, self.expire_after_seconds))
        if self.eviction_policy == "lfu" and self.expires:
            fail("DynamicTable.eviction_policy", "one that records when an id was last seen "
                 "('decayed_lfu', 'distance_lfu' or 'lru') with expire_after_*", "lfu")
        check_number("DynamicTable.decay_exponent", self.decay_exponent, above=0.0)
        check_int("DynamicTable.buckets", self.buckets, allow_none=True)
        if self.admission_threshold > 1 and self.eviction_policy == "lru":  # type: ignore[operator]
            fail("DynamicTable.admission_threshold", "1 with eviction_policy='lru' (LRU keeps no "
                 "counts to admit by; use 'decayed_lfu', 'distance_lfu' or 'lfu')",
                 self.admission_threshold)

    @property
    def expires(self) -> bool:
        """Whether ids expire (``expire_after_windows`` or ``expire_after_seconds``)."""
        return self.expire_after_windows is not None or self.expire_after_seconds is not None


# ------------------------------------------------------------------------- eviction policies

class DecayedLFUEvictionPolicy(MCHEvictionPolicy):
    """LFU with decay, as a torchrec ``MCHEvictionPolicy``: an id's score is its count of
    sightings, multiplied by ``2 ** (-1 / half_life)`` at every pass (``decay``), kept in fixed
    point (``COUNT_ONE`` per sighting).

    Metadata: per slot ``counts`` and ``last_access_iter`` (the forward that last saw the id;
    expiry reads it), which ``DynamicMCHModule`` updates in every training forward; per history
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
            counts = torch.cat([counts, torch.full_like(additional_ids, COUNT_ONE)])
        summed = torch.zeros_like(unique_ids_counts).scatter_add_(0, unique_inverse_mapping,
                                                                  counts)
        return {"counts": summed if threshold_mask is None else summed[threshold_mask]}

    @torch.no_grad()
    def decay(self, mch_metadata: dict[str, torch.Tensor]) -> None:
        """One pass of decay for the resident ids' counts."""
        counts = mch_metadata["counts"]
        counts.copy_((counts.double() * self.factor).floor_().long())

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
        scores[mch_size - self.protected:] = torch.iinfo(torch.int64).max
        evicted, selected = self._compute_selected_eviction_and_replacement_indices(
            mch_size, torch.cat([scores, new_scores]))
        counts[evicted] = new_counts[selected]
        last[evicted] = current_iter
        self.last_admitted = int(selected.numel())
        return evicted, selected


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


# ------------------------------------------------------------------------------ id mixing

_MASK = 2**63 - 1
_MUL_A = 0x9E3779B97F4A7C15 & _MASK | 1
_MUL_B = 0xBF58476D1CE4E5B9 & _MASK | 1
_INV_A = pow(_MUL_A, -1, 2**63)
_INV_B = pow(_MUL_B, -1, 2**63)


def _mul_mod63(x: torch.Tensor, c: int) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64 on CPU and CUDA; masking leaves it modulo 2**63.
    return torch.bitwise_and(x * c, _MASK)


def _xorshift32(x: torch.Tensor) -> torch.Tensor:
    # Self-inverse on 63-bit values: the shifted-in part (bits 32..62) is untouched by the xor.
    return torch.bitwise_xor(x, torch.bitwise_right_shift(x, 32))


def mix_ids(ids: torch.Tensor, input_size: int = ID_SPACE) -> torch.Tensor:
    """A bijection of ``[0, 2**63)`` (multiply, xorshift, multiply), applied by torchrec as the
    tables' ``input_hash_func`` *before* ids are routed to ranks.

    Why: row-wise managed collision sends an id to the rank owning its block of the id range,
    so small or sequential raw ids would all land on rank 0. Being a bijection it adds no
    collision; ``unmix_ids`` inverts it for exports. (The one id that mixes to ``2**63 - 1``,
    the empty-slot marker, is not supported.)"""
    del input_size  # the range is fixed: the whole non-negative int64 space
    # A negative id would wrap onto 2**63 + id and share its row: refuse it instead. On the GPU
    # the check is asynchronous (no host sync); the error surfaces at the next sync point.
    if ids.device.type == "cpu":
        if ids.numel() and int(ids.min()) < 0:
            bad = int(ids[ids < 0][0])
            raise ValueError(f"a dynamic table got the negative id {bad}; raw ids must be in "
                             "[0, 2**63) (hash or offset signed ids before they reach the table).")
    elif ids.numel():
        torch._assert_async((ids >= 0).all(), "a dynamic table got a negative raw id")
    return _mul_mod63(_xorshift32(_mul_mod63(ids, _MUL_A)), _MUL_B)


def unmix_ids(mixed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``mix_ids``: the raw ids stored in a dynamic table's map."""
    return _mul_mod63(_xorshift32(_mul_mod63(mixed, _INV_B)), _INV_A)


def fallback_index(mixed: torch.Tensor, rows: int) -> torch.Tensor:
    """Which of a table's ``rows`` fallback rows a (mixed) id without its own row reads:
    ``floor(mixed * rows / 2**63)``, its position in the id space. Shards own contiguous blocks
    of the id space, so each shard's ids read its own fallback rows, and the rows keep their ids
    when the world size changes. Exact integer arithmetic (``rows < 2**31``)."""
    hi = torch.bitwise_right_shift(mixed, 32)
    lo = torch.bitwise_and(mixed, 0xFFFFFFFF)
    return torch.bitwise_right_shift(hi * rows + torch.bitwise_right_shift(lo * rows, 32), 31)


def shard_of(mixed: torch.Tensor, shards: int) -> torch.Tensor:
    """The shard (rank) that owns a mixed id: torchrec's row-wise managed collision sends it by
    FBGEMM's block bucketization, ``mixed // ceil(ID_SPACE / shards)``."""
    return torch.div(mixed, -(-ID_SPACE // shards), rounding_mode="floor")


# ------------------------------------------------------------------------------- modules

def _world_size() -> int:
    # Models are usually built before the Trainer starts the process group: torchrun's
    # WORLD_SIZE says how many ranks there will be.
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class _Settings:
    """What ``DynamicMCHModule`` takes from ``DynamicTable`` beyond torchrec's arguments."""

    interval_steps: int | None = None
    interval_rows: int | None = None
    interval_seconds: float | None = None
    fallback_rows: int = 1
    history_slots: int | None = None
    expire_windows: int | None = None
    expire_seconds: float | None = None

    @staticmethod
    def of(spec: DynamicTable) -> _Settings:
        return _Settings(interval_steps=spec.eviction_interval,
                         interval_rows=spec.eviction_interval_rows,
                         interval_seconds=spec.eviction_interval_seconds,
                         fallback_rows=spec.fallback_rows,
                         history_slots=spec.history_slots,
                         expire_windows=spec.expire_after_windows,
                         expire_seconds=spec.expire_after_seconds)


_COUNTERS = ("admitted", "evicted", "expired", "passes", "dropped")


class DynamicMCHModule(MCHManagedCollisionModule):
    """torchrec's ``MCHManagedCollisionModule`` (one table's sorted id -> slot map on one
    shard) with passes every so many rows, seconds or steps, fallback rows, expiry, and, for
    ``DecayedLFUEvictionPolicy``, a bounded history that carries waiting ids' counts across
    passes (see the module docstring).

    Memory per shard: the map (sorted ids, slots, and the policy's per-slot metadata: 8 bytes
    each, 32 per slot for ``decayed_lfu``), and the history: ``decayed_lfu`` 16 bytes per entry
    for ``2 * history_slots / shards`` entries (half is kept for the ids waiting over passes,
    half takes new sightings before they are coalesced); the legacy policies 8 or 16 bytes per
    id *sighting* since the last pass, for the larger of torchrec's first size (the first
    batch's ids x ``eviction_interval`` x 1.25) and twice the most one interval brought.

    torchrec's constructor plus ``settings``; ``rebuild_with_output_id_range`` (sharding) keeps
    them. Reads and writes torchrec 1.8's private attributes of the module; the tests of
    resume, expiry and fallback rows fail if they change.
    """

    def __init__(self, *args: Any, settings: _Settings | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        m: Any = self
        # torchrec keeps its "init" segments as the very tensor of the buffer that a checkpoint
        # loads into: a load would overwrite this module's own shard boundaries.
        m._init_output_segments_tensor = m._init_output_segments_tensor.clone()
        self._settings = settings or _Settings(interval_steps=m._eviction_interval)
        segments = [int(s) for s in m._init_output_segments_tensor.tolist() if s >= 0]
        self.shards = len(segments) - 1
        """Shards of this table (its world size when sharded row-wise)."""
        self.shard = segments.index(m._output_global_offset)
        self.fallback_per_shard = max(1, -(-self._settings.fallback_rows // self.shards))
        """The last rows of this shard that ids without a row read."""
        if self.fallback_per_shard >= m._zch_size:
            fail(f"DynamicTable.fallback_rows (table {m._name!r})", f"fewer than the "
                 f"{m._zch_size} rows of each of its {self.shards} shard(s)",
                 self._settings.fallback_rows)
        self.decayed = isinstance(m._eviction_policy, DecayedLFUEvictionPolicy)
        if self.decayed:
            slots = self._settings.history_slots or m._zch_size
            _resize_history(m, 2 * -(-slots // self.shards))
        self.closes_step = True
        """Whether the current training forward is the last micro-batch of its step."""
        self._steps = 0
        """Optimizer steps this module has taken part in (forwards that closed a step)."""
        self._last_pass_step = 0
        self._rows_since_pass = 0
        self._last_pass_time = 0.0
        self._windows = 0
        self._window_marks: list[int] = []
        """The forward count at the end of each of the last train windows (expiry in windows)."""
        self._time_marks: list[tuple[int, float]] = []
        """(forward count, wall time) every 1/16 of ``expire_seconds`` (expiry in seconds)."""
        self.counters = dict.fromkeys(_COUNTERS, 0)
        """Since the run started (restored on resume): ids given a row, residents that lost
        theirs to another id, residents expired, passes, and ids dropped from a full history."""
        self.counters_epoch = 0
        """Times the counters restarted (a resume at another world size); the same on every
        rank, so reporters know their baseline is gone."""
        self.loaded_segments: list[int] | None = None
        """The shard boundaries of the checkpoint last loaded (set by ``validate_state``)."""
        self._lookup_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rebuild_with_output_id_range(self, output_id_range: tuple[int, int],
                                     output_segments: list[int],
                                     device: torch.device | None = None) -> DynamicMCHModule:
        m: Any = self
        return type(self)(
            name=m._name, zch_size=output_id_range[1] - output_id_range[0],
            device=device or self.device, eviction_policy=m._eviction_policy,
            eviction_interval=m._eviction_interval, input_hash_size=m._input_hash_size,
            input_hash_func=m._input_hash_func, output_global_offset=output_id_range[0],
            output_segments=output_segments, buckets=len(output_segments) - 1,
            settings=self._settings)

    # ---------------------------------------------------------------- lookups

    def fallback_slots(self, mixed: torch.Tensor) -> torch.Tensor:
        """The fallback slot (global row) each mixed id of this shard reads."""
        m: Any = self
        first = m._output_global_offset + m._zch_size - self.fallback_per_shard
        if self.fallback_per_shard == 1:
            return torch.full_like(mixed, first)
        g = fallback_index(mixed, self.fallback_per_shard * self.shards)
        local = (g - self.shard * self.fallback_per_shard).clamp_(0, self.fallback_per_shard - 1)
        return local + first

    def _lookup(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position in the sorted map, found) of mixed ids ``v``; the training forward's
        ``profile`` computes it and ``remap`` reuses it (unless a pass changed the map)."""
        cached = self._lookup_cache
        if cached is not None and cached[0] is v:
            return cached[1], cached[2]
        sorted_ids: torch.Tensor = self._mch_sorted_raw_ids
        # The last entry is always empty (a protected fallback slot): searching the others
        # keeps every position in range.
        pos = torch.searchsorted(sorted_ids[:-1], v)
        return pos, sorted_ids[pos] == v

    def remap(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True,
              write_weights: torch.Tensor | None = None) -> dict[str, JaggedTensor]:
        """Ids with a row read it; the others read their fallback row."""
        mapping: torch.Tensor = self._mch_remapped_ids_mapping
        out: dict[str, JaggedTensor] = {}
        for name, f in features.items():
            v = f.values()
            pos, found = self._lookup(v)
            slots = torch.where(found, mapping[pos], self.fallback_slots(v))
            out[name] = JaggedTensor(values=slots, lengths=f.lengths(), offsets=f.offsets(),
                                     weights=f.weights_or_none())
        self._lookup_cache = None
        return out

    def occupied(self) -> int:
        """Slots holding an id."""
        return int(torch.searchsorted(self._mch_sorted_raw_ids, self._delimiter).item())

    def open_slots(self) -> torch.Tensor:
        m: Any = self
        return torch.tensor([m._zch_size - self.fallback_per_shard - self.occupied()])

    # ---------------------------------------------------------------- training

    @torch.no_grad()
    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Record this batch's ids in the history; run a pass when the interval is over."""
        m: Any = self  # torchrec's attributes are untyped
        if not self.training:
            return features
        if m._current_iter == -1:
            # As torchrec: the iteration restored with the buffers (a resume sets it itself).
            m._current_iter = int(m._current_iter_tensor.item())
            m._last_eviction_iter = m._current_iter
        m._current_iter += 1
        m._current_iter_tensor.data += 1
        if self._last_pass_time == 0.0:
            self._last_pass_time = time.time()
        for f in features.values():
            # One length per feature and row of the whole (all ranks') batch; `weights` holds
            # one id count per feature of the table.
            w = f.weights_or_none()
            self._rows_since_pass += f.lengths().numel() // max(1, w.numel() if w is not None
                                                                else 1)
            v = f.values()
            if self.decayed:
                # Resident ids are counted in place; only the others wait in the history.
                pos, found = self._lookup(v)
                self._lookup_cache = (v, pos, found)
                # Adding 0 at, and taking the max with 0 over, the positions of ids not found:
                # two scatters, no compaction of the positions.
                m._mch_counts.index_add_(0, pos, found.long() * COUNT_ONE)
                m._mch_last_access_iter.scatter_reduce_(0, pos, found.long() * m._current_iter,
                                                        reduce="amax")
                self._record(v[~found])
            else:
                self._record_growing(v)
        if self.closes_step:
            self._steps += 1
            if self._pass_due():
                self.run_pass()
        return features

    def _pass_due(self) -> bool:
        s = self._settings
        if s.interval_rows is not None:
            return self._rows_since_pass >= s.interval_rows
        if s.interval_seconds is not None:
            return time.time() - self._last_pass_time >= s.interval_seconds
        m: Any = self
        return self._steps - self._last_pass_step >= (s.interval_steps or m._eviction_interval)

    def _record_growing(self, values: torch.Tensor) -> None:
        # torchrec sizes the history from the first batch and drops what does not fit; this
        # keeps that size as a floor and grows.
        m: Any = self
        start = m._current_history_buffer_offset
        end = start + values.numel()
        if end > m._input_history_buffer_size:
            grown = 2 * m._input_history_buffer_size if m._input_history_buffer_size > 0 else \
                int(end * m._eviction_interval * 1.25)  # torchrec's first size, now a floor
            _resize_history(m, max(end, grown))
        m._history_accumulator[start:end] = values
        m._eviction_policy.record_history_metadata(
            m._current_iter, values, {k: b[start:end] for k, b in m._history_metadata.items()})
        m._current_history_buffer_offset = end

    def _record(self, values: torch.Tensor) -> None:
        m: Any = self
        start = m._current_history_buffer_offset
        end = start + values.numel()
        if end <= m._input_history_buffer_size:
            m._history_accumulator[start:end] = values
            m._history_counts[start:end] = COUNT_ONE
            m._current_history_buffer_offset = end
        else:
            self._coalesce(values)

    def _coalesce(self, incoming: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge the history (and ``incoming`` sightings) into one entry per id, keeping at most
        half the buffer (the most-seen ids); returns the merged ids and counts."""
        m: Any = self
        used = m._current_history_buffer_offset
        ids, counts = m._history_accumulator[:used], m._history_counts[:used]
        if incoming is not None:
            ids = torch.cat([ids, incoming])
            counts = torch.cat([counts, torch.full_like(incoming, COUNT_ONE)])
        uniq, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros_like(uniq).scatter_add_(0, inverse, counts)
        keep = m._input_history_buffer_size // 2
        if incoming is not None and uniq.numel() > keep:
            top = torch.topk(summed, keep, sorted=False).indices.sort().values
            self.counters["dropped"] += uniq.numel() - keep
            uniq, summed = uniq[top], summed[top]
        n = uniq.numel()
        m._history_accumulator[:n] = uniq
        m._history_counts[:n] = summed
        m._current_history_buffer_offset = n
        return uniq, summed

    @torch.no_grad()
    def run_pass(self) -> None:
        """Admission and eviction now, over the ids seen since the last pass (then expiry in
        seconds, if set). The evicted slots are reset by torchrec in this forward."""
        m: Any = self
        before = self.occupied()
        policy: Any = m._eviction_policy
        policy.protected = self.fallback_per_shard
        if self.decayed:
            self._lookup_cache = None  # the map changes
            uniq, counts = self._coalesce()
            # Only ids at the threshold, and, when no slot is free, above the weakest resident
            # (residents win ties), can take a row: rank just those (a pass sorts what it ranks).
            can = counts >= policy.threshold
            if before >= m._zch_size - self.fallback_per_shard and bool(can.any()):
                can &= counts > m._mch_counts[:before].min()
            chosen = can.nonzero().squeeze(1)
            waiting = torch.ones_like(uniq, dtype=torch.bool)
            policy.last_admitted = 0
            if chosen.numel():
                m._update_and_evict(uniq[chosen], counts[chosen], {})
                sorted_ids = m._mch_sorted_raw_ids
                pos = torch.searchsorted(sorted_ids[:-1], uniq[chosen])
                waiting[chosen] = sorted_ids[pos] != uniq[chosen]
            # Resident ids' counts decay after the ranking, as the waiting ids' below: at the
            # next pass both hold their new sightings plus their past ones decayed.
            policy.decay(m._mch_metadata)
            # Ids that did not get a row wait for the next pass with their decayed count.
            ids = uniq[waiting]
            kept = (counts[waiting].double() * policy.factor).floor_().long()
            live = kept > 0
            ids, kept = ids[live], kept[live]
            cap = m._input_history_buffer_size // 2
            if ids.numel() > cap:
                top = torch.topk(kept, cap, sorted=False).indices.sort().values
                ids, kept = ids[top], kept[top]
            n = ids.numel()
            m._history_accumulator[:n] = ids
            m._history_counts[:n] = kept
            m._current_history_buffer_offset = n
        else:
            m._coalesce_history()
        admitted = int(policy.last_admitted)
        self.counters["admitted"] += admitted
        self.counters["evicted"] += before + admitted - self.occupied()
        self.counters["passes"] += 1
        self._last_pass_step = self._steps
        self._rows_since_pass = 0
        self._last_pass_time = time.time()
        m._last_eviction_iter = m._current_iter
        if self._settings.expire_seconds is not None:
            self._expire_by_time()

    # ---------------------------------------------------------------- expiry

    def _expire_by_time(self) -> None:
        m: Any = self
        span = float(self._settings.expire_seconds or 0.0)
        now = time.time()
        marks = self._time_marks
        if not marks or now - marks[-1][1] >= span / 16:
            marks.append((int(m._current_iter), now))
        old = [it for it, t in marks if t <= now - span]
        if old:
            # Keep the newest mark older than the span, and the ones after it.
            del marks[:len(old) - 1]
            self.expire(old[-1], keep_history=False)

    def end_window(self) -> None:
        """A train window ended: with ``expire_after_windows=N``, evict the ids unseen during
        the last N windows (those still in the history count as seen)."""
        m: Any = self
        self._windows += 1
        n = self._settings.expire_windows
        if n is None:
            return
        self._window_marks.append(max(0, int(m._current_iter)))
        del self._window_marks[:-(n + 1)]
        if len(self._window_marks) == n + 1:
            self.expire(self._window_marks[0], keep_history=True)

    @torch.no_grad()
    def expire(self, horizon_iter: int, keep_history: bool) -> int:
        """Evict the ids last seen at or before forward ``horizon_iter``; their slots are queued
        for torchrec's row reset. Returns how many."""
        m: Any = self
        ids: torch.Tensor = m._mch_sorted_raw_ids
        old = (ids != EMPTY_SLOT) & (m._mch_metadata["last_access_iter"] <= horizon_iter)
        used = m._current_history_buffer_offset
        if keep_history and used > 0:
            old &= ~torch.isin(ids, m._history_accumulator[:used])
        idx = old.nonzero().squeeze(1)
        n = int(idx.numel())
        if n == 0:
            return 0
        self._lookup_cache = None  # the map changes
        ids[idx] = EMPTY_SLOT
        for buf in m._mch_metadata.values():
            buf[idx] = 0
        slots = m._mch_remapped_ids_mapping[idx]
        if m._evicted:
            m._evicted_emb_indices = torch.unique(torch.cat([m._evicted_emb_indices, slots]))
        else:
            m._evicted_emb_indices = slots
        m._evicted = True
        m._sort_mch_buffers()
        self.counters["expired"] += n
        return n

    # ---------------------------------------------------------------- checkpoints

    def validate_state(self) -> None:
        """After ``load_state_dict``: remember the checkpoint's shard boundaries, take this
        module's own back and re-sort (torchrec asserts that the new boundaries are among the
        old; a checkpoint of another layout is re-routed instead, see ``_relayout``)."""
        m: Any = self
        self.loaded_segments = [int(s) for s in m._output_segments_tensor.tolist() if s >= 0]
        m._output_segments_tensor = m._init_output_segments_tensor
        m._sort_mch_buffers()


class StepBoundaries:
    """Tells a model's dynamic tables which training forwards end an optimizer step, so that
    passes run at step ends and ``eviction_interval`` counts optimizer steps whatever the
    micro-batches per step (a window's last step may have fewer), and when a train window ends
    (``end_window``). The Trainer runs every training forward inside
    ``micro_batch(closes_step)``."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._maps = [m for m in mc_modules(model).values() if isinstance(m, DynamicMCHModule)]

    @contextlib.contextmanager
    def micro_batch(self, closes_step: bool) -> Iterator[None]:
        """Run one training forward; ``closes_step``: it is the last micro-batch of its step."""
        if closes_step or not self._maps:
            yield
            return
        for m in self._maps:
            m.closes_step = False
        try:
            yield
        finally:
            # A forward outside this context (a hand-written loop) counts as a whole step.
            for m in self._maps:
                m.closes_step = True

    def end_window(self) -> None:
        """A train window ended (``end_window``)."""
        if self._maps:
            end_window(self._model)


def end_window(model: nn.Module) -> None:
    """Tell ``model``'s dynamic tables that a train window ended: with
    ``expire_after_windows`` they evict the ids unseen for that many windows now and reset their
    rows (torchrec's own reset), so a checkpoint taken next holds no pending reset. The Trainer
    calls it after every train window; call it yourself in a hand-written loop."""
    for _, coll in dynamic_collections(model):
        mcc: Any = coll._managed_collision_collection
        for mod in mcc._managed_collision_modules.values():
            if isinstance(mod, DynamicMCHModule):
                mod.end_window()
        _reset_evicted_rows(coll)


def _reset_evicted_rows(coll: nn.Module) -> None:
    """Reset the rows of the slots the maps queued for reset, as torchrec's forward does after a
    pass (an unsharded collection has no reset in torchrec: the queue is just consumed)."""
    c: Any = coll
    evictions = c._managed_collision_collection.evict()
    if hasattr(c, "_evict"):
        c._evict(evictions)


def _mc_module(name: str, spec: DynamicTable, device: torch.device) -> DynamicMCHModule:
    return DynamicMCHModule(
        zch_size=spec.num_slots,
        device=device,
        eviction_policy=make_eviction_policy(spec),
        eviction_interval=spec.eviction_interval or 1,
        input_hash_size=ID_SPACE,
        input_hash_func=mix_ids,
        name=name,
        buckets=spec.buckets or _world_size(),
        settings=_Settings.of(spec),
    )


def dynamic_embedding_collection(
    tables: list[EmbeddingConfig], dynamic: DynamicTable | dict[str, DynamicTable],
    device: torch.device | None = None,
) -> ManagedCollisionEmbeddingCollection:
    """A torchrec ``ManagedCollisionEmbeddingCollection`` over ``tables`` (sequence features:
    its forward returns ``(Dict[feature, JaggedTensor], None)``). ``dynamic`` is one spec for
    every table or one per table name; each table's ``num_embeddings`` must equal its spec's
    ``num_slots``. A table may list several features (they share its ids and rows). The rows
    are built on ``device`` (default meta: DMP materialises shards); the id maps on CPU (the
    sharder moves them to the compute device)."""
    specs = _specs_for(tables, dynamic)
    ec = EmbeddingCollection(tables=tables, device=device or torch.device("meta"))
    mcc = ManagedCollisionCollection(
        {t.name: _mc_module(t.name, specs[t.name], torch.device("cpu")) for t in tables}, tables)
    # allow_in_place_embed_weight_update: re-initialising evicted rows through .data, so it
    # does not trip autograd's version check on the table views used by this step's graph.
    return ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False,
                                               allow_in_place_embed_weight_update=True)


def _specs_for(tables: list[EmbeddingConfig], dynamic: DynamicTable | dict[str, DynamicTable],
               ) -> dict[str, DynamicTable]:
    names = [t.name for t in tables]
    if isinstance(dynamic, DynamicTable):
        specs = {n: dynamic for n in names}
    else:
        missing = sorted(set(names) - set(dynamic))
        extra = sorted(set(dynamic) - set(names))
        if missing or extra:
            raise ValueError(f"`dynamic` must name exactly the tables {names}; missing "
                             f"{missing}, unknown {extra}.")
        specs = dict(dynamic)
    for t in tables:
        if t.num_embeddings != specs[t.name].num_slots:
            raise ValueError(f"table {t.name!r}: `num_embeddings` ({t.num_embeddings}) must equal "
                             f"its DynamicTable.num_slots ({specs[t.name].num_slots}).")
    return specs


class DynamicEmbeddingBagCollection(nn.Module):
    """Pooled dynamic features: an ``EmbeddingBagCollection`` look-alike (``forward(kjt) ->
    KeyedTensor``, ``embedding_bag_configs()``) over a managed-collision collection whose
    per-id rows are pooled here (sum or mean, per table's ``pooling``). A table may be read by
    several features (each pooled on its own).

    Pooling is one ``segment_reduce`` per feature, after the sharded lookup; the collection
    itself is what DMP shards, so the KJT reaches it unchanged (TorchRec pipelines can trace).
    """

    def __init__(self, tables: list[EmbeddingBagConfig],
                 dynamic: DynamicTable | dict[str, DynamicTable],
                 device: torch.device | None = None) -> None:
        super().__init__()
        for t in tables:
            if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {t.name!r}: `pooling` must be SUM or MEAN for a dynamic "
                                 f"table, but is {t.pooling}.")
        self._bag_configs = list(tables)
        self._mean = {f: t.pooling == PoolingType.MEAN for t in tables for f in t.feature_names}
        self._features = [f for t in tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        configs = [EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim,
                                   num_embeddings=t.num_embeddings, feature_names=t.feature_names,
                                   weight_init_max=t.weight_init_max,
                                   weight_init_min=t.weight_init_min, init_fn=t.init_fn)
                   for t in tables]
        self.mc_ec = dynamic_embedding_collection(configs, dynamic, device)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The pooled tables (what torchrec's DLRM reads for dimensions)."""
        return self._bag_configs

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        looked_up, _ = self.mc_ec(features)
        pooled = [_pool(looked_up[f], self._mean[f]) for f in self._features]
        return KeyedTensor(keys=self._features, length_per_key=self._dims,
                           values=torch.cat(pooled, dim=1))


@torch.fx.wrap
def _pool(jt: JaggedTensor, mean: bool) -> torch.Tensor:
    lengths, values = jt.lengths(), jt.values()
    # One id per row (as many ids as rows, none more than one): nothing to pool. Checked on CPU
    # only, where reading the maximum costs no device synchronisation.
    if values.device.type == "cpu" and values.shape[0] == lengths.numel() and (
            not values.shape[0] or int(lengths.max()) == 1):
        return values
    out = torch.segment_reduce(values, "sum", lengths=lengths, axis=0, unsafe=True)
    if mean:
        out = out / lengths.clamp_min(1).unsqueeze(1).to(out.dtype)
    return out


# ------------------------------------------------------------------------ finding tables

def dynamic_collections(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Managed-collision embedding collections in ``model``, sharded or not (name, module)."""
    from torchrec.distributed.mc_embedding_modules import (
        BaseShardedManagedCollisionEmbeddingCollection,
    )
    for name, m in model.named_modules():
        if isinstance(m, ManagedCollisionEmbeddingCollection
                      | BaseShardedManagedCollisionEmbeddingCollection):
            yield name, m


def mc_modules(model: nn.Module) -> dict[str, MCHManagedCollisionModule]:
    """``{table: this rank's id map}`` for every dynamic table in ``model``."""
    out: dict[str, MCHManagedCollisionModule] = {}
    for _, coll in dynamic_collections(model):
        mcc: Any = coll._managed_collision_collection
        for table, mod in mcc._managed_collision_modules.items():
            if isinstance(mod, MCHManagedCollisionModule):
                out[table] = mod
    return out


def dynamic_table_names(model: nn.Module) -> set[str]:
    """Names of the tables that are dynamic (before or after sharding)."""
    names: set[str] = set()
    for _, coll in dynamic_collections(model):
        if isinstance(coll, ManagedCollisionEmbeddingCollection):
            names.update(c.name for c in coll._managed_collision_collection.embedding_configs())
        else:
            names.update(mc_modules(coll))
    return names


def check_sparse_optimizer(model: nn.Module, optimizer_name: str) -> None:
    """Dynamic tables need an optimizer whose per-row state an eviction resets."""
    if dynamic_table_names(model) and optimizer_name not in DYNAMIC_SPARSE_OPTIMIZERS:
        fail("sparse_optimizer", f"one of {', '.join(DYNAMIC_SPARSE_OPTIMIZERS)} with dynamic "
             f"tables (an evicted slot must not keep the previous id's optimizer state)",
             optimizer_name)


def planner_constraints(model: nn.Module, device_type: str) -> dict[str, dict[str, Any]]:
    """``{table: ParameterConstraints kwargs}`` for the dynamic tables: ``row_wise`` (the only
    sharding torchrec's managed collision has); the ``fused`` kernel on CPU, the planner's
    choice of kernel on CUDA."""
    out: dict[str, dict[str, Any]] = {}
    for name in dynamic_table_names(model):
        kw: dict[str, Any] = {"sharding_types": ["row_wise"]}
        if device_type == "cpu":
            kw["compute_kernels"] = ["fused"]
        out[name] = kw
    return out


def check_buckets(model: nn.Module, world_size: int) -> None:
    """Every dynamic table's buckets divide evenly over ``world_size`` ranks (torchrec's
    planner fails with "uneven buckets per rank" otherwise; this says which field to set)."""
    for table, mod in mc_modules(model).items():
        if mod.buckets() % world_size:
            fail(f"DynamicTable.buckets (table {table!r})", f"a multiple of the world size "
                 f"{world_size}; build the model after the process group, or set it", mod.buckets())


# --------------------------------------------------------------------- eviction resets

def _feature_of_table(tbe: Any, table: int) -> int:
    """FBGEMM's per-table offsets (``D_offsets``, ``weights_offsets``...) are indexed by
    *feature*; torchrec's eviction passes the *table*'s index. A table read by several features
    (a shared table) is found at its first feature."""
    return list(tbe.feature_table_map).index(table)


def reset_rows_cpu(tbe: Any, pruned_indices: torch.Tensor, pruned_indices_offsets: torch.Tensor,
                   logical_table_ids: torch.Tensor, buffer_ids: torch.Tensor) -> None:
    """CPU counterpart of FBGEMM's ``reset_weight_momentum`` for one table-batched module.

    What the CUDA kernel does, for each pruned table ``t`` (``logical_table_ids[t]``, here a
    table index, see ``_feature_of_table``) and each row index in its segment
    ``pruned_indices[offsets[buffer_ids[t]]:offsets[buffer_ids[t]+1]]``: zero the row's weights
    and its row-wise Adagrad accumulator. As in FBGEMM's Python wrapper, only row-wise Adagrad
    has state to reset. (torchrec then re-initialises the weights with the table's ``init_fn``.)
    CPU tables live in the ``*_host`` buffers, which the CUDA op's signature does not carry: that
    is why this is a method replacement, not a kernel registered for the op."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if tbe.optimizer == EmbOptimType.NONE:
        raise NotImplementedError("resetting rows needs a fused optimizer")
    weights = tbe.weights_host
    d_offsets = tbe.D_offsets.tolist()
    w_offsets = tbe.weights_offsets.tolist()
    rowwise = tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    bounds = pruned_indices_offsets.tolist()
    for t, b in zip(logical_table_ids.tolist(), buffer_ids.tolist(), strict=True):
        rows = pruned_indices[bounds[b]:bounds[b + 1]].long()
        if rows.numel() == 0:
            continue
        f = _feature_of_table(tbe, t)
        dim = d_offsets[f + 1] - d_offsets[f]
        with torch.no_grad():
            table = weights[w_offsets[f]:].as_strided((int(rows.max()) + 1, dim), (dim, 1))
            table.index_fill_(0, rows, 0.0)
            if rowwise:
                momentum = tbe.momentum1_host[int(tbe.momentum1_offsets[f]):]
                momentum.index_fill_(0, rows, 0.0)


def _reset_rows_fbgemm(tbe: Any, reset: Any, pruned_indices: torch.Tensor,
                       pruned_indices_offsets: torch.Tensor, logical_table_ids: torch.Tensor,
                       buffer_ids: torch.Tensor) -> None:
    """FBGEMM's own reset (the CUDA kernel) with torchrec's table index turned into the feature
    index the kernel reads its offsets by."""
    features = torch.tensor([_feature_of_table(tbe, int(t)) for t in logical_table_ids.tolist()],
                            dtype=logical_table_ids.dtype, device=logical_table_ids.device)
    reset(pruned_indices=pruned_indices, pruned_indices_offsets=pruned_indices_offsets,
          logical_table_ids=features, buffer_ids=buffer_ids)


def install_eviction_reset(model: nn.Module) -> int:
    """Give every table-batched module under a sharded dynamic collection its eviction reset
    (an instance attribute shadowing FBGEMM's method): ``reset_rows_cpu`` for CPU tables,
    FBGEMM's op with the feature index for the others. Returns how many it installed."""
    n = 0
    for _, coll in dynamic_collections(model):
        for tbe, _idx in getattr(coll, "_table_to_tbe_and_index", {}).values():
            if "reset_embedding_weight_momentum" in vars(tbe):
                continue
            if tbe.weights_host.numel():
                tbe.reset_embedding_weight_momentum = functools.partial(reset_rows_cpu, tbe)
            else:
                tbe.reset_embedding_weight_momentum = functools.partial(
                    _reset_rows_fbgemm, tbe, tbe.reset_embedding_weight_momentum)
            n += 1
    return n


install_cpu_eviction = install_eviction_reset
"""The former name (CPU only then)."""


# ---------------------------------------------------------------------------- checkpoints

STATE_FORMAT = 2
"""``DynamicTablesState`` format: 2 adds the fallback layout, the pass schedule in rows and
seconds, expiry marks and the counters; 1 (before) loads too."""


class DynamicTablesState:
    """The id maps' state that torchrec keeps outside ``state_dict()``: a checkpoint component
    (``Stateful``), saved per rank.

    The maps themselves (sorted ids, slots, the policy's per-slot metadata, the iteration) are
    module buffers: DCP saves them, sharded like the rows. What is not a buffer is the history
    since the last pass (ids seen, their counts or access iterations), the pass schedule, the
    expiry marks and the counters. Without them a resumed run would admit and evict
    differently from the uninterrupted one. This reads torchrec 1.8's private attributes of
    ``MCHManagedCollisionModule``; the bitwise-resume test fails if they change.

    A checkpoint of another layout (world size, or number of fallback rows per shard) is
    re-routed on load (``_relayout``, a collective over ``process_group``): every resident id
    moves, with its row, optimizer state and metadata, to the shard that owns it now, and the
    fallback rows keep their place in the id space. The ids seen since the checkpoint's last
    pass are not carried over then (they are counted again from the next batches).
    """

    needed_for_scoring = True
    """Restored with the model for evaluate/predict too (``checkpoint.contents``): the maps'
    buffers load into any layout, and one of another layout is re-routed here."""

    def __init__(self, model: nn.Module, world_size: int,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self._model = model
        self._world_size = world_size
        self._group = process_group

    def state_dict(self) -> dict[str, Any]:
        tables: dict[str, Any] = {}
        for table, mod in mc_modules(self._model).items():
            m: Any = mod
            used = int(m._current_history_buffer_offset)
            st: dict[str, Any] = {
                "buffer_size": int(m._input_history_buffer_size),
                "used": used,
                "history": (m._history_accumulator[:used].clone()
                            if m._input_history_buffer_size > 0 else None),
                "history_metadata": {k: v[:used].clone() for k, v in m._history_metadata.items()},
                "current_iter": int(m._current_iter),
                "last_eviction_iter": int(m._last_eviction_iter),
            }
            if isinstance(m, DynamicMCHModule):
                st.update({
                    "steps": m._steps, "last_pass_step": m._last_pass_step,
                    "rows_since_pass": m._rows_since_pass, "last_pass_time": m._last_pass_time,
                    "windows": m._windows, "window_marks": list(m._window_marks),
                    "time_marks": list(m._time_marks), "counters": dict(m.counters),
                    "counters_epoch": m.counters_epoch,
                    "fallback_per_shard": m.fallback_per_shard, "shards": m.shards,
                    "decayed": m.decayed,
                })
            tables[table] = st
        return {"format": STATE_FORMAT, "world_size": self._world_size, "tables": tables}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mods = mc_modules(self._model)
        tables = state_dict["tables"]
        if set(tables) != set(mods):
            raise ValueError(f"the checkpoint has dynamic tables {sorted(tables)}, the model "
                             f"{sorted(mods)}; build the model with the same dynamic tables.")
        saved_world = int(state_dict["world_size"])
        for table, st in tables.items():
            m: Any = mods[table]
            if st.get("decayed", False) != getattr(m, "decayed", False):
                raise ValueError(
                    f"dynamic table {table!r} was checkpointed with "
                    f"{'decayed_lfu' if st.get('decayed') else 'a legacy eviction policy'} and is "
                    f"built with {'decayed_lfu' if getattr(m, 'decayed', False) else 'another'}"
                    f"; build it with the checkpoint's eviction_policy (before decayed_lfu the "
                    "default was 'distance_lfu').")
        relayout = any(
            saved_world != self._world_size
            or int(st.get("fallback_per_shard", 1)) != getattr(mods[t], "fallback_per_shard", 1)
            for t, st in tables.items())
        for table, st in tables.items():
            m = mods[table]
            _restore(m, st, history=not relayout)
        if relayout:
            group = self._group if self._group is not None else (
                dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
            for table, st in sorted(tables.items()):
                _relayout(self._model, table, saved_world, int(st.get("fallback_per_shard", 1)),
                          group)


def _restore(m: Any, st: dict[str, Any], history: bool) -> None:
    """Put one table's saved non-buffer state back (the history only with ``history``)."""
    m._current_iter = st["current_iter"]
    m._last_eviction_iter = st["last_eviction_iter"]
    size, used = st["buffer_size"], st["used"] if history else 0
    if size > 0 and (not isinstance(m, DynamicMCHModule) or not m.decayed):
        _resize_history(m, max(size, m._input_history_buffer_size))
    elif used > m._input_history_buffer_size:  # a smaller history_slots than the checkpoint's
        _resize_history(m, used)
    if used:
        m._history_accumulator[:used] = st["history"]
        for k, v in st["history_metadata"].items():
            m._history_metadata[k][:used] = v
    m._current_history_buffer_offset = used
    if not isinstance(m, DynamicMCHModule):
        return
    # Checkpoints from before passes counted steps (format 1, no step keys): forwards were
    # steps then (the count was only wrong with gradient accumulation).
    m._steps = int(st.get("steps", st["current_iter"]))
    m._last_pass_step = int(st.get("last_pass_step", st["last_eviction_iter"]))
    m._rows_since_pass = int(st.get("rows_since_pass", 0))
    m._last_pass_time = float(st.get("last_pass_time", 0.0))
    m._windows = int(st.get("windows", 0))
    m._window_marks = list(st.get("window_marks", []))
    m._time_marks = [tuple(x) for x in st.get("time_marks", [])]
    m.counters_epoch = int(st.get("counters_epoch", 0))
    if "counters" in st:
        m.counters = dict(st["counters"])
    else:  # format 1: the policy's counters; evictions were derived
        m.counters = dict.fromkeys(_COUNTERS, 0)
        m.counters.update(admitted=int(st["admitted"]), passes=int(st["passes"]),
                          evicted=int(st["admitted"]) - m.occupied())


def _resize_history(m: Any, size: int) -> None:
    """(Re)allocate an MCH module's history buffers (the ids seen since the last pass, and the
    policy's per-id history metadata) at ``size`` ids, keeping the ids already recorded."""
    keep = min(m._current_history_buffer_offset, size) if m._input_history_buffer_size > 0 else 0
    acc = torch.empty(size, dtype=torch.int64, device=m.device)
    if keep:
        acc[:keep] = m._history_accumulator[:keep]
    m._history_accumulator = acc
    for name, _is_mch, is_history in m._eviction_policy.metadata_info:
        if is_history:
            buf = "_history_" + name
            new = torch.zeros(size, dtype=torch.int64, device=m.device)
            if keep:
                new[:keep] = m._history_metadata[name][:keep]
            m.register_buffer(buf, new, persistent=False)
            m._history_metadata[name] = new
    m._input_history_buffer_size = size


def _table_owner(model: nn.Module, table: str) -> tuple[Any, Any]:
    """(the collection, this rank's map) of ``table``."""
    for _, coll in dynamic_collections(model):
        c: Any = coll
        mods = c._managed_collision_collection._managed_collision_modules
        if table in mods:
            return coll, mods[table]
    raise KeyError(table)


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors must be for collectives on ``group`` (NCCL: the GPU)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_rows(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``[n_r, c]`` int64 rows, concatenated in rank order (on the CPU)."""
    _, world = _group_rank_size(group)
    if world == 1:
        return local
    dev = _comm_device(group)
    n = torch.tensor([local.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    most = max(int(s) for s in sizes)
    padded = torch.zeros(most, local.shape[1], dtype=torch.int64, device=dev)
    padded[:local.shape[0]] = local.to(dev)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:int(s)].cpu() for p, s in zip(parts, sizes, strict=True)])


def _keep_best(rows: torch.Tensor, names: list[str], cap: int) -> torch.Tensor:
    """Indices of the ``cap`` rows (id, slot, metadata by ``names``) a policy keeps: by count,
    then by last access (torchrec's own policies rank by those)."""
    order = torch.arange(rows.shape[0])
    for key in ("last_access_iter", "counts"):  # least significant first (stable sorts)
        if key in names:
            col = rows[order, 2 + names.index(key)]
            order = order[torch.argsort(col, descending=True, stable=True)]
    return order[:cap]


@torch.no_grad()
def _relayout(model: nn.Module, table: str, saved_world: int, saved_fallback: int,
              group: dist.ProcessGroup | None) -> None:
    """Re-route a dynamic table loaded from a checkpoint of another layout (a collective).

    DCP has loaded the saved global row space into this run's shards: rank ``r`` holds the rows
    and map entries at its new row range, entries that still name slots of the old layout.
    Every rank gathers all resident entries (id, old slot, metadata), and all compute the same
    plan: each id goes to the shard that owns it now (``shard_of``), into the first free slots
    of that shard in id order (if more ids land on a shard than it has slots for ids, its
    best by count / last access stay); fallback row ``g`` of the new layout takes the old
    fallback row covering the same part of the id space (the same row when their number is
    unchanged). Rows and optimizer state move with one ``all_to_all``."""
    coll, m = _table_owner(model, table)
    if not isinstance(m, DynamicMCHModule) or m.loaded_segments is None:
        raise RuntimeError(f"dynamic table {table!r}: its id map was not loaded from the "
                           "checkpoint, so it cannot be re-routed.")
    rank, world = _group_rank_size(group)
    mm: Any = m
    old_seg, fb_old = m.loaded_segments, saved_fallback
    new_seg = [int(s) for s in mm._init_output_segments_tensor.tolist() if s >= 0]
    shards_new, fb_new = len(new_seg) - 1, m.fallback_per_shard
    names = sorted(mm._mch_metadata)
    ids = mm._mch_sorted_raw_ids
    real = ids != EMPTY_SLOT
    local = torch.stack([ids[real], mm._mch_remapped_ids_mapping[real]]
                        + [mm._mch_metadata[k][real] for k in names], dim=1).cpu()
    everything = _all_gather_rows(local, group)
    owner = shard_of(everything[:, 0], shards_new)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    mine = everything[:0]
    dropped = 0
    for k in range(shards_new):
        rows = everything[owner == k]
        cap = new_seg[k + 1] - new_seg[k] - fb_new
        if rows.shape[0] > cap:
            dropped += rows.shape[0] - cap
            rows = rows[_keep_best(rows, names, cap)]
        rows = rows[torch.argsort(rows[:, 0])]
        src.append(rows[:, 1])
        dst.append(new_seg[k] + torch.arange(rows.shape[0]))
        if k == rank:
            mine = rows
    # Fallback rows: new row g reads the part of the id space whose middle old row g_old covered.
    total_new, total_old = fb_new * shards_new, fb_old * (len(old_seg) - 1)
    g_new = torch.arange(total_new)
    g_old = torch.div((2 * g_new + 1) * total_old, 2 * total_new, rounding_mode="floor")
    old_ends = torch.tensor(old_seg[1:])
    new_ends = torch.tensor(new_seg[1:])
    src.append(old_ends[g_old // fb_old] - fb_old + g_old % fb_old)
    dst.append(new_ends[g_new // fb_new] - fb_new + g_new % fb_new)
    _move_rows(coll, table, torch.cat(src), torch.cat(dst), new_seg, rank, world, group)
    # This shard's map: its ids in the first slots (sorted), every other slot empty, in slot
    # order, so the fallback slots are the last entries (never assigned, see the policies).
    n, z = mine.shape[0], mm._zch_size
    new_ids = torch.full((z,), EMPTY_SLOT, dtype=torch.int64)
    new_ids[:n] = mine[:, 0]
    ids.copy_(new_ids.to(ids.device))
    mm._mch_remapped_ids_mapping.copy_(torch.arange(
        mm._output_global_offset, mm._output_global_offset + z, device=ids.device))
    for j, key in enumerate(names):
        meta = torch.zeros(z, dtype=torch.int64)
        meta[:n] = mine[:, 2 + j]
        mm._mch_metadata[key].copy_(meta.to(ids.device))
    mm._evicted = False
    m.loaded_segments = None
    if world != saved_world:
        # Each rank's counters were its own shard's; rank 0's alone came back. Start afresh.
        m.counters = dict.fromkeys(_COUNTERS, 0)
        m.counters_epoch += 1
    if rank == 0:
        logger.warning(
            "dynamic table %s: re-routed %d ids from a checkpoint of %d shard(s) with %d "
            "fallback row(s) each to %d shard(s) with %d each%s; the ids seen since its last "
            "pass are counted again from the next batches", table, everything.shape[0],
            len(old_seg) - 1, fb_old, shards_new, fb_new,
            f"; {dropped} ids with the fewest sightings did not fit their new shard"
            if dropped else "")


def _move_rows(coll: Any, table: str, src: torch.Tensor, dst: torch.Tensor,
               new_seg: list[int], rank: int, world: int,
               group: dist.ProcessGroup | None) -> None:
    """Copy global rows ``src`` (weights and per-row optimizer state) to global rows ``dst``,
    where each rank holds the rows of its range in ``new_seg``."""
    if not hasattr(coll, "_table_to_tbe_and_index"):
        raise RuntimeError(f"dynamic table {table!r} is not sharded; a checkpoint of another "
                           "layout can only be re-routed into a sharded model (the Trainer's).")
    tbe, idx = coll._table_to_tbe_and_index[table]
    if getattr(tbe, "lxu_cache_weights", torch.empty(0)).numel():
        tbe.flush()  # a UVM-cached table: write the cache back first
    weights = tbe.split_embedding_weights()[int(idx)]
    states = [s.view(s.shape[0], -1) for s in tbe.split_optimizer_states()[int(idx)]]
    lo = new_seg[rank]
    ends = torch.tensor(new_seg[1:])
    src_rank = torch.searchsorted(ends, src, right=True)
    dst_rank = torch.searchsorted(ends, dst, right=True)

    def payload(local_rows: torch.Tensor) -> torch.Tensor:
        parts = [weights[local_rows].float()] + [s[local_rows].float() for s in states]
        return torch.cat(parts, dim=1)

    sending = (src_rank == rank).nonzero().squeeze(1)
    sending = sending[torch.argsort(dst_rank[sending], stable=True)]
    dev = _comm_device(group)
    send = payload((src[sending] - lo).to(weights.device)).to(dev)
    receiving = (dst_rank == rank).nonzero().squeeze(1)
    receiving = receiving[torch.argsort(src_rank[receiving], stable=True)]
    if world > 1:
        send_splits = torch.bincount(dst_rank[sending], minlength=world).tolist()
        recv_splits = torch.bincount(src_rank[receiving], minlength=world).tolist()
        recv = torch.empty(len(receiving), send.shape[1], dtype=send.dtype, device=dev)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    else:
        recv = send
    rows = (dst[receiving] - lo).to(weights.device)
    recv = recv.to(weights.device)
    dim = weights.shape[1]
    weights[rows] = recv[:, :dim].to(weights.dtype)
    at = dim
    for s in states:
        s[rows] = recv[:, at:at + s.shape[1]].to(s.dtype)
        at += s.shape[1]
    if hasattr(tbe, "reset_cache_states") and getattr(
            tbe, "lxu_cache_weights", torch.empty(0)).numel():
        tbe.reset_cache_states()  # the cache held rows of the old layout


# -------------------------------------------------------------------------------- stats

def table_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """This rank's ``{table: {"slots", "fallback_rows", "occupied", "admitted", "evicted",
    "expired", "passes", "dropped", "counters_epoch"}}``: rows in its shard (fallback rows
    included), those of them that ids without a row read, slots holding an id, and since the
    run started (across resumes at the same world size) new ids given a row, resident ids that
    lost theirs to another id, resident ids expired, passes, and ids dropped from a full history
    before a pass; ``counters_epoch`` counts the restarts of those counters (a resume at another
    world size restarts them; the same on every rank). Sum over ranks for the table's totals."""
    out: dict[str, dict[str, int]] = {}
    for table, mod in mc_modules(model).items():
        m: Any = mod
        epoch = 0
        if isinstance(mod, DynamicMCHModule):
            counters, fallback, occupied = mod.counters, mod.fallback_per_shard, mod.occupied()
            epoch = mod.counters_epoch
        else:
            counters = dict.fromkeys(_COUNTERS, 0)
            fallback, occupied = 1, int(m._zch_size) - 1 - int(mod.open_slots().item())
        out[table] = {"slots": int(m._zch_size), "fallback_rows": fallback,
                      "occupied": occupied, **{k: int(counters[k]) for k in _COUNTERS},
                      "counters_epoch": epoch}
    return out


def table_memory(model: nn.Module) -> dict[str, dict[str, int]]:
    """This rank's bytes per dynamic table: ``rows`` (the weights, fallback rows included),
    ``optimizer`` (the fused optimizer's per-row state), ``id_map`` (the sorted ids, their slots
    and the policy's per-slot metadata), ``history`` (the ids held for the next pass, with their
    metadata, as allocated), and ``total``: what a hashed table of equal memory is measured
    against."""
    out: dict[str, dict[str, int]] = {}
    for _, coll in dynamic_collections(model):
        tbes: dict[str, Any] = getattr(coll, "_table_to_tbe_and_index", {})
        for table, mod in mc_modules(coll).items():
            m: Any = mod
            history = 0
            if m._input_history_buffer_size > 0:
                history = m._history_accumulator.nbytes + sum(
                    v.nbytes for v in m._history_metadata.values())
            id_map = sum(b.nbytes for n, b in m.named_buffers() if not n.startswith("_history_"))
            rows = optim = 0
            if table in tbes:
                tbe, idx = tbes[table]
                rows = tbe.split_embedding_weights()[int(idx)].nbytes
                optim = sum(s.nbytes for s in tbe.split_optimizer_states()[int(idx)])
            out[table] = {"rows": rows, "optimizer": optim, "id_map": id_map, "history": history,
                          "total": rows + optim + id_map + history}
    return out


def is_resident(model: nn.Module, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{table: mask}``: which raw ids have their own row in this rank's shard of ``table``
    (the others read the table's fallback rows)."""
    maps = mc_modules(model)
    out: dict[str, torch.Tensor] = {}
    for table, raw in ids.items():
        m: Any = maps[table]
        sorted_ids = m._mch_sorted_raw_ids
        mixed = mix_ids(raw.to(sorted_ids.device))
        pos = torch.searchsorted(sorted_ids[:-1], mixed)
        out[table] = (sorted_ids[pos] == mixed).to(raw.device)
    return out
