"""Streaming click metrics, exact across ranks (the math; ``hooks.metrics`` reports them).

``ClickMetrics`` keeps every real row (prediction, label, weight, optional group id) since its
last reset in a ``torchmetrics.Metric``; ``result()`` gathers all ranks' rows with torchmetrics'
distributed sync (uneven row counts are fine) and computes on the union. So a 2-rank value is the
value over all rows, not an average of per-rank values, and AUC is exact (no histogram bins).

The math comes from maintained libraries where they have it:

- ``auc``: torchmetrics' ROC curve (``_binary_clf_curve``, the scikit-learn algorithm: one point
  per distinct score, so tied scores count one half) and trapezoidal area, with sample weights.
- ``ne`` (normalized entropy), ``logloss``, ``calibration``, ``ctr``: torchrec.metrics' state
  functions (``get_ne_states``/``compute_ne``, ``get_calibration_states``, ``get_ctr_states``).
  torchrec measures cross-entropy in bits; ``logloss`` here is in nats (the usual BCE).
- ``gauc``: **impression-weighted mean of per-user AUC over users that have both a positive and
  a negative row**: ``sum_u W_u * AUC_u / sum_u W_u``, where ``W_u`` is the user's total row
  weight (impressions) and ``AUC_u`` is the weighted, tie-aware AUC of the user's rows. Users
  with one class only are left out (their AUC is undefined). torchrec's ``GAUCMetric`` is a
  different quantity (an unweighted mean over fixed-size candidate sessions), so it is computed
  here, vectorised, and tested against torchmetrics' AUC per user.

Rows with weight 0 (evaluation padding on exhausted ranks) are dropped on update. Memory: 24
bytes per real row (32 with group ids) on each rank until the next reset, and on ``result()``
every rank briefly holds all ranks' rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torchmetrics
from torchmetrics.functional.classification.precision_recall_curve import _binary_clf_curve
from torchrec.metrics.calibration import get_calibration_states
from torchrec.metrics.ctr import get_ctr_states
from torchrec.metrics.ne import compute_logloss, compute_ne, get_ne_states

METRIC_NAMES: tuple[str, ...] = ("auc", "gauc", "logloss", "ne", "calibration", "ctr")
"""Every metric ``ClickMetrics`` can compute (``gauc`` needs group ids)."""

_ETA = 1e-12  # torchrec NEMetric's clamp for probabilities and the mean label
_LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- pure functions


def weighted_auc(preds: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> float:
    """Exact weighted ROC AUC (ties count one half); NaN when a class is missing.

    Uses torchmetrics' ROC-curve helper (which ``BinaryAUROC(thresholds=None)`` uses, but with
    sample weights, which that class does not take).
    """
    pos = float((weights * labels).sum())
    neg = float((weights * (1 - labels)).sum())
    if pos <= 0 or neg <= 0:
        return math.nan
    fps, tps, _ = _binary_clf_curve(preds, labels.long(), sample_weights=weights)
    zero = torch.zeros(1, dtype=fps.dtype, device=fps.device)
    fpr = torch.cat([zero, fps]) / fps[-1]
    tpr = torch.cat([zero, tps]) / tps[-1]
    return float(torch.trapz(tpr, fpr))


def grouped_auc(
    preds: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor
) -> tuple[float, int]:
    """GAUC (see the module docstring) and the number of groups it averages; NaN and 0 when no
    group has both classes.

    Vectorised: rows are sorted by (group, score); rows with equal group and score form a tie
    block; a positive's credit is the negative weight below its block in its group plus half
    the negative weight in its block (the Mann-Whitney statistic with mid-ranks).
    """
    if preds.numel() == 0:
        return math.nan, 0
    order = torch.argsort(preds, stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    g, p, y, w = groups[order], preds[order], labels[order], weights[order]
    new_group = torch.ones_like(g, dtype=torch.bool)
    new_group[1:] = g[1:] != g[:-1]
    new_block = new_group.clone()
    new_block[1:] |= p[1:] != p[:-1]
    block = torch.cumsum(new_block.long(), 0) - 1
    group = torch.cumsum(new_group.long(), 0) - 1
    num_blocks, num_groups = int(block[-1]) + 1, int(group[-1]) + 1
    pos_w = torch.zeros(num_blocks, dtype=w.dtype).index_add_(0, block, w * y)
    neg_w = torch.zeros(num_blocks, dtype=w.dtype).index_add_(0, block, w * (1 - y))
    block_group = torch.zeros(num_blocks, dtype=torch.long).index_copy_(0, block, group)
    # Negative weight in earlier blocks of the same group: exclusive prefix sum minus its value
    # at the group's first block.
    neg_before = torch.cumsum(neg_w, 0) - neg_w
    first_block = torch.full((num_groups,), num_blocks, dtype=torch.long).scatter_reduce_(
        0, block_group, torch.arange(num_blocks), reduce="amin"
    )
    neg_before = neg_before - neg_before[first_block][block_group]
    credit = torch.zeros(num_groups, dtype=w.dtype).index_add_(
        0, block_group, pos_w * (neg_before + 0.5 * neg_w)
    )
    g_pos = torch.zeros(num_groups, dtype=w.dtype).index_add_(0, block_group, pos_w)
    g_neg = torch.zeros(num_groups, dtype=w.dtype).index_add_(0, block_group, neg_w)
    valid = (g_pos > 0) & (g_neg > 0)
    if not bool(valid.any()):
        return math.nan, 0
    auc_g = credit[valid] / (g_pos[valid] * g_neg[valid])
    imp = (g_pos + g_neg)[valid]
    return float((auc_g * imp).sum() / imp.sum()), int(valid.sum())


def click_metrics(
    preds: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    groups: torch.Tensor | None = None,
) -> dict[str, float]:
    """All metrics over the given rows (1-D tensors; ``preds`` are probabilities in [0, 1],
    labels 0/1). Undefined values (no rows, one class only) are NaN."""
    preds, labels, weights = preds.double(), labels.double(), weights.double()
    out: dict[str, float] = {"num_samples": float(preds.numel()), "weight_sum": float(weights.sum())}
    if preds.numel() and bool(((labels != 0) & (labels != 1)).any()):
        raise ValueError(
            "ClickMetrics needs binary 0/1 labels (AUC and GAUC are defined for two classes); "
            "pass labels_fn to map yours."
        )
    if out["weight_sum"] <= 0:
        out.update({name: math.nan for name in METRIC_NAMES if name != "gauc" or groups is not None})
        return out
    # torchrec's state functions reduce over the last dim of [n_tasks, n_rows] tensors.
    l2, p2, w2 = labels[None], preds[None], weights[None]
    ne_states = get_ne_states(l2, p2, w2, _ETA)
    ce_bits = ne_states["cross_entropy_sum"]
    out["ne"] = float(compute_ne(ce_bits, ne_states["weighted_num_samples"], ne_states["pos_labels"],
                                 ne_states["neg_labels"], _ETA)[0])
    out["logloss"] = float(compute_logloss(ce_bits, ne_states["pos_labels"],
                                           ne_states["neg_labels"], _ETA)[0]) * _LN2
    cal = get_calibration_states(l2, p2, w2)
    # torchrec reports 0 without positives; undefined is clearer as NaN.
    denom = float(cal["calibration_denom"][0])
    out["calibration"] = float(cal["calibration_num"][0]) / denom if denom > 0 else math.nan
    ctr = get_ctr_states(l2, p2, w2)
    out["ctr"] = float(ctr["ctr_num"][0] / ctr["ctr_denom"][0])
    out["auc"] = weighted_auc(preds, labels, weights)
    if groups is not None:
        out["gauc"], n_users = grouped_auc(preds, labels, weights, groups)
        out["gauc_num_groups"] = float(n_users)
    return out


# ----------------------------------------------------------------------------- the metric


class ClickMetrics(torchmetrics.Metric):
    """Row store for the click metrics, synchronised across ranks by torchmetrics on ``result``.

    ``result()`` is a collective: every rank must call it at the same point (the hook calls it
    at steps and window ends that are identical on all ranks). It gathers on the process group
    passed to ``result``, else the one given here; with neither it is torch's default group.
    """

    full_state_update = False
    rows: list[torch.Tensor]
    groups: list[torch.Tensor]

    def __init__(self, with_groups: bool = False, process_group: Any = None) -> None:
        super().__init__(process_group=process_group, sync_on_compute=False)
        self.with_groups = with_groups
        # One [n, 3] float64 state (prediction, label, weight): one gather instead of three.
        self.add_state("rows", default=[], dist_reduce_fx="cat")
        self.add_state("groups", default=[], dist_reduce_fx="cat")

    def update(  # type: ignore[override]
        self,
        preds: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
    ) -> None:
        preds = preds.detach().reshape(-1)
        labels = labels.detach().reshape(-1)
        if preds.shape != labels.shape:
            raise ValueError(
                f"predictions and labels must have one value per row, got {tuple(preds.shape)} "
                f"and {tuple(labels.shape)}."
            )
        w = torch.ones_like(preds) if weights is None else weights.detach().reshape(-1)
        keep = w > 0
        self.rows.append(torch.stack([preds.double(), labels.double(), w.double()], 1)[keep])
        if self.with_groups:
            if groups is None:
                raise ValueError("this ClickMetrics computes GAUC: pass `groups` (one id per row).")
            self.groups.append(groups.detach().reshape(-1).long()[keep])

    def _pad_empty(self) -> None:
        # torchmetrics gathers each list state only if it is non-empty: a rank with no rows would
        # skip a collective its peers enter (a hang). An empty tensor keeps everyone in step.
        dev = self.device
        if not self.rows:
            self.rows.append(torch.zeros(0, 3, dtype=torch.float64, device=dev))
        if self.with_groups and not self.groups:
            self.groups.append(torch.zeros(0, dtype=torch.long, device=dev))

    def compute(self) -> dict[str, float]:  # type: ignore[override]
        """Same as ``result()`` (torchmetrics' entry point; it warns when this rank saw no
        update, which ``result()`` does not)."""
        return self.result()

    def result(self, process_group: Any = None) -> dict[str, float]:
        """``click_metrics`` over all ranks' rows since the last reset. A collective over
        ``process_group`` (default: the constructor's): call it on every rank of that group at
        the same point."""
        self._pad_empty()
        # Synced here rather than by torchmetrics' compute wrapper (sync_on_compute=False), so
        # the empty-rank padding above happens before the gather.
        with self.sync_context(process_group=process_group, should_sync=True, should_unsync=True):
            rows = _cat(self.rows, (0, 3), torch.float64).cpu()
            groups = _cat(self.groups, (0,), torch.long).cpu() if self.with_groups else None
        return click_metrics(rows[:, 0], rows[:, 1], rows[:, 2], groups)


def _cat(state: list[torch.Tensor] | torch.Tensor, empty: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if isinstance(state, torch.Tensor):  # after a sync torchmetrics leaves the gathered tensor
        return state
    return torch.cat(state) if state else torch.zeros(empty, dtype=dtype)
