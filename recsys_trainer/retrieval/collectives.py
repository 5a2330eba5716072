"""The tensor collectives of retrieval training and evaluation (on the model's process group).

Ranks hold different numbers of rows (a window's last batch is short; evaluation pads with
zero-weight batches), so every gather here first exchanges the sizes and pads to the largest.
Each function is a collective: every rank of the group calls it at the same point. With no
process group (or a world of one) they return the local tensor.

These are ``torch.fx`` leaves: the sizes are data, and TorchRec's pipeline traces the models'
forward (the functions are called as ``collectives.<name>`` so that the wrapping applies).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (the default group), ``(0, 1)`` without one."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_sizes(n: int, device: torch.device, group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank's ``n`` (one small all-gather)."""
    _, size = world(group)
    if size == 1:
        return [n]
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return [int(x.item()) for x in out]


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                    sizes: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Every rank's rows of ``x`` (``[n_r, ...]``, ``n_r`` may differ), concatenated in rank
    order, and the sizes. No gradient flows through the result."""
    _, size = world(group)
    if size == 1:
        return x, [x.shape[0]]
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], x.device, group)
    longest = max(sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x.detach()
    out = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[:n] for o, n in zip(out, sizes, strict=True)]), sizes


class _GatherRows(torch.autograd.Function):
    """All-gather of equal-shaped ``[m, ...]`` tensors whose backward hands each rank the sum of
    every rank's gradient for its own rows (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        rank, size = world(group)
        ctx.group, ctx.rank, ctx.rows = group, rank, x.shape[0]
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def all_gather_with_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                         ) -> tuple[torch.Tensor, int]:
    """Every rank's rows of ``x`` concatenated in rank order, and the offset of this rank's
    rows. Differentiable like one process holding all rows: in backward each rank's ``x``
    receives the gradient of *every* rank's loss with respect to its rows (one all-reduce in
    backward, so every rank must run backward, as data-parallel training does anyway). With the
    data-parallel mean over ranks this is the gradient of one global batch."""
    rank, size = world(group)
    if size == 1:
        return x, 0
    sizes = all_gather_sizes(x.shape[0], x.device, group)
    longest = max(sizes)
    padded = torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))])
    full = _GatherRows.apply(padded, group)
    out = torch.cat([full[r * longest:r * longest + n] for r, n in enumerate(sizes)])
    return out, sum(sizes[:rank])


torch.fx.wrap("all_gather_sizes")
torch.fx.wrap("all_gather_rows")
torch.fx.wrap("all_gather_with_grad")


__all__ = ["all_gather_rows", "all_gather_sizes", "all_gather_with_grad", "world"]
