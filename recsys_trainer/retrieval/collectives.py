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


class _Pending:
    """The state one asynchronous gather shares between its two autograd nodes."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, rows: int) -> None:
        self.group, self.rank, self.size, self.rows = group, rank, size, rows
        self.parts: list[torch.Tensor] = []
        self.work: Any = None
        self.grad: torch.Tensor | None = None
        self.grad_work: Any = None


class _StartGather(torch.autograd.Function):
    """Launches the all-gather of equal-shaped ``[m, ...]`` rows (forward) and, in backward,
    waits for the all-reduce ``_FinishGather`` launched and returns this rank's rows of it:
    every rank's gradient for its own rows (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, state: _Pending) -> torch.Tensor:
        ctx.state = state
        x = x.contiguous()
        state.parts = [torch.empty_like(x) for _ in range(state.size)]
        state.work = dist.all_gather(state.parts, x, group=state.group, async_op=True)
        return x.new_empty(0)  # a token: it ties _FinishGather to this node in the graph

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        state = ctx.state
        state.grad_work.wait()
        assert state.grad is not None
        return state.grad[state.rank * state.rows:(state.rank + 1) * state.rows], None


class _FinishGather(torch.autograd.Function):
    """Waits for the all-gather and concatenates it (forward); launches the all-reduce of the
    gathered rows' gradient (backward) and returns at once, so that the autograd nodes between
    the two (whatever the model computed while the gather was in flight, e.g. the user tower)
    run their backward while it is in flight."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, state: _Pending) -> torch.Tensor:
        ctx.state = state
        state.work.wait()
        out = torch.cat(state.parts)
        state.parts = []
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        state = ctx.state
        state.grad = grad.contiguous().clone()
        state.grad_work = dist.all_reduce(state.grad, group=state.group, async_op=True)
        return grad.new_empty(0), None


class PendingRows:
    """An all-gather of every rank's rows launched by ``start_gather_with_grad``: ``wait()``
    returns the rows of all ranks in rank order (differentiable), the ``extra`` int64 columns
    gathered with them, and the offset of this rank's rows."""

    def __init__(self, x: torch.Tensor, extra: torch.Tensor | None, sizes: list[int], offset: int,
                 token: torch.Tensor | None, state: _Pending | None) -> None:
        self._x, self._extra, self._sizes, self._offset = x, extra, sizes, offset
        self._token, self._state = token, state
        self._result: tuple[torch.Tensor, torch.Tensor | None, int] | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        if self._state is None:  # a world of one
            return self._x, self._extra, self._offset
        if self._result is not None:
            return self._result
        full = _FinishGather.apply(self._token, self._state)
        longest, width = max(self._sizes), self._x.shape[1]
        out = torch.cat([full[r * longest:r * longest + n] for r, n in enumerate(self._sizes)])
        extra = None
        if self._extra is not None:
            extra = out[:, width:].detach().contiguous().view(torch.int64)
            out = out[:, :width]
        self._result = out, extra, self._offset
        return self._result


def start_gather_with_grad(x: torch.Tensor, extra: torch.Tensor | None = None,
                           group: dist.ProcessGroup | None = None) -> PendingRows:
    """Launch the all-gather of every rank's rows of ``x [n_r, D]`` (``n_r`` may differ; one
    small blocking all-gather of the sizes first), with ``extra``: ``[n_r, k]`` int64 columns
    (ids, flags) carried in the same message, bit for bit, so that one collective moves both.

    ``wait()`` on the result gives ``(rows [sum n_r, D], extra [sum n_r, k] or None, offset of
    this rank's rows)``. Differentiable like one process holding all rows: in backward each
    rank's ``x`` receives the gradient of *every* rank's loss for its rows (one all-reduce, so
    every rank must run backward, as data-parallel training does anyway). The all-gather runs
    while the caller computes something else (gloo runs collectives on its own threads), and
    so does the backward all-reduce, while the backward of what was computed in between runs.
    """
    rank, size = world(group)
    if size == 1:
        return PendingRows(x, extra, [x.shape[0]], 0, None, None)
    sizes = all_gather_sizes(x.shape[0], x.device, group)
    longest = max(sizes)
    rows = x
    if extra is not None:
        # The int64 columns reinterpreted as x's dtype (a view, bit for bit; the gather copies
        # bytes, no arithmetic touches them): one message instead of two. Their gradient is 0.
        # [n_r, k] from extra's own shape, not reshape(n_r, -1): a rank with no rows has
        # nothing to infer a -1 from (and would fail alone, leaving the others in the gather).
        meta = extra.to(torch.int64)
        meta = (meta.unsqueeze(1) if meta.dim() == 1 else meta.flatten(1)).contiguous().view(x.dtype)
        rows = torch.cat([x, meta], dim=1)
    padded = torch.cat([rows, rows.new_zeros((longest - rows.shape[0], *rows.shape[1:]))])
    state = _Pending(group, rank, size, longest)
    token = _StartGather.apply(padded, state)
    return PendingRows(x, extra, sizes, sum(sizes[:rank]), token, state)


torch.fx.wrap("all_gather_sizes")
torch.fx.wrap("all_gather_rows")
torch.fx.wrap("start_gather_with_grad")


__all__ = ["PendingRows", "all_gather_rows", "all_gather_sizes", "start_gather_with_grad", "world"]
