"""The model split for serving: its embedding tables and its dense program.

``table_modules`` finds a model's embedding collections (torchrec's, sharded or not, dynamic
and managed-collision ones); ``dense_copy`` copies the rest of the model without them
(``skeleton``: with the collections rebuilt on ``meta``, an unsharded architecture to export a
checkpoint with) and ``on_host`` gives that copy the checkpoint's dense state on the CPU; ``export_program`` traces
its ``serving_logits`` (the serving contract, ``recsys_trainer.serving.exporting.export``) with
``torch.export``, ``program_bytes`` serialises the program and ``aot_package`` compiles it with
AOTInductor. ``export.build`` puts these together into an artifact.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.dynamic import DynamicEmbeddingBagCollection
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving import program as dense_program


@dataclass
class TableModule:
    """One embedding collection of a model, as the export reads it."""

    path: str
    """The state-dict prefix of the tables (the collection's name in the model)."""
    owner: str
    """The module an export copy replaces (a ``DynamicEmbeddingBagCollection`` for its tables)."""
    kind: str
    """``pooled`` / ``sequence``."""
    configs: list[Any]
    dynamic: bool
    pooling: dict[str, str]
    """Per table: ``sum`` / ``mean`` / ``none``."""
    module: nn.Module


def _is_table_module(m: nn.Module) -> bool:
    return isinstance(m, EmbeddingBagCollection | ShardedEmbeddingBagCollection | EmbeddingCollection
                      | ShardedEmbeddingCollection | DynamicEmbeddingBagCollection
                      | ManagedCollisionEmbeddingCollection
                      | BaseShardedManagedCollisionEmbeddingCollection)


def weighted(m: nn.Module) -> bool:
    """Whether the pooled collection ``m`` takes per-id weights (sharded or not)."""
    f = getattr(m, "is_weighted", None)
    return bool(f()) if callable(f) else bool(getattr(m, "_is_weighted", False))


def _pooling(config: Any) -> str:
    return "mean" if config.pooling == PoolingType.MEAN else "sum"


def table_modules(model: nn.Module) -> list[TableModule]:
    """The embedding modules of ``model`` (unsharded or sharded), outermost only."""
    out: list[TableModule] = []
    skip: list[str] = []
    for path, m in model.named_modules():
        if any(path.startswith(p + ".") for p in skip) or not _is_table_module(m):
            continue
        skip.append(path)
        if isinstance(m, DynamicEmbeddingBagCollection):
            cfgs = m.embedding_bag_configs()
            inner = m.collection_name
            out.append(TableModule(f"{path}.{inner}" if path else inner, path, "pooled", cfgs,
                                    True, {c.name: _pooling(c) for c in cfgs},
                                    getattr(m, inner)))
        elif isinstance(m, ManagedCollisionEmbeddingCollection):
            cfgs = m._embedding_module.embedding_configs()  # type: ignore[operator]
            out.append(TableModule(path, path, "sequence", cfgs, True,
                                    {c.name: "none" for c in cfgs}, m))
        elif isinstance(m, BaseShardedManagedCollisionEmbeddingCollection):
            cfgs = m._embedding_module._embedding_configs  # type: ignore[union-attr]
            out.append(TableModule(path, path, "sequence", list(cfgs), True,  # type: ignore[arg-type]
                                    {c.name: "none" for c in cfgs}, m))  # type: ignore[union-attr]
        elif isinstance(m, EmbeddingBagCollection | ShardedEmbeddingBagCollection):
            cfgs = m.embedding_bag_configs() if isinstance(m, EmbeddingBagCollection) \
                else m._embedding_bag_configs
            out.append(TableModule(path, path, "pooled", list(cfgs), False,
                                    {c.name: _pooling(c) for c in cfgs}, m))
        else:
            cfgs = m.embedding_configs() if isinstance(m, EmbeddingCollection) \
                else m._embedding_configs  # type: ignore[union-attr]
            out.append(TableModule(path, path, "sequence", list(cfgs), False,  # type: ignore[arg-type]
                                    {c.name: "none" for c in cfgs}, m))  # type: ignore[union-attr]
    return out


def dense_copy(model: nn.Module, modules: list[TableModule]) -> nn.Module:
    """A copy of ``model`` without its embedding modules (each replaced by an empty module
    while copying): the dense part, small whatever the tables' size, sharded or not."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for tm in modules:
        if not tm.owner:
            raise ValueError("the model is itself an embedding collection: nothing dense to export.")
        parent_path, _, name = tm.owner.rpartition(".")
        parent = model.get_submodule(parent_path)
        swapped.append((parent, name, getattr(parent, name)))
    try:
        for parent, name, _ in swapped:
            setattr(parent, name, nn.Module())
        return copy.deepcopy(model)
    finally:
        for parent, name, original in swapped:
            setattr(parent, name, original)


def skeleton(live: nn.Module) -> nn.Module:
    """An unsharded stand-in of ``live`` (sharded or not) for exports from its checkpoints: a
    CPU copy of its dense part, and its embedding collections rebuilt on ``meta`` from their
    configurations (``PublishHook``'s default architecture)."""
    modules = table_modules(live)
    dynamic = [tm.owner for tm in modules if tm.dynamic]
    if dynamic:
        raise ValueError(
            f"PublishHook cannot rebuild the dynamic or managed-collision tables {dynamic} "
            "from their sharded form; pass PublishHook(model=...): an unsharded instance of "
            "the trained architecture (its tables may be on the meta device).")
    shell = dense_copy(live, modules).to("cpu")
    meta = torch.device("meta")
    for tm in modules:
        stand_in: nn.Module
        if tm.kind == "pooled":
            stand_in = EmbeddingBagCollection(tables=list(tm.configs),
                                              is_weighted=weighted(tm.module), device=meta)
        else:
            stand_in = EmbeddingCollection(tables=list(tm.configs), device=meta)
        parent, _, name = tm.owner.rpartition(".")
        setattr(shell.get_submodule(parent), name, stand_in)
    return shell


def on_host(dense_model: nn.Module, dense_state: Mapping[str, torch.Tensor]) -> nn.Module:
    """``dense_model`` with the checkpoint's ``dense_state`` and every tensor on the CPU.

    The export crosses from the model's device to the host here: a serving artifact is traced
    and scored on the CPU whatever the model trained on, so a copy of a model on CUDA (or on
    ``meta``, for a model built only to name the architecture) must not keep its device.
    ``assign=True`` takes the checkpoint's host tensors as the parameters and buffers instead of
    copying them into the device ones; what the checkpoint does not hold (non-persistent
    buffers, e.g. position indices) is then moved. Values keep the model's dtypes, as a copy into
    its tensors would (a model built in another precision for serving exports in that one).
    """
    dtypes = {k: t.dtype for k, t in dense_model.state_dict(keep_vars=True).items()}
    dense_model.load_state_dict(
        {k: v.to(dtypes[k]) if k in dtypes and v.dtype != dtypes[k] else v
         for k, v in dense_state.items()}, strict=True, assign=True)
    left = [n for n, t in [*dense_model.named_parameters(), *dense_model.named_buffers()]
            if t.device.type == "meta"]
    if left:
        raise ValueError(
            f"{type(dense_model).__name__} holds {left[:5]} on the meta device and the checkpoint "
            "does not hold them (non-persistent buffers), so the export cannot give them values; "
            "build the model with its dense part on the CPU (only tables may be on meta).")
    return dense_model.to("cpu")


class _Program(nn.Module):
    """What is exported: the model's ``serving_logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model.serving_logits(dense, pooled, sequences, lengths)  # type: ignore[operator]


def check_contract(model: nn.Module, has_sequences: bool) -> None:
    """Refuse a model without the serving contract (``recsys_trainer.serving.exporting.export``)."""
    if not callable(getattr(model, "serving_logits", None)):
        raise TypeError(
            f"{type(model).__name__} has no `serving_logits(dense, pooled, sequences, lengths)` "
            "method, which an export needs (the dense part without the embedding lookups); see "
            "recsys_trainer.serving.exporting.export and docs/serving.md for the contract.")
    if has_sequences and not callable(getattr(model, "serving_sequence_lengths", None)):
        raise TypeError(f"{type(model).__name__} reads sequence features but has no "
                        "`serving_sequence_lengths()` (the padded length per feature).")


def value_features(model: nn.Module) -> set[str]:
    """The sequence features ``model``'s ``serving_logits`` reads as raw integer values (event
    times, ``[B, L]`` int64, zero-padded) instead of embeddings: its optional
    ``serving_value_features()``; none without it."""
    f = getattr(model, "serving_value_features", None)
    return set(f()) if callable(f) else set()


def example_inputs(model: nn.Module, spec: FeatureSpec, modules: list[TableModule],
                   lengths: Mapping[str, int]) -> tuple[Any, ...]:
    """Zero inputs of ``serving_logits`` (dense, pooled, sequences, lengths) to trace it with."""
    b = 2  # not 0 or 1: torch.export specialises those sizes
    pooled = {f: torch.zeros(b, c.embedding_dim) for tm in modules if tm.kind == "pooled"
              for c in tm.configs for f in c.feature_names}
    dims = {f: c.embedding_dim for tm in modules if tm.kind == "sequence" for c in tm.configs
            for f in c.feature_names}
    values = value_features(model)
    missing = sorted(set(lengths) - set(dims) - values)
    if missing:
        raise ValueError(f"serving_sequence_lengths() names {missing}, which no sequence table of "
                         f"the model reads (they read {sorted(dims)}) and serving_value_features() "
                         "does not list.")
    unknown = sorted(values - {q.name for q in spec.sequence})
    if unknown:
        raise ValueError(f"serving_value_features() names {unknown}, which are not sequence "
                         "features of the FeatureSpec.")
    sequences = {f: torch.zeros(b, n, dtype=torch.int64) if f in values else torch.zeros(b, n, dims[f])
                 for f, n in lengths.items()}
    lens = {f: torch.full((b,), n, dtype=torch.int64) for f, n in lengths.items()}
    return (torch.zeros(b, spec.num_dense), pooled, sequences, lens)


def export_program(dense_model: nn.Module, example: tuple[Any, ...]) -> Any:
    """``torch.export`` of ``dense_model.serving_logits``, its batch size dynamic."""
    batch = torch.export.Dim("batch", min=1)
    shapes = ({0: batch}, {f: {0: batch} for f in example[1]}, {f: {0: batch} for f in example[2]},
              {f: {0: batch} for f in example[3]})
    return dense_program.export(_Program(dense_model).eval(), example, shapes)


def program_bytes(ep: Any) -> bytes:
    """The exported program ``ep`` as the artifact stores it (``torch.export.save``)."""
    # No example inputs in the archive: they are its only pickled member (see
    # scorer.check_program_archive).
    example = ep._example_inputs
    ep._example_inputs = None
    try:
        return dense_program.save(ep)
    finally:
        ep._example_inputs = example  # AOTInductor compiles from them


def aot_package(ep: Any, tmp_dir: str) -> tuple[bytes | None, str | None]:
    """``(package bytes, None)`` of ``ep`` compiled with AOTInductor in ``tmp_dir``, or
    ``(None, why)`` when it fails (recorded, not raised)."""
    path = os.path.join(tmp_dir, mf.AOTI_PROGRAM)
    try:
        dense_program.aot_compile(ep, path)
        with open(path, "rb") as f:
            return f.read(), None
    except Exception as e:  # noqa: BLE001 - reported in the manifest and the summary
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
