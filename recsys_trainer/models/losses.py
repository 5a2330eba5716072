"""The ranking models' losses: functional (no loss module, so a model stays fx-traceable for
TorchRec's pipelines), honouring ``batch.weights`` (zero-weight padding batches in evaluation
contribute nothing), with the label check every bundled ranking model declares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BINARY_LABELS: tuple[float, float] = (0.0, 1.0)
"""What a logistic loss accepts (click-style labels: 0/1, or a rate): ``check_binary_labels``
enforces it, and ``BinaryClassifier``, every bundled ranking model's base, declares it as the
model's ``label_range``."""


class BinaryClassifier(nn.Module):
    """What the bundled classifiers share: a logistic loss (``weighted_bce_with_logits``, one
    logit per row or per task), so labels in ``[0, 1]``, which they declare for the data."""

    label_range: tuple[float, float] | None = BINARY_LABELS
    """The labels its loss accepts. The Trainer gives it to a dataset whose ``FeatureSpec`` sets
    no ``label_range``, so that a label outside it is a ``DataError`` naming the column, file and
    row on every rank (``data.spec.apply_model_to_specs``)."""


def check_binary_labels(labels: torch.Tensor) -> None:
    """Refuse labels outside ``[0, 1]`` (or NaN): a logistic loss trains on them without
    complaint (a label of 2 pushes the logit to +inf), silently. On CPU the error names the
    value; on any other device an asynchronous device assert avoids a host sync per step."""
    ok = ((labels >= 0) & (labels <= 1)).all()
    if labels.device.type != "cpu":
        torch._assert_async(ok, "a label is outside [0, 1] (logistic loss); check the label column")
    elif not bool(ok):
        bad = labels[~((labels >= 0) & (labels <= 1))]
        raise ValueError(
            f"label {float(bad[0]):g} is outside [0, 1] ({bad.numel()} such label(s) in this "
            "batch), but this model's loss (binary cross-entropy) needs click-style labels in "
            "[0, 1]. Check the label column; to have the reader name the column, file and row, "
            "set FeatureSpec(label_range=(0, 1)), or give the model label_range = (0.0, 1.0) "
            "as the bundled models have (the Trainer then checks the data's labels against it)."
        )


# A leaf for torch.fx (TorchRec pipelines trace the model): the check's data-dependent branch
# cannot be traced, and must not be.
torch.fx.wrap("check_binary_labels")


def weighted_bce_with_logits(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """Mean binary cross-entropy, weighted; an all-zero-weight batch gives 0, not NaN. Labels
    must be in ``[0, 1]`` (``check_binary_labels``)."""
    check_binary_labels(labels)
    per_row = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    if weights is None:
        return per_row.mean()
    w = weights.to(per_row.dtype)
    total = w.sum()
    return torch.where(total > 0, (per_row * w).sum() / total.clamp_min(1e-12), total)


def check_task_shapes(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None,
                      task_weights: torch.Tensor | list[float] | None) -> None:
    """Shapes of a multi-task loss's inputs: logits and labels ``[B, T]``, weights ``[B]``,
    ``T`` task weights. A mismatch would broadcast silently into a wrong loss."""
    if logits.dim() != 2 or tuple(labels.shape) != tuple(logits.shape):
        raise ValueError(
            f"a multi-task loss needs logits and labels of one shape [B, T], but they are "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}; give the FeatureSpec one label "
            "column per task (labels=[...]) and the model one logit per task."
        )
    if weights is not None and tuple(weights.shape) != (logits.shape[0],):
        raise ValueError(f"example weights must be [B] = [{logits.shape[0]}], but are "
                         f"{tuple(weights.shape)}.")
    if task_weights is not None and len(task_weights) != logits.shape[1]:
        raise ValueError(f"{len(task_weights)} task weights for {logits.shape[1]} tasks; give one "
                         "per task, in the order of the FeatureSpec's labels.")


torch.fx.wrap("check_task_shapes")


def multi_task_bce_with_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    task_weights: torch.Tensor | list[float] | None = None,
) -> torch.Tensor:
    """Multi-task binary cross-entropy: ``sum_t task_weights[t] * loss_t`` where ``loss_t`` is
    ``weighted_bce_with_logits(logits[:, t], labels[:, t], weights)`` (the example-weighted mean
    over rows; 0 when every weight is 0, e.g. an evaluation padding batch).

    Args:
        logits: ``[B, T]``, one logit per task (the order of ``FeatureSpec.labels``).
        labels: ``[B, T]`` in ``[0, 1]`` (``batch.labels`` with ``labels=["click", "like"]``).
        weights: ``[B]`` example weights, or None.
        task_weights: ``[T]`` weights of the tasks' losses (default 1 each: their sum).
    """
    check_task_shapes(logits, labels, weights, task_weights)
    check_binary_labels(labels)
    per = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    if weights is None:
        per_task = per.mean(0)
    else:
        w = weights.to(per.dtype)
        total = w.sum()
        per_task = torch.where(total > 0, (per * w[:, None]).sum(0) / total.clamp_min(1e-12),
                               torch.zeros_like(per[0]))
    if task_weights is None:
        return per_task.sum()
    tw = torch.as_tensor(task_weights, dtype=per_task.dtype, device=per_task.device)
    return (per_task * tw).sum()


__all__ = ["BINARY_LABELS", "BinaryClassifier", "check_binary_labels", "check_task_shapes", "multi_task_bce_with_logits",
           "weighted_bce_with_logits"]
