"""``checkpoint.rotation.select_to_delete``: the retention policy as a pure function, on
checkpoint infos built in memory (no disk, no manager)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from recsys_trainer.checkpoint import layout, rotation
from recsys_trainer.checkpoint.rotation import RetentionPolicy, select_to_delete

HOUR = 3600.0


@dataclass(frozen=True)
class Info:
    """The fields rotation reads (``rotation.Rotatable``), nothing else."""

    step: int
    commit_time: float = 0.0
    keep: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def steps(infos: list[Info]) -> list[int]:
    return [i.step for i in infos]


def test_max_to_keep_keeps_the_newest_by_step_and_returns_the_rest_oldest_first() -> None:
    infos = [Info(30), Info(10), Info(50), Info(20), Info(40)]
    assert steps(select_to_delete(infos, RetentionPolicy(max_to_keep=2))) == [10, 20, 30]
    assert select_to_delete(infos, RetentionPolicy(max_to_keep=5)) == []
    assert select_to_delete([], RetentionPolicy(max_to_keep=1)) == []


def test_the_just_committed_step_is_protected_even_when_newer_ones_exist() -> None:
    # An output_dir with steps 10..40 from an earlier run; this run just committed step 20.
    infos = [Info(10), Info(20), Info(30), Info(40)]
    gone = select_to_delete(infos, RetentionPolicy(max_to_keep=1), protected_steps={20})
    assert steps(gone) == [10, 30]


def test_keep_marked_checkpoints_survive_and_do_not_count_against_max_to_keep() -> None:
    infos = [Info(1, keep=True), Info(2), Info(3), Info(4)]
    assert steps(select_to_delete(infos, RetentionPolicy(max_to_keep=2))) == [2]


def test_keep_best_min_and_max() -> None:
    infos = [Info(1, metrics={"loss": 0.3, "auc": 0.70}),
             Info(2, metrics={"loss": 0.1, "auc": 0.60}),
             Info(3, metrics={"loss": 0.2, "auc": 0.80}),
             Info(4), Info(5)]
    by_loss = RetentionPolicy(max_to_keep=1, keep_best_metric="loss", keep_best_mode="min")
    assert steps(select_to_delete(infos, by_loss)) == [1, 3, 4]
    by_auc = RetentionPolicy(max_to_keep=1, keep_best_metric="auc", keep_best_mode="max")
    assert steps(select_to_delete(infos, by_auc)) == [1, 2, 4]


def test_keep_best_ties_go_to_the_newest_and_nan_or_absent_metrics_do_not_compete() -> None:
    infos = [Info(1, metrics={"loss": 0.1}), Info(2, metrics={"loss": 0.1}),
             Info(3, metrics={"loss": math.nan}), Info(4, metrics={"other": 0.0}), Info(5)]
    policy = RetentionPolicy(max_to_keep=1, keep_best_metric="loss")
    assert steps(select_to_delete(infos, policy)) == [1, 3, 4]
    # A metric no checkpoint recorded keeps no best: only max_to_keep applies.
    missing = RetentionPolicy(max_to_keep=1, keep_best_metric="ndcg")
    assert steps(select_to_delete(infos, missing)) == [1, 2, 3, 4]


def test_keep_every_n_hours_keeps_the_oldest_of_each_period() -> None:
    # A checkpoint every 20 minutes for 3 hours (steps 0..9 at 0, 20, ..., 180 min).
    infos = [Info(s, commit_time=1_000.0 + s * HOUR / 3) for s in range(10)]
    gone = select_to_delete(infos, RetentionPolicy(max_to_keep=2, keep_every_n_hours=1.0))
    # Kept: 0, 3, 6 (0 h, 1 h, 2 h: each at least an hour after the previous kept one), the
    # newest two (8, 9); 9 is also the 3 h one.
    assert steps(gone) == [1, 2, 4, 5, 7]


def test_keep_every_n_hours_periods_start_at_the_previous_kept_one_not_on_a_grid() -> None:
    t = [0.0, 0.9 * HOUR, 1.1 * HOUR, 2.0 * HOUR, 2.05 * HOUR, 5.0 * HOUR]
    infos = [Info(i + 1, commit_time=c) for i, c in enumerate(t)]
    gone = select_to_delete(infos, RetentionPolicy(max_to_keep=1, keep_every_n_hours=1.0))
    # 1 (0 h), 3 (1.1 h), 6 (5 h: >= 2.1 h); 4 at 2.0 h is < 1.1 h + 1 h.
    assert steps(gone) == [2, 4, 5]


def test_all_rules_together() -> None:
    infos = [Info(10, commit_time=0.0, metrics={"loss": 0.5}),
             Info(20, commit_time=0.5 * HOUR, metrics={"loss": 0.05}),
             Info(30, commit_time=1.0 * HOUR, keep=True),
             Info(40, commit_time=1.5 * HOUR, metrics={"loss": 0.2}),
             Info(50, commit_time=2.0 * HOUR),
             Info(60, commit_time=2.5 * HOUR),
             Info(70, commit_time=3.0 * HOUR)]
    policy = RetentionPolicy(max_to_keep=1, keep_every_n_hours=2.0, keep_best_metric="loss")
    # newest 70; best 20; KEEP 30; periodic 10 (0 h) and 50 (2 h); protected 40 (resumed from).
    assert steps(select_to_delete(infos, policy, protected_steps=[40])) == [60]


def test_the_manager_and_layout_see_the_same_function_and_real_infos_work() -> None:
    assert layout.select_to_delete is rotation.select_to_delete
    assert layout.RetentionPolicy is rotation.RetentionPolicy
    real = [layout.CheckpointInfo(s, f"/x/step_{s}", float(s), 1) for s in (1, 2, 3)]
    assert select_to_delete(real, RetentionPolicy(max_to_keep=1)) == real[:2]
