"""``DecodedChunk``: decoded rows as numpy columns, cut into ``Batch``es (CPU tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_trainer.batch import Batch


@dataclass
class DecodedChunk:
    """Decoded rows as numpy columns; ``batch(lo, hi)`` cuts source rows ``[lo, hi)``.

    Sparse ids are either ``ids`` (``[blocks, num_keys, block_rows]``, see
    ``decode._regular_ids``: every key has exactly one id per row, no id weights) or, in general, per-key flat ``values`` / ``lengths`` / ``id_weights``.
    Sequence ids are per-key flat ``seq_values`` / ``seq_lengths`` (keys ``seq_keys``).
    """

    keys: list[str]
    single_label: bool
    num_source_rows: int
    labels: np.ndarray
    dense: np.ndarray
    weights: np.ndarray | None
    values: list[np.ndarray]
    lengths: list[np.ndarray]
    id_weights: list[np.ndarray] | None
    kept_cum: np.ndarray | None
    """Rows kept before each source row (when NaN-label rows were dropped), else None."""
    ids: np.ndarray | None = None
    passthrough: Mapping[str, pa.Array] = field(default_factory=dict)
    """The spec's passthrough columns (kept rows only)."""
    seq_keys: list[str] = field(default_factory=list)
    seq_values: list[np.ndarray] = field(default_factory=list)
    seq_lengths: list[np.ndarray] = field(default_factory=list)
    offsets: list[np.ndarray] = field(init=False)
    seq_offsets: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = [np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in self.lengths]
        self.seq_offsets = [np.concatenate([[0], np.cumsum(x, dtype=np.int64)]) for x in self.seq_lengths]

    def batch(self, lo: int, hi: int) -> Batch:
        """The ``Batch`` of source rows ``[lo, hi)`` (rows dropped for NaN labels left out)."""
        # Imported here, not with the module: the serving scorer decodes with this module and
        # must not import torchrec (whose package imports torchrec.distributed).
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from recsys_trainer.batch import Batch
        if self.kept_cum is not None:
            lo, hi = int(self.kept_cum[lo]), int(self.kept_cum[hi])
        n = hi - lo
        labels = self.labels[lo:hi]
        if self.ids is not None:
            # A whole block is the key-major values as they are; every length is 1. (numpy,
            # not torch.ones: torch's intra-op thread pool costs milliseconds per call on a
            # busy host.)
            k = len(self.keys)
            kjt = KeyedJaggedTensor(
                keys=self.keys,
                values=torch.from_numpy(self._block_ids(lo, hi)),
                lengths=torch.from_numpy(np.ones(k * n, dtype=np.int32)),
                stride=n,
                length_per_key=[n] * k,
                offset_per_key=list(range(0, k * n + 1, n)) if n else [0] * (k + 1),
            )
        elif self.keys:
            kjt = _jagged_kjt(self.keys, self.values, self.lengths, self.offsets, self.id_weights, lo, hi)
        else:
            kjt = KeyedJaggedTensor.empty(values_dtype=torch.int64)
        # Views of the chunk's arrays (contiguous row ranges; each batch has its own rows).
        return Batch(
            dense=torch.from_numpy(self.dense[lo:hi]),
            sparse=kjt,
            labels=torch.from_numpy(labels[:, 0] if self.single_label else labels),
            weights=None if self.weights is None else torch.from_numpy(self.weights[lo:hi]),
            passthrough={c: a.slice(lo, n) for c, a in self.passthrough.items()},
            sequence=_jagged_kjt(self.seq_keys, self.seq_values, self.seq_lengths, self.seq_offsets,
                                 None, lo, hi) if self.seq_keys else None,
        )


    def id_arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Every pooled key's ``(flat ids int64, ids per row int32, id weights float32 or
        None)`` over all the chunk's kept rows, as numpy (what ``batch`` puts into the KJT):
        for readers of the decoded ids that do not build a ``Batch`` (the serving scorer)."""
        n = len(self.labels)
        if self.ids is not None:
            flat = self._block_ids(0, n).reshape(len(self.keys), n)  # key-major: a view
            ones = np.ones(n, dtype=np.int32)
            return {k: (flat[j], ones, None) for j, k in enumerate(self.keys)}
        return {k: (self.values[j], self.lengths[j],
                    None if self.id_weights is None else self.id_weights[j])
                for j, k in enumerate(self.keys)}

    def id_matrix(self) -> np.ndarray | None:
        """``[num_keys, rows]`` int64 ids when every pooled key has exactly one id per row and
        no id weights (the common case, decoded in one block), else None."""
        if self.ids is None:
            return None
        n = len(self.labels)
        return self._block_ids(0, n).reshape(len(self.keys), n)

    def sequence_arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every sequence key's ``(flat ids int64, ids per row int32)`` over all kept rows."""
        return {k: (self.seq_values[j], self.seq_lengths[j]) for j, k in enumerate(self.seq_keys)}

    def _block_ids(self, lo: int, hi: int) -> np.ndarray:
        """Key-major flat ids of kept rows ``[lo, hi)``: a view when they are one whole block."""
        assert self.ids is not None
        bs = self.ids.shape[2]
        first, last = lo // bs, -(-hi // bs)
        if hi - lo == bs and lo % bs == 0:
            return self.ids[first].reshape(-1)
        if hi == lo:
            return np.empty(0, dtype=np.int64)
        parts = [self.ids[b, :, max(lo - b * bs, 0):min(hi - b * bs, bs)] for b in range(first, last)]
        return np.concatenate(parts, axis=1).reshape(-1)


def _jagged_kjt(keys: list[str], values: list[np.ndarray], lengths: list[np.ndarray],
                offsets: list[np.ndarray], weights: list[np.ndarray] | None,
                lo: int, hi: int) -> KeyedJaggedTensor:
    """Rows ``[lo, hi)`` of per-key flat ids as one key-major KJT (one concatenate per field)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # see DecodedChunk.batch
    bounds = [(int(o[lo]), int(o[hi])) for o in offsets]
    per_key = [b - a for a, b in bounds]

    def cat(parts: list[np.ndarray]) -> torch.Tensor:
        # One key's rows are a contiguous range of its arrays: a view, no copy (unless it is
        # Arrow's read-only memory, which a tensor must not alias).
        if len(parts) == 1 and parts[0].flags.writeable:
            return torch.from_numpy(parts[0])
        return torch.from_numpy(np.concatenate(parts))

    return KeyedJaggedTensor(
        keys=keys,
        values=cat([v[a:b] for v, (a, b) in zip(values, bounds, strict=True)]),
        lengths=cat([x[lo:hi] for x in lengths]),
        weights=None if weights is None else cat(
            [w[a:b] for w, (a, b) in zip(weights, bounds, strict=True)]),
        stride=hi - lo,
        length_per_key=per_key,
        offset_per_key=np.concatenate([[0], np.cumsum(per_key)]).astype(np.int64).tolist(),
    )
