"""The sparse/dense split: fused sparse optimizers, the sharding plan, and DMP wrapping.

Follows torchrec's ``examples/golden_training/train_dlrm.py``: the sparse optimizer is applied in
backward on the embedding tables *before* sharding (FBGEMM then fuses it into the table-batched
backward), ``DistributedModelParallel`` shards the tables and wraps the remaining (dense) modules
in DDP, and the dense optimizer gets exactly the parameters with no in-backward optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import (
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import optimizers as trec_optim
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

logger = logging.getLogger(__name__)

# name -> (optimizer class understood by torchrec/FBGEMM, kwargs it accepts, devices that run it)
_SPARSE_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, ("cpu", "cuda")),
    "adagrad": (torch.optim.Adagrad, ("cpu", "cuda")),
    "rowwise_adagrad": (RowWiseAdagrad, ("cpu", "cuda")),
    # FBGEMM asserts "not supported in CPU mode" for these:
    "adam": (trec_optim.Adam, ("cuda",)),
    "partial_rowwise_adam": (trec_optim.PartialRowWiseAdam, ("cuda",)),
    "lamb": (trec_optim.LAMB, ("cuda",)),
    "partial_rowwise_lamb": (trec_optim.PartialRowWiseLAMB, ("cuda",)),
    "lars_sgd": (trec_optim.LarsSGD, ("cuda",)),
}

CPU_SHARDING_TYPES = ("table_wise", "column_wise", "data_parallel")
# What the planner may pick for a table nobody pinned. ``data_parallel`` is left out on every
# device: such a table gets a plain dense gradient, all-reduced whole every step, and would be
# trained by the dense optimizer instead of its fused sparse one (the planner picks it for small
# tables on CUDA). Ask for it per table with ``sharding_types`` if that is what you want.
DEFAULT_SHARDING_TYPES = {
    "cpu": ["table_wise", "column_wise"],
    "cuda": ["table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"],
}


def supported_sparse_optimizers(device_type: str) -> list[str]:
    """Names of the fused sparse optimizers FBGEMM runs on ``device_type`` ("cpu"/"cuda")."""
    return [n for n, (_, devs) in _SPARSE_OPTIMIZERS.items() if device_type in devs]


@dataclass(frozen=True)
class SparseOptimizer:
    """A fused (in-backward) optimizer for the embedding tables.

    Args:
        name: one of ``sgd``, ``adagrad``, ``rowwise_adagrad`` (CPU and CUDA), ``adam``,
            ``partial_rowwise_adam``, ``lamb``, ``partial_rowwise_lamb``, ``lars_sgd`` (CUDA only).
        lr: learning rate.
        kwargs: further optimizer arguments (``eps``, ``weight_decay``, ``betas``...).

    The sparse lr is fixed for the run (FBGEMM owns it); the dense lr follows the scheduler.
    """

    name: str = "rowwise_adagrad"
    lr: float = 0.01
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in _SPARSE_OPTIMIZERS:
            raise ValueError(
                f"`sparse_optimizer.name` must be one of {', '.join(_SPARSE_OPTIMIZERS)}, but is {self.name!r}."
            )
        if not (isinstance(self.lr, int | float) and self.lr > 0):
            raise ValueError(f"`sparse_optimizer.lr` must be a number > 0, but is {self.lr!r}.")

    def check_device(self, device_type: str) -> None:
        ok = supported_sparse_optimizers(device_type)
        if self.name not in ok:
            raise ValueError(
                f"sparse optimizer {self.name!r} is not supported by FBGEMM on {device_type}; "
                f"supported there: {', '.join(ok)}."
            )

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return _SPARSE_OPTIMIZERS[self.name][0]

    def optimizer_kwargs(self) -> dict[str, Any]:
        return {"lr": self.lr, **self.kwargs}


def embedding_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The torchrec embedding collections in ``model`` (the modules DMP shards)."""
    for name, module in model.named_modules():
        if isinstance(module, EmbeddingBagCollection | EmbeddingCollection):
            yield name, module


