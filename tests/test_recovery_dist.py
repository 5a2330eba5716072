"""Recovery without a human, through the CLI under real ``torchrun`` (2 ranks, gloo):

- SIGTERM to the torchrun agent (a scheduler's preemption): both ranks stop after the same step,
  commit that step and exit 143; rerunning the same command resumes there, and the final model
  is bitwise equal to an uninterrupted run;
- SIGKILL of one rank under ``--max-restarts``: torchrun restarts the group, which forms its
  process groups again (a store of its own per attempt, ``distributed.attempt_store``), takes
  over ``output_dir``'s lock and resumes from the newest committed checkpoint by itself; the
  job exits 0 with the same final model;
- the same with two torchrun agents ("nodes", c10d rendezvous) where one node's worker is
  killed: both nodes' workers restart, rejoin and resume;
- SIGTERM to one rank only (``run_distributed``): both stop after the same step and save it.

Each job has a hard timeout; a test that hangs fails, naming the job's log."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from recsys_trainer.checkpoint import export_model_state_dict, layout
from recsys_trainer.distributed import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "configs" / "dlrm_synthetic.yaml"
TESTS = Path(__file__).resolve().parent
PY = sys.executable
STEPS, SAVE_EVERY = 40, 10
JOB_TIMEOUT_S = 240


def config(tmp_path: Path, out: Path, pace_s: float, **replace: Any) -> Path:
    """The example's YAML (``examples/configs/dlrm_synthetic.yaml``, as the production command of
    docs/failure-modes.md runs it) with a smaller model and data, a save period and a pacing
    hook; sections in ``replace`` replace the example's whole."""
    raw: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    for section, values in {**_small(out, pace_s), **replace}.items():
        if isinstance(values, dict) and section not in replace:
            raw[section] = {**raw.get(section, {}), **values}
        else:
            raw[section] = values
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _small(out: Path, pace_s: float) -> dict[str, Any]:
    return {
        "run": "train",
        "args": {"output_dir": str(out), "train_steps": STEPS, "log_steps": 10,
                 "save_steps": SAVE_EVERY, "save_end": True, "seed": 3},
        "model": {"sparse_features": 4, "num_dense": 4, "num_embeddings": 200, "embedding_dim": 8,
                  "dense_arch": [16], "over_arch": [16, 1]},
        "data": {"kind": "synthetic", "batch_size": 32, "train_batches": 60, "eval_batches": 0},
        "dense_optimizer": {"name": "adam", "lr": 0.01},
        "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.05},
        "hooks": [{"class": "custom_components.Progress", "path": str(out) + ".progress",
                   "pace_s": pace_s}],
    }


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


