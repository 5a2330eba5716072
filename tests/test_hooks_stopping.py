"""Early stopping and the non-finite-loss guard: every rank stops (or skips) at the same step."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hooks_fixtures import ListWindows, make_trainer, synthetic

from recsys_trainer import (
    EarlyStoppingHook,
    LambdaHook,
    MetricReportHook,
    NonFiniteLossHook,
    TrainingArguments,
)


def _windows(num: int, nan_at: int | None = None) -> ListWindows:
    """``num`` windows of 6 batches (3 per rank). ``nan_at``: global batch index in window w0
    whose dense features are NaN (odd indices belong to rank 1 only)."""
    wins = {f"w{i}": synthetic(6, 32, seed=i) for i in range(num)}
    if nan_at is not None:
        wins["w0"][nan_at].dense[:] = math.nan
    return ListWindows(wins)


def _all_finite(trainer: Any) -> bool:
    """Dense parameters and this rank's embedding shards hold no NaN/inf."""
    for v in trainer.model.state_dict().values():
        local = v.local_shards() if hasattr(v, "local_shards") else None
        tensors = [s.tensor for s in local] if local is not None else [
            v.to_local() if hasattr(v, "to_local") else v]
        if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors):
            return False
    return True


def _scenarios(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    # 1. Early stopping on an injected eval score: best at eval 2, no improvement at 3 and 4.
    scores = iter([0.5, 0.6, 0.55, 0.58, 0.9, 0.9])
    inject = LambdaHook(after_evaluate=lambda t, m: m.__setitem__("score", next(scores)))
    stopper = EarlyStoppingHook("score", mode="max", patience=2)
    t = make_trainer(_windows(5), _windows(5), [inject, stopper], output_dir=f"{tmp}/es")
    t.train_and_evaluate()
    out["early"] = (t.state.global_step, t.state.stop_reason, stopper.stopped_at_step)

    # 2. Stop: rank 1's 3rd batch is NaN; rank 0 never sees a bad loss.
    losses: list[float] = []
    record = LambdaHook(after_step=lambda t, o: losses.append(float(o.loss)))
    t = make_trainer(_windows(2, nan_at=5), None, [NonFiniteLossHook("stop"), record],
                     output_dir=f"{tmp}/stop")
    t.train()
    out["stop"] = (t.state.global_step, t.state.stop_reason, list(losses))

    # 3. Skip: the same data; step 3 is skipped on both ranks, training goes on, nothing is NaN.
    losses.clear()
    guard = NonFiniteLossHook("skip")
    t = make_trainer(_windows(2, nan_at=5), None, [guard, record], output_dir=f"{tmp}/skip")
    t.train()
    out["skip"] = (t.state.global_step, guard.skipped_steps, list(losses), _all_finite(t))
    return out


@pytest.mark.distributed
def test_early_stopping_and_non_finite_guard_act_identically_on_both_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dist_utils import run_distributed

    r0, r1 = run_distributed(_scenarios, world_size=2, timeout_s=180, args=(str(tmp_path),))
    # Early stopping: 3 steps per window; stop agreed after the 4th window's evaluation.
    assert r0["early"][0] == r1["early"][0] == 12
    assert r0["early"][2] == r1["early"][2] == 12
    assert "early stopping: score" in r0["early"][1] and "early stopping" in r1["early"][1]
    # Stop: rank 1's loss at step 3 is NaN, rank 0's is not, and both stop after step 3.
    assert r0["stop"][0] == r1["stop"][0] == 3
    assert r0["stop"][1] == r1["stop"][1] == "non-finite loss"
    assert math.isfinite(r0["stop"][2][2]) and math.isnan(r1["stop"][2][2])
    # Skip: both ranks skip step 3 and train all 6 steps; no NaN reached the tables or dense
    # parameters, so every later loss is finite on both ranks.
    for r in (r0, r1):
        steps, skipped, step_losses, finite = r["skip"]
        assert steps == 6 and skipped == [3] and finite
        assert all(math.isfinite(x) for i, x in enumerate(step_losses) if i != 2)
    assert math.isnan(r1["skip"][2][2])


def test_early_stopping_counts_patience_and_min_delta() -> None:
    class _T:  # the slice of Trainer the hook uses
        state = type("S", (), {"mode": "train", "global_step": 7})()
        is_rank_zero = False
        stops: list[str] = []

        def request_stop(self, reason: str) -> None:
            self.stops.append(reason)

    t = _T()
    h = EarlyStoppingHook("ne", mode="min", patience=2, min_delta=0.01)
    for v in (0.90, 0.85, 0.845, math.nan, 0.842):  # 0.845, 0.842: not better by > 0.01
        h.after_evaluate(t, {"ne": v})  # type: ignore[arg-type]
    assert h.best == 0.85 and h.num_bad == 2 and len(t.stops) == 1
    h2 = EarlyStoppingHook("ne", mode="min", patience=2)
    h2.load_state_dict(h.state_dict())
    assert (h2.best, h2.num_bad) == (0.85, 2)
    with pytest.raises(KeyError, match="'ne' is not in the evaluation metrics"):
        h.after_evaluate(t, {"loss": 1.0})  # type: ignore[arg-type]


def test_early_stopping_on_a_metric_needs_a_hook_that_adds_it_first(tmp_path) -> None:  # type: ignore[no-untyped-def]
    hooks = [EarlyStoppingHook("auc"), MetricReportHook()]
    trainer = make_trainer(_windows(1), _windows(1), hooks, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="put a MetricReportHook before it"):
        trainer.train_and_evaluate()


def test_invalid_guard_and_stopper_arguments_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="`action` must be 'stop' or 'skip'"):
        NonFiniteLossHook("ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_skips` needs action='skip'"):
        NonFiniteLossHook("stop", max_skips=3)
    with pytest.raises(ValueError, match="`patience` must be an int >= 1"):
        EarlyStoppingHook(patience=0)


