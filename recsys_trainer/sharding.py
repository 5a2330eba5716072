"""Sharding: the plan, ``DistributedModelParallel`` wrapping, and the DMP model's DDP part.

Follows torchrec's ``examples/golden_training/train_dlrm.py``: the sparse optimizer is applied in
backward on the embedding tables *before* sharding (FBGEMM then fuses it into the table-batched
backward), ``DistributedModelParallel`` shards the tables and wraps the remaining (dense) modules
in DDP, and the dense optimizer gets exactly the parameters with no in-backward optimizer
(``recsys_trainer.optimizers``). fp16 unscaling of the sparse gradients lives in
``recsys_trainer.precision``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import (
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import (
    KernelConfig,
    PlannerError,
    PlannerErrorType,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys_trainer import dynamic, table_precision
from recsys_trainer.data.spec import FeatureSpec, check_features_fit_tables
from recsys_trainer.distributed import usable_memory_bytes
from recsys_trainer.optimizers import SparseOptimizer, TableOptimizers, resolve_table_optimizers
from recsys_trainer.torchrec_compat import quiet_fx_tracing_notice, quiet_stack_notices

logger = logging.getLogger(__name__)

CPU_SHARDING_TYPES = ("table_wise", "column_wise", "data_parallel")
# What the planner may pick for a table nobody pinned. ``data_parallel`` is left out on every
# device: such a table gets a plain dense gradient, all-reduced whole every step, and would be
# trained by the dense optimizer instead of its fused sparse one (the planner picks it for small
# tables on CUDA). Ask for it per table with ``sharding_types`` if that is what you want.
DEFAULT_SHARDING_TYPES = {
    "cpu": ["table_wise", "column_wise"],
    "cuda": ["table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"],
}


def embedding_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The torchrec embedding collections in ``model`` (the modules DMP shards)."""
    for name, module in model.named_modules():
        if isinstance(module, EmbeddingBagCollection | EmbeddingCollection):
            yield name, module


def table_parameters(model: nn.Module) -> Iterator[tuple[str, str, nn.Parameter]]:
    """``(table, parameter name, parameter)`` for every embedding-table weight of ``model``
    (before sharding): torchrec names them ``<collection>.embedding_bags.<table>.weight``."""
    for mod_name, module in embedding_modules(model):
        for n, p in module.named_parameters():
            yield n.split(".")[-2], f"{mod_name}.{n}" if mod_name else n, p


def apply_sparse_optimizer(
    model: nn.Module, spec: SparseOptimizer, per_table: TableOptimizers | None = None
) -> dict[str, SparseOptimizer]:
    """Register the sparse optimizers in backward on every embedding table of ``model`` (before
    sharding): ``per_table``'s entry for a table (by name or glob, ``resolve_table_optimizers``)
    or ``spec``. TorchRec groups tables by optimizer into separate FBGEMM kernels when sharding.

    Returns ``{table: SparseOptimizer}`` for every table.
    """
    chosen = resolve_table_optimizers(sorted({t for t, _, _ in table_parameters(model)}), spec,
                                      per_table)
    register_sparse_optimizers(model, chosen)
    return chosen


def register_sparse_optimizers(model: nn.Module, chosen: Mapping[str, SparseOptimizer]) -> None:
    """Register ``chosen`` (``{table: SparseOptimizer}``, resolved) in backward on the tables."""
    params = list(table_parameters(model))
    if not params:
        raise ValueError(
            "the model has no torchrec EmbeddingBagCollection/EmbeddingCollection with parameters; "
            "recsys_trainer shards embedding tables and needs at least one."
        )
    groups: dict[int, tuple[SparseOptimizer, list[nn.Parameter]]] = {}
    for table, _, p in params:
        groups.setdefault(id(chosen[table]), (chosen[table], []))[1].append(p)
    for opt, ps in groups.values():
        apply_optimizer_in_backward(opt.optimizer_class, ps, opt.optimizer_kwargs())


def table_configs(model: nn.Module, kind: Literal["pooled", "sequence"] | None = None) -> list[Any]:
    """The torchrec table configs (name, rows, feature names, ...) of every embedding table
    (``kind``: only those of ``EmbeddingBagCollection``s, "pooled", or of
    ``EmbeddingCollection``s, "sequence")."""
    out: list[Any] = []
    for _, module in embedding_modules(model):
        if isinstance(module, EmbeddingBagCollection):
            if kind != "sequence":
                out.extend(module.embedding_bag_configs())
        elif kind != "pooled":
            out.extend(module.embedding_configs())  # type: ignore[operator]
    return out