class Job:
    """One torchrun agent running the CLI on ``cfg``; its output goes to ``log``."""

    def __init__(self, cfg: Path, log: Path, *torchrun_args: str) -> None:
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            [PY, "-m", "torch.distributed.run", *torchrun_args, "-m", "recsys_trainer", str(cfg)],
            stdout=self._out, stderr=subprocess.STDOUT, env=env(), cwd=REPO,
            start_new_session=True)

    def workers(self) -> dict[int, int]:
        """``{rank: pid}`` of the agent's live workers."""
        out: dict[int, int] = {}
        for pid in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                  text=True).stdout.split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = int(pid)
        return out

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the torchrun job did not end within {timeout_s} s: {self.text()[-4000:]}")

    def kill(self) -> None:
        # torchrun starts its workers in sessions of their own: kill them by pid first.
        for pid in self.workers().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the agent and its workers
            self.proc.wait(10)

    def text(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")


def progress(out: Path, rank: int = 0) -> list[tuple[int, str, str]]:
    """``(step, torchrun restart count, pid)`` of every step rank ``rank`` trained, in order."""
    path = Path(f"{out}.progress.rank{rank}")
    if not path.exists():
        return []
    return [(int(s), a, pid) for s, a, pid, _ in
            (line.split() for line in path.read_text().splitlines())]


def wait_for_step(job: Job, out: Path, step: int, timeout_s: float = JOB_TIMEOUT_S) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = progress(out)
        if done and done[-1][0] >= step:
            return done[-1][0]
        if job.proc.poll() is not None:
            pytest.fail(f"the job ended before step {step}: {job.text()[-4000:]}")
        time.sleep(0.05)
    job.kill()
    pytest.fail(f"the job did not reach step {step} in {timeout_s} s: {job.text()[-4000:]}")


def final_model(out: Path) -> dict[str, torch.Tensor]:
    return export_model_state_dict(str(out / layout.step_dir_name(STEPS)))


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final model: the CLI on the same config on 2 ranks of
    ``run_distributed`` (a torchrun agent would only add its start and its workers' imports;
    the model is the same, bitwise)."""
    from dist_utils import run_cli, run_distributed

    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "out"
    runs = run_distributed(run_cli, 2, JOB_TIMEOUT_S, args=([str(config(tmp, out, pace_s=0.0))],),
                           env=env())
    assert [code for code, _ in runs] == [0, 0], runs
    return final_model(out)


def test_sigterm_to_the_torchrun_agent_commits_the_step_and_the_rerun_resumes_bitwise(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "out"
    cfg = config(tmp_path, out, pace_s=0.05)
    job = Job(cfg, tmp_path / "log1", "--standalone", "--nproc_per_node=2")
    wait_for_step(job, out, 16)
    job.proc.send_signal(signal.SIGTERM)
    job.wait()  # torchrun itself exits 1 after a signal (its SignalException)
    text = job.text()
    stopped = [progress(out, r)[-1][0] for r in (0, 1)]
    assert stopped[0] == stopped[1], text[-4000:]
    step = stopped[0]
    assert step % SAVE_EVERY != 0, "the signal came right at a save step: nothing to prove"
    for rank in (0, 1):
        assert (f"recsys-train: rank {rank}: preempted by SIGTERM after step {step}: checkpoint "
                f"{out / layout.step_dir_name(step)} committed") in text, text[-4000:]
    # The last step trained is the one committed: nothing is lost.
    assert layout.latest_committed(str(out)).step == step  # type: ignore[union-attr]
    rerun = Job(cfg, tmp_path / "log2", "--standalone", "--nproc_per_node=2")
    assert rerun.wait() == 0, rerun.text()[-4000:]
    assert f"resuming from {out / layout.step_dir_name(step)} (step {step})" in rerun.text()
    assert [s for s, _, _ in progress(out)] == list(range(1, STEPS + 1))
    assert_same_model(final_model(out), reference)


def _kill_rank_1_and_recover(jobs: list[Job], out: Path, kill_at: int) -> list[list[int]]:
    """SIGKILL rank 1 once rank 0 passed ``kill_at``; every agent must then end 0. Returns the
    steps rank 0 trained in each of its processes (one per attempt), checked to resume from the
    newest committed step before the kill, losing at most one save period."""
    wait_for_step(jobs[0], out, kill_at)
    victim = next(w[1] for w in (j.workers() for j in jobs) if 1 in w)
    os.kill(victim, signal.SIGKILL)
    for job in jobs:
        assert job.wait() == 0, job.text()[-4000:]
    runs: dict[str, list[int]] = {}
    for step, _, pid in progress(out):
        runs.setdefault(pid, []).append(step)
    first, second = runs.values()
    resumed_from = second[0] - 1
    assert resumed_from % SAVE_EVERY == 0 and 0 <= first[-1] - resumed_from <= SAVE_EVERY, runs
    assert second == list(range(resumed_from + 1, STEPS + 1))
    assert all(f"resuming from {out / layout.step_dir_name(resumed_from)}" in j.text() for j in jobs)
    return [first, second]


def test_a_killed_rank_under_max_restarts_resumes_from_the_newest_checkpoint_by_itself(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "out"
    job = Job(config(tmp_path, out, pace_s=0.05), tmp_path / "log", "--standalone",
              "--nproc_per_node=2", "--max-restarts=1")
    _kill_rank_1_and_recover([job], out, 16)
    assert [a for _, a, _ in progress(out)][-1] == "1"  # torchrun's first restart
    assert_same_model(final_model(out), reference)


def test_two_nodes_rejoin_after_one_nodes_worker_is_killed_and_resume(
        tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    """``--nnodes=1:2`` elastic, c10d rendezvous on localhost, one worker per node: node 1's
    worker is killed; its agent restarts it, node 0's agent restarts its own (the group is
    re-formed), and both resume from the newest commit. The two agents' restart counts may
    differ here (an agent that sees the other node rejoin restarts without counting), which
    a per-restart-count store prefix would not survive."""
    out = tmp_path / "out"
    cfg = config(tmp_path, out, pace_s=0.05)
    port = free_port()
    jobs = [Job(cfg, tmp_path / f"node{n}.log", "--nnodes=1:2", "--nproc_per_node=1",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id=recovery-{port}", "--max-restarts=1")
            for n in range(2)]
    try:
        _kill_rank_1_and_recover(jobs, out, 16)
    finally:
        for j in jobs:
            j.kill()
    assert_same_model(final_model(out), reference)


def test_a_repeating_fault_ends_after_the_restart_budget_naming_it_and_keeps_the_checkpoints(
        tmp_path: Path) -> None:
    """A corrupt file in the second window under ``--max-restarts=1``: both attempts resume from
    the newest commit and fail on that file with the named ``DataError``; torchrun gives up and
    the job ends non-zero within the bound, its committed checkpoints unchanged and verifying."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, out = tmp_path / "data", tmp_path / "out"
    rng = np.random.default_rng(0)
    for hour in range(2):
        (data / f"hour={hour:02d}").mkdir(parents=True)
        for part in range(2):
            pq.write_table(pa.table({"y": rng.integers(0, 2, 640).astype(np.float32),
                                     "x": rng.random(640, dtype=np.float32),
                                     "item": rng.integers(0, 100, 640)}),
                           data / f"hour={hour:02d}" / f"part-{part}.parquet")
    bad = data / "hour=01" / "part-1.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    cfg = config(tmp_path, out, pace_s=0.0,
                 model={"embedding_dim": 8, "dense_arch": [16], "over_arch": [16, 1]},
                 data={"kind": "parquet", "train": str(data), "batch_size": 32,
                       "features": {"labels": ["y"], "dense": ["x"],
                                    "sparse": [{"name": "item", "num_embeddings": 100}]}})
    job = Job(cfg, tmp_path / "log", "--standalone", "--nproc_per_node=2", "--max-restarts=1")
    assert job.wait() != 0
    text = job.text()
    # The first attempt's saves (window 1: 20 steps, save_steps=10) are what is committed at
    # the end: the restart resumed from the newest and changed nothing.
    saved = sorted({int(s) for s in re.findall(r"checkpoint step (\d+) committed", text)})
    committed = [i.step for i in layout.list_committed(str(out))]
    assert committed == saved and saved, text[-4000:]
    assert f"resuming from {out / layout.step_dir_name(saved[-1])}" in text, text[-4000:]
    for attempt in (0, 1):
        assert f"(torchrun restart {attempt})" in text, text[-4000:]
    assert text.count(f"DataError: file {bad}") >= 2, text[-4000:]
    info = layout.latest_committed(str(out))
    assert info is not None
    manifest = layout.read_manifest(info.where)
    assert manifest is not None
    layout.verify_files(info.where, manifest, checksums=True)


