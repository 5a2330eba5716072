"""The scorer's embedding part: tables loaded from the artifact's safetensors, looked up in
plain torch exactly as training's modules pool them.

* pooled tables (``EmbeddingBagCollection``): per feature, the sum or mean of its ids' rows
  (``F.embedding_bag``; one id per row: the row itself), weighted by the ids' weights when
  the table is weighted;
* sequence tables (``EmbeddingCollection``): per feature, the rows in order, zero-padded to
  the length the model reads (``[B, L, dim]``) with the ids per row (``[B]``);
* dynamic tables: raw id -> its row by a search in the sorted resident ids; any other id
  reads the default row its routing names (``routing.py``); pooled with ``segment_reduce``
  as ``dynamic.DynamicEmbeddingBagCollection`` pools.

Quantized tables stay quantized in memory; the rows a request reads are dequantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from recsys_trainer.serving.quantize import dequantize
from recsys_trainer.serving.routing import Routing, check_ids


def _tensor(values: Any, dtype: Any) -> torch.Tensor:
    """``values`` as a tensor sharing its memory when it can: ids and weights read from Arrow
    are read-only views, which torch refuses to wrap silently (it warns), so those are copied."""
    return torch.from_numpy(np.require(values, dtype=dtype, requirements=["C", "W"]))


@dataclass
class DynamicRows:
    """A dynamic table's resident rows: sorted raw ``ids`` (int64), their ``vectors`` and the
    ``default_rows`` unknown ids read (both float32, float16 or bfloat16, or quantized
    bytes)."""

    ids: torch.Tensor
    vectors: torch.Tensor
    default_rows: torch.Tensor
    routing: Routing


@dataclass
class Table:
    """One table of the artifact (see ``manifest.py`` for the fields' meaning)."""

    name: str
    kind: str
    """``"pooled"`` or ``"sequence"``."""
    dim: int
    pooling: str
    weighted: bool
    features: list[str]
    quantization: str | None
    weight: torch.Tensor | None
    """Plain tables: ``[rows, dim]`` float32, float16 or bfloat16 (the table's precision in
    training), or quantized bytes. None for dynamic ones."""
    dynamic: DynamicRows | None = None

    @classmethod
    def from_manifest(cls, entry: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> Table:
        dyn = entry.get("dynamic")
        dynamic = None
        if dyn is not None:
            dynamic = DynamicRows(ids=tensors[dyn["ids"]], vectors=tensors[dyn["vectors"]],
                                  default_rows=tensors[dyn["default_rows"]],
                                  routing=Routing.from_json(dyn["routing"]))
        return cls(name=entry["name"], kind=entry["kind"], dim=int(entry["dim"]),
                   pooling=entry["pooling"], weighted=bool(entry["weighted"]),
                   features=list(entry["features"]), quantization=entry.get("quantization"),
                   weight=None if dyn is not None else tensors[entry["tensor"]], dynamic=dynamic)

    # ------------------------------------------------------------------ rows

    def _dequant(self, rows: torch.Tensor) -> torch.Tensor:
        # Half-precision rows widen to float32 exactly, as FBGEMM's lookup widens them before
        # pooling in float32: the same sums, bit for bit.
        if self.quantization is None:
            return rows if rows.dtype == torch.float32 else rows.float()
        return dequantize(rows, self.quantization, self.dim)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, dim]`` float32 rows of ``ids`` (raw ids for a dynamic table)."""
        if self.dynamic is None:
            assert self.weight is not None
            return self._dequant(self.weight[ids])
        d = self.dynamic
        check_ids(ids, self.name)
        if len(d.ids):
            pos = torch.searchsorted(d.ids, ids).clamp_max(len(d.ids) - 1)
            found = d.ids[pos] == ids
        else:
            pos = torch.zeros_like(ids)
            found = torch.zeros_like(ids, dtype=torch.bool)
        if bool(found.all()):
            return self._dequant(d.vectors[pos])
        out = self._dequant(d.default_rows[d.routing.default_row(ids)])
        if bool(found.any()):
            out[found] = self._dequant(d.vectors[pos[found]])
        return out

    def pool(self, ids: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None) -> torch.Tensor:
        """``[B, dim]``: each row's ids pooled as the training module pools them."""
        idx = _tensor(ids, np.int64)
        lens = _tensor(lengths, np.int64)
        mean = self.pooling == "mean"
        if self.dynamic is not None:
            # dynamic.DynamicEmbeddingBagCollection's _pool: one id per row is its row, else
            # segment_reduce over the rows.
            rows = self.rows(idx)
            if weights is None and bool((lens == 1).all()):
                return rows
            out = torch.segment_reduce(rows, "sum", lengths=lens, axis=0, unsafe=True)
            if mean:
                out = out / lens.clamp_min(1).unsqueeze(1).to(out.dtype)
            return out
        if weights is None and bool((lens == 1).all()):
            return self.rows(idx)  # one id per row: its row, nothing to pool
        assert self.weight is not None
        offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=offsets[1:])
        psw = None if weights is None else _tensor(weights, np.float32)
        if self.quantization is not None or self.weight.dtype != torch.float32:
            # Gather and expand (or widen) only the rows read, then pool them.
            uniq, inverse = torch.unique(idx, return_inverse=True)
            return F.embedding_bag(inverse, self.rows(uniq), offsets, mode="mean" if mean else "sum",
                                   per_sample_weights=psw, include_last_offset=True)
        return F.embedding_bag(idx, self.weight, offsets, mode="mean" if mean else "sum",
                               per_sample_weights=psw, include_last_offset=True)

    def padded(self, ids: np.ndarray, lengths: np.ndarray, length: int, feature: str,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, length, dim], [B])``: each row's rows in order, zero-padded (what torchrec's
        ``JaggedTensor.to_padded_dense`` gives the model in training)."""
        lens = _tensor(lengths, np.int64)
        b = len(lens)
        _check_length(lens, length, feature)
        out = torch.zeros(b, length, self.dim, dtype=torch.float32)
        n = int(lens.sum())
        if n:
            idx = _tensor(ids, np.int64)
            row_of = torch.repeat_interleave(torch.arange(b), lens)
            starts = torch.cumsum(lens, 0) - lens
            out[row_of, torch.arange(n) - starts[row_of]] = self.rows(idx)
        return out, lens


def _check_length(lens: torch.Tensor, length: int, feature: str) -> None:
    if len(lens) and int(lens.max()) > length:
        row = int(torch.nonzero(lens > length)[0, 0])
        raise ValueError(
            f"row {row} has {int(lens[row])} ids for sequence feature {feature!r}, but the "
            f"model reads at most {length} (training refuses such a row too); give the "
            f"SequenceFeature max_len={length}.")


def padded_values(values: np.ndarray, lengths: np.ndarray, length: int, feature: str,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, length] int64, [B])``: a value feature's integers (event times; no table), each
    row's in order and zero-padded, as the model's ``serving_value_features`` reads them."""
    lens = _tensor(lengths, np.int64)
    _check_length(lens, length, feature)
    b = len(lens)
    out = torch.zeros(b, length, dtype=torch.int64)
    n = int(lens.sum())
    if n:
        row_of = torch.repeat_interleave(torch.arange(b), lens)
        starts = torch.cumsum(lens, 0) - lens
        out[row_of, torch.arange(n) - starts[row_of]] = _tensor(values, np.int64)
    return out, lens


