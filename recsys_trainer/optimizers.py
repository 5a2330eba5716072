"""The two optimizers of the sparse/dense split, and their state as checkpoint components.

* ``SparseOptimizer``: the fused (in-backward) FBGEMM optimizer of the embedding tables. It is
  registered on the tables before sharding (``sharding.shard_model``) and steps inside backward.
* the dense optimizer: any ``torch.optim`` optimizer over exactly the parameters that have no
  in-backward optimizer (``build_dense_optimizer``), with an optional lr scheduler.
* ``SparseDenseOptimizer``: one keyed optimizer over both, for lr logging and whole-state reads.
* ``OptimizerState``: one optimizer's state keyed by parameter name, the ``Stateful`` the
  Trainer hands to the checkpoint manager (once for each half).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.optim import optimizers as trec_optim
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recsys_trainer.validation import check_choice, check_number, check_type

# name -> (optimizer class understood by torchrec/FBGEMM, devices that run it)
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

    FBGEMM owns the sparse lr: it is this ``lr`` for the whole run unless a
    ``SparseLRSchedule`` rewrites it each step (the dense lr follows the dense scheduler).
    It is also the ``sparse_optimizer`` section of a CLI config (same fields).
    """

    name: str = "rowwise_adagrad"
    lr: float = 0.01
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("sparse_optimizer.name", self.name, list(_SPARSE_OPTIMIZERS), quote=False)
        check_number("sparse_optimizer.lr", self.lr, above=0)
        check_type("sparse_optimizer.kwargs", self.kwargs, (dict,), "a mapping")

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


TableOptimizers = Mapping[str, SparseOptimizer]
"""Per-table sparse optimizers: ``{table name or glob pattern: SparseOptimizer}``."""


def resolve_table_optimizers(
    tables: list[str], default: SparseOptimizer, per_table: TableOptimizers | None
) -> dict[str, SparseOptimizer]:
    """``{table: SparseOptimizer}`` for every table in ``tables``.

    A key of ``per_table`` is a table name or an ``fnmatch`` glob (``"t_user*"``). An exact name
    wins over patterns; among patterns the first one (in the mapping's order) that matches wins;
    a table no key matches gets ``default``. A key that matches no table is an error (a typo
    would otherwise silently train that table with the default).
    """
    out = {t: default for t in tables}
    if not per_table:
        return out
    unused = []
    for key, spec in per_table.items():
        if not isinstance(spec, SparseOptimizer):
            raise ValueError(f"`table_optimizers[{key!r}]` must be a SparseOptimizer, but is {spec!r}.")
        # An exact name is a dict hit (shard_model passes the Trainer's resolved map back in:
        # one exact key per table, which would otherwise cost tables^2 fnmatch calls).
        if key not in out and not any(fnmatch.fnmatchcase(t, key) for t in tables):
            unused.append(key)
    if unused:
        raise ValueError(
            f"`table_optimizers` keys {unused} match no embedding table; the model's tables are "
            f"{sorted(tables)}. Use a table name or a glob pattern (fnmatch: *, ?, [..]) over them."
        )
    for t in tables:
        if t in per_table:
            out[t] = per_table[t]
            continue
        for key, spec in per_table.items():
            if fnmatch.fnmatchcase(t, key):
                out[t] = spec
                break
    return out


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


