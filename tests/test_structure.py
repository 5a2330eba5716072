"""The Trainer's shape: built once (placement + builder), saving through ``CheckpointHook`` at the
loop's resume points, evaluation decided by one ``EvalSchedule``."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from helpers import batches, tiny_model
from hooks_fixtures import ListWindows

from recsys_trainer import Hook, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.builder import build_trainer_parts
from recsys_trainer.data.base import IterableAsWindow
from recsys_trainer.distributed import FakeGang
from recsys_trainer.eval_schedule import EvalSchedule
from recsys_trainer.hooks.base import EVENTS, RESUME_POINT_EVENTS, HookList
from recsys_trainer.hooks.checkpoint import CheckpointHook
from recsys_trainer.periods import Period
from recsys_trainer.placement import place


class _Points(Hook):
    """Records the resume points and the saves, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_resume_point(self, trainer: Trainer, point: Any) -> None:
        self.seen.append(f"{point}@{trainer.state.global_step}")

    def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
        self.seen.append(f"saved:{os.path.basename(path)}")


class _AddsMetric(Hook):
    """Adds a metric in after_evaluate (keep-best must see it: the CheckpointHook runs last)."""

    def after_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        metrics["my_metric"] = 0.25 + trainer.state.global_step


def _kwargs(**args: Any) -> dict[str, Any]:
    args.setdefault("log_steps", 1000)
    return dict(model=tiny_model(), args=TrainingArguments(**args),
                dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1), add_logger_hook=False)


def _windows(n: int, per: int) -> ListWindows:
    return ListWindows({f"w{i}": batches(per, seed=i) for i in range(n)})


@pytest.mark.timeout(120)
def test_from_parts_trains_the_components_the_builder_made_without_building_them_again(tmp_path) -> None:
    parts = build_trainer_parts(train_dataset=_windows(2, 3), **_kwargs(output_dir=str(tmp_path)))
    trainer = Trainer.from_parts(parts)
    assert trainer.model is parts.model and trainer.optimizer is parts.optimizer
    assert trainer.checkpointer is parts.checkpointer and trainer.gang is parts.placement.gang
    assert trainer.device == parts.placement.device
    trainer.train()
    assert trainer.state.global_step == 6


@pytest.mark.timeout(120)
def test_from_parts_saves_through_a_replaced_checkpointer_and_a_replaced_hook_list(tmp_path) -> None:
    from recsys_trainer.checkpoint.manager import CheckpointManager

    parts = build_trainer_parts(train_dataset=_windows(1, 4),
                                **_kwargs(output_dir=str(tmp_path / "built"), save_steps=2))
    parts.checkpointer = CheckpointManager(str(tmp_path / "mine"), save_steps=2, async_save=False)
    parts.hooks = HookList([_Points()])
    trainer = Trainer.from_parts(parts)
    assert isinstance(list(trainer.hooks)[-1], CheckpointHook)
    trainer.train()
    assert {"step_00000002", "step_00000004"} <= set(os.listdir(tmp_path / "mine"))
    built = tmp_path / "built"
    assert not built.exists() or not any(n.startswith("step_") for n in os.listdir(built))


@pytest.mark.timeout(120)
def test_a_given_placement_is_used_as_is_and_the_tables_come_from_the_seed_alone(tmp_path) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), seed=5, log_steps=1000)
    gang = FakeGang(rank=0, world_size=1)
    placement = place(args, gang)
    assert placement.gang is gang and placement.rank == 0 and placement.world_size == 1
    after_place = torch.rand(4)  # place() seeded every generator with args.seed
    torch.manual_seed(5)
    assert torch.equal(after_place, torch.rand(4))

    def tables(caller_draws: int, given: Any) -> list[torch.Tensor]:
        kw = _kwargs(output_dir=str(tmp_path / f"{caller_draws}-{given is None}"), seed=5)
        torch.rand(caller_draws)  # what the caller drew between place() and the build
        trainer = Trainer(placement=given, **kw)
        assert given is None or (trainer.placement is given and trainer.gang is gang)
        sd = trainer.model.state_dict()
        return [v.local_shards()[0].tensor.clone() if hasattr(v, "local_shards") else v.clone()
                for k, v in sorted(sd.items()) if "embedding_bags" in k]

    # However much the caller drew (recsys-train builds its datasets and model after place()),
    # the tables are those of args.seed: the same as a Trainer that placed the job itself.
    reference = tables(0, None)
    for got in (tables(1, placement), tables(1000, placement), tables(7, None)):
        assert len(got) == len(reference) > 0
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


