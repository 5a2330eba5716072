"""Log, eval and save periods in rows seen (as well as steps, windows and epochs): one way per
period, named errors, and every rank acting after the same step when ranks read uneven batches."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch.distributed as dist
from dist_utils import run_distributed
from helpers import batches, make_trainer

from recsys_trainer import TrainingArguments
from recsys_trainer.checkpoint import layout
from recsys_trainer.hooks import LambdaHook, LoggerHook
from recsys_trainer.periods import Period, Trigger


@dataclass
class _Progress:
    global_step: int
    rows_seen: int
    last_step_rows: int
    windows_done: int = 0
    epoch: int = 0
    event_time_s: float = 0.0
    last_window_event_s: float = 0.0


def crossings(rows_per_step: int, every: int, steps: int) -> list[int]:
    """The steps after which a rows period of ``every`` falls due (the reference)."""
    return [s for s in range(1, steps + 1) if s * rows_per_step // every > (s - 1) * rows_per_step // every]


def test_a_rows_period_falls_due_once_on_the_step_that_reaches_each_multiple() -> None:
    p = Period(100, "rows")
    assert p.due_after_step(_Progress(2, 128, 64)) and not p.due_after_step(_Progress(1, 64, 64))
    assert p.due_after_step(_Progress(1, 100, 100))  # reaching the multiple exactly counts
    assert p.due_after_step(_Progress(1, 250, 250))  # two multiples crossed: due (once)
    assert not Period(3, "steps").due_after_step(_Progress(4, 0, 0))
    assert Period(2, "windows").due_after_window(4) and not Period(2, "windows").due_after_step(_Progress(2, 0, 0))


def test_an_event_time_period_falls_due_after_the_window_that_crosses_each_multiple() -> None:
    from recsys_trainer.trainer_state import TrainerState

    st = TrainerState()
    t = Trigger.of({"every_n_event_seconds": (10.0, "event_seconds")})
    due = []
    # Windows of 4 s of event time from t=1000, one missing (a gap in the stream: 1012-1016).
    for end in (1004.0, 1008.0, 1012.0, 1020.0, 1024.0, 1028.0, 1032.0):
        st.finish_window_in_event_time(end)
        assert not t.due("step", st)  # checked at window ends only
        if t.due("window", st):
            due.append(end)
    # The first window crosses from 0; then 1010 (window to 1012), 1020, 1030 (to 1032).
    assert due == [1004.0, 1012.0, 1020.0, 1032.0]
    st.finish_window_in_event_time(None)  # a window without event time moves nothing
    assert st.last_window_event_s == 0.0 and not t.due("window", st)
    # The count survives a checkpoint: a resumed run acts after the same windows.
    again = TrainerState()
    again.load_state_dict(st.state_dict())
    again.finish_window_in_event_time(1040.0)
    assert again.event_time_s == 1040.0 and t.due("window", again)


def test_a_trigger_is_due_when_any_period_is_and_seconds_count_from_its_last_due() -> None:
    now = [0.0]
    t = Trigger.of({"a": (4, "steps"), "b": (None, "rows"), "c": (2, "windows"),
                    "d": (3, "epochs"), "e": (10.0, "seconds")}, clock=lambda: now[0])
    assert [p.unit for p in t.periods] == ["steps", "windows", "epochs", "seconds"]
    due_steps = [s for s in range(1, 13) if t.due("step", _Progress(s, 0, 0))]
    assert due_steps == [4, 8, 12]  # the clock stands still: only the steps period
    assert [w for w in range(1, 6) if t.due("window", _Progress(0, 0, 0, windows_done=w))] == [2, 4]
    assert [e for e in range(1, 7) if t.due("epoch", _Progress(0, 0, 0, epoch=e))] == [3, 6]
    now[0] = 9.9
    assert not t.due("step", _Progress(13, 0, 0))
    now[0] = 10.0  # 10 s since the trigger was made: due at a step or a window end, not an epoch
    assert not t.due("epoch", _Progress(0, 0, 0, epoch=1))
    assert t.due("window", _Progress(0, 0, 0, windows_done=1))
    now[0] = 15.0  # 5 s since it fell due
    assert not t.due("step", _Progress(13, 0, 0))
    assert t.due("step", _Progress(16, 0, 0))  # the steps period; it restarts the clock too
    now[0] = 24.0
    assert not t.due("step", _Progress(17, 0, 0))
    now[0] = 26.0
    assert t.due("step", _Progress(17, 0, 0))
    assert not Trigger([]) and not Trigger([]).due("step", _Progress(4, 0, 0))
    assert not Trigger([Period(2, "windows")]).due("window", _Progress(0, 0, 0))  # none done
    for fields, message in [({"every_n_steps": (0, "steps")}, "`every_n_steps` must be an int >= 1"),
                            ({"every_n_seconds": (-1.0, "seconds")},
                             "`every_n_seconds` must be a number > 0 or None, but is -1.0."),
                            ({"save_every_n_windows": (1.5, "windows")}, "an int >= 1 or None")]:
        with pytest.raises(ValueError, match=message):
            Trigger.of(fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "message"), [
    ({"log_steps": 10, "log_every_n_rows": 1000},
     "the log period is given 2 ways: `log_steps`=10, `log_every_n_rows`=1000; set only one of "
     "`log_steps`, `log_every_n_rows`."),
    ({"save_steps": 10, "save_every_n_rows": 1000},
     "the save period is given 2 ways: `save_steps`=10, `save_every_n_rows`=1000; set only one of "
     "`save_steps`, `save_every_n_rows`."),
    ({"eval_every_n_rows": 500, "eval_every_n_epochs": 1},
     "the eval period is given 2 ways: `eval_every_n_rows`=500, `eval_every_n_epochs`=1; set only one "
     "of `eval_every_n_steps`, `eval_every_n_rows`, `eval_every_n_windows`, `eval_every_n_epochs`."),
    ({"log_every_n_rows": 0}, "`log_every_n_rows` must be an int >= 1 or None, but is 0."),
    ({"eval_every_n_rows": 2.5}, "`eval_every_n_rows` must be an int >= 1 or None, but is 2.5."),
    ({"eval_every_n_steps": 5, "pipeline": "sparse_dist"},
     "`eval_every_n_steps` evaluates between two steps, which `pipeline` 'sparse_dist' cannot"),
])
def test_each_period_takes_one_way_and_a_second_is_a_named_error(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        TrainingArguments(**args)
    assert message in str(e.value)


def test_log_steps_defaults_to_100_unless_rows_are_given() -> None:
    assert TrainingArguments().log_period == Period(100, "steps")
    a = TrainingArguments(log_every_n_rows=5000)
    assert a.log_steps is None and a.log_period == Period(5000, "rows")
    # Windows and epochs save triggers still add to a steps or rows one.
    TrainingArguments(save_every_n_rows=10, save_every_n_windows=1, save_every_n_epochs=1)


def _record(trainer_hooks: list[Any]) -> tuple[list[int], LoggerHook]:
    evals: list[int] = []
    logger = LoggerHook()
    trainer_hooks += [logger, LambdaHook(after_evaluate=lambda t, m: evals.append(t.state.global_step))]
    return evals, logger


def test_log_eval_and_save_periods_in_rows_act_on_the_steps_that_reach_them(tmp_path: Any) -> None:
    hooks: list[Any] = []
    evals, logger = _record(hooks)
    out = str(tmp_path / "out")
    trainer = make_trainer(train=batches(10, batch_size=32), eval_=batches(1, seed=1), hooks=hooks,
                           output_dir=out, log_steps=None, log_every_n_rows=80,
                           eval_every_n_rows=100, save_every_n_rows=150, max_to_keep=10)
    trainer.train_and_evaluate()
    assert trainer.state.rows_seen == 320
    assert [int(r["step"]) for r in logger.records] == crossings(32, 80, 10) == [3, 5, 8, 10]
    assert evals == crossings(32, 100, 10) == [4, 7, 10]  # and not after the epoch (a period is set)
    assert [c.step for c in layout.list_committed(out)] == crossings(32, 150, 10) == [5, 10]

    # Resumed: rows_seen comes back from the checkpoint and the periods continue from there.
    more = make_trainer(train=batches(10, batch_size=32), output_dir=out, save_every_n_rows=150,
                        max_to_keep=10, train_epoch=2, resume_from="auto")
    more.train()
    assert more.state.rows_seen == 640
    assert [c.step for c in layout.list_committed(out)] == crossings(32, 150, 20) == [5, 10, 15, 19]


def test_eval_periods_in_steps_and_epochs_replace_the_per_epoch_default(tmp_path: Any) -> None:
    # 4 batches an epoch, 3 epochs: 12 steps.
    for args, expected in [({}, [4, 8, 12]),  # default (unwindowed eval data): after each epoch
                           ({"eval_every_n_steps": 3}, [3, 6, 9, 12]),
                           ({"eval_every_n_epochs": 2}, [8])]:
        hooks: list[Any] = []
        evals, _ = _record(hooks)
        make_trainer(train=batches(4), eval_=batches(1, seed=1), hooks=hooks, train_epoch=3,
                     output_dir=str(tmp_path / "out"), **args).train_and_evaluate()
        assert evals == expected, args


def _uneven_ranks(out: str) -> dict[str, Any]:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    hooks: list[Any] = []
    evals, logger = _record(hooks)
    # Rank 0 reads batches of 16 rows, rank 1 of 48: 64 rows of all ranks per step.
    trainer = make_trainer(train=batches(8, batch_size=16 if rank == 0 else 48, seed=rank),
                           eval_=batches(1, batch_size=8, seed=10 + rank), hooks=hooks,
                           output_dir=out, log_steps=None, log_every_n_rows=100,
                           eval_every_n_rows=150, save_every_n_rows=200, max_to_keep=10)
    trainer.train_and_evaluate()
    # A seconds period on the run's gang: only rank 1's clock says 5 s have passed, and both
    # ranks agree it is due (one all-reduce); asked again at once, neither finds it due.
    now = [0.0]
    seconds = Trigger([Period(3, "seconds")], clock=lambda: now[0])
    now[0] = 5.0 if rank == 1 else 1.0
    agreed = [seconds.due("step", trainer.state, gang=trainer.gang) for _ in range(2)]
    return {"log": [int(r["step"]) for r in logger.records], "eval": evals,
            "rows_seen": trainer.state.rows_seen, "seconds_due": agreed}


@pytest.mark.distributed
def test_two_ranks_with_uneven_batches_act_on_rows_periods_after_the_same_step(tmp_path: Any) -> None:
    out = str(tmp_path / "out")
    r0, r1 = run_distributed(_uneven_ranks, world_size=2, timeout_s=180, args=(out,))
    assert r0 == r1, (r0, r1)
    assert r0["rows_seen"] == 8 * 64
    assert r0["seconds_due"] == [True, False]
    assert r0["log"] == crossings(64, 100, 8) == [2, 4, 5, 7, 8]
    assert r0["eval"] == crossings(64, 150, 8) == [3, 5, 8]
    assert [c.step for c in layout.list_committed(out)] == crossings(64, 200, 8) == [4, 7]
    # Rank 0's own rows (16 a step) would have logged after steps 7 only: the count is global.
    assert crossings(16, 100, 8) == [7]


def test_windowed_eval_on_a_period_evaluates_the_eval_window_paired_with_the_train_window(
        tmp_path: Any) -> None:
    from custom_components import ConcatMLP
    from data_utils import row_id_spec, write_windows

    from recsys_trainer import Trainer
    from recsys_trainer.data.parquet import ParquetWindowDataset

    write_windows(str(tmp_path / "train"), [[32], [32], [32]])  # 3 windows x 4 batches of 8
    write_windows(str(tmp_path / "eval"), [[8], [8], [8]], first_row_id=1000)
    for args, expected in [({}, [(4, "hour=00"), (8, "hour=01"), (12, "hour=02")]),  # every window
                           ({"eval_every_n_windows": 2}, [(8, "hour=01")]),
                           # 8 rows a step: every 6 steps, mid-window, the current window's pair
                           ({"eval_every_n_rows": 48}, [(6, "hour=01"), (12, "hour=02")])]:
        seen: list[tuple[int, str]] = []
        hook = LambdaHook(before_window=lambda t, w, seen=seen: seen.append(
            (t.state.global_step, os.path.basename(w))) if t.state.mode == "eval" else None)
        trainer = Trainer(
            ConcatMLP(["item", "tag"], num_embeddings=100, num_dense=1),
            TrainingArguments(output_dir=str(tmp_path / "out"), resume_from=None, **args),
            train_dataset=ParquetWindowDataset(str(tmp_path / "train"), row_id_spec(), batch_size=8),
            eval_dataset=ParquetWindowDataset(str(tmp_path / "eval"), row_id_spec(), batch_size=8),
            hooks=[hook], add_logger_hook=False)
        trainer.train_and_evaluate()
        assert seen == expected, args
