"""Small reference models whose ``forward(batch)`` returns ``(loss, logits)``.

Losses are functional (no loss module) and honour ``batch.weights``, so padding batches in
evaluation contribute nothing, and the model stays fx-traceable for TorchRec pipelines.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from recsys_trainer.batch import Batch
from recsys_trainer.dynamic import ID_SPACE, DynamicTable, pooled_collection
from recsys_trainer.table_precision import data_type

BINARY_LABELS: tuple[float, float] = (0.0, 1.0)
"""What a logistic loss accepts (click-style labels: 0/1, or a rate): ``check_binary_labels``
enforces it, and every bundled model declares it as its ``label_range``."""


def check_binary_labels(labels: torch.Tensor) -> None:
    """Refuse labels outside ``[0, 1]`` (or NaN): a logistic loss trains on them without
    complaint (a label of 2 pushes the logit to +inf), silently. On CPU the error names the
    value; on any other device an asynchronous device assert avoids a host sync per step."""
    ok = ((labels >= 0) & (labels <= 1)).all()
    if labels.device.type != "cpu":
        torch._assert_async(ok, "a label is outside [0, 1] (logistic loss); check the label column")
    elif not bool(ok):
        bad = labels[~((labels >= 0) & (labels <= 1))]
        raise ValueError(
            f"label {float(bad[0]):g} is outside [0, 1] ({bad.numel()} such label(s) in this "
            "batch), but this model's loss (binary cross-entropy) needs click-style labels in "
            "[0, 1]. Check the label column; to have the reader name the column, file and row, "
            "set FeatureSpec(label_range=(0, 1)), or give the model label_range = (0.0, 1.0) "
            "as the bundled models have (the Trainer then checks the data's labels against it)."
        )


# A leaf for torch.fx (TorchRec pipelines trace the model): the check's data-dependent branch
# cannot be traced, and must not be.
torch.fx.wrap("check_binary_labels")


def weighted_bce_with_logits(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """Mean binary cross-entropy, weighted; an all-zero-weight batch gives 0, not NaN. Labels
    must be in ``[0, 1]`` (``check_binary_labels``)."""
    check_binary_labels(labels)
    per_row = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    if weights is None:
        return per_row.mean()
    w = weights.to(per_row.dtype)
    total = w.sum()
    return torch.where(total > 0, (per_row * w).sum() / total.clamp_min(1e-12), total)


def check_task_shapes(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None,
                      task_weights: torch.Tensor | list[float] | None) -> None:
    """Shapes of a multi-task loss's inputs: logits and labels ``[B, T]``, weights ``[B]``,
    ``T`` task weights. A mismatch would broadcast silently into a wrong loss."""
    if logits.dim() != 2 or tuple(labels.shape) != tuple(logits.shape):
        raise ValueError(
            f"a multi-task loss needs logits and labels of one shape [B, T], but they are "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}; give the FeatureSpec one label "
            "column per task (labels=[...]) and the model one logit per task."
        )
    if weights is not None and tuple(weights.shape) != (logits.shape[0],):
        raise ValueError(f"example weights must be [B] = [{logits.shape[0]}], but are "
                         f"{tuple(weights.shape)}.")
    if task_weights is not None and len(task_weights) != logits.shape[1]:
        raise ValueError(f"{len(task_weights)} task weights for {logits.shape[1]} tasks; give one "
                         "per task, in the order of the FeatureSpec's labels.")


torch.fx.wrap("check_task_shapes")


def multi_task_bce_with_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    task_weights: torch.Tensor | list[float] | None = None,
) -> torch.Tensor:
    """Multi-task binary cross-entropy: ``sum_t task_weights[t] * loss_t`` where ``loss_t`` is
    ``weighted_bce_with_logits(logits[:, t], labels[:, t], weights)`` (the example-weighted mean
    over rows; 0 when every weight is 0, e.g. an evaluation padding batch).

    Args:
        logits: ``[B, T]``, one logit per task (the order of ``FeatureSpec.labels``).
        labels: ``[B, T]`` in ``[0, 1]`` (``batch.labels`` with ``labels=["click", "like"]``).
        weights: ``[B]`` example weights, or None.
        task_weights: ``[T]`` weights of the tasks' losses (default 1 each: their sum).
    """
    check_task_shapes(logits, labels, weights, task_weights)
    check_binary_labels(labels)
    per = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    if weights is None:
        per_task = per.mean(0)
    else:
        w = weights.to(per.dtype)
        total = w.sum()
        per_task = torch.where(total > 0, (per * w[:, None]).sum(0) / total.clamp_min(1e-12),
                               torch.zeros_like(per[0]))
    if task_weights is None:
        return per_task.sum()
    tw = torch.as_tensor(task_weights, dtype=per_task.dtype, device=per_task.device)
    return (per_task * tw).sum()


TableInit = Callable[[torch.Tensor], torch.Tensor | None]
"""An embedding table's initialiser: fills the (local shard of the) weight in place. It is
torchrec's ``EmbeddingBagConfig.init_fn``, which the sharded tables call on each shard."""