def test_the_non_finite_policy_is_a_training_argument_the_hook_only_selects(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # One process, window w0's 3rd batch NaN: the same decisions as the 2-rank test, from args.
    t = make_trainer(_windows(1, nan_at=2), None, output_dir=f"{tmp_path}/stop",
                     non_finite_loss="stop")
    t.train()
    assert (t.state.global_step, t.state.stop_reason) == (3, "non-finite loss")
    t = make_trainer(_windows(1, nan_at=2), None, output_dir=f"{tmp_path}/skip",
                     non_finite_loss="skip", max_non_finite_skips=1)
    t.train()
    assert t.non_finite.skipped_steps == [3] and _all_finite(t)
    assert t.state.stop_reason == "1 steps skipped for a non-finite loss (max_skips=1)"
    # "ignore" (the default) trains on; the hook switches the Trainer's policy at before_train.
    t = make_trainer(_windows(1, nan_at=2), None, output_dir=f"{tmp_path}/ignore")
    t.train()
    assert t.state.global_step == 6 and t.state.stop_reason is None
    guard = NonFiniteLossHook("skip")
    t = make_trainer(_windows(1, nan_at=2), None, [guard], output_dir=f"{tmp_path}/hook")
    t.train()
    assert t.non_finite.action == "skip" and guard.skipped_steps == [3] and guard.num_skipped == 1


def test_invalid_non_finite_policies_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="`non_finite_loss` must be one of 'ignore', 'stop', 'skip'"):
        TrainingArguments(non_finite_loss="retry")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_non_finite_skips` needs `non_finite_loss` = 'skip'"):
        TrainingArguments(non_finite_loss="stop", max_non_finite_skips=2)
    with pytest.raises(ValueError, match="`non_finite_loss` 'skip' decides before backward"):
        TrainingArguments(non_finite_loss="skip", pipeline="sparse_dist")
