"""What ``RetrievalMetricHook``, the full-corpus metrics and the item export need from a
retrieval model (``RetrievalModel``), and how they find it inside a wrapped model."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class RetrievalModel(Protocol):
    """What ``RetrievalMetricHook`` and ``export_item_embeddings`` need from a model: the
    corpus size (item ids ``[0, num_items)``) and the item tower. ``forward(batch)`` returns
    ``(loss, outputs)`` with at least ``outputs["query"]`` and ``outputs["target"]``."""

    num_items: int

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` embeddings of item ids ``[n]`` (a collective under DMP)."""
        ...


def find_retrieval_model(model: nn.Module) -> RetrievalModel:
    """The ``RetrievalModel`` inside ``model`` (a DMP's ``module``, a DDP's ``module``, or
    ``model`` itself); a ``TypeError`` naming what is missing otherwise."""
    seen: nn.Module | None = model
    for _ in range(4):
        if isinstance(seen, RetrievalModel):
            return seen
        seen = getattr(seen, "module", None)
        if not isinstance(seen, nn.Module):
            break
    raise TypeError(
        f"{type(model).__name__} is not a retrieval model: full-corpus evaluation and export need "
        "a model with `num_items` and `item_embeddings(ids) -> [n, D]` (TwoTowerModel, "
        "SASRecModel, or your own), reached directly or through DMP's `.module`.")


__all__ = ["RetrievalModel", "find_retrieval_model"]
