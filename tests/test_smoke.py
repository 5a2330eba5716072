"""Test mode: ``TrainingArguments(smoke_test=True)`` and ``recsys-train CONFIG --smoke`` run a
couple of train steps, one eval batch, a checkpoint save and a resume in a temporary directory,
never in ``output_dir``, and name the phase that failed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from custom_components import FailAt
from helpers import batches, make_trainer
from test_cli_components import custom, env

from recsys_trainer.smoke import SmokeTestError

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def test_smoke_mode_trains_evaluates_saves_and_resumes_outside_output_dir(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer = make_trainer(train=batches(6), eval_=batches(2, seed=1), output_dir=str(out),
                           smoke_test=True, resume_from="auto", log_steps=None,
                           log_every_n_rows=50, eval_every_n_rows=60, save_every_n_rows=70,
                           save_every_n_windows=1)
    smoke_dir = trainer.args.output_dir
    assert os.path.isdir(smoke_dir) and not smoke_dir.startswith(str(tmp_path))
    trainer.train()
    report = trainer.smoke.report if trainer.smoke is not None else {}
    assert report["checkpoint_step"] == 2 and report["steps"] == 3  # 2, saved, loaded, +1
    assert report["eval_samples"] == 32  # eval_steps=1: one batch of 32 rows
    assert trainer.evaluate()["num_samples"] == 32  # evaluate() runs the phases too
    assert set(report["seconds"]) == {"train", "evaluate", "save", "resume"}
    assert not out.exists(), "the smoke test wrote into output_dir"
    assert not os.path.exists(smoke_dir), "the smoke test left its directory behind"


def test_smoke_mode_passes_on_train_data_of_just_two_batches(tmp_path: Path) -> None:
    trainer = make_trainer(train=batches(2), output_dir=str(tmp_path / "out"), smoke_test=True)
    trainer.train()
    assert trainer.smoke is not None and trainer.smoke.report["steps"] == 3


@pytest.mark.parametrize(("event", "phase"), [
    ("after_step", "train"), ("after_eval_step", "evaluate"), ("before_save_checkpoint", "save"),
    ("after_load_checkpoint", "resume"),
])
def test_a_failing_phase_is_named_with_its_exception(tmp_path: Path, event: str, phase: str) -> None:
    trainer = make_trainer(train=batches(4), eval_=batches(2, seed=1), hooks=[FailAt(event)],
                           output_dir=str(tmp_path / "out"), smoke_test=True)
    with pytest.raises(SmokeTestError, match=rf"smoke test failed in phase '{phase}': RuntimeError: "
                                             rf"planted failure in {event}") as err:
        trainer.train_and_evaluate()
    assert err.value.phase == phase
    assert not (tmp_path / "out").exists()


def _write(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(custom(tmp_path, **changes)))
    return path


def test_the_cli_smoke_flag_exits_0_on_the_real_config_without_touching_output_dir(tmp_path: Path) -> None:
    path = _write(tmp_path, run="train_and_evaluate")
    p = subprocess.run([PY, "-m", "recsys_trainer", str(path), "--smoke"], capture_output=True,
                       text=True, timeout=200, env=env(), cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "rank 0/1 smoke test passed: {" in p.stdout and "'checkpoint_step': 2" in p.stdout
    assert not (tmp_path / "out").exists()


def test_the_cli_smoke_flag_exits_1_naming_the_phase_that_failed(tmp_path: Path) -> None:
    path = _write(tmp_path, hooks=[{"class": "custom_components.FailAt", "event": "before_save_checkpoint"}])
    p = subprocess.run([PY, "-m", "recsys_trainer", str(path), "--smoke"], capture_output=True,
                       text=True, timeout=200, env=env(), cwd=REPO)
    assert p.returncode == 1, p.stdout + p.stderr[-4000:]
    assert ("recsys-train: smoke test FAILED in phase 'save': RuntimeError: planted failure in "
            "before_save_checkpoint") in p.stderr


@pytest.mark.distributed
def test_the_cli_smoke_flag_runs_under_torchrun_on_2_ranks(tmp_path: Path) -> None:
    path = _write(tmp_path, run="train_and_evaluate")
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--max_restarts=0", "-m", "recsys_trainer", str(path), "--smoke"],
                       capture_output=True, text=True, timeout=240, env=env(), cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    passed = sorted(re.findall(r"rank (\d)/2 smoke test passed: \{'eval_samples': (\d+)", p.stdout))
    # One eval batch of 8 rows on each rank, summed over both.
    assert passed == [("0", "16"), ("1", "16")], p.stdout
    assert not (tmp_path / "out").exists()