def table_names(model: nn.Module) -> list[str]:
    return [c.name for c in table_configs(model)]


def check_table_dims(model: nn.Module) -> None:
    """Refuse an embedding dim that is not a multiple of 4 before sharding: FBGEMM's
    table-batched kernels need it (torchrec otherwise asserts "local_cols=... not divisible by
    4" from deep inside sharding)."""
    bad = [(c.name, c.embedding_dim) for c in table_configs(model) if c.embedding_dim % 4]
    if bad:
        name, dim = bad[0]
        raise ValueError(
            f"embedding table {name!r} has embedding_dim={dim}, but FBGEMM's table-batched "
            f"kernels need a multiple of 4 ({len(bad)} such table(s): "
            f"{', '.join(f'{n!r}={d}' for n, d in bad)}). Give it embedding_dim="
            f"{-(-dim // 4) * 4} and use its first {dim} column(s) in the model's forward (a "
            "1-wide bias table: dim 4, then `pooled[:, :1]`)."
        )


def feature_tables(model: nn.Module, kind: Literal["pooled", "sequence"] | None = None,
                   ) -> list[tuple[str, str, int | None]]:
    """``(feature, table, num_embeddings)`` for every feature an embedding table of ``model``
    reads (a feature read by two tables appears twice; ``kind`` as in ``table_configs``). A
    dynamic table takes any raw id, so its bound is None."""
    unbounded = dynamic.dynamic_table_names(model)
    return [(f, c.name, None if c.name in unbounded else c.num_embeddings)
            for c in table_configs(model, kind) for f in c.feature_names]


def check_data_fits_model(model: nn.Module, datasets: Iterable[Any]) -> None:
    """Refuse datasets whose ``FeatureSpec`` does not fit the model's tables (see
    ``check_features_fit_tables``). Datasets without a spec (plain iterables of ``Batch``) are
    not checked."""
    _check_data_fits(datasets, feature_tables(model, "pooled"), feature_tables(model, "sequence"))


def _check_data_fits(datasets: Iterable[Any], pooled: list[tuple[str, str, int | None]],
                     unpooled: list[tuple[str, str, int | None]]) -> None:
    for ds in datasets:
        spec = getattr(ds, "features", None)
        if isinstance(spec, FeatureSpec):
            check_features_fit_tables(spec, pooled, unpooled)


def plan_sharding(
    model: nn.Module,
    env: ShardingEnv,
    device: torch.device,
    sharding_types: dict[str, str] | None = None,
    local_world_size: int | None = None,
    batch_size: int | None = None,
) -> ShardingPlan:
    """Plan table placement for this world size and device.

    On CPU only table_wise/column_wise/data_parallel exist. On CUDA the planner chooses among
    table-, column-, row-, table-row- and table-column-wise. ``data_parallel`` is excluded on
    both unless asked for per table (its grads are all-reduced densely and land in the dense
    optimizer). ``sharding_types`` overrides per table.
    """
    overrides = dict(sharding_types or {})
    names = set(table_names(model))
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"`sharding_types` names tables {unknown} that the model does not have; its tables: {sorted(names)}."
        )
    constraints: dict[str, ParameterConstraints] = {}
    for name in names:
        if name in overrides:
            st = overrides[name]
            if device.type == "cpu" and st not in CPU_SHARDING_TYPES:
                raise ValueError(
                    f"`sharding_types[{name!r}]` is {st!r}, which needs CUDA; on CPU use one of "
                    f"{', '.join(CPU_SHARDING_TYPES)}."
                )
            constraints[name] = ParameterConstraints(sharding_types=[st])
        else:
            default = DEFAULT_SHARDING_TYPES.get(device.type, DEFAULT_SHARDING_TYPES["cpu"])
            constraints[name] = ParameterConstraints(sharding_types=list(default))
    # Dynamic (managed-collision) tables shard only row-wise; they take no override.
    for name, kw in dynamic.planner_constraints(model, device.type).items():
        if name in overrides:
            raise ValueError(f"`sharding_types[{name!r}]` is set, but {name!r} is a dynamic table, "
                             "which torchrec shards only row_wise; remove the entry.")
        constraints[name] = ParameterConstraints(**kw)
    # The planner assumes 128 GB of host memory (and 32 GB of HBM) per rank unless told: a
    # plan that does not fit the real host (or its container's limit) is OOM-killed at
    # allocation with exit 137 and no message. Tell it what this process may really use.
    memory, source = usable_memory_bytes()
    ranks_here = max(1, local_world_size or 1)
    hbm = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=env.world_size, local_world_size=local_world_size,
                      ddr_cap_bytes=memory // ranks_here, hbm_cap_bytes=hbm),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    with quiet_stack_notices():
        planner = EmbeddingShardingPlanner(
            topology=topology, batch_size=batch_size, constraints=constraints, debug=False
        )
    sharders: Any = dynamic.sharders()
    memory_note = (f"each of the {ranks_here} rank(s) on this host may use "
                   f"{memory / ranks_here / 2**30:.2f} GiB of host memory ({source}: "
                   f"{memory / 2**30:.2f} GiB{f' / {ranks_here} local ranks' if ranks_here > 1 else ''})")
    if hbm is not None:
        memory_note = f"each GPU has {hbm / 2**30:.2f} GiB, and {memory_note}"

    def plan() -> ShardingPlan | str:
        try:
            with quiet_stack_notices():
                return planner.plan(model, sharders)
        except PlannerError as e:
            if e.error_type != PlannerErrorType.INSUFFICIENT_STORAGE:
                return f"{type(e).__name__}: {e}"
            return _does_not_fit(model, device, memory_note, e)

    # Rank 0 plans and every rank gets its plan, or its error: torchrec's collective_plan
    # would leave the other ranks waiting in the broadcast when rank 0's planner raises.
    pg = env.process_group
    shared = env.world_size > 1 and pg is not None
    planner_rank = not shared or dist.get_rank(pg) == 0
    result = plan() if planner_rank else None
    if shared:
        box = [result]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        result = box[0]
    if isinstance(result, str):
        raise ValueError(result if planner_rank else f"sharding planner (rank 0): {result}")
    assert result is not None
    return result


