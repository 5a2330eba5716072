"""The pieces the bundled models share: MLPs and towers, the multi-task heads, the pairwise
feature interaction's serving input (``stack_pooled``), and the embedding tables (one per
feature, their initialisers, their sizes with dynamic tables)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recsys_trainer.dynamic import ID_SPACE, DynamicTable, pooled_collection
from recsys_trainer.table_precision import data_type

# ----------------------------------------------------------------------------- MLPs and heads


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    """Linear + ReLU layers through ``sizes`` (``sizes[0]`` is the input width)."""
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def tower(sizes: Sequence[int]) -> nn.Sequential:
    """Linear + ReLU through ``sizes[:-1]``, then a final Linear without activation (an
    embedding, or a logit)."""
    if len(sizes) < 2:
        raise ValueError(f"a tower needs an input and an output width, but has sizes {list(sizes)}.")
    return nn.Sequential(mlp(sizes[:-1]), nn.Linear(sizes[-2], sizes[-1]))


class TaskHeads(nn.Module):
    """One tower per task over a shared input: ``[B, in_features]`` -> logits ``[B, T]`` (the
    order of ``tasks``, the order of ``FeatureSpec.labels``). ``prior_rates``: each task's
    logit starts at its base rate (``init_last_bias``)."""

    def __init__(self, in_features: int, tasks: Sequence[str], arch: Sequence[int] = (16,),
                 prior_rates: Sequence[float] | None = None) -> None:
        super().__init__()
        self.tasks = check_tasks(tasks)
        self.towers = nn.ModuleList(tower([in_features, *arch, 1]) for _ in self.tasks)
        init_task_priors(self.towers, prior_rates, self.tasks)

    def forward(self, shared: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(shared) for t in self.towers], dim=1)


def check_tasks(tasks: Sequence[str]) -> list[str]:
    """``tasks`` as a list of distinct names (the labels' order); a ValueError otherwise."""
    out = list(tasks)
    if isinstance(tasks, str) or not out or len(set(out)) != len(out) or not all(
            isinstance(t, str) for t in out):
        raise ValueError(f"`tasks` must be a list of distinct task (label) names, but is {tasks!r}.")
    return out


def init_task_priors(towers: Iterable[nn.Module], prior_rates: Sequence[float] | None,
                     tasks: Sequence[str]) -> None:
    """Start each task's tower at its base rate (``init_last_bias``); None leaves them."""
    if prior_rates is None:
        return
    if len(prior_rates) != len(tasks):
        raise ValueError(f"`prior_rates` must hold one rate per task {list(tasks)}, but is "
                         f"{prior_rates!r}.")
    for head, rate, task in zip(towers, prior_rates, tasks, strict=True):
        init_last_bias(head, rate, f"the prior rate of task {task!r}")


def check_task_weights(task_weights: Sequence[float] | None, tasks: Sequence[str]) -> list[float]:
    """One weight >= 0 per task (default 1 each)."""
    weights = [1.0] * len(tasks) if task_weights is None else [float(w) for w in task_weights]
    if len(weights) != len(tasks) or any(w < 0 for w in weights):
        raise ValueError(f"`task_weights` must hold one weight >= 0 per task {list(tasks)}, "
                         f"but is {task_weights!r}.")
    return weights


def init_last_bias(module: nn.Module, rate: float, what: str) -> None:
    """Start the logit of ``module``'s last ``nn.Linear`` at the base rate ``rate`` instead of
    0.5 (rare labels otherwise spend their first steps unlearning the bias)."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"{what} must be in (0, 1), but is {rate!r}.")
    last = [m for m in module.modules() if isinstance(m, nn.Linear)][-1]
    with torch.no_grad():
        last.bias.fill_(math.log(rate / (1.0 - rate)))


def stack_pooled(sparse_arch: nn.Module, pooled: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """What torchrec's ``SparseArch`` returns (``[B, F, D]``, its features in order), from
    pooled embeddings per feature: the serving side of ``sparse_arch(kjt)``."""
    arch: Any = sparse_arch  # torchrec's SparseArch: sparse_feature_names, F, D
    names: list[str] = arch.sparse_feature_names
    f, d = int(arch.F), int(arch.D)
    return torch.cat([pooled[n] for n in names], dim=1).reshape(-1, f, d)


# ----------------------------------------------------------------------------- tables


TableInit = Callable[[torch.Tensor], torch.Tensor | None]
"""An embedding table's initialiser: fills the (local shard of the) weight in place. It is
torchrec's ``EmbeddingBagConfig.init_fn``, which the sharded tables call on each shard."""


def uniform_init(bound: float) -> TableInit:
    """U(-bound, bound). torchrec's default is ``uniform_init(sqrt(1 / num_embeddings))``."""
    return functools.partial(torch.nn.init.uniform_, a=-bound, b=bound)


def normal_init(std: float, mean: float = 0.0) -> TableInit:
    """N(mean, std^2); ``normal_init(1.0)`` is ``nn.Embedding``/``nn.EmbeddingBag``'s default."""
    return functools.partial(torch.nn.init.normal_, mean=mean, std=std)


def make_tables(
    feature_names: list[str],
    num_embeddings: int | list[int],
    embedding_dim: int,
    init: TableInit | Mapping[str, TableInit] | None = None,
    dtype: str | Mapping[str, str] | None = None,
) -> list[EmbeddingBagConfig]:
    """One table ``t_<feature>`` per feature. ``init``: one initialiser for every table, or
    ``{table name: initialiser}`` (tables not named keep torchrec's default uniform init).
    ``dtype``: the weights' precision (``"fp32"``, ``"fp16"``, ``"bf16"``; torchrec's
    ``data_type``), one for every table or ``{table name: precision}`` (others fp32). The
    initialiser fills the weight in that precision, so a half-precision table starts from its
    draws rounded to it; they are the rows training reads, hence what a checkpoint and a
    serving export hold (no fp32 master copy exists to drift from)."""
    sizes = num_embeddings if isinstance(num_embeddings, list) else [num_embeddings] * len(feature_names)
    names = [f"t_{f}" for f in feature_names]
    inits = dict(init) if isinstance(init, Mapping) else dict.fromkeys(names, init)
    unknown = sorted(set(inits) - set(names))
    if unknown:
        raise ValueError(f"`init` names tables {unknown} that do not exist; the tables are {names}.")
    dtypes = dict(dtype) if isinstance(dtype, Mapping) else dict.fromkeys(names, dtype or "fp32")
    unknown = sorted(set(dtypes) - set(names))
    if unknown:
        raise ValueError(f"`embedding_dtype` names tables {unknown} that do not exist; the tables "
                         f"are {names}.")
    return [
        EmbeddingBagConfig(
            name=name, embedding_dim=embedding_dim, num_embeddings=n, feature_names=[f],
            init_fn=inits.get(name),
            data_type=data_type(dtypes.get(name, "fp32"), f"embedding_dtype[{name!r}]"
                                if isinstance(dtype, Mapping) else "embedding_dtype"),
        )
        for name, f, n in zip(names, feature_names, sizes, strict=True)
    ]


def dynamic_specs(features: Sequence[str],
                  dynamic: DynamicTable | Mapping[str, DynamicTable] | None) -> dict[str, DynamicTable]:
    """A model's ``dynamic`` argument per feature: None (no dynamic table), one
    ``DynamicTable`` (every feature's table) or ``{feature: DynamicTable}`` (those only)."""
    if dynamic is None:
        return {}
    if isinstance(dynamic, DynamicTable):
        return dict.fromkeys(features, dynamic)
    return dict(dynamic)


def table_sizes(features: list[str], num_embeddings: int | list[int],
                 dynamic: Mapping[str, DynamicTable]) -> list[int]:
    """Rows per feature's table: a dynamic table's ``num_slots`` (torchrec sizes its default
    init from them), else ``num_embeddings`` (one for all, or one per feature). Refuses
    ``dynamic`` entries for features the model lacks, entries that are not a ``DynamicTable``,
    lookup paths that differ (one collection holds the dynamic tables), and a hashed table
    sized to the raw id space (a feature meant to be dynamic but left out)."""
    unknown = sorted(set(dynamic) - set(features))
    if unknown:
        raise ValueError(f"`dynamic` names features {unknown} that the model does not have; its "
                         f"sparse features are {features}.")
    for f, spec in dynamic.items():
        if not isinstance(spec, DynamicTable):
            raise TypeError(f"`dynamic[{f!r}]` must be a recsys_trainer.dynamic.DynamicTable, "
                            f"but is a {type(spec).__name__}.")
    lookups = {f: spec.pooled_lookup for f, spec in dynamic.items()}
    if len(set(lookups.values())) > 1:
        raise ValueError(f"`pooled_lookup` must be the same for every dynamic table of the model, "
                         f"but is {lookups}.")
    if isinstance(num_embeddings, list):
        if len(num_embeddings) != len(features):
            raise ValueError(f"`num_embeddings` has {len(num_embeddings)} sizes for "
                             f"{len(features)} sparse features {features}.")
        rows = list(num_embeddings)
    else:
        rows = [num_embeddings] * len(features)
    for f, n in zip(features, rows, strict=True):
        if f not in dynamic and n >= ID_SPACE:
            raise ValueError(
                f"feature {f!r} has num_embeddings {n} (the raw id space) but no dynamic table: "
                f"name it in `dynamic` or give it the rows of a hashed table.")
    return [dynamic[f].num_slots if f in dynamic else n for f, n in zip(features, rows, strict=True)]



def pooled_tables(features: list[str], num_embeddings: int | list[int], embedding_dim: int,
                  dynamic: DynamicTable | Mapping[str, DynamicTable] | None,
                  init: TableInit | Mapping[str, TableInit] | None, table_device: str,
                  dtype: str | Mapping[str, str] | None = None) -> nn.Module:
    """The pooled collection of one table ``t_<feature>`` per feature (``make_tables``): hashed
    tables of ``num_embeddings`` rows, and the dynamic ones ``dynamic`` names (one
    ``DynamicTable`` for all, or per feature; ``table_sizes`` checks them), on
    ``table_device``, their weights in ``dtype`` (``make_tables``)."""
    specs = dynamic_specs(features, dynamic)
    sizes = table_sizes(features, num_embeddings, specs)
    # A table per feature, ``t_<feature>``: ``dynamic`` by feature name is by table name.
    return pooled_collection(make_tables(features, sizes, embedding_dim, init, dtype),
                             {f"t_{f}": spec for f, spec in specs.items()},
                             device=torch.device(table_device))


__all__ = ["TableInit", "TaskHeads", "check_task_weights", "check_tasks", "dynamic_specs",
           "init_last_bias", "init_task_priors", "make_tables", "mlp", "normal_init", "pooled_tables",
           "stack_pooled", "table_sizes", "tower", "uniform_init"]