def apply_sparse_optimizer(model: nn.Module, spec: SparseOptimizer) -> list[str]:
    """Register ``spec`` in backward on every embedding table of ``model`` (before sharding).

    Returns the table-parameter names it was applied to.
    """
    names: list[str] = []
    for mod_name, module in embedding_modules(model):
        params = list(module.parameters())
        if not params:
            continue
        apply_optimizer_in_backward(spec.optimizer_class, params, spec.optimizer_kwargs())
        names.extend(f"{mod_name}.{n}" if mod_name else n for n, _ in module.named_parameters())
    if not names:
        raise ValueError(
            "the model has no torchrec EmbeddingBagCollection/EmbeddingCollection with parameters; "
            "recsys_trainer shards embedding tables and needs at least one."
        )
    return names


def table_names(model: nn.Module) -> list[str]:
    out: list[str] = []
    for _, module in embedding_modules(model):
        configs: Any
        if isinstance(module, EmbeddingBagCollection):
            configs = module.embedding_bag_configs()
        else:
            configs = module.embedding_configs()  # type: ignore[operator]
        out.extend(c.name for c in configs)
    return out


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
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=env.world_size, local_world_size=local_world_size),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size, constraints=constraints, debug=False
    )
    sharders: Any = get_default_sharders()
    pg = env.process_group
    if pg is not None and env.world_size > 1:
        return planner.collective_plan(model, sharders, pg)
    return planner.plan(model, sharders)


def shard_model(
    model: nn.Module,
    sparse_optimizer: SparseOptimizer,
    device: torch.device,
    process_group: dist.ProcessGroup | None = None,
    sharding_types: dict[str, str] | None = None,
    local_world_size: int | None = None,
    plan: ShardingPlan | None = None,
    static_graph: bool = True,
) -> DistributedModelParallel:
    """Apply the sparse optimizer in backward, plan, and wrap in ``DistributedModelParallel``.

    ``model`` may hold its tables on the meta device; DMP materialises only the local shards.
    ``static_graph`` is DDP's flag: faster, but incompatible with ``no_sync`` (gradient
    accumulation fails with "expect_autograd_hooks_ INTERNAL ASSERT"), so turn it off then.
    """
    sparse_optimizer.check_device(device.type)
    apply_sparse_optimizer(model, sparse_optimizer)
    pg = process_group if process_group is not None else dist.GroupMember.WORLD
    assert pg is not None, "a process group must be initialised before sharding"
    env = ShardingEnv.from_process_group(pg)
    if plan is None:
        plan = plan_sharding(model, env, device, sharding_types, local_world_size)
    return DistributedModelParallel(
        module=model,
        env=env,
        device=device,
        plan=plan,
        data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=static_graph),
    )


