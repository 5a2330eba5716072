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
    total, weight, count = grouped_auc_sums(preds, labels, weights, groups)
    # The one read-back (a crossing to the host), after all the work on the inputs' device.
    total_f, weight_f, n = (float(total), float(weight), int(count))
    return (total_f / weight_f, n) if n else (math.nan, 0)


def grouped_auc_sums(
    preds: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAUC's parts as 0-dim tensors on the inputs' device, with no read-back: ``sum_u W_u *
    AUC_u``, ``sum_u W_u`` and the number of groups, over the groups with both classes
    (``grouped_auc`` divides). ``preds`` must not be empty.

    Buffers are sized by the row count, an upper bound of the blocks and groups, rather than
    by their exact numbers: those are data, and reading them would stop the device (and could
    not be done at all on the meta device the CPU guard uses). Unused entries stay zero and
    add nothing."""
    n = preds.numel()
    dev = preds.device
    order = torch.argsort(preds, stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    g, p, y, w = groups[order], preds[order], labels[order], weights[order]
    new_group = torch.ones_like(g, dtype=torch.bool)
    new_group[1:] = g[1:] != g[:-1]
    new_block = new_group.clone()
    new_block[1:] |= p[1:] != p[:-1]
    block = torch.cumsum(new_block.long(), 0) - 1
    group = torch.cumsum(new_group.long(), 0) - 1
    pos_w = torch.zeros(n, dtype=w.dtype, device=dev).index_add_(0, block, w * y)
    neg_w = torch.zeros(n, dtype=w.dtype, device=dev).index_add_(0, block, w * (1 - y))
    block_group = torch.zeros(n, dtype=torch.long, device=dev).index_copy_(0, block, group)
    # Negative weight in earlier blocks of the same group: exclusive prefix sum minus its value
    # at the group's first block. (Unused blocks sit in group 0, after its real first block.)
    neg_before = torch.cumsum(neg_w, 0) - neg_w
    first_block = torch.zeros(n, dtype=torch.long, device=dev).scatter_reduce_(
        0, block_group, torch.arange(n, device=dev), reduce="amin", include_self=False
    )
    neg_before = neg_before - neg_before[first_block][block_group]
    credit = torch.zeros(n, dtype=w.dtype, device=dev).index_add_(
        0, block_group, pos_w * (neg_before + 0.5 * neg_w)
    )
    g_pos = torch.zeros(n, dtype=w.dtype, device=dev).index_add_(0, block_group, pos_w)
    g_neg = torch.zeros(n, dtype=w.dtype, device=dev).index_add_(0, block_group, neg_w)
    valid = (g_pos > 0) & (g_neg > 0)
    imp = torch.where(valid, g_pos + g_neg, torch.zeros_like(g_pos))
    auc_g = torch.where(valid, credit / (g_pos * g_neg).clamp_min(torch.finfo(w.dtype).tiny),
                        torch.zeros_like(credit))
    return (auc_g * imp).sum(), imp.sum(), valid.sum()


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
        rows, groups = self.gathered_rows(process_group)
        # The crossing to the host: the union of the rows goes over once, and the exact metrics
        # (many small reads) are computed there.
        rows = rows.cpu()
        groups = groups.cpu() if groups is not None else None
        return click_metrics(rows[:, 0], rows[:, 1], rows[:, 2], groups)

    def gathered_rows(self, process_group: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All ranks' rows ``[n, 3]`` (prediction, label, weight) and group ids ``[n]`` (None
        without groups), on this metric's device: ``result()`` up to its copy to the host. A
        collective, as ``result()``."""
        self._pad_empty()
        # Synced here rather than by torchmetrics' compute wrapper (sync_on_compute=False), so
        # the empty-rank padding above happens before the gather.
        with self.sync_context(process_group=process_group, should_sync=True, should_unsync=True):
            rows = _cat(self.rows, (0, 3), torch.float64, self.device)
            groups = _cat(self.groups, (0,), torch.long, self.device) if self.with_groups else None
        return rows, groups


def _cat(state: list[torch.Tensor] | torch.Tensor, empty: tuple[int, ...], dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    if isinstance(state, torch.Tensor):  # after a sync torchmetrics leaves the gathered tensor
        return state
    return torch.cat(state) if state else torch.zeros(empty, dtype=dtype, device=device)
