"""Row-wise quantized tables: FBGEMM's fused formats, read back in plain torch.

``int8``: FBGEMM's ``FloatToFused8BitRowwiseQuantized``: each row is ``dim`` uint8 codes then
its float32 scale and float32 bias (``dim + 8`` bytes); a value is ``code * scale + bias``.
``int4``: ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(bit_rate=4)``: two codes per byte
(element ``2j`` in the low nibble of byte ``j``), then a float16 scale and a float16 bias
(``ceil(dim / 2) + 4`` bytes).

Quantizing uses FBGEMM's CPU kernels (at export, where fbgemm is loaded with torchrec);
``dequantize`` is plain torch, so a server (or ``Scorer``) needs no FBGEMM, and keeps the
table quantized in memory: only the rows a request reads are expanded. ``tests/test_serving.py``
checks ``dequantize`` against FBGEMM's own dequantization ops, bitwise.
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("int8", "int4")


def quantize(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A float32 table ``[rows, dim]`` -> its fused row-wise quantized bytes (uint8)."""
    try:
        ops = torch.ops.fbgemm
        # Half-precision rows widen to float32 exactly: they quantize as the same values in an
        # fp32 table would, by one path for every precision.
        if kind == "int8":
            return ops.FloatToFused8BitRowwiseQuantized(weight.float().contiguous())
        if kind == "int4":
            return ops.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight.float().contiguous(), 4)
    except (AttributeError, RuntimeError) as e:
        raise RuntimeError(f"quantizing a table to {kind} needs FBGEMM's CPU ops "
                           f"(fbgemm_gpu, loaded with torchrec): {e}") from e
    raise ValueError(f"`quantize` must be one of {QUANTIZATIONS} or None, but is {kind!r}.")


def dequantize(q: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    """Fused quantized rows (uint8 ``[n, bytes]``) -> float32 ``[n, dim]``."""
    if kind == "int8":
        scale_bias = q[:, dim:dim + 8].contiguous().view(torch.float32).to(torch.float64)
        # FBGEMM's kernel rounds code * scale + bias once (an FMA). In float64 the product of
        # an 8-bit code and a float32 scale is exact, so one rounding of the sum to float32
        # gives the same value (tested bitwise against FBGEMM's op).
        return (q[:, :dim].to(torch.float64) * scale_bias[:, :1]
                + scale_bias[:, 1:2]).to(torch.float32)
    if kind == "int4":
        packed = (dim + 1) // 2
        codes = q[:, :packed]
        both = torch.stack([torch.bitwise_and(codes, 0x0F), torch.bitwise_right_shift(codes, 4)],
                           dim=2).reshape(q.shape[0], 2 * packed)[:, :dim]
        scale_bias = q[:, packed:packed + 4].contiguous().view(torch.float16).to(torch.float32)
        return both.to(torch.float32) * scale_bias[:, :1] + scale_bias[:, 1:2]
    raise ValueError(f"unknown quantization {kind!r} (this reader knows {QUANTIZATIONS}).")