class FusedLookup:
    """Plain float32 pooled tables of one dim, concatenated into one tensor (each table's
    ``weight`` becomes a view of it), so that features with one id per row are looked up in one
    gather instead of one per feature (what FBGEMM's table-batched kernel does in training).
    The values are the rows themselves: the same bits as a per-table lookup."""

    def __init__(self, tables: list[Table]) -> None:
        self.dim = tables[0].dim
        weights = [t.weight for t in tables if t.weight is not None]
        assert len(weights) == len(tables)
        self.weight = torch.cat(weights)
        starts = [0]
        for w in weights:
            starts.append(starts[-1] + int(w.shape[0]))
        self.offset = {t.name: int(starts[i]) for i, t in enumerate(tables)}
        for i, t in enumerate(tables):
            t.weight = self.weight[int(starts[i]):int(starts[i + 1])]

    @staticmethod
    def eligible(t: Table) -> bool:
        return (t.kind == "pooled" and t.dynamic is None and t.quantization is None
                and not t.weighted and t.weight is not None and t.weight.dtype == torch.float32)

    def rows(self, ids: np.ndarray, offsets: torch.Tensor) -> torch.Tensor:
        """``[keys, rows, dim]``: row ``ids[k, r] + offsets[k]`` of the concatenated tables."""
        idx = torch.from_numpy(ids) + offsets.unsqueeze(1)
        return self.weight.index_select(0, idx.reshape(-1)).view(ids.shape[0], ids.shape[1], self.dim)
