"""Dynamic embedding tables: raw 64-bit ids mapped without collisions into a fixed capacity.

Built on torchrec's managed-collision modules, not a home-made table:

* ``ManagedCollisionEmbeddingCollection`` holds an ``EmbeddingCollection`` (the rows, a fused
  FBGEMM table with its in-backward sparse optimizer) and a ``ManagedCollisionCollection`` with
  one ``MCHManagedCollisionModule`` per table: a sorted id -> slot map with per-slot metadata.
* Every ``eviction_interval`` optimizer steps the module coalesces the ids it saw since the last
  pass and lets the eviction policy decide which new ids get a slot and which resident ids lose
  theirs. Between passes a new id reads the table's *shared default row* (the last slot of each
  rank's shard), so it trains that row, not a row of some other id.
* ``DynamicMCHModule`` is torchrec's ``MCHManagedCollisionModule`` with two changes: its id
  history grows instead of being sized from the first batch (torchrec drops the ids that do not
  fit, silently), and its passes count optimizer steps (the Trainer marks the micro-batches that
  do not end one, ``StepBoundaries``) instead of forwards.
* Admission (``admission_threshold``): a new id competes for a slot only if it was seen at least
  that many times during the interval (counted on the rank that owns its bucket, so across all
  ranks' batches). Resident ids keep their own statistics.

Pooled features use the same unpooled collection plus a sum/mean pool
(``DynamicEmbeddingBagCollection``): ``ManagedCollisionEmbeddingBagCollection`` cannot be
sharded on CPU (torchrec issue 2958: its sharder offers only ``row_wise``, which the CPU
embedding-bag sharder lacks). Sequence features use the collection directly
(``dynamic_embedding_collection``).

Sharding: managed collision exists only ``row_wise`` in torchrec (each rank owns a contiguous
slot range and the ids of its buckets), with the ``fused`` kernel on CPU. On CUDA the planner
picks the kernel (``fused``, UVM caching...); that path has **not run on a GPU**.

Eviction on CPU: torchrec resets an evicted slot's row and optimizer state with FBGEMM's
``reset_weight_momentum`` op, which has only a CUDA kernel. ``install_cpu_eviction`` gives each
CPU table-batched module of a sharded dynamic collection a CPU implementation of the same
reset (see ``reset_rows_cpu``), as an instance attribute: nothing global is patched.
"""

from __future__ import annotations

import contextlib
import functools
import os
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
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsys_trainer.validation import check_choice, check_int, check_number, fail

ID_SPACE = 2**63 - 1
"""Ids a dynamic table accepts: ``[0, ID_SPACE)``. ``2**63 - 1`` (int64 max) marks an empty slot
in torchrec's map. Use it as ``SparseFeature(num_embeddings=ID_SPACE)`` so the data layer hashes
strings into the whole space and passes integer ids unchanged."""

EMPTY_SLOT = torch.iinfo(torch.int64).max

EvictionPolicyName = Literal["distance_lfu", "lfu", "lru"]
EVICTION_POLICIES: tuple[str, ...] = ("distance_lfu", "lfu", "lru")
DYNAMIC_SPARSE_OPTIMIZERS: tuple[str, ...] = ("sgd", "rowwise_adagrad")
"""Sparse optimizers whose state an eviction resets (FBGEMM's reset covers row-wise Adagrad's
one value per row; SGD has none). Full Adagrad keeps a stale accumulator on an evicted slot in
FBGEMM's own CUDA path, so it is refused."""


