"""The tensor collectives of retrieval training and evaluation (on the model's process group).

Ranks hold different numbers of rows (a window's last batch is short; evaluation pads with
zero-weight batches), so every gather here first exchanges the sizes and pads to the largest.
Each function is a collective: every rank of the group calls it at the same point. With no
process group (or a world of one) they return the local tensor.

These are ``torch.fx`` leaves: the sizes are data, and TorchRec's pipeline traces the models'
forward (the functions are called as ``collectives.<name>`` so that the wrapping applies).
"""

from __future__ import annotations

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


def all_gather_with_local_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                               ) -> tuple[torch.Tensor, int]:
    """Every rank's rows of ``x`` concatenated in rank order, where this rank's slice *is*
    ``x`` (gradients flow into it) and the other ranks' slices are constants; also the offset
    of this rank's slice. Each rank's loss thus trains only its own rows (as in CLIP-style
    training with ``local_loss``): no collective runs in backward."""
    rank, size = world(group)
    if size == 1:
        return x, 0
    gathered, sizes = all_gather_rows(x, group)
    start = sum(sizes[:rank])
    out = torch.cat([gathered[:start], x, gathered[start + x.shape[0]:]])
    return out, start


torch.fx.wrap("all_gather_sizes")
torch.fx.wrap("all_gather_rows")
torch.fx.wrap("all_gather_with_local_grad")


__all__ = ["all_gather_rows", "all_gather_sizes", "all_gather_with_local_grad", "world"]
