"""Mixed precision: autocast, the backward pass, and fp16 loss scaling, over ``accelerate``.

Everything the Trainer does with ``accelerate`` goes through ``Precision``, and every use of an
accelerate internal is here, each with the reason the public API does not serve.

fp16 has one twist in a sparse/dense trainer: the fused sparse optimizer updates the tables
*inside* backward, before ``GradScaler.unscale_`` could run, so the gradient is unscaled on its
way into the tables instead (``install_sparse_grad_unscaling``); the dense gradients are
unscaled by the scaler as usual, before clipping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from recsys_trainer.args import MixedPrecision


class Precision:
    """Autocast, backward and loss scaling for one Trainer.

    Args:
        mixed_precision: "no", "bf16" (CPU and CUDA) or "fp16" (CUDA only: loss scaling).
        cuda: whether the model runs on CUDA.
        gradient_accumulation_steps: ``backward`` divides each micro-batch's loss by it, so the
            accumulated dense gradients are the mean over the micro-batches.
    """

    def __init__(self, mixed_precision: MixedPrecision, *, cuda: bool,
                 gradient_accumulation_steps: int = 1) -> None:
        if mixed_precision == "fp16" and not cuda:
            raise ValueError(
                "`mixed_precision` is 'fp16', which needs CUDA (CPU autocast has no fp16 loss "
                "scaling); on CPU use 'bf16' or 'no'."
            )
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        # accelerate keeps process-wide singletons, and its public API has no way to build a
        # second Accelerator with other settings in one process. A second Trainer in the same
        # process (tests, notebooks) must still get its own, so start them afresh:
        # - AcceleratorState._reset_state: a new Accelerator with another mixed_precision raises
        #   "AcceleratorState has already been initialized and cannot be changed" otherwise.
        #   reset_partial_state=False keeps the process group (PartialState) we run on.
        # - GradientState._reset_state: it would keep the previous Accelerator's sync_gradients
        #   flag and dataloader references; the constructor only updates its plugin settings.
        # (_shared_state is how accelerate itself tells whether the singleton exists.)
        if AcceleratorState._shared_state:
            AcceleratorState._reset_state(reset_partial_state=False)
            GradientState._reset_state()
        self.accelerator = Accelerator(
            cpu=not cuda,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler (None unless ``mixed_precision="fp16"``)."""
        scaler: torch.amp.GradScaler | None = self.accelerator.scaler
        return scaler

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The forward pass's autocast context (a no-op without mixed precision)."""
        return self.accelerator.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss / gradient_accumulation_steps``, scaled under fp16, then backward (the fused
        sparse update runs inside it)."""
        self.accelerator.backward(loss)

    def set_sync_gradients(self, sync: bool) -> None:
        """Tell accelerate whether this micro-batch ends an accumulation (its bookkeeping,
        readable as ``accelerator.sync_gradients``; DDP's ``no_sync`` is the Trainer's)."""
        self.accelerator.sync_gradients = sync

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients in place (fp16; a no-op otherwise), e.g. before
        clipping them. The optimizer is named explicitly: accelerate would otherwise unscale the
        optimizers passed to ``prepare``, and nothing is (``prepare`` breaks the DMP model)."""
        self.accelerator.unscale_gradients(optimizer=optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under fp16 through the scaler, which skips a step whose
        gradients overflowed and then updates the scale."""
        scaler = self.scaler
        if scaler is None:
            optimizer.step()
            return
        scaler.step(optimizer)
        scaler.update()

    def prepare_model(self, dmp: nn.Module) -> None:
        """Under fp16, unscale the gradients entering the sharded tables (see the module
        docstring); nothing otherwise."""
        scaler = self.scaler
        if scaler is not None:
            install_sparse_grad_unscaling(dmp, lambda: scaler.get_scale())


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``1/scale`` and zeroes non-finite entries.

    Placed on the pooled-embedding output when fp16 loss scaling is on: the fused sparse
    optimizer updates inside backward, before any ``GradScaler.unscale_`` could run, so the
    gradient must be unscaled on its way into the tables (and an overflowing step must not
    write inf/nan into them).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale_fn: Callable[[], torch.Tensor | float]) -> torch.Tensor:
        ctx.scale_fn = scale_fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        scale = ctx.scale_fn()
        g = grad.float() / scale
        g = torch.where(torch.isfinite(g), g, torch.zeros_like(g))
        return g.to(grad.dtype), None


def unscale_sparse_grad(x: torch.Tensor, scale_fn: Callable[[], torch.Tensor | float]) -> torch.Tensor:
    """Apply ``_ScaleGrad`` (see its docstring)."""
    out: torch.Tensor = _ScaleGrad.apply(x, scale_fn)  # type: ignore[no-untyped-call]
    return out


def install_sparse_grad_unscaling(dmp: nn.Module, scale_fn: Callable[[], torch.Tensor | float]) -> int:
    """Unscale the gradients entering every sharded embedding module (fp16 loss scaling).

    Sharded modules return awaitables; we append a callback that wraps the pooled values.
    Returns how many modules were hooked.
    """
    from torchrec.distributed.types import Awaitable, ShardedModule
    from torchrec.sparse.jagged_tensor import KeyedTensor

    def wrap(result: Any) -> Any:
        if isinstance(result, KeyedTensor):
            return KeyedTensor(
                keys=result.keys(),
                length_per_key=result.length_per_key(),
                values=unscale_sparse_grad(result.values(), scale_fn),
                key_dim=result.key_dim(),
            )
        if isinstance(result, dict):
            return {k: wrap(v) for k, v in result.items()}
        if isinstance(result, torch.Tensor):
            return unscale_sparse_grad(result, scale_fn)
        raise TypeError(f"cannot unscale the gradient of an embedding output of type {type(result)}")

    def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        if isinstance(output, Awaitable):
            output.callbacks.append(wrap)
            return output
        return wrap(output)

    n = 0
    for module in dmp.modules():
        if isinstance(module, ShardedModule):
            module.register_forward_hook(hook)
            n += 1
    return n
