"""The HSTU layer (hierarchical sequential transduction units; Zhai et al., "Actions Speak Louder
than Words", ICML 2024) and its stack over padded rows (one length bucket), which
``models.hstu``'s models run on jagged histories (``models.jagged``).

**The layer** (``HSTULayer``), over the tokens ``x`` of a row:

* pointwise projections: ``U, V, Q, K = split(SiLU(Linear(LayerNorm(x))))``;
* causal pointwise attention: ``A[n, m] = SiLU(q_n . k_m / sqrt(d) + bias[n, m])`` for
  ``m <= n`` (0 otherwise), **divided by the number of tokens the query sees** (``n + 1``), not
  normalised by a softmax: a token's attention keeps how much of the history relates to it;
* ``bias[n, m]``: a relative attention bias, one learned weight per distance ``n - m`` (capped
  at the longest row) plus, with event times, one per **time bucket** of ``theta_n - tau_m``
  (the time of what position ``n`` predicts minus the time of token ``m``; half-octave buckets
  of the data's time unit, ``time_bucket``);
* gating by ``U``: ``x + Linear(Dropout(U * LayerNorm(A V)))``.

The authors' code (facebookresearch/generative-recommenders, ``research/modeling/sequential/
hstu.py``) differs in details the paper leaves open; docs/models.md lists them. The one that
matters here: attention is divided by the number of keys each query sees where theirs divides
by the padded length: with the layer norm that follows, the two differ only through the norm's
epsilon, and this one makes a row's result independent of the batch's padding (so jagged
equals padded, and serving equals training).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from recsys_trainer.models.jagged import BucketPolicy, by_static_buckets, run_by_bucket

TIME_BOUNDARIES: tuple[int, ...] = tuple(sorted({round(2 ** (k / 2)) for k in range(64)}))
"""Where the time buckets start: half-octaves (1, 2, 3, 4, 6, 8, 11, 16, ...) up to 2^31.5 of
the data's time unit. A difference below 1 (or negative) is bucket 0."""

NUM_TIME_BUCKETS = len(TIME_BOUNDARIES) + 1