def dense_parameters(dmp: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters with no in-backward (fused) optimizer: exactly the dense optimizer's share."""
    out = []
    for name, p in dmp.named_parameters():
        if not p.requires_grad or hasattr(p, "_in_backward_optimizers"):
            continue
        out.append((name, p))
    return out


DenseOptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerArg = (
    torch.optim.lr_scheduler.LRScheduler
    | Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
    | None
)


def build_dense_optimizer(
    dmp: nn.Module, dense: DenseOptimizerArg
) -> tuple[torch.optim.Optimizer, list[tuple[str, nn.Parameter]]]:
    """The dense optimizer over exactly the dense parameters of the sharded model.

    ``dense`` is a factory ``params -> Optimizer`` (preferred) or an optimizer built over the
    user's model. An instance is used as is when it already holds exactly the dense parameters;
    one that also holds embedding tables is an error (the tables have their fused optimizer).
    """
    named = dense_parameters(dmp)
    params = [p for _, p in named]
    if isinstance(dense, torch.optim.Optimizer):
        own = {id(p) for g in dense.param_groups for p in g["params"]}
        fused = {id(p) for p in dmp.parameters() if hasattr(p, "_in_backward_optimizers")}
        if own & fused:
            raise ValueError(
                "the dense optimizer holds embedding-table parameters, which the sparse optimizer "
                "updates in backward; build it over the dense parameters only, or pass a factory "
                "`lambda params: torch.optim.Adam(params, lr=...)` as dense_optimizers[0]."
            )
        if own != {id(p) for p in params}:
            raise ValueError(
                f"the dense optimizer holds {len(own)} parameters, but the sharded model has "
                f"{len(params)} dense parameters ({', '.join(n for n, _ in named[:5])}...); pass a "
                "factory `lambda params: Optimizer(params, ...)` as dense_optimizers[0]."
            )
        return dense, named
    if not callable(dense):
        raise ValueError(
            f"`dense_optimizers[0]` must be a torch.optim.Optimizer or a callable params -> Optimizer, but is {dense!r}."
        )
    opt = dense(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"the dense optimizer factory returned {opt!r}, not a torch.optim.Optimizer.")
    return opt, named


class SparseDenseOptimizer(CombinedOptimizer):
    """One keyed optimizer over both halves: the dense one (stepped by the Trainer) and DMP's
    fused sparse one (stepped inside backward). ``state_dict`` covers both for checkpoints."""

    def __init__(
        self,
        dense: torch.optim.Optimizer,
        dense_named: list[tuple[str, nn.Parameter]],
        fused: KeyedOptimizer,
    ) -> None:
        self.dense = dense
        self.fused = fused
        dense_keyed = KeyedOptimizerWrapper(dict(dense_named), lambda _params: dense)
        super().__init__([("dense", dense_keyed), ("sparse", fused)])

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        # Fused optimizers already ran during backward; stepping them again is a no-op in
        # torchrec, but skip the call anyway.
        self.dense.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)

    def dense_lr(self) -> float:
        return float(self.dense.param_groups[0]["lr"])

    def sparse_lr(self) -> float | None:
        for group in self.fused.param_groups:
            if "lr" in group:
                return float(group["lr"])
        return None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``1/scale`` and zeroes non-finite entries.

    Placed on the pooled-embedding output when fp16 loss scaling is on: the fused sparse
    optimizer updates inside backward, before any ``GradScaler.unscale_`` could run, so the
    gradient must be unscaled on its way into the tables (and an overflowing step must not
    write inf/nan into them).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale_fn: Callable[[], torch.Tensor | float]) -> torch.Tensor:
        ctx.scale_fn = scale_fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scale = ctx.scale_fn()
        g = grad.float() / scale
        g = torch.where(torch.isfinite(g), g, torch.zeros_like(g))
        return g.to(grad.dtype), None


def unscale_sparse_grad(x: torch.Tensor, scale_fn: Callable[[], torch.Tensor | float]) -> torch.Tensor:
    """Apply ``_ScaleGrad`` (see its docstring)."""
    out: torch.Tensor = _ScaleGrad.apply(x, scale_fn)  # type: ignore[no-untyped-call]
    return out


def install_sparse_grad_unscaling(dmp: nn.Module, scale_fn: Callable[[], torch.Tensor | float]) -> int:
    """Unscale the gradients entering every sharded embedding module (fp16 loss scaling).

    Sharded modules return awaitables; we append a callback that wraps the pooled values.
    Returns how many modules were hooked.
    """
    from torchrec.distributed.types import Awaitable, ShardedModule
    from torchrec.sparse.jagged_tensor import KeyedTensor

    def wrap(result: Any) -> Any:
        if isinstance(result, KeyedTensor):
            return KeyedTensor(
                keys=result.keys(),
                length_per_key=result.length_per_key(),
                values=unscale_sparse_grad(result.values(), scale_fn),
                key_dim=result.key_dim(),
            )
        if isinstance(result, dict):
            return {k: wrap(v) for k, v in result.items()}
        if isinstance(result, torch.Tensor):
            return unscale_sparse_grad(result, scale_fn)
        raise TypeError(f"cannot unscale the gradient of an embedding output of type {type(result)}")

    def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        if isinstance(output, Awaitable):
            output.callbacks.append(wrap)
            return output
        return wrap(output)

    n = 0
    for module in dmp.modules():
        if isinstance(module, ShardedModule):
            module.register_forward_hook(hook)
            n += 1
    return n
