"""Raw ids of dynamic tables: the id space, the mixing applied before routing, and where an id
lives (its shard, and the fallback row it reads without a row of its own).

Pure tensor functions (no torchrec): the serving export and the checkpoint exports use the same
rules as training.
"""

from __future__ import annotations

import torch

ID_SPACE = 2**63 - 1
"""Ids a dynamic table accepts: ``[0, ID_SPACE)``. ``2**63 - 1`` (int64 max) marks an empty slot
in torchrec's map. Use it as ``SparseFeature(num_embeddings=ID_SPACE)`` so the data layer hashes
strings into the whole space and passes integer ids unchanged."""


EMPTY_SLOT = torch.iinfo(torch.int64).max
"""The empty-slot marker of torchrec's sorted id map (int64 max)."""

_MASK = 2**63 - 1
_MUL_A = 0x9E3779B97F4A7C15 & _MASK | 1
_MUL_B = 0xBF58476D1CE4E5B9 & _MASK | 1
_INV_A = pow(_MUL_A, -1, 2**63)
_INV_B = pow(_MUL_B, -1, 2**63)


def _mul_mod63(x: torch.Tensor, c: int) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64 on CPU and CUDA; masking leaves it modulo 2**63.
    return torch.bitwise_and(x * c, _MASK)


def _xorshift32(x: torch.Tensor) -> torch.Tensor:
    # Self-inverse on 63-bit values: the shifted-in part (bits 32..62) is untouched by the xor.
    return torch.bitwise_xor(x, torch.bitwise_right_shift(x, 32))


def mix_ids(ids: torch.Tensor, input_size: int = ID_SPACE) -> torch.Tensor:
    """A bijection of ``[0, 2**63)`` (multiply, xorshift, multiply), applied by torchrec as the
    tables' ``input_hash_func`` *before* ids are routed to ranks.

    Why: row-wise managed collision sends an id to the rank owning its block of the id range,
    so small or sequential raw ids would all land on rank 0. Being a bijection it adds no
    collision; ``unmix_ids`` inverts it for exports. (The one id that mixes to ``2**63 - 1``,
    the empty-slot marker, is not supported.)"""
    del input_size  # the range is fixed: the whole non-negative int64 space
    # A negative id would wrap onto 2**63 + id and share its row: refuse it instead. On the GPU
    # the check is asynchronous (no host sync); the error surfaces at the next sync point.
    if ids.device.type == "cpu":
        if ids.numel() and int(ids.min()) < 0:
            bad = int(ids[ids < 0][0])
            raise ValueError(f"a dynamic table got the negative id {bad}; raw ids must be in "
                             "[0, 2**63) (hash or offset signed ids before they reach the table).")
    elif ids.numel():
        torch._assert_async((ids >= 0).all(), "a dynamic table got a negative raw id")
    # In place after the first product: on a batch's few hundred ids the cost is the ops and
    # their allocations (12 us here against 15 for the same steps allocating each result).
    x = ids * _MUL_A
    x.bitwise_and_(_MASK)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 32))
    return x.mul_(_MUL_B).bitwise_and_(_MASK)


def unmix_ids(mixed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``mix_ids``: the raw ids stored in a dynamic table's map."""
    return _mul_mod63(_xorshift32(_mul_mod63(mixed, _INV_B)), _INV_A)


def fallback_index(mixed: torch.Tensor, rows: int) -> torch.Tensor:
    """Which of a table's ``rows`` fallback rows a (mixed) id without its own row reads:
    ``floor(mixed * rows / 2**63)``, its position in the id space. Shards own contiguous blocks
    of the id space, so each shard's ids read its own fallback rows, and the rows keep their ids
    when the world size changes. Exact integer arithmetic (``rows < 2**31``)."""
    hi = torch.bitwise_right_shift(mixed, 32)
    lo = torch.bitwise_and(mixed, 0xFFFFFFFF)
    return torch.bitwise_right_shift(hi * rows + torch.bitwise_right_shift(lo * rows, 32), 31)


def shard_of(mixed: torch.Tensor, shards: int) -> torch.Tensor:
    """The shard (rank) that owns a mixed id: torchrec's row-wise managed collision sends it by
    FBGEMM's block bucketization, ``mixed // ceil(ID_SPACE / shards)``."""
    return torch.div(mixed, -(-ID_SPACE // shards), rounding_mode="floor")
