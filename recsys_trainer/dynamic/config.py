"""``DynamicTable``: what makes an embedding table dynamic, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from recsys_trainer.validation import check_choice, check_int, check_number, check_type, fail

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
DEFAULT_HISTORY_FRACTION = 8
"""``history_slots`` defaults to ``num_slots // DEFAULT_HISTORY_FRACTION`` (at least 64): 2.5
bytes a slot, which keeps a dynamic table's bookkeeping within 24 bytes a slot from 512 slots up
(the map 20, the lookup index at most 1.5); below 512 slots the 64 ids' 1,280 bytes make it
20 + 1,280 / num_slots (measured on the churny stream, 10 seeds: ``num_slots // 4`` gains
+0.0011 AUC for 2.5 more bytes a slot, ``num_slots // 2`` +0.0017 for 7.5; docs/dynamic.md,
"Memory")."""


@dataclass(frozen=True, kw_only=True)
class DynamicTable:
    """Makes an embedding table dynamic: raw ids get their own row, up to ``num_slots`` rows.

    The defaults were measured on a churny stream (``benchmarks/bench_dynamic.py``; see
    docs/dynamic.md): a decaying-count policy (admission at 2 sightings, half-life 4 passes), a
    pass every ``max(2048, num_slots)`` rows, a history of ``num_slots / 8`` ids, one fallback
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
    split over its shards; 20 bytes each (an int64 id and a float32 count, and room for one
    new sighting, an int64 id, before they are coalesced). Default ``num_slots // 8`` (at least
    64). When full it is coalesced, then the least-seen ids are dropped.
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
    pooled_lookup: bool = True
    """Pooled features (``DynamicEmbeddingBagCollection``, the DLRM's tables): look them up
    with torchrec's ``ManagedCollisionEmbeddingBagCollection`` (FBGEMM's pooled lookup, the
    id map in front; default) or, with False, with the unpooled
    ``ManagedCollisionEmbeddingCollection`` pooled afterwards (the path before: slower,
    docs/dynamic.md "Step time"; its checkpoints name the rows ``embeddings``, not
    ``embedding_bags``, so they load only with False). One value for a collection's tables.
    Sequence features always take the unpooled collection."""

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
        check_type("DynamicTable.pooled_lookup", self.pooled_lookup, (bool,), "true or false")
        if self.admission_threshold > 1 and self.eviction_policy == "lru":  # type: ignore[operator]
            fail("DynamicTable.admission_threshold", "1 with eviction_policy='lru' (LRU keeps no "
                 "counts to admit by; use 'decayed_lfu', 'distance_lfu' or 'lfu')",
                 self.admission_threshold)

    @property
    def expires(self) -> bool:
        """Whether ids expire (``expire_after_windows`` or ``expire_after_seconds``)."""
        return self.expire_after_windows is not None or self.expire_after_seconds is not None