def time_bucket(delta: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """The bucket of each time difference (integers): how many boundaries it reaches. Exact
    integer comparisons, the same on every device and in the serving program; int32, as the
    ``[rows, L, L]`` buckets are the size of the attention matrix."""
    return torch.bucketize(delta, boundaries, right=True, out_int32=True)


# ----------------------------------------------------------------------------- the layer


class HSTULayer(nn.Module):
    """One HSTU layer (the module docstring): ``[R, L, D]`` tokens in, ``[R, L, D]`` out."""

    def __init__(self, dim: int, num_heads: int, attention_dim: int, linear_dim: int,
                 max_positions: int, time_bias: bool, dropout: float) -> None:
        super().__init__()
        self.num_heads, self.attention_dim, self.linear_dim = num_heads, attention_dim, linear_dim
        self.input_norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, num_heads * (2 * linear_dim + 2 * attention_dim))
        self.output_norm = nn.LayerNorm(num_heads * linear_dim)
        self.output = nn.Linear(num_heads * linear_dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.position_bias = nn.Parameter(torch.zeros(max_positions).normal_(0, 0.02))
        """One weight per distance ``n - m`` between a query and a key."""
        self.time_bias = (nn.Parameter(torch.zeros(NUM_TIME_BUCKETS).normal_(0, 0.02))
                          if time_bias else None)
        """One weight per time bucket of ``theta_n - tau_m`` (None without event times)."""

    def forward(self, x: torch.Tensor, causal: torch.Tensor, distance: torch.Tensor,
                keys_seen: torch.Tensor, time_buckets: torch.Tensor | None) -> torch.Tensor:
        """``x [R, L, D]``; ``causal [L, L]`` (1 where key ``m <= n``), ``distance [L, L]``
        (``n - m``, capped), ``keys_seen [L]`` (``n + 1``), ``time_buckets [R, L, L]``."""
        r, length, _ = x.shape
        h, a, v = self.num_heads, self.attention_dim, self.linear_dim
        u, val, q, k = F.silu(self.uvqk(self.input_norm(x))).split([h * v, h * v, h * a, h * a], dim=-1)
        q = q.view(r, length, h, a).transpose(1, 2)
        k = k.view(r, length, h, a).transpose(1, 2)
        val = val.view(r, length, h, v).transpose(1, 2)
        bias = self.position_bias[distance]  # [L, L]
        if self.time_bias is not None and time_buckets is not None:
            bias = bias + self.time_bias[time_buckets]  # [R, L, L]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(a) + bias.unsqueeze(-3)
        attention = F.silu(scores) * causal / keys_seen.unsqueeze(-1)
        out = torch.matmul(attention, val).transpose(1, 2).reshape(r, length, h * v)
        return x + self.output(self.dropout(u * self.output_norm(out)))


class HSTUEncoder(nn.Module):
    """A stack of ``HSTULayer``s over padded rows (one length bucket): ``forward(x [R, L, D],
    tau [R, L], theta [R, L]) -> [R, L, D]``, ``tau``/``theta`` the tokens' times and the
    times of what each position predicts (ignored without ``time_bias``)."""

    time_boundaries: torch.Tensor

    def __init__(self, dim: int, *, num_layers: int, num_heads: int, attention_dim: int | None,
                 linear_dim: int | None, max_tokens: int, time_bias: bool, dropout: float) -> None:
        super().__init__()
        for name, value in (("num_layers", num_layers), ("num_heads", num_heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, but is {value!r}.")
        per_head = max(1, dim // num_heads)
        attention_dim = per_head if attention_dim is None else attention_dim
        linear_dim = per_head if linear_dim is None else linear_dim
        for name, value in (("attention_dim", attention_dim), ("linear_dim", linear_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1 or None, but is {value!r}.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), but is {dropout!r}.")
        self.max_tokens, self.time_bias = max_tokens, time_bias
        self.layers = nn.ModuleList(
            HSTULayer(dim, num_heads, attention_dim, linear_dim, max_tokens, time_bias, dropout)
            for _ in range(num_layers))
        self.register_buffer("time_boundaries", torch.tensor(TIME_BOUNDARIES, dtype=torch.int64),
                             persistent=False)

    def forward(self, x: torch.Tensor, tau: torch.Tensor | None = None,
                theta: torch.Tensor | None = None) -> torch.Tensor:
        length = x.shape[1]
        pos = torch.arange(length, device=x.device)
        gap = pos.unsqueeze(1) - pos.unsqueeze(0)  # n - m
        causal = (gap >= 0).to(x.dtype)
        distance = gap.clamp(0, self.max_tokens - 1)
        keys_seen = (pos + 1).to(x.dtype)
        buckets = None
        if self.time_bias:
            if tau is None or theta is None:
                raise ValueError("this HSTU encoder has a time bias: give the tokens' times.")
            buckets = time_bucket(theta.unsqueeze(2) - tau.unsqueeze(1), self.time_boundaries)
        x = x.contiguous()
        for layer in self.layers:
            x = layer(x, causal, distance, keys_seen, buckets)
        return x

    def run(self, tokens: torch.Tensor, counts: torch.Tensor, tau: torch.Tensor | None,
            theta: torch.Tensor | None, policy: BucketPolicy) -> torch.Tensor:
        """Jagged rows (``tokens [N, D]``, ``counts [B]`` tokens per row, times ``[N]``) bucket
        by bucket (``models.jagged.run_by_bucket``): ``[N, D]``."""
        extras = [] if tau is None or theta is None else [tau, theta]
        return run_by_bucket(self._bucket, tokens, counts, extras, self.max_tokens, policy)

    def run_padded(self, x: torch.Tensor, counts: torch.Tensor, tau: torch.Tensor | None,
                   theta: torch.Tensor | None, last: torch.Tensor) -> torch.Tensor:
        """``[B, D]``: each padded row's output at position ``last[b]``, computed at its own
        bucket's length as ``run`` computes it in training (``by_static_buckets``: the serving
        program's fixed shapes)."""
        extras = [] if tau is None or theta is None else [tau, theta]
        out = x.new_zeros(x.shape[0], x.shape[2])
        for length, y, rows in by_static_buckets(self._bucket, x, counts, extras):
            at = last[rows].clamp_max(length - 1).view(-1, 1, 1).expand(-1, 1, y.shape[2])
            out = out.index_copy(0, rows, y.gather(1, at).squeeze(1))
        return out

    def _bucket(self, x: torch.Tensor, counts: torch.Tensor, extras: Sequence[torch.Tensor]) -> torch.Tensor:
        return self(x, *extras) if extras else self(x)


__all__ = ["HSTUEncoder", "HSTULayer", "NUM_TIME_BUCKETS", "TIME_BOUNDARIES", "time_bucket"]
