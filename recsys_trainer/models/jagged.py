"""Histories by length bucket: what makes a sequence model's step cost follow the events of a
batch, not its number of rows times its longest row.

Real histories are long-tailed (most users have a few events, a few have thousands). Padding a
batch to its longest row makes every row cost as much as that one: with lengths of mean 50 and
max 1,000, twenty times the events, and for attention (quadratic in the length) hundreds of
times. Here the rows are grouped by length into **buckets** whose padded lengths are powers of
two (``bucket_lengths``: 8, 16, 32, ..., and the longest length the model takes), each bucket
padded to its own length and run as one dense batch (``run_by_bucket``). A row is padded to at
most twice its length (the shortest bucket aside), so time and memory per step grow with the
batch's events (and, for attention, with the sum of its rows' squared lengths), whatever its
longest row. The dense per-bucket batches keep the work in large matrix products, which is what
a CPU (and a GPU without a jagged attention kernel) runs fast; there is no jagged attention in
torch or in FBGEMM's CPU operators to use instead.

A row's result depends only on the row: the same computation on the same padded length,
whatever else is in its bucket. ``by_static_buckets`` runs a padded batch (the serving
program's input, of a fixed padded length for ``torch.export``) bucket by bucket, each row at
its own bucket's length: the exported program computes each row exactly as training did, at
training's cost.

``policy="padded"`` (one bucket: the batch's longest row) is the padded baseline the benchmark
(``benchmarks/bench_hstu.py``) and the tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

BucketPolicy = Literal["length", "padded"]

MIN_BUCKET = 8
"""The shortest bucket: shorter rows are padded to it (tiny buckets would cost more in
per-bucket overhead than their padding)."""


def bucket_lengths(max_tokens: int, min_bucket: int = MIN_BUCKET) -> list[int]:
    """The padded lengths of the buckets of rows of at most ``max_tokens`` tokens: powers of two
    from ``min_bucket`` below ``max_tokens``, then ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"`max_tokens` must be >= 1, but is {max_tokens}.")
    out, n = [], min_bucket
    while n < max_tokens:
        out.append(n)
        n *= 2
    return [*out, max_tokens]


@dataclass(frozen=True)
class Bucket:
    """One bucket of a batch: its ``rows`` (indices into the batch, ``[R]``) and their padded
    ``length``."""

    rows: torch.Tensor
    length: int


def buckets_of(counts: torch.Tensor, max_tokens: int, policy: BucketPolicy = "length") -> list[Bucket]:
    """The non-empty buckets of rows with ``counts [B]`` tokens each (``counts <= max_tokens``).

    ``"length"``: by ``bucket_lengths(max_tokens)``; ``"padded"``: one bucket of every row at
    the batch's longest. Reads the counts on the host once (each bucket's size decides a
    shape): one sync per step off the CPU."""
    if policy == "padded":
        longest = int(counts.max()) if counts.numel() else 1
        return [Bucket(torch.arange(counts.numel(), device=counts.device), max(longest, 1))]
    if policy != "length":
        raise ValueError(f"the bucket policy must be 'length' or 'padded', but is {policy!r}.")
    lengths = bucket_lengths(max_tokens)
    bounds = torch.tensor(lengths, dtype=counts.dtype, device=counts.device)
    which = torch.bucketize(counts, bounds)  # the first bucket length >= the count
    order = torch.argsort(which, stable=True)
    sizes = torch.bincount(which, minlength=len(lengths)).tolist()
    out, start = [], 0
    for length, size in zip(lengths, sizes, strict=True):
        if size:
            out.append(Bucket(order[start:start + size], length))
        start += size
    return out


def token_index(offsets: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, length: int,
                pad: int) -> torch.Tensor:
    """``[R, length]`` positions in a flat token tensor (row ``r``'s tokens at ``offsets[r]``,
    ``counts[r]`` of them) of ``rows``' tokens, left-aligned; ``pad`` past a row's end."""
    pos = torch.arange(length, device=offsets.device).unsqueeze(0)
    idx = offsets[rows].unsqueeze(1) + pos
    return torch.where(pos < counts[rows].unsqueeze(1), idx, torch.full_like(idx, pad))


def run_by_bucket(
    fn: Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor],
    tokens: torch.Tensor,
    counts: torch.Tensor,
    extras: Sequence[torch.Tensor],
    max_tokens: int,
    policy: BucketPolicy = "length",
) -> torch.Tensor:
    """``fn`` over a batch of jagged rows, bucket by bucket; the flat result ``[N, D_out]``.

    ``tokens [N, D]``: every row's tokens, row after row (row ``r`` has ``counts[r]``);
    ``extras``: per-token tensors ``[N, ...]`` padded alike (e.g. times; padded with 0).
    ``fn(x [R, L, D], counts [R], extras [R, L, ...]) -> [R, L, D_out]`` runs on each bucket,
    zero-padded past each row's end; the result of a row's padding is dropped."""
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    n = tokens.shape[0]
    padded = torch.cat([tokens, tokens.new_zeros(1, *tokens.shape[1:])])
    extras_padded = [torch.cat([e, e.new_zeros(1, *e.shape[1:])]) for e in extras]
    out: torch.Tensor | None = None
    for bucket in buckets_of(counts, max_tokens, policy):
        idx = token_index(offsets, counts, bucket.rows, bucket.length, n)
        y = fn(padded[idx], counts[bucket.rows], [e[idx] for e in extras_padded])
        if out is None:
            out = y.new_empty(n + 1, *y.shape[2:])
        out[idx.reshape(-1)] = y.reshape(-1, *y.shape[2:])
    if out is None:  # no rows
        return tokens.new_zeros(0, *tokens.shape[1:])
    return out[:n]


def by_static_buckets(
    fn: Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor],
    x: torch.Tensor,
    counts: torch.Tensor,
    extras: Sequence[torch.Tensor],
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``fn`` over a padded batch ``x [B, T, D]`` (``T``: the most tokens a row can have),
    bucket by bucket: ``[(length, fn(x[rows, :length], ...), rows [R])]`` for every bucket
    length, ``rows`` the indices of the rows whose bucket it is (none for an empty bucket).
    Each row is computed once, at its own bucket's length, exactly as ``run_by_bucket`` does
    in training, so serving costs what training does (not every row at every length). The
    padded length stays fixed (what ``torch.export`` traces); only the rows per bucket vary."""
    t = x.shape[1]
    lengths = bucket_lengths(t)
    which = torch.bucketize(counts, torch.tensor(lengths, dtype=counts.dtype, device=counts.device))
    out = []
    for i, length in enumerate(lengths):
        rows = torch.nonzero(which == i).flatten()
        out.append((length, fn(x[rows, :length], counts[rows], [e[rows, :length] for e in extras]),
                    rows))
    return out


__all__ = ["MIN_BUCKET", "Bucket", "BucketPolicy", "bucket_lengths", "buckets_of", "by_static_buckets",
           "run_by_bucket", "token_index"]
