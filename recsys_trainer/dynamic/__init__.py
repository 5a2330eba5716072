"""Dynamic embedding tables: raw 64-bit ids mapped without collisions into a fixed capacity.

Built on torchrec's managed-collision modules, not a home-made table:

* ``ManagedCollisionEmbeddingBagCollection`` (pooled features) and
  ``ManagedCollisionEmbeddingCollection`` (sequence features) hold an ``EmbeddingBagCollection``
  or an ``EmbeddingCollection`` (the rows, a fused FBGEMM table with its in-backward sparse
  optimizer) and a ``ManagedCollisionCollection`` with one ``MCHManagedCollisionModule`` per
  table: a sorted id -> slot map with per-slot metadata.
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

Pooled features (``DynamicEmbeddingBagCollection``) use torchrec's
``ManagedCollisionEmbeddingBagCollection``: the id maps in front of FBGEMM's fused pooled lookup
(``DynamicTable.pooled_lookup``; False: the unpooled collection plus a sum/mean pool, the path
before, slower). Sequence features use ``ManagedCollisionEmbeddingCollection`` directly
(``dynamic_embedding_collection``). A table may be read by several features (a candidate item
and a history sequence): they share its ids, rows and passes.

Sharding: managed collision exists only ``row_wise`` in torchrec (each rank owns a contiguous
slot range and the ids of its block of the (mixed) id space), with the ``fused`` kernel on CPU.
torchrec offers row-wise pooled sharding on CUDA only (torchrec issue 2958): ``sharders`` adds
it on CPU for the managed-collision bag sharder, whose sharded collections pad gloo's
reduce-scatter of pooled rows when the ranks' batches differ (``PaddedPooledReduceScatter``).
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

Layout (each module one concern; the arrows point down this list):

* ``ids``: the id space, ``mix_ids`` / ``unmix_ids``, ``shard_of``, ``fallback_index`` (torch only);
* ``config``: ``DynamicTable``;
* ``policy``: the eviction policies (``DecayedLFUEvictionPolicy``, torchrec's legacy ones);
* ``id_map``: ``DynamicMCHModule``, one table's map on one shard;
* ``modules``: ``dynamic_embedding_collection``, ``DynamicEmbeddingBagCollection``,
  ``MixedEmbeddingBagCollection`` (some pooled tables dynamic, the others hashed),
  ``pooled_collection``, ``lookup_path_hint``, ``rows_key``;
* ``tables``: finding a model's dynamic tables; what sharding, the optimizers and the Trainer
  ask of them (``StepBoundaries``, ``end_window``);
* ``sharded_map``: ``DynamicShardedMaps`` (torchrec's sharded id maps with a short path per
  batch for ``DynamicMCHModule`` maps) and its sharder;
* ``pooled_sharding``: ``sharders`` (row-wise pooled sharding on CPU, batches of different
  sizes on gloo; the maps sharded by ``sharded_map``);
* ``reset``: ``install_eviction_reset``;
* ``relayout`` and ``state``: the checkpoint component and the re-routing at another layout;
* ``stats``: ``table_stats``, ``table_memory`` (``map_memory``, ``bookkeeping_per_slot``),
  ``is_resident``.

Everything public is importable from ``recsys_trainer.dynamic``.
"""


from __future__ import annotations

from recsys_trainer.dynamic.config import (
    DEFAULT_ADMISSION,
    DEFAULT_HALF_LIFE,
    DEFAULT_HISTORY_FRACTION,
    DEFAULT_INTERVAL_ROWS,
    DYNAMIC_SPARSE_OPTIMIZERS,
    EVICTION_POLICIES,
    DynamicTable,
    EvictionPolicyName,
)
from recsys_trainer.dynamic.id_map import (
    DynamicMCHModule,
)
from recsys_trainer.dynamic.ids import (
    EMPTY_SLOT,
    ID_SPACE,
    fallback_index,
    mix_ids,
    shard_of,
    unmix_ids,
)
from recsys_trainer.dynamic.modules import (
    DynamicEmbeddingBagCollection,
    MixedEmbeddingBagCollection,
    dynamic_embedding_collection,
    lookup_path_hint,
    pooled_collection,
    rows_key,
)
from recsys_trainer.dynamic.policy import (
    COUNT_ONE,
    DecayedLFUEvictionPolicy,
    make_eviction_policy,
)
from recsys_trainer.dynamic.pooled_sharding import PaddedPooledReduceScatter, sharders
from recsys_trainer.dynamic.reset import (
    install_cpu_eviction,
    install_eviction_reset,
    reset_rows_cpu,
)
from recsys_trainer.dynamic.sharded_map import DynamicMapsSharder, DynamicShardedMaps
from recsys_trainer.dynamic.state import (
    STATE_FORMAT,
    DynamicTablesState,
)
from recsys_trainer.dynamic.stats import (
    BOOKKEEPING,
    MEMORY_PARTS,
    bookkeeping_per_slot,
    is_resident,
    map_memory,
    table_memory,
    table_stats,
)
from recsys_trainer.dynamic.tables import (
    StepBoundaries,
    check_buckets,
    check_sparse_optimizer,
    dynamic_collections,
    dynamic_table_names,
    end_window,
    id_maps,
    mc_modules,
    pass_steps,
    planner_constraints,
)

__all__ = [
    "BOOKKEEPING",
    "COUNT_ONE",
    "DEFAULT_ADMISSION",
    "DEFAULT_HALF_LIFE",
    "DEFAULT_HISTORY_FRACTION",
    "DEFAULT_INTERVAL_ROWS",
    "DYNAMIC_SPARSE_OPTIMIZERS",
    "DecayedLFUEvictionPolicy",
    "DynamicEmbeddingBagCollection",
    "DynamicMCHModule",
    "DynamicMapsSharder",
    "DynamicShardedMaps",
    "DynamicTable",
    "DynamicTablesState",
    "EMPTY_SLOT",
    "EVICTION_POLICIES",
    "EvictionPolicyName",
    "ID_SPACE",
    "MEMORY_PARTS",
    "MixedEmbeddingBagCollection",
    "PaddedPooledReduceScatter",
    "STATE_FORMAT",
    "StepBoundaries",
    "bookkeeping_per_slot",
    "check_buckets",
    "check_sparse_optimizer",
    "dynamic_collections",
    "dynamic_embedding_collection",
    "dynamic_table_names",
    "end_window",
    "id_maps",
    "pass_steps",
    "fallback_index",
    "install_cpu_eviction",
    "install_eviction_reset",
    "is_resident",
    "lookup_path_hint",
    "make_eviction_policy",
    "map_memory",
    "mc_modules",
    "mix_ids",
    "rows_key",
    "planner_constraints",
    "pooled_collection",
    "reset_rows_cpu",
    "shard_of",
    "sharders",
    "table_memory",
    "table_stats",
    "unmix_ids",
]