def _planned_sharding_types(plan: ShardingPlan) -> dict[str, str]:
    """``{table: sharding type}`` (``"table_wise"``, ``"data_parallel"``...) of a plan."""
    return {table: ps.sharding_type for module_plan in plan.plan.values()
            for table, ps in module_plan.items()}  # type: ignore[attr-defined]


def _does_not_fit(model: nn.Module, device: torch.device, memory_note: str, e: Exception) -> str:
    """The message for tables that do not fit: the largest tables with their sizes, the
    memory per rank and where that figure came from, and what to do."""
    from torchrec.modules.embedding_configs import data_type_to_dtype

    sizes = sorted(((c.name, c.num_embeddings, c.embedding_dim,
                     c.num_embeddings * c.embedding_dim * data_type_to_dtype(c.data_type).itemsize)
                    for c in table_configs(model)), key=lambda t: -t[3])
    largest = ", ".join(f"{n!r} ({rows:,} x {dim} = {size / 2**30:.2f} GiB of weights)"
                        for n, rows, dim, size in sizes[:3])
    total = sum(t[3] for t in sizes)
    where = "GPU memory" if device.type == "cuda" else "host memory"
    planner_summary = str(e).strip().splitlines()[-1].strip()
    return (
        f"the embedding tables do not fit in {where}: {len(sizes)} table(s) hold "
        f"{total / 2**30:.2f} GiB of weights before optimizer state, the largest {largest}; "
        f"{memory_note}. Refused before allocating anything. Use more ranks or hosts, smaller "
        f"tables, or a host (or container limit) with more memory. Planner: {planner_summary}"
    )


