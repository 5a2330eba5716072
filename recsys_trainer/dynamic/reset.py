"""Resetting evicted rows: torchrec resets an evicted slot's row and optimizer state with FBGEMM's
``reset_weight_momentum`` op, which has only a CUDA kernel and takes a *feature* index where
torchrec passes a *table* index. ``install_eviction_reset`` gives each table-batched module of a
sharded dynamic collection a reset that maps the table to its first feature: on CPU
``reset_rows_cpu`` (what the kernel does), on CUDA FBGEMM's own op. Instance attributes: nothing
global is patched."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn

from recsys_trainer.dynamic.tables import dynamic_collections


def _feature_of_table(tbe: Any, table: int) -> int:
    """FBGEMM's per-table offsets (``D_offsets``, ``weights_offsets``...) are indexed by
    *feature*; torchrec's eviction passes the *table*'s index. A table read by several features
    (a shared table) is found at its first feature."""
    return list(tbe.feature_table_map).index(table)


@dataclass(frozen=True)
class _HostLayout:
    """Where each table of a CPU table-batched module lives in its host buffers: per table
    index, ``(rows, dim, weights offset, momentum offset or None)``. Fixed once the module is
    built; ``install_eviction_reset`` reads it once, not at every reset."""

    tables: dict[int, tuple[int, int, int, int | None]]

    @staticmethod
    def of(tbe: Any) -> _HostLayout:
        rowwise = tbe.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
        w_offsets = tbe.weights_offsets.tolist()
        m_offsets = tbe.momentum1_offsets.tolist() if rowwise else None
        tables = {}
        for t, spec in enumerate(tbe.embedding_specs):
            f = _feature_of_table(tbe, t)
            tables[t] = (int(spec[0]), int(spec[1]), w_offsets[f],
                         m_offsets[f] if m_offsets is not None else None)
        return _HostLayout(tables)


def reset_rows_cpu(tbe: Any, pruned_indices: torch.Tensor, pruned_indices_offsets: torch.Tensor,
                   logical_table_ids: torch.Tensor, buffer_ids: torch.Tensor,
                   layout: _HostLayout | None = None) -> None:
    """CPU counterpart of FBGEMM's ``reset_weight_momentum`` for one table-batched module.

    What the CUDA kernel does, for each pruned table ``t`` (``logical_table_ids[t]``, here a
    table index, see ``_feature_of_table``) and each row index in its segment
    ``pruned_indices[offsets[buffer_ids[t]]:offsets[buffer_ids[t]+1]]``: zero the row's weights
    and its row-wise Adagrad accumulator. As in FBGEMM's Python wrapper, only row-wise Adagrad
    has state to reset. (torchrec then re-initialises the weights with the table's ``init_fn``.)
    CPU tables live in the ``*_host`` buffers, which the CUDA op's signature does not carry: that
    is why this is a method replacement, not a kernel registered for the op. ``layout``: the
    module's ``_HostLayout`` (read from it when not given); a row outside its table is an
    ``IndexError``."""
    if tbe.optimizer == EmbOptimType.NONE:
        raise NotImplementedError("resetting rows needs a fused optimizer")
    lay = layout if layout is not None else _HostLayout.of(tbe)
    bounds = pruned_indices_offsets.tolist()
    for t, b in zip(logical_table_ids.tolist(), buffer_ids.tolist(), strict=True):
        rows = pruned_indices[bounds[b]:bounds[b + 1]].long()
        if rows.numel() == 0:
            continue
        n, dim, w_offset, m_offset = lay.tables[t]
        with torch.no_grad():
            tbe.weights_host[w_offset:w_offset + n * dim].view(n, dim).index_fill_(0, rows, 0.0)
            if m_offset is not None:
                tbe.momentum1_host[m_offset:m_offset + n].index_fill_(0, rows, 0.0)


def _reset_rows_fbgemm(tbe: Any, reset: Any, pruned_indices: torch.Tensor,
                       pruned_indices_offsets: torch.Tensor, logical_table_ids: torch.Tensor,
                       buffer_ids: torch.Tensor) -> None:
    """FBGEMM's own reset (the CUDA kernel) with torchrec's table index turned into the feature
    index the kernel reads its offsets by."""
    features = torch.tensor([_feature_of_table(tbe, int(t)) for t in logical_table_ids.tolist()],
                            dtype=logical_table_ids.dtype, device=logical_table_ids.device)
    reset(pruned_indices=pruned_indices, pruned_indices_offsets=pruned_indices_offsets,
          logical_table_ids=features, buffer_ids=buffer_ids)


def install_eviction_reset(model: nn.Module) -> int:
    """Give every table-batched module under a sharded dynamic collection its eviction reset
    (an instance attribute shadowing FBGEMM's method): ``reset_rows_cpu`` for CPU tables,
    FBGEMM's op with the feature index for the others. Returns how many it installed."""
    n = 0
    for _, coll in dynamic_collections(model):
        for tbe, _idx in getattr(coll, "_table_to_tbe_and_index", {}).values():
            if "reset_embedding_weight_momentum" in vars(tbe):
                continue
            if tbe.weights_host.numel():
                tbe.reset_embedding_weight_momentum = functools.partial(
                    reset_rows_cpu, tbe, layout=_HostLayout.of(tbe))
            else:
                tbe.reset_embedding_weight_momentum = functools.partial(
                    _reset_rows_fbgemm, tbe, tbe.reset_embedding_weight_momentum)
            n += 1
    return n


install_cpu_eviction = install_eviction_reset
"""The former name (CPU only then)."""