def build_lr_scheduler(
    scheduler: SchedulerArg, dense: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The lr scheduler of the dense optimizer: ``scheduler`` itself, or the factory's result.

    A scheduler bound to another optimizer is an error: it would step an lr nobody uses.
    """
    if scheduler is None or isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        out = scheduler
    else:
        out = scheduler(dense)
    if out is not None and out.optimizer is not dense:
        raise ValueError(
            "the lr scheduler is bound to another optimizer than the dense optimizer; pass a "
            "factory `lambda opt: Scheduler(opt, ...)` as dense_optimizers[1]."
        )
    return out


class OptimizerState:
    """One optimizer's state, keyed by parameter name: a checkpoint component (``Stateful``).

    ``state_dict()`` is ``{"state": {param_name: {key: value}}, "param_groups": [...]}`` where
    the tensors *are* the live state (a reader may load into them in place, as
    ``torch.distributed.checkpoint`` does) and ``param_groups`` holds each group's settings
    (lr, betas, ...) without its parameters; it is empty when ``with_param_groups`` is False
    (the fused sparse optimizer: FBGEMM owns its lr for the whole run).

    ``load_state_dict`` takes any subset of the parameters (checkpoints may leave some out,
    ``params_not_save``): the others keep their state. ``init_state()`` creates an optimizer's
    lazily made state (Adam's moments...) so that there is something to load into.
    """

    def __init__(self, keyed: KeyedOptimizer, *, with_param_groups: bool,
                 eager_state: bool = False) -> None:
        self._keyed = keyed
        self._with_param_groups = with_param_groups
        # FBGEMM's fused optimizers make their state with the tables; a stateless one (SGD)
        # has none to make, and stepping it on zero grads would touch sharded weights.
        self._eager_state = eager_state

    def state_dict(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self._keyed.param_groups] if self._with_param_groups else []
        return {"state": self._keyed.state_dict()["state"], "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        live = self._keyed.state_dict()["state"]
        unknown = sorted(set(state_dict.get("state", {})) - set(live))
        if unknown:
            raise ValueError(f"optimizer state for parameters this optimizer does not have: "
                             f"{unknown[:5]}.")
        with torch.no_grad():
            for name, entry in state_dict.get("state", {}).items():
                for key, value in entry.items():
                    mine = live[name].get(key)
                    if mine is value:
                        continue  # loaded in place already (the usual case): nothing to copy
                    if isinstance(mine, torch.Tensor) and isinstance(value, torch.Tensor):
                        mine.copy_(value)
                    else:
                        self._keyed.state[self._keyed.params[name]][key] = value
        groups = state_dict.get("param_groups") or []
        if groups:
            mine_groups = list(self._keyed.param_groups)
            if len(groups) != len(mine_groups):
                raise ValueError(f"the state has {len(groups)} param groups, this optimizer has "
                                 f"{len(mine_groups)}.")
            for g, saved in zip(mine_groups, groups, strict=True):
                for k, v in saved.items():
                    g[k] = v  # type: ignore[index]

    def init_state(self) -> None:
        """Create lazily made state without changing any parameter: one step on zero grads,
        then the parameters (weight decay would move them) and grads are restored. The values
        are meant to be overwritten by a load."""
        if self._eager_state:
            return
        params = list(self._keyed.params.values())
        state = self._keyed.state
        if all(p in state and state[p] for p in params):
            return
        saved = [p.detach().clone() for p in params]
        grads = [p.grad for p in params]
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p)
            self._keyed.step()
            for p, s, g in zip(params, saved, grads, strict=True):
                p.copy_(s)
                p.grad = g


class SparseLRSchedule:
    """A learning-rate schedule for the fused (in-backward) table optimizers: every table
    group's lr becomes its configured lr times ``factor(step)``.

    FBGEMM owns an in-backward optimizer's lr and takes a new one only when torchrec's fused
    optimizer is stepped (its ``step`` calls ``set_learning_rate`` with the group's lr; the
    update itself already ran in backward, so that step changes no weight). ``apply(step)``
    writes the groups and makes that call. It holds no state besides the configured lrs: call
    it with ``trainer.state.global_step`` before each step (``LambdaHook(before_step=...)``) and
    a resumed run continues the schedule (the checkpoint does not hold the fused lr).

    Raises ``SparseLRScheduleError`` (a ValueError) when there is nothing to schedule: no fused
    table optimizer, a table whose FBGEMM optimizer is ``NONE`` (no lr to set: FBGEMM would
    raise NotImplementedError at the first step), or a group without ``"lr"``.
    """

    def __init__(self, optimizer: SparseDenseOptimizer, factor: Callable[[int], float]) -> None:
        self.fused = optimizer.fused
        self.factor = factor
        if not self.fused.param_groups:
            raise SparseLRScheduleError("SparseLRSchedule: the model has no fused (in-backward) "
                                        "table optimizer, so there is no sparse lr to schedule.")
        # Refuse at construction, not at the first step inside training.
        none = [name for name, leaf in _fused_leaves(self.fused)
                if getattr(getattr(leaf, "_emb_module", None), "optimizer", None) == EmbOptimType.NONE]
        if none:
            raise SparseLRScheduleError(
                f"SparseLRSchedule: the tables of {none} have no fused optimizer (FBGEMM "
                "OptimType.NONE), so they have no lr to schedule; give them a sparse optimizer.")
        no_lr = [i for i, g in enumerate(self.fused.param_groups) if "lr" not in g]
        if no_lr:
            raise SparseLRScheduleError(
                f"SparseLRSchedule: fused param group(s) {no_lr} have no 'lr' (keys: "
                f"{sorted(k for k in self.fused.param_groups[no_lr[0]] if k != 'params')}).")
        self.base = [float(g["lr"]) for g in self.fused.param_groups]
        """The configured lr of each fused group (read once: ``apply`` overwrites them)."""

    def apply(self, step: int) -> float:
        """Set every table group's lr for ``step``; returns the factor."""
        f = float(self.factor(step))
        check_number("the sparse lr schedule's factor", f, at_least=0)
        for group, base in zip(self.fused.param_groups, self.base, strict=True):
            group["lr"] = base * f
        try:
            self.fused.step()
        except NotImplementedError as e:  # a table made lr-less after construction
            raise SparseLRScheduleError(f"SparseLRSchedule: FBGEMM refused the new lr: {e}") from e
        return f


class SparseLRScheduleError(ValueError):
    """A ``SparseLRSchedule`` or ``linear_decay`` that cannot work as configured."""


def _fused_leaves(opt: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The innermost optimizers of torchrec's (nested) ``CombinedOptimizer``, with their path
    (each one FBGEMM module's ``EmbeddingFusedOptimizer``)."""
    subs = getattr(opt, "optimizers", None)
    if not isinstance(subs, list) or not subs:
        return [(prefix or "<root>", opt)]
    out: list[tuple[str, Any]] = []
    for name, sub in subs:
        out += _fused_leaves(sub, ".".join(p for p in (prefix, name) if p))
    return out


def linear_decay(total_steps: int, final: float = 0.1, warmup_steps: int = 0) -> Callable[[int], float]:
    """A factor for ``SparseLRSchedule``: a linear warm-up from 0 over ``warmup_steps``, then a
    linear decay from 1 to ``final`` at ``total_steps`` (``final`` after it)."""
    check_number("total_steps", total_steps, above=0)
    check_number("final", final, at_least=0)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 0 <= warmup_steps < total_steps:
        # A warm-up as long as the run would never reach the decay (and a negative one would
        # divide by it): refuse it here rather than schedule nonsense.
        raise SparseLRScheduleError(f"`warmup_steps` must be an int with 0 <= warmup_steps < "
                                    f"total_steps ({total_steps}), but is {warmup_steps!r}.")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        return 1.0 + (final - 1.0) * min(1.0, (step - warmup_steps) / span)

    return factor


class SparseDenseOptimizer(CombinedOptimizer):
    """One keyed optimizer over both halves: the dense one (stepped by the Trainer) and DMP's
    fused sparse one (stepped inside backward). ``state_dict`` covers both."""

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
        self.dense_state = OptimizerState(dense_keyed, with_param_groups=True)
        """The dense half as a checkpoint component."""
        self.sparse_state = OptimizerState(fused, with_param_groups=False, eager_state=True)
        """The fused sparse half as a checkpoint component."""

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

    def sparse_lrs(self) -> dict[str, float]:
        """``{table: lr}`` read from the live fused groups: the current lr, also under a
        ``SparseLRSchedule`` (which rewrites the groups, not the configured ``SparseOptimizer``)."""
        lr_of = {id(p): float(g["lr"]) for g in self.fused.param_groups if "lr" in g
                 for p in g["params"]}
        out = {}
        for key, p in self.fused.params.items():
            if id(p) in lr_of:
                # "<...>.t_item.weight" -> "t_item": the table is the module above the weight.
                parts = key.split(".")
                out[parts[-2] if len(parts) > 1 and parts[-1] == "weight" else key] = lr_of[id(p)]
        return out