def shard_model(
    model: nn.Module,
    sparse_optimizer: SparseOptimizer,
    device: torch.device,
    process_group: dist.ProcessGroup | None = None,
    sharding_types: dict[str, str] | None = None,
    local_world_size: int | None = None,
    plan: ShardingPlan | None = None,
    static_graph: bool = True,
    table_optimizers: TableOptimizers | None = None,
    resolved: Mapping[str, SparseOptimizer] | None = None,
) -> DistributedModelParallel:
    """Apply the sparse optimizer in backward, plan, and wrap in ``DistributedModelParallel``.

    ``model`` may hold its tables on the meta device; DMP materialises only the local shards.
    ``table_optimizers`` (``{table name or glob: SparseOptimizer}``) overrides
    ``sparse_optimizer`` for the tables it matches; ``resolved`` (``{table: SparseOptimizer}``
    for every table, as ``resolve_table_optimizers`` returns it) replaces both when the caller
    resolved them already (the Trainer's builder).
    ``static_graph`` is DDP's flag: faster, but incompatible with ``no_sync`` (gradient
    accumulation fails with "expect_autograd_hooks_ INTERNAL ASSERT"), so turn it off then.
    """
    check_table_dims(model)
    chosen = dict(resolved) if resolved is not None else \
        resolve_table_optimizers(table_names(model), sparse_optimizer, table_optimizers)
    unbounded = dynamic.dynamic_table_names(model)
    for table, opt in chosen.items():
        opt.check_device(device.type)
        if table in unbounded:
            dynamic.check_sparse_optimizer(model, opt.name)
    configs = table_configs(model)
    # A precision FBGEMM cannot train here is refused by name, never trained in fp32 instead.
    table_precision.check_tables(configs, device.type, chosen)
    register_sparse_optimizers(model, chosen)
    pg = process_group if process_group is not None else dist.GroupMember.WORLD
    assert pg is not None, "a process group must be initialised before sharding"
    env = ShardingEnv.from_process_group(pg)
    dynamic.check_buckets(model, env.world_size)
    if plan is None:
        plan = plan_sharding(model, env, device, sharding_types, local_world_size)
    # Every rank holds the same plan (rank 0's, broadcast), so every rank refuses it here.
    table_precision.check_sharding(configs, _planned_sharding_types(plan), sharding_types)
    with quiet_stack_notices():
        dmp = DistributedModelParallel(
            module=model,
            env=env,
            device=device,
            plan=plan,
            sharders=dynamic.sharders(),
            data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=static_graph),
        )
    quiet_fx_tracing_notice()  # the sharded model's first batch would print it
    # FBGEMM's row reset on eviction is CUDA-only and indexes features, not tables.
    dynamic.install_eviction_reset(dmp)
    return dmp


@dataclass(frozen=True)
class ShardedModel:
    """What ``build_sharded_model`` made of a model."""

    model: DistributedModelParallel
    table_optimizers: dict[str, SparseOptimizer]
    """``{table: SparseOptimizer}``: the fused optimizer every embedding table trains with."""
    pooled_features: list[tuple[str, str, int | None]]
    """``(feature, table, num_embeddings)`` read by the pooled tables (``feature_tables``)."""
    sequence_features: list[tuple[str, str, int | None]]
    """The same for the unpooled (sequence) tables."""


def build_sharded_model(
    model: nn.Module,
    datasets: Iterable[Any],
    sparse_optimizer: SparseOptimizer,
    table_optimizers: TableOptimizers | None,
    device: torch.device,
    *,
    process_group: dist.ProcessGroup | None,
    sharding_types: dict[str, str] | None,
    local_world_size: int | None,
    static_graph: bool,
) -> ShardedModel:
    """The Trainer's sharded model, the model's tables read once: every table's sparse
    optimizer resolved (``table_optimizers`` over ``sparse_optimizer``), the ``datasets`` checked
    against the tables (``check_data_fits_model``; the same answer on every rank), then
    ``shard_model``. Its tables materialise from the RNG as it is when this is called."""
    chosen = resolve_table_optimizers(table_names(model), sparse_optimizer, table_optimizers)
    pooled, unpooled = feature_tables(model, "pooled"), feature_tables(model, "sequence")
    _check_data_fits(datasets, pooled, unpooled)
    dmp = shard_model(model, sparse_optimizer, device, process_group=process_group,
                      sharding_types=sharding_types, local_world_size=local_world_size,
                      static_graph=static_graph, resolved=chosen)
    return ShardedModel(dmp, chosen, pooled, unpooled)


def dense_no_sync(dmp: nn.Module, skip_sync: bool) -> contextlib.AbstractContextManager[Any]:
    """DDP's ``no_sync`` on the DMP model's dense part when ``skip_sync`` (a micro-batch that does
    not end a gradient accumulation: its gradients are all-reduced with the last one's)."""
    inner = getattr(dmp, "_dmp_wrapped_module", None)
    if skip_sync and isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    return contextlib.nullcontext()


__all__ = [
    "CPU_SHARDING_TYPES",
    "ShardedModel",
    "apply_sparse_optimizer",
    "build_sharded_model",
    "dense_no_sync",
    "embedding_modules",
    "plan_sharding",
    "register_sparse_optimizers",
    "shard_model",
    "table_names",
]
