"""TensorBoard, JSON-lines log, progress bar, profiler and plots, from one small real run."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hooks_fixtures import ListWindows, make_trainer, synthetic, user_ids

from recsys_trainer import (
    JsonlMetricsHook,
    MetricReportHook,
    ProfilerHook,
    ProgressHook,
    TensorBoardHook,
)
from recsys_trainer.hooks.jsonl import read_jsonl
from recsys_trainer.plot import main as plot_main


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("run")
    train = ListWindows({f"h{i:02d}": synthetic(4, 32, seed=i) for i in range(3)})
    eval_ = ListWindows({f"h{i:02d}": synthetic(2, 32, seed=100 + i) for i in range(3)})
    silent, tty = io.StringIO(), _Tty()
    hooks = {
        "metrics": MetricReportHook(group_fn=user_ids),
        "tb": TensorBoardHook(),
        "jsonl": JsonlMetricsHook(),
        "progress_auto": ProgressHook(stream=silent),
        "progress_on": ProgressHook(enabled=True, stream=tty, postfix_every=2),
        "profiler": ProfilerHook(start_step=3, num_steps=2),
    }
    trainer = make_trainer(train, eval_, list(hooks.values()), output_dir=str(out), log_steps=5)
    steps_seen: list[dict[str, float]] = []
    from recsys_trainer import LambdaHook

    trainer.add_hook(LambdaHook(after_step=lambda t, o: steps_seen.append(t.timings.as_dict())))
    trainer.train_and_evaluate()
    # What a checkpointer's save fires around its write (the checkpoint subsystem emits these).
    trainer.hooks.fire("before_save_checkpoint", trainer, str(out / "ckpt"))
    trainer.hooks.fire("after_save_checkpoint", trainer, str(out / "ckpt"))
    trainer.hooks.fire("end", trainer)
    return {"out": out, "hooks": hooks, "steps": trainer.state.global_step, "silent": silent,
            "tty": tty, "timings": steps_seen}


def _events(log_dir: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def test_tensorboard_event_file_holds_loss_metrics_lrs_throughput_and_time_breakdown(run: dict[str, Any]) -> None:
    steps = run["steps"]  # 3 windows x 4 batches, one process
    assert steps == 12
    acc = _events(os.path.join(run["out"], "tensorboard"))
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "lr/dense", "lr/sparse", "perf/samples_per_s", "time/data_wait_s",
                "time/forward_backward_s", "time/optimizer_s", "checkpoint/save_s", "eval/loss"}
    expected |= {f"{g}/{m}" for g in ("train", "eval", "train_window", "eval_window")
                 for m in ("auc", "gauc", "ne", "logloss", "calibration", "ctr")}
    assert expected <= tags, sorted(expected - tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 12]  # log_steps=5, then the end
    assert [e.step for e in acc.Scalars("train/auc")] == [5, 10, 12]
    assert [e.step for e in acc.Scalars("eval/auc")] == [4, 8, 12]  # after each train window
    assert [e.step for e in acc.Scalars("eval_window/auc")] == [0, 1, 2]  # window ordinal
    assert all(e.value > 0 for e in acc.Scalars("perf/samples_per_s"))
    assert [e.value for e in acc.Scalars("lr/dense")] == pytest.approx([1e-2] * 3)


def test_step_timings_are_measured_for_every_step_and_zeroed_after_it(run: dict[str, Any]) -> None:
    timings = run["timings"]
    assert len(timings) == run["steps"]
    assert all(t["forward_backward_s"] > 0 and t["optimizer_s"] > 0 and t["data_wait_s"] > 0
               for t in timings)


def test_jsonl_log_parses_and_holds_train_metric_and_eval_records(run: dict[str, Any]) -> None:
    path = run["out"] / "metrics.jsonl"
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict: every line is one JSON object
    assert records == read_jsonl(str(path))
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 12]
    assert {"loss", "samples_per_s", "dense_lr", "sparse_lr", "data_wait_s"} <= set(train[0])
    windows = [r for r in records if r["type"] == "metrics" and r["scope"] == "window"]
    assert [(r["mode"], r["window_id"]) for r in windows] == [
        (m, f"h{i:02d}") for i in range(3) for m in ("train", "eval")]
    evals = [r for r in records if r["type"] == "eval"]
    assert len(evals) == 3 and all("auc" in r and "loss" in r for r in evals)


def test_progress_bar_is_off_when_the_stream_is_not_a_terminal(run: dict[str, Any]) -> None:
    assert run["silent"].getvalue() == ""
    auto = run["hooks"]["progress_auto"]
    assert auto.train_bar is None and auto.eval_bar is None


def test_progress_bar_draws_train_and_eval_bars_when_switched_on(run: dict[str, Any]) -> None:
    text = run["tty"].getvalue()
    assert "train" in text and "eval" in text and "loss=" in text and "samples_s=" in text
    assert f"train: {run['steps']}step" in text  # no train_steps: a counter without a total


def test_profiler_writes_a_chrome_trace_under_the_tensorboard_dir(run: dict[str, Any]) -> None:
    prof = run["hooks"]["profiler"]
    files = prof.trace_files()
    assert len(files) == 1
    assert Path(files[0]).parent == run["out"] / "tensorboard" / "profiler"
    with open(files[0]) as f:
        trace = json.load(f)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::" in n for n in names)


def test_plot_command_renders_curves_and_per_window_auc_to_png(run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    curves, windows = run["out"] / "curves.png", run["out"] / "windows.png"
    rc = plot_main([str(run["out"] / "metrics.jsonl"), "--out", str(curves), "--windows", str(windows)])
    assert rc == 0
    for png in (curves, windows):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert "auc" in capsys.readouterr().out


def test_plot_command_explains_a_log_without_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text('{"type": "other", "step": 1}\n')
    assert plot_main([str(log), "--out", str(tmp_path / "x.png")]) == 2
    assert "no loss or metric values" in capsys.readouterr().err
