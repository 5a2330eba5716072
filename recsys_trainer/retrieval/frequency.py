"""Streaming item-frequency estimation for the logQ (sampling-probability) correction.

In-batch negatives are the other rows' positive items: item ``j`` appears as a negative in
proportion to how often it is interacted with, so a plain in-batch softmax pushes popular items
down. The correction (Yi et al., RecSys 2019, "Sampling-bias-corrected neural modeling for
large corpus item recommendations") subtracts ``log Q(j)``, the expected number of times ``j``
is a candidate, from each logit. ``Q`` is not known in a stream: ``ItemFrequencyEstimator``
estimates each item's share of recent interactions with a *decayed count-min sketch*:

* ``num_hashes`` rows of ``num_buckets`` counters; an id adds 1 to one bucket per row (row 0:
  ``id mod num_buckets``, exact when the ids fit; rows 1+: universal hashes ``((a id + b) mod p)
  mod num_buckets``). The estimate is the minimum over the rows (collisions only add);
* every count decays by ``decay`` per update (a step), lazily: each bucket keeps the step it was
  last touched and is decayed on its next touch or query, so an update costs O(ids), not
  O(buckets); the total count decays the same way, and ``probability(ids)`` is the decayed
  count over the decayed total.

The state is three buffers (counts, last-touched steps, the total and the step counter), so it
is saved and restored with the model (``Trainer``'s ``"model"`` checkpoint component). DMP
leaves such a module in its DDP part, which does not broadcast buffers: every rank keeps its
own copy, and the models keep the copies identical by updating with the ids of *all* ranks
(``collectives.all_gather_rows``), which is also what a checkpoint restores (DCP saves a
replicated tensor once). Everything is integer or float64 arithmetic on a fixed order of
operations, so a resumed run continues bitwise.
"""

from __future__ import annotations

import math

import torch
from torch import nn

_PRIME = 2_147_483_647  # 2^31 - 1: (a * (id mod p) + b) stays below 2^62, no int64 overflow


class ItemFrequencyEstimator(nn.Module):
    """A decayed count-min sketch of item ids: ``update(ids)`` once per step, then
    ``probability(ids)`` is each id's share of the (decayed) interactions seen.

    Args:
        num_buckets: counters per hash row. With ids in ``[0, num_buckets)`` and
            ``num_hashes=1`` the counts are exact (row 0 is ``id mod num_buckets``).
        num_hashes: hash rows; the estimate is their minimum (a count-min sketch). Use 2-4 when
            ids exceed the buckets (hashed or raw 64-bit ids).
        half_life_steps: counts halve after this many updates without the item (the decay per
            update is ``0.5 ** (1 / half_life_steps)``); ``None``: no decay (plain counts).
        seed: fixes the hash functions of rows 1+ (the same on every rank).
    """

    counts: torch.Tensor
    last_step: torch.Tensor
    total: torch.Tensor
    step: torch.Tensor
    hash_a: torch.Tensor
    hash_b: torch.Tensor

    def __init__(self, num_buckets: int, num_hashes: int = 1, half_life_steps: float | None = 1000.0,
                 seed: int = 0) -> None:
        super().__init__()
        if not isinstance(num_buckets, int) or num_buckets < 1:
            raise ValueError(f"`num_buckets` must be an int >= 1, but is {num_buckets!r}.")
        if not isinstance(num_hashes, int) or num_hashes < 1:
            raise ValueError(f"`num_hashes` must be an int >= 1, but is {num_hashes!r}.")
        if half_life_steps is not None and not half_life_steps > 0:
            raise ValueError(f"`half_life_steps` must be > 0 or None, but is {half_life_steps!r}.")
        self.num_buckets, self.num_hashes = num_buckets, num_hashes
        self.half_life_steps = half_life_steps
        self.log_decay = 0.0 if half_life_steps is None else math.log(0.5) / half_life_steps
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(1, _PRIME, (num_hashes,), generator=g, dtype=torch.int64)
        b = torch.randint(0, _PRIME, (num_hashes,), generator=g, dtype=torch.int64)
        a[0], b[0] = 1, 0  # row 0: the identity hash (exact for ids below num_buckets)
        # Hash parameters are derived from the seed: not saved, never differ between ranks.
        self.register_buffer("hash_a", a, persistent=False)
        self.register_buffer("hash_b", b, persistent=False)
        self.register_buffer("counts", torch.zeros(num_hashes, num_buckets, dtype=torch.float64))
        self.register_buffer("last_step", torch.zeros(num_hashes, num_buckets, dtype=torch.int64))
        self.register_buffer("total", torch.zeros((), dtype=torch.float64))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def buckets(self, ids: torch.Tensor) -> torch.Tensor:
        """``[num_hashes, n]`` bucket of each id in each row."""
        ids = ids.to(torch.int64).reshape(1, -1)
        if self.num_hashes == 1:
            return torch.remainder(ids, self.num_buckets)
        x = torch.remainder(ids, _PRIME)
        h = torch.remainder(self.hash_a[:, None] * x + self.hash_b[:, None], _PRIME)
        # Row 0 keeps the identity (a=1, b=0 gives id mod p, then mod num_buckets).
        return torch.remainder(h, self.num_buckets)

    def _decay(self, steps: torch.Tensor) -> torch.Tensor:
        return torch.exp(steps.to(torch.float64) * self.log_decay)

    @torch.no_grad()
    def update(self, ids: torch.Tensor) -> None:
        """Count one step's interactions (``ids``, any shape; repeats count each time). Every
        rank must pass the same ids (all ranks' items) to keep the copies identical."""
        ids = ids.reshape(-1)
        t = self.step + 1
        self.total.mul_(math.exp(self.log_decay)).add_(float(ids.numel()))
        self.step.copy_(t)
        if ids.numel() == 0:
            return
        for row, b in enumerate(self.buckets(ids)):
            # One write per distinct bucket (sorted by unique): deterministic, no scatter races.
            uniq, n = torch.unique(b, return_counts=True)
            counts, last = self.counts[row], self.last_step[row]
            counts[uniq] = counts[uniq] * self._decay(t - last[uniq]) + n.to(torch.float64)
            last[uniq] = t

    @torch.no_grad()
    def probability(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's estimated share of the interactions (float64, same shape as ``ids``): the
        minimum decayed count over the hash rows over the decayed total. 0 before any update
        and for ids never seen (hashed into empty buckets)."""
        shape = ids.shape
        b = self.buckets(ids.reshape(-1))
        rows = torch.arange(self.num_hashes, device=b.device)[:, None]
        counts = self.counts[rows, b] * self._decay(self.step - self.last_step[rows, b])
        est = counts.min(dim=0).values
        return (est / self.total.clamp_min(1e-300)).reshape(shape)

    def extra_repr(self) -> str:
        return (f"num_buckets={self.num_buckets}, num_hashes={self.num_hashes}, "
                f"half_life_steps={self.half_life_steps}")


__all__ = ["ItemFrequencyEstimator"]