@dataclass(frozen=True, kw_only=True)
class DynamicTable:
    """Makes an embedding table dynamic: raw ids get their own row, up to ``num_slots`` rows."""

    num_slots: int
    """Rows in the table (its memory). Each rank's shard keeps its last row as the shared
    default row, so ``num_slots - world_size`` ids can have their own row at once."""
    eviction_policy: EvictionPolicyName = "distance_lfu"
    """Who loses a slot when new ids need one: ``distance_lfu`` (count / age^decay),
    ``lfu`` (count), ``lru`` (last access)."""
    eviction_interval: int = 100
    """Optimizer steps between admission/eviction passes (with gradient accumulation a step is
    all its micro-batches); new ids read the default row until the next pass. The pass runs in
    the last forward of every ``eviction_interval``-th step, over every id this rank's shard
    saw since the previous pass."""
    admission_threshold: int = 1
    """Sightings within one interval before a new id competes for its own row (1: any id)."""
    decay_exponent: float = 1.0
    """Age exponent of ``distance_lfu`` and ``lru``."""
    buckets: int | None = None
    """Id buckets (a multiple of the world size; ids go to ranks by bucket). None: the world
    size when the model is built (the process group's, else the ``WORLD_SIZE`` variable)."""

    def __post_init__(self) -> None:
        check_int("DynamicTable.num_slots", self.num_slots, minimum=2)
        check_choice("DynamicTable.eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        check_int("DynamicTable.eviction_interval", self.eviction_interval)
        check_int("DynamicTable.admission_threshold", self.admission_threshold)
        check_number("DynamicTable.decay_exponent", self.decay_exponent, above=0.0)
        check_int("DynamicTable.buckets", self.buckets, allow_none=True)
        if self.admission_threshold > 1 and self.eviction_policy == "lru":
            fail("DynamicTable.admission_threshold", "1 with eviction_policy='lru' (LRU keeps no "
                 "counts to admit by; use 'distance_lfu' or 'lfu')", self.admission_threshold)


# ------------------------------------------------------------------------- eviction policies

class _Admission:
    """Mixed into torchrec's policies: admission by count, and counters for the logs.

    torchrec ranks resident slots and new ids together by score and keeps the top
    ``num_slots``. A new id seen fewer than ``admission_threshold`` times gets count 0, hence
    score 0; empty slots score 0 too and, ranked first by the stable sort, win every tie, so the
    id never enters. Resident ids keep their real counts."""

    admission_threshold: int = 1
    admitted: int = 0
    """New ids given a slot since the module was built (this rank's shard)."""
    passes: int = 0

    def update_metadata_and_generate_eviction_scores(
        self, current_iter: int, mch_size: int, argsort_mapping: torch.Tensor,
        sorted_counts: torch.Tensor, matching_mask: torch.Tensor, matching_indices: torch.Tensor,
        mch_metadata: dict[str, torch.Tensor], history_metadata: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.admission_threshold > 1:
            sorted_counts = torch.where(
                ~matching_mask & (sorted_counts < self.admission_threshold),
                torch.zeros_like(sorted_counts), sorted_counts)
        evicted, selected = super().update_metadata_and_generate_eviction_scores(  # type: ignore[misc]
            current_iter, mch_size, argsort_mapping, sorted_counts, matching_mask,
            matching_indices, mch_metadata, history_metadata)
        self.admitted += int(selected.numel())
        self.passes += 1
        return evicted, selected


class _DistanceLFU(_Admission, DistanceLFU_EvictionPolicy):
    pass


class _LFU(_Admission, LFU_EvictionPolicy):
    pass


class _LRU(_Admission, LRU_EvictionPolicy):
    pass


def make_eviction_policy(spec: DynamicTable) -> MCHEvictionPolicy:
    """A fresh torchrec policy for one table, with admission and counters."""
    policy: _Admission
    if spec.eviction_policy == "distance_lfu":
        policy = _DistanceLFU(decay_exponent=spec.decay_exponent)
    elif spec.eviction_policy == "lfu":
        policy = _LFU()
    else:
        policy = _LRU(decay_exponent=spec.decay_exponent)
    policy.admission_threshold = spec.admission_threshold
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
        if ids.numel() and bool((ids < 0).any()):
            bad = int(ids[ids < 0][0])
            raise ValueError(f"a dynamic table got the negative id {bad}; raw ids must be in "
                             "[0, 2**63) (hash or offset signed ids before they reach the table).")
    elif ids.numel():
        torch._assert_async((ids >= 0).all(), "a dynamic table got a negative raw id")
    return _mul_mod63(_xorshift32(_mul_mod63(ids, _MUL_A)), _MUL_B)


def unmix_ids(mixed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``mix_ids``: the raw ids stored in a dynamic table's map."""
    return _mul_mod63(_xorshift32(_mul_mod63(mixed, _INV_B)), _INV_A)


# ------------------------------------------------------------------------------- modules

def _world_size() -> int:
    # Models are usually built before the Trainer starts the process group: torchrun's
    # WORLD_SIZE says how many ranks there will be.
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class DynamicMCHModule(MCHManagedCollisionModule):
    """torchrec's ``MCHManagedCollisionModule`` (one table's sorted id -> slot map), with

    * a history that keeps every id: torchrec sizes the history of ids seen since the last pass
      from the *first* batch (its ids x ``eviction_interval`` x 1.25) and silently drops the
      ids that do not fit, so a short first batch starved admission for the whole run. Here the
      first batch only sets the initial size, and the buffers grow (at least doubling) when an
      interval brings more ids. Memory: 8 bytes per id held, twice that for the policies that
      keep a last-access time (``distance_lfu``, ``lru``), for the larger of torchrec's first
      size and twice the most ids one interval brought to this rank (at most
      ``eviction_interval x gradient_accumulation_steps x`` the ids of one micro-batch of all
      ranks together);
    * passes counted in optimizer steps: a training forward ends a step unless
      ``closes_step`` is False (``StepBoundaries`` sets it for the other micro-batches of an
      accumulated step); the pass runs in the forward that ends every ``eviction_interval``-th
      step. A forward outside the Trainer counts as a step, as in torchrec.

    Same constructor as torchrec's, which sharding relies on (``rebuild_with_output_id_range``
    builds ``type(self)(...)``). Reads and writes torchrec 1.8's private history attributes;
    the tests of short first batches and of bitwise resume fail if they change.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closes_step = True
        """Whether the current training forward is the last micro-batch of its step."""
        self._steps = 0
        """Optimizer steps this module has taken part in (forwards that closed a step)."""
        self._last_pass_step = 0

    @torch.no_grad()
    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Record this batch's ids in the history; run the pass when a step interval closes."""
        m: Any = self  # torchrec's attributes are untyped
        if not self.training:
            return features
        if m._current_iter == -1:
            # As torchrec: the iteration restored with the buffers (a resume sets it itself).
            m._current_iter = int(m._current_iter_tensor.item())
            m._last_eviction_iter = m._current_iter
        m._current_iter += 1
        m._current_iter_tensor.data += 1
        values = [f.values() for f in features.values()]
        start = m._current_history_buffer_offset
        end = start + sum(v.numel() for v in values)
        if end > m._input_history_buffer_size:
            grown = 2 * m._input_history_buffer_size if m._input_history_buffer_size > 0 else \
                int(end * m._eviction_interval * 1.25)  # torchrec's first size, now a floor
            _resize_history(m, max(end, grown))
        for v in values:
            n = v.numel()
            m._history_accumulator[start:start + n] = v
            m._eviction_policy.record_history_metadata(
                m._current_iter, v, {k: b[start:start + n] for k, b in m._history_metadata.items()})
            start += n
        m._current_history_buffer_offset = end
        if self.closes_step:
            self._steps += 1
            if self._steps - self._last_pass_step >= m._eviction_interval:
                m._coalesce_history()
                self._last_pass_step = self._steps
                m._last_eviction_iter = m._current_iter
        return features


class StepBoundaries:
    """Tells a model's dynamic tables which training forwards end an optimizer step, so that
    ``eviction_interval`` counts optimizer steps whatever the micro-batches per step (a window's
    last step may have fewer). The Trainer runs every training forward inside
    ``micro_batch(closes_step)``."""

    def __init__(self, model: nn.Module) -> None:
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


def _mc_module(name: str, spec: DynamicTable, device: torch.device) -> DynamicMCHModule:
    return DynamicMCHModule(
        zch_size=spec.num_slots,
        device=device,
        eviction_policy=make_eviction_policy(spec),
        eviction_interval=spec.eviction_interval,
        input_hash_size=ID_SPACE,
        input_hash_func=mix_ids,
        name=name,
        buckets=spec.buckets or _world_size(),
    )


def dynamic_embedding_collection(
    tables: list[EmbeddingConfig], dynamic: DynamicTable | dict[str, DynamicTable],
    device: torch.device | None = None,
) -> ManagedCollisionEmbeddingCollection:
    """A torchrec ``ManagedCollisionEmbeddingCollection`` over ``tables`` (sequence features:
    its forward returns ``(Dict[feature, JaggedTensor], None)``). ``dynamic`` is one spec for
    every table or one per table name; each table's ``num_embeddings`` must equal its spec's
    ``num_slots``. The rows are built on ``device`` (default meta: DMP materialises shards);
    the id maps on CPU (the sharder moves them to the compute device)."""
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
        if len(t.feature_names) != 1:
            # FBGEMM's eviction reset (and our CPU copy of it) takes torchrec's *table* index
            # where its offsets are per *feature*: with a shared table, evicting rows of one table
            # would zero rows of another. One feature per dynamic table keeps the two equal.
            raise ValueError(
                f"dynamic table {t.name!r} is read by {len(t.feature_names)} features "
                f"({', '.join(t.feature_names)}); a dynamic table takes exactly one feature. Give "
                "each feature its own dynamic table, or keep the shared table hashed.")
        if t.num_embeddings != specs[t.name].num_slots:
            raise ValueError(f"table {t.name!r}: `num_embeddings` ({t.num_embeddings}) must equal "
                             f"its DynamicTable.num_slots ({specs[t.name].num_slots}).")
    return specs


class DynamicEmbeddingBagCollection(nn.Module):
    """Pooled dynamic features: an ``EmbeddingBagCollection`` look-alike (``forward(kjt) ->
    KeyedTensor``, ``embedding_bag_configs()``) over a managed-collision collection whose
    per-id rows are pooled here (sum or mean, per table's ``pooling``).

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
    lengths = jt.lengths()
    out = torch.segment_reduce(jt.values(), "sum", lengths=lengths, axis=0, unsafe=True)
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


# --------------------------------------------------------------------- eviction on CPU

def reset_rows_cpu(tbe: Any, pruned_indices: torch.Tensor, pruned_indices_offsets: torch.Tensor,
                   logical_table_ids: torch.Tensor, buffer_ids: torch.Tensor) -> None:
    """CPU counterpart of FBGEMM's ``reset_weight_momentum`` for one table-batched module.

    What the CUDA kernel does, for each pruned table ``t`` (``logical_table_ids[t]``) and each
    row index in its segment ``pruned_indices[offsets[buffer_ids[t]]:offsets[buffer_ids[t]+1]]``:
    zero the row's weights and its row-wise Adagrad accumulator. As in FBGEMM's Python wrapper,
    only row-wise Adagrad has state to reset. (torchrec then re-initialises the weights with
    the table's ``init_fn``.) CPU tables live in the ``*_host`` buffers, which the CUDA op's
    signature does not carry: that is why this is a method replacement, not a kernel
    registered for the op."""
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
        dim = d_offsets[t + 1] - d_offsets[t]
        with torch.no_grad():
            table = weights[w_offsets[t]:].as_strided((int(rows.max()) + 1, dim), (dim, 1))
            table.index_fill_(0, rows, 0.0)
            if rowwise:
                momentum = tbe.momentum1_host[int(tbe.momentum1_offsets[t]):]
                momentum.index_fill_(0, rows, 0.0)


def install_cpu_eviction(model: nn.Module) -> int:
    """Give every CPU table-batched module under a sharded dynamic collection the CPU row reset
    (an instance attribute shadowing FBGEMM's method). Returns how many it installed."""
    n = 0
    for _, coll in dynamic_collections(model):
        for tbe, _idx in getattr(coll, "_table_to_tbe_and_index", {}).values():
            if tbe.weights_host.numel() and "reset_embedding_weight_momentum" not in vars(tbe):
                tbe.reset_embedding_weight_momentum = functools.partial(reset_rows_cpu, tbe)
                n += 1
    return n


# ---------------------------------------------------------------------------- checkpoints

class DynamicTablesState:
    """The id maps' state that torchrec keeps outside ``state_dict()``: a checkpoint component
    (``Stateful``), saved per rank.

    The maps themselves (sorted ids, slots, counts, last access, the iteration) are module
    buffers: DCP saves them, sharded like the rows. What is not a buffer is the history since
    the last eviction pass (ids seen, their access iterations), the pass schedule and the
    counters. Without them a resumed run would admit and evict differently from the
    uninterrupted one. This reads torchrec 1.8's private attributes of
    ``MCHManagedCollisionModule``; the bitwise-resume test fails if they change.

    A different world size is refused: each rank's map holds the ids of its buckets in slots
    anywhere in its range, and torchrec's MCH keeps no bucket-to-slot alignment that would let
    another layout find them.
    """

    needed_for_scoring = True
    """Restored with the model for evaluate/predict too (``checkpoint.contents``): the maps'
    buffers load into any layout, so its world-size check is what refuses one they do not fit."""

    def __init__(self, model: nn.Module, world_size: int) -> None:
        self._model = model
        self._world_size = world_size

    def state_dict(self) -> dict[str, Any]:
        tables: dict[str, Any] = {}
        for table, mod in mc_modules(self._model).items():
            m: Any = mod
            used = int(m._current_history_buffer_offset)
            policy: Any = m._eviction_policy
            tables[table] = {
                "buffer_size": int(m._input_history_buffer_size),
                "used": used,
                "history": (m._history_accumulator[:used].clone()
                            if m._input_history_buffer_size > 0 else None),
                "history_metadata": {k: v[:used].clone() for k, v in m._history_metadata.items()},
                "current_iter": int(m._current_iter),
                "last_eviction_iter": int(m._last_eviction_iter),
                # Pass schedule in optimizer steps (DynamicMCHModule); torchrec's counts forwards.
                "steps": int(getattr(m, "_steps", m._current_iter)),
                "last_pass_step": int(getattr(m, "_last_pass_step", m._last_eviction_iter)),
                "admitted": int(getattr(policy, "admitted", 0)),
                "passes": int(getattr(policy, "passes", 0)),
            }
        return {"world_size": self._world_size, "tables": tables}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = int(state_dict["world_size"])
        if saved != self._world_size:
            raise ValueError(
                f"dynamic tables were checkpointed at world size {saved} and cannot be resumed at "
                f"{self._world_size}: each rank's id map is its own shard and torchrec's managed "
                f"collision cannot redistribute it. Resume with {saved} ranks, or start a new run "
                "from an export (recsys_trainer.checkpoint.dynamic_export).")
        mods = mc_modules(self._model)
        tables = state_dict["tables"]
        if set(tables) != set(mods):
            raise ValueError(f"the checkpoint has dynamic tables {sorted(tables)}, the model "
                             f"{sorted(mods)}; build the model with the same dynamic tables.")
        for table, st in tables.items():
            m: Any = mods[table]
            size = st["buffer_size"]
            if size > 0:
                _resize_history(m, size)
                m._history_accumulator[:st["used"]] = st["history"]
                for k, v in st["history_metadata"].items():
                    m._history_metadata[k][:st["used"]] = v
            m._current_history_buffer_offset = st["used"]
            m._current_iter = st["current_iter"]
            m._last_eviction_iter = st["last_eviction_iter"]
            if isinstance(m, DynamicMCHModule):
                # Checkpoints from before passes counted steps: forwards were steps then (the
                # count was only wrong with gradient accumulation).
                m._steps = int(st.get("steps", st["current_iter"]))
                m._last_pass_step = int(st.get("last_pass_step", st["last_eviction_iter"]))
            policy: Any = m._eviction_policy
            policy.admitted, policy.passes = st["admitted"], st["passes"]


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


# -------------------------------------------------------------------------------- stats

def table_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """This rank's ``{table: {"slots", "occupied", "admitted", "evicted", "passes"}}``: slots in
    its shard (default row included), slots holding an id, and since the module was built (or
    the run started, across resumes) new ids given a slot and resident ids that lost theirs.
    Sum over ranks for the table's totals."""
    out: dict[str, dict[str, int]] = {}
    for table, mod in mc_modules(model).items():
        m: Any = mod
        slots = int(m._zch_size)
        occupied = slots - 1 - int(mod.open_slots().item())
        policy: Any = m._eviction_policy
        admitted = int(getattr(policy, "admitted", 0))
        # Each admission fills one slot; the ones that did not grow the occupancy displaced an id.
        out[table] = {"slots": slots, "occupied": occupied, "admitted": admitted,
                      "evicted": admitted - occupied, "passes": int(getattr(policy, "passes", 0))}
    return out
