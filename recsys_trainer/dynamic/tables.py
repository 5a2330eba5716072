"""Where a model's dynamic tables are (sharded or not), and what the trainer asks of them: the
sharding constraints, the sparse optimizer check, the step and window boundaries."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torchrec.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from recsys_trainer.dynamic.config import DYNAMIC_SPARSE_OPTIMIZERS
from recsys_trainer.dynamic.id_map import DynamicMCHModule
from recsys_trainer.validation import fail


def dynamic_collections(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Managed-collision embedding collections in ``model`` (pooled or not), sharded or not
    (name, module)."""
    for name, m in model.named_modules():
        if isinstance(m, BaseManagedCollisionEmbeddingCollection
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
        if isinstance(coll, BaseManagedCollisionEmbeddingCollection):
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


class StepBoundaries:
    """Tells a model's dynamic tables which training forwards end an optimizer step, so that
    passes run at step ends and ``eviction_interval`` counts optimizer steps whatever the
    micro-batches per step (a window's last step may have fewer), and when a train window ends
    (``end_window``). The Trainer runs every training forward inside
    ``micro_batch(closes_step)``."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._maps = id_maps(model)

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


def id_maps(model: nn.Module) -> list[DynamicMCHModule]:
    """The id maps of ``model``'s dynamic tables, in a fixed order (find them once: walking the
    module tree is not for every step)."""
    return [m for m in mc_modules(model).values() if isinstance(m, DynamicMCHModule)]


def pass_steps(maps: list[DynamicMCHModule]) -> tuple[int, ...]:
    """The step of the last admission/eviction pass of each of ``maps`` (``id_maps``): it
    changes exactly when a pass ran. Passes run at step ends on every rank alike, so every
    rank reads the same."""
    return tuple(int(m._last_pass_step) for m in maps)


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