@pytest.mark.timeout(120)
def test_saves_happen_at_the_resume_points_and_the_checkpoint_hook_runs_after_every_hook(tmp_path) -> None:
    points = _Points()
    trainer = Trainer(train_dataset=_windows(2, 3), eval_dataset=_windows(2, 1), hooks=[points],
                      **_kwargs(output_dir=str(tmp_path), save_steps=2, save_every_n_windows=1,
                                save_end=True, async_save=False, keep_best_metric="my_metric",
                                keep_best_mode="max"))
    trainer.add_hook(_AddsMetric())  # added later: still before the CheckpointHook
    hooks = list(trainer.hooks)
    assert isinstance(hooks[-1], CheckpointHook) and isinstance(hooks[-2], _AddsMetric)
    trainer.train_and_evaluate()
    assert trainer.state.global_step == 6
    # Steps 1..3 in window 0 (a save at step 2), the window's resume point (saves step 3), the
    # same in window 1 (saves at 4 and 6; the window's and the end's find step 6 saved already).
    assert points.seen == [
        "step@1", "step@2", "saved:step_00000002", "step@3", "window@3", "saved:step_00000003",
        "step@4", "saved:step_00000004", "step@5", "step@6", "saved:step_00000006", "window@6",
        "epoch@6", "end@6",
    ]
    # The metric a user hook added in after_evaluate reached the keep-best record.
    assert trainer.checkpointer.last_metrics["my_metric"] == 6.25


def test_resume_point_events_are_separate_from_the_documented_order() -> None:
    assert "on_resume_point" in RESUME_POINT_EVENTS and "on_resume_point" not in EVENTS
    hooks = HookList([_Points()], last=[_AddsMetric()])
    hooks.add(_Points())
    assert [type(h).__name__ for h in hooks] == ["_Points", "_Points", "_AddsMetric"]
    assert hooks.has("on_resume_point")
    assert json.dumps(sorted(EVENTS))  # unchanged public tuple


def test_the_eval_schedule_defaults_per_window_or_per_epoch_and_honours_a_period() -> None:
    windowed = _windows(3, 1)
    unwindowed = IterableAsWindow(batches(2))
    s = EvalSchedule(windowed, None, enabled=True)
    plans = [p for _, _, p in s.windows(iter_ids(["w0", "w1", "w2"]))]
    assert [p.windows if p else None for p in plans] == [["w0"], ["w1"], ["w2"]]
    assert all(p is not None and p.after_window for p in plans)
    assert s.due_after_epoch(1) is None
    u = EvalSchedule(unwindowed, None, enabled=True)
    plans = [p for _, _, p in u.windows(iter_ids(["a", "b"]))]
    assert all(p is not None and not p.after_window and p.windows is None for p in plans)
    epoch = u.due_after_epoch(1)
    assert epoch is not None and epoch.windows is None
    every2 = EvalSchedule(windowed, Period(2, "windows"), enabled=True)
    due = [p.after_window for _, _, p in every2.windows(iter_ids(["w0", "w1", "w2"])) if p]
    assert due == [False, True, False]
    off = EvalSchedule(windowed, None, enabled=False)
    assert [p for _, _, p in off.windows(iter_ids(["w0"]))] == [None]
    assert off.owed_on_resume(["w0"]) is None and s.owed_on_resume(None) is None


def iter_ids(ids: list[str]) -> Any:
    from recsys_trainer.data.base import Lookahead

    return Lookahead(iter(ids))