def _one_rank_signalled(root: str) -> dict[str, Any]:
    """Rank 1 alone gets SIGTERM (a signal to one worker, not to the agent); the rerun in the
    same processes resumes from the step both ranks stopped after."""
    from test_checkpoint_trainer import RowRecorder, RowWindows, bitwise_verdict, build, snapshot

    from recsys_trainer import LambdaHook, Preempted

    rank = int(os.environ["RANK"])
    full_rec = RowRecorder()
    full = build(os.path.join(root, "full"), RowWindows(), hooks=[full_rec], train_epoch=2)
    full.train()

    def after_step(trainer: Any, output: Any) -> None:
        if rank == 1 and trainer.state.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    out = os.path.join(root, "cut")
    first = RowRecorder()
    cut = build(out, RowWindows(), hooks=[first, LambdaHook(after_step=after_step)],
                save_steps=4, train_epoch=2)
    try:
        cut.train()
        preempted = None
    except Preempted as e:
        preempted = e
    assert preempted is not None, f"rank {rank} trained on"
    p = preempted.preemption
    second = RowRecorder()
    resumed = build(out, RowWindows(), hooks=[second], save_steps=4, train_epoch=2)
    resumed.train()
    return {"code": preempted.code, "signal": p.signal, "step": p.step, "committed": p.committed,
            "equal": bitwise_verdict(snapshot(resumed), snapshot(full)),
            "rows": first.rows + second.rows, "full_rows": full_rec.rows}


def test_sigterm_to_one_rank_only_stops_both_after_the_same_step_and_both_save_it(
        tmp_path: Path) -> None:
    from dist_utils import run_distributed

    results = run_distributed(_one_rank_signalled, world_size=2, timeout_s=180,
                              args=(str(tmp_path),))
    for r in results:
        assert (r["code"], r["signal"], r["step"], r["committed"]) == (143, "SIGTERM", 5, True)
        assert r["equal"] == "yes", r["equal"]
        assert sorted(r["rows"]) == sorted(r["full_rows"]) and len(set(r["rows"])) == len(r["rows"])