def init_last_bias(module: nn.Module, rate: float, what: str) -> None:
    """Start the logit of ``module``'s last ``nn.Linear`` at the base rate ``rate`` instead of
    0.5 (rare labels otherwise spend their first steps unlearning the bias)."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"{what} must be in (0, 1), but is {rate!r}.")
    last = [m for m in module.modules() if isinstance(m, nn.Linear)][-1]
    with torch.no_grad():
        last.bias.fill_(math.log(rate / (1.0 - rate)))


def uniform_init(bound: float) -> TableInit:
    """U(-bound, bound). torchrec's default is ``uniform_init(sqrt(1 / num_embeddings))``."""
    return functools.partial(torch.nn.init.uniform_, a=-bound, b=bound)


def normal_init(std: float, mean: float = 0.0) -> TableInit:
    """N(mean, std^2); ``normal_init(1.0)`` is ``nn.Embedding``/``nn.EmbeddingBag``'s default."""
    return functools.partial(torch.nn.init.normal_, mean=mean, std=std)


def stack_pooled(sparse_arch: nn.Module, pooled: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """What torchrec's ``SparseArch`` returns (``[B, F, D]``, its features in order), from
    pooled embeddings per feature: the serving side of ``sparse_arch(kjt)``."""
    arch: Any = sparse_arch  # torchrec's SparseArch: sparse_feature_names, F, D
    names: list[str] = arch.sparse_feature_names
    f, d = int(arch.F), int(arch.D)
    return torch.cat([pooled[n] for n in names], dim=1).reshape(-1, f, d)


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
    ``data_type``), one for every table or ``{table name: precision}`` (others fp32)."""
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


def _table_sizes(features: list[str], num_embeddings: int | list[int],
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


class DLRMClassifier(nn.Module):
    """torchrec's DLRM (bottom MLP, pairwise interactions, top MLP) with a weighted BCE loss.

    Tables are created on the meta device: ``DistributedModelParallel`` materialises only the
    shards each rank owns, initialised by ``embedding_init`` (one ``TableInit`` or one per table
    name, see ``make_tables``; default torchrec's U(-sqrt(1/rows), sqrt(1/rows))).

    ``dynamic`` (``recsys_trainer.dynamic``): one ``DynamicTable`` makes every table dynamic
    (raw ids, ``num_slots`` rows each; ``num_embeddings`` is not used); ``{feature:
    DynamicTable}`` makes only those features' tables dynamic, each with its own settings, and
    the others stay hashed with their ``num_embeddings`` rows (feed those ids below it, as
    without ``dynamic``).
    """

    label_range: tuple[float, float] | None = BINARY_LABELS
    """The labels its loss accepts. The Trainer gives it to a dataset whose ``FeatureSpec`` sets
    no ``label_range``, so that a label outside it is a ``DataError`` naming the column, file and
    row on every rank (``data.spec.apply_model_to_specs``)."""

    def __init__(
        self,
        sparse_features: list[str],
        num_dense: int,
        num_embeddings: int | list[int] = 10_000,
        embedding_dim: int = 16,
        dense_arch: tuple[int, ...] = (64,),
        over_arch: tuple[int, ...] = (64, 1),
        table_device: str = "meta",
        dense_log1p: bool = False,
        prior_ctr: float | None = None,
        dynamic: DynamicTable | Mapping[str, DynamicTable] | None = None,
        embedding_init: TableInit | Mapping[str, TableInit] | None = None,
        embedding_dtype: str | Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        # Count-valued dense inputs (Criteo's I1..I13) span orders of magnitude; log1p is the
        # usual normalisation and keeps the bottom MLP well conditioned.
        self.dense_log1p = dense_log1p
        if dense_arch[-1] != embedding_dim:
            dense_arch = (*dense_arch, embedding_dim)
        if dynamic is None:
            specs: dict[str, DynamicTable] = {}
        elif isinstance(dynamic, DynamicTable):
            specs = dict.fromkeys(sparse_features, dynamic)
        else:
            specs = dict(dynamic)
        sizes = _table_sizes(sparse_features, num_embeddings, specs)
        # A table per feature, ``t_<feature>``: ``dynamic`` by feature name is by table name.
        ebc = pooled_collection(
            make_tables(sparse_features, sizes, embedding_dim, embedding_init, embedding_dtype),
            {f"t_{f}": spec for f, spec in specs.items()}, device=torch.device(table_device))
        self.dlrm = DLRM(
            embedding_bag_collection=ebc,  # type: ignore[arg-type]  # dynamic: EBC look-alikes
            dense_in_features=num_dense,
            dense_arch_layer_sizes=list(dense_arch),
            over_arch_layer_sizes=list(over_arch),
        )
        if prior_ctr is not None:
            # Start at the base rate instead of 0.5: with rare clicks (CTR ~0.5%) the first
            # windows' log loss is otherwise dominated by unlearning the bias.
            init_last_bias(self.dlrm.over_arch, prior_ctr, "`prior_ctr`")

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(batch.dense, self.dlrm.sparse_arch(batch.sparse))
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()

    def _logits(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """torchrec ``DLRM.forward`` after its sparse arch (``embedded``: ``[B, F, D]``): the
        part training and serving share."""
        dense = torch.log1p(dense.clamp_min(0)) if self.dense_log1p else dense
        d = self.dlrm
        return d.over_arch(d.inter_arch(dense_features=d.dense_arch(dense),
                                        sparse_features=embedded)).squeeze(-1)

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor],
                       ) -> torch.Tensor:
        """The logits of ``forward`` from looked-up embeddings (``pooled``: ``[B, D]`` per
        feature): the serving contract (``recsys_trainer.serving.exporting.export``)."""
        return self._logits(dense, stack_pooled(self.dlrm.sparse_arch, pooled))
