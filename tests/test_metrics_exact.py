"""Click metrics are exact: against rank-based references, and 2 ranks == 1 process."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hooks_fixtures import (
    ListWindows,
    make_trainer,
    open_bandit_batches,
    rank_auc,
    synthetic,
    user_ids,
)
from torchmetrics.classification import BinaryAUROC

from recsys_trainer import LambdaHook, MetricReportHook
from recsys_trainer.metrics import ClickMetrics, click_metrics, grouped_auc, weighted_auc


def _weighted_pair_auc(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """Weighted AUC from its definition: weighted fraction of (pos, neg) pairs ordered right."""
    pos, neg = y == 1, y == 0
    diff = p[pos][:, None] - p[neg][None, :]
    score = (diff > 0) + 0.5 * (diff == 0)
    ww = w[pos][:, None] * w[neg][None, :]
    return float((score * ww).sum() / ww.sum())


def _rows(n: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    p = np.round(rng.random(n), 2)  # coarse: many ties
    y = (rng.random(n) < 0.3).astype(np.float64)
    w = rng.random(n) + 0.1
    g = rng.integers(0, 25, n)
    return p, y, w, g


def test_weighted_auc_equals_the_pairwise_definition_with_ties_and_weights() -> None:
    p, y, w, _ = _rows(600, 0)
    got = weighted_auc(torch.tensor(p), torch.tensor(y), torch.tensor(w))
    assert got == pytest.approx(_weighted_pair_auc(p, y, w), abs=1e-12)
    unweighted = weighted_auc(torch.tensor(p), torch.tensor(y), torch.ones(len(p), dtype=torch.float64))
    assert unweighted == pytest.approx(rank_auc(p, y), abs=1e-12)


def test_auc_is_nan_when_one_class_is_missing() -> None:
    p = torch.rand(10, dtype=torch.float64)
    assert math.isnan(weighted_auc(p, torch.zeros(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)))


def test_gauc_is_the_impression_weighted_mean_of_per_user_auc_over_users_with_both_classes() -> None:
    p, y, _, g = _rows(800, 1)
    # Users 98 and 99 have one class only: they must not count.
    p = np.concatenate([p, [0.1, 0.9, 0.5], [0.3, 0.4]])
    y = np.concatenate([y, [0.0, 0.0, 0.0], [1.0, 1.0]])
    g = np.concatenate([g, [98, 98, 98], [99, 99]])
    w = np.ones_like(p)
    got, n_users = grouped_auc(torch.tensor(p), torch.tensor(y), torch.tensor(w), torch.tensor(g))
    num = num32 = den = 0.0
    users = 0
    for u in np.unique(g):
        m = g == u
        if 0 < y[m].sum() < m.sum():  # both classes
            num += m.sum() * rank_auc(p[m], y[m])
            num32 += m.sum() * float(BinaryAUROC()(torch.tensor(p[m]), torch.tensor(y[m]).long()))
            den += m.sum()
            users += 1
    assert n_users == users == len(np.unique(g)) - 2
    assert got == pytest.approx(num / den, abs=1e-12)
    assert got == pytest.approx(num32 / den, abs=1e-6)  # torchmetrics computes in float32


def test_ne_logloss_calibration_and_ctr_match_their_definitions() -> None:
    p, y, w, _ = _rows(500, 2)
    p = np.clip(p, 0.01, 0.99)
    got = click_metrics(torch.tensor(p), torch.tensor(y), torch.tensor(w))
    logloss = -(w * (y * np.log(p) + (1 - y) * np.log(1 - p))).sum() / w.sum()
    ctr = (w * y).sum() / w.sum()
    baseline = -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr))
    assert got["logloss"] == pytest.approx(logloss, rel=1e-9)
    assert got["ne"] == pytest.approx(logloss / baseline, rel=1e-9)
    assert got["ctr"] == pytest.approx(ctr, rel=1e-9)
    assert got["calibration"] == pytest.approx((w * p).sum() / (w * y).sum(), rel=1e-9)


def test_zero_weight_rows_are_ignored_by_every_metric() -> None:
    p, y, _, g = _rows(300, 3)
    m = ClickMetrics(with_groups=True)
    m.update(torch.tensor(p), torch.tensor(y), torch.ones(300), torch.tensor(g))
    # A padding batch: other values, weight 0.
    m.update(torch.rand(300), torch.ones(300), torch.zeros(300), torch.tensor(g))
    ref = click_metrics(torch.tensor(p), torch.tensor(y), torch.ones(300, dtype=torch.float64), torch.tensor(g))
    assert m.result() == pytest.approx(ref, abs=1e-12)


def test_non_binary_labels_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="binary 0/1 labels"):
        click_metrics(torch.rand(4), torch.tensor([0.0, 0.5, 1.0, 0.0]), torch.ones(4))


# ---------------------------------------------------------------------------- 2 ranks vs 1


def _sigmoid(x: torch.Tensor) -> np.ndarray:
    return torch.sigmoid(x.detach().float()).reshape(-1).numpy().astype(np.float64)


def _two_rank_run(tmp: str) -> dict[str, Any]:
    """Train on 2 synthetic windows, evaluating Open Bandit / synthetic windows after each, then
    evaluate both; record every row the metric hook saw, and what it reported."""
    train = ListWindows({"s0": synthetic(7, 64, seed=1), "s1": synthetic(5, 64, seed=2)})
    eval_ = ListWindows({"obd": open_bandit_batches(333), "synthetic": synthetic(9, 50, seed=3)})
    rows: list[dict[str, Any]] = []
    evals = [0]  # how many evaluations have started

    def record(mode: str):  # type: ignore[no-untyped-def]
        def fn(trainer, out) -> None:  # type: ignore[no-untyped-def]
            if out.is_padding:
                return
            for mb in out.micro_batches:
                rows.append({"mode": mode, "step": trainer.state.global_step, "eval": evals[0],
                             "window": trainer.state.window_id, "p": _sigmoid(mb.outputs),
                             "y": mb.batch.labels.numpy().astype(np.float64),
                             "g": user_ids(mb.batch).numpy()})
        return fn

    hook = MetricReportHook(every=3, group_fn=user_ids)
    def count(trainer) -> None:  # type: ignore[no-untyped-def]
        evals[0] += 1

    recorder = LambdaHook(after_step=record("train"), after_eval_step=record("eval"),
                          before_evaluate=count)
    trainer = make_trainer(train, eval_, [hook, recorder], output_dir=tmp)
    trainer.train_and_evaluate()
    final = trainer.evaluate()
    reports = [{"mode": r.mode, "scope": r.scope, "step": r.step, "window": r.window_id,
                "values": r.values} for r in hook.reports]
    return {"rows": rows, "reports": reports, "final": final, "steps": trainer.state.global_step}


def _reference(rows: list[dict[str, Any]]) -> tuple[dict[str, float], float]:
    p = np.concatenate([r["p"] for r in rows])
    y = np.concatenate([r["y"] for r in rows])
    g = np.concatenate([r["g"] for r in rows])
    t = torch.tensor
    return click_metrics(t(p), t(y), torch.ones(len(p), dtype=torch.float64), t(g)), rank_auc(p, y)


@pytest.mark.distributed
def test_two_rank_metrics_equal_single_process_metrics_over_all_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dist_utils import run_distributed

    per_rank = run_distributed(_two_rank_run, world_size=2, timeout_s=180, args=(str(tmp_path),))
    r0, r1 = per_rank
    assert r0["reports"] == r1["reports"], "ranks must report identical values"
    assert r0["final"] == r1["final"]
    rows = r0["rows"] + r1["rows"]
    reports = r0["reports"]

    def check(values: dict[str, float], sel: list[dict[str, Any]]) -> None:
        ref, auc_rank = _reference(sel)
        assert values["num_samples"] == ref["num_samples"] == sum(len(r["p"]) for r in sel)
        assert abs(values["auc"] - auc_rank) < 1e-4
        for k in ("auc", "gauc", "ne", "logloss", "calibration", "ctr"):
            assert values[k] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), k

    # Per-window eval values: Open Bandit after train window s0, synthetic after s1, then both
    # in the final evaluate().
    evals = [r for r in reports if r["mode"] == "eval" and r["scope"] == "window"]
    assert [r["window"] for r in evals] == ["obd", "synthetic", "obd", "synthetic"]
    for rep, n in zip(evals, [1, 2, 3, 3], strict=True):
        check(rep["values"], [x for x in rows if x["mode"] == "eval" and x["eval"] == n
                              and x["window"] == rep["window"]])
    # Open Bandit: all 10,000 real rows (rank 1 padded while rank 0 finished), none twice.
    assert evals[0]["values"]["num_samples"] == 10_000
    whole = [r for r in reports if r["scope"] == "eval"]
    for rep, n in zip(whole, [1, 2, 3], strict=True):
        check(rep["values"], [x for x in rows if x["mode"] == "eval" and x["eval"] == n])
    final = r0["final"]
    assert final["auc"] == whole[2]["values"]["auc"] and final["ne"] == whole[2]["values"]["ne"]
    # Train: every 3 steps, and the partial interval at the end of training.
    steps = r0["steps"]
    intervals = [r for r in reports if r["mode"] == "train" and r["scope"] == "interval"]
    expected = [s for s in range(3, steps + 1, 3)] + ([steps] if steps % 3 else [])
    assert [r["step"] for r in intervals] == expected
    prev = 0
    for rep in intervals:
        check(rep["values"], [x for x in rows if x["mode"] == "train" and prev < x["step"] <= rep["step"]])
        prev = rep["step"]
    train_windows = [r for r in reports if r["mode"] == "train" and r["scope"] == "window"]
    assert [r["window"] for r in train_windows] == ["s0", "s1"]
    for rep in train_windows:
        check(rep["values"], [x for x in rows if x["mode"] == "train" and x["window"] == rep["window"]])
