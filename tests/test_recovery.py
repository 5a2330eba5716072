"""Preemption in one process: a real SIGTERM/SIGINT to this process while training stops after
the step in progress, saves that step (draining an async save in flight first), raises
``Preempted`` (exit code 128 + signal), and a rerun resumes bitwise equal to an uninterrupted
run, every row trained once: mid-window, during an evaluation, at a window change. A save that
misses the grace period ends the process with the previous checkpoint intact. The 2-rank runs
under torchrun (SIGTERM to the agent, a killed rank with --max-restarts) are in
test_recovery_dist.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_trainer import (
    FEATS,
    NUM_DENSE,
    ROWS,
    RowRecorder,
    RowWindows,
    _slow_writes,
    assert_bitwise_equal,
    committed_steps,
    snapshot,
)

from recsys_trainer import Hook, LambdaHook, Preempted, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.checkpoint import layout
from recsys_trainer.hooks.base import StepOutput
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.preemption import DUPLICATE_WINDOW_S, PreemptionWatcher
from recsys_trainer.storage import locate

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parent


def build(output_dir: str, hooks: list[Hook] | None = None, eval_windows: int = 0,
          **args: Any) -> Trainer:
    """The tiny DLRM of test_checkpoint_trainer on 3 windows of 8 batches (and eval windows)."""
    torch.manual_seed(0)
    model = DLRMClassifier(FEATS, NUM_DENSE, ROWS, embedding_dim=8, dense_arch=(16,),
                           over_arch=(16, 1))
    args.setdefault("log_steps", 1000)
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=output_dir, **args),
        train_dataset=RowWindows(num_windows=3),
        eval_dataset=RowWindows(num_windows=3, batches_per_window=3, seed=5) if eval_windows else None,
        hooks=hooks or [],
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2),
                          lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False,
    )


class Events(Hook):
    """The events that end a run, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.preemption: Any = None

    def after_train(self, trainer: Trainer) -> None:
        self.events.append("after_train")

    def on_exception(self, trainer: Trainer, exc: BaseException) -> None:
        self.events.append("on_exception")

    def on_preempt(self, trainer: Trainer, preemption: Any) -> None:
        self.events.append("on_preempt")
        self.preemption = preemption

    def end(self, trainer: Trainer) -> None:
        self.events.append(f"end:{trainer.state.stop_reason}")


def signal_self(signum: int = signal.SIGTERM) -> None:
    os.kill(os.getpid(), signum)


def run_preempted(trainer: Trainer, with_eval: bool = False) -> Preempted:
    with pytest.raises(Preempted) as info:
        trainer.train_and_evaluate() if with_eval else trainer.train()
    return info.value


def full_run(tmp_path: Path, with_eval: bool = False, **args: Any) -> tuple[Trainer, RowRecorder]:
    rec = RowRecorder()
    t = build(str(tmp_path / "full"), [rec], eval_windows=3 if with_eval else 0, **args)
    t.train_and_evaluate() if with_eval else t.train()
    return t, rec


def resume_and_compare(tmp_path: Path, out: str, first: RowRecorder, with_eval: bool = False,
                       hooks: list[Hook] | None = None, **args: Any) -> RowRecorder:
    """Rerun the same command in ``out``; the model equals the uninterrupted one bit for bit and
    every row was trained exactly once over both runs."""
    full, full_rec = full_run(tmp_path, with_eval, **args)
    second = RowRecorder()
    resumed = build(out, [second, *(hooks or [])], eval_windows=3 if with_eval else 0, **args)
    resumed.train_and_evaluate() if with_eval else resumed.train()
    assert resumed.state.global_step == full.state.global_step
    assert_bitwise_equal(snapshot(resumed), snapshot(full))
    rows = first.rows + second.rows
    assert sorted(rows) == sorted(full_rec.rows) and len(set(rows)) == len(rows)
    return second


def test_sigterm_during_an_async_save_drains_it_then_saves_the_stopped_step_and_resumes_bitwise(
        tmp_path: Path, monkeypatch: Any) -> None:
    log: list[tuple[str, int, float]] = []
    _slow_writes(monkeypatch, 0.4, log)
    in_flight_at_signal: list[bool] = []

    def after_step(trainer: Trainer, output: StepOutput) -> None:
        if trainer.state.global_step == 5:
            in_flight_at_signal.append(trainer.checkpointer.in_flight)
            signal_self()  # step 4's save is still being written

    out = str(tmp_path / "cut")
    first, events = RowRecorder(), Events()
    handler_before = signal.getsignal(signal.SIGTERM)
    t = build(out, [first, events, LambdaHook(after_step=after_step)], save_steps=4,
              train_steps=20)
    preempted = run_preempted(t)
    assert in_flight_at_signal == [True]
    # Every step after the signal's step is lost; both the drained and the stopped step commit.
    assert preempted.code == 143 and preempted.preemption.step == 5
    assert committed_steps(out) == [4, 5] and t.state.global_step == 5
    p = preempted.preemption
    assert p.signal == "SIGTERM" and p.committed and p.checkpoint.endswith("step_00000005")
    assert p.seconds_to_commit is not None and p.seconds_to_commit < 25
    assert events.events == ["on_preempt", "end:preempted by SIGTERM"]
    assert events.preemption is p and t.preemption is p
    # The output_dir lock is released and the previous signal handler is back.
    assert not t.checkpointer._lock.held
    assert signal.getsignal(signal.SIGTERM) is handler_before
    second = resume_and_compare(tmp_path, out, first, train_steps=20)
    assert ("loaded", "step_00000005") in second.events


def test_sigint_during_an_evaluation_abandons_it_and_the_rerun_evaluates_that_window_again(
        tmp_path: Path) -> None:
    evaluated: list[tuple[str, str]] = []

    def before_window(trainer: Trainer, window_id: str) -> None:
        evaluated.append((trainer.state.mode, window_id))

    def after_eval_step(trainer: Trainer, output: StepOutput) -> None:
        if trainer.state.window_id == "w1" and output.step == 2:
            signal_self(signal.SIGINT)

    out = str(tmp_path / "cut")
    first, events = RowRecorder(), Events()
    t = build(out, [first, events, LambdaHook(before_window=before_window,
                                              after_eval_step=after_eval_step)],
              eval_windows=3, save_every_n_windows=1)
    preempted = run_preempted(t, with_eval=True)
    assert preempted.code == 130 and preempted.preemption.signal == "SIGINT"
    # Stopped inside eval window w1, after the 16 steps of train windows w0 and w1; the saved
    # position is still window w1 (its train batches done), so its evaluation comes again.
    assert preempted.preemption.step == 16 and committed_steps(out) == [8, 16]
    assert events.events == ["on_preempt", "end:preempted by SIGINT"]
    manifest = layout.read_manifest(locate(os.path.join(out, "step_00000016")))
    assert manifest is not None
    position = manifest["trainer_state"]
    assert (position["window_index"], position["batches_in_window"], position["window_id"]) == \
        (1, 8, "w1")
    assert [w for mode, w in evaluated if mode == "eval"] == ["w0", "w1"]
    evaluated.clear()
    resume_and_compare(tmp_path, out, first, with_eval=True, save_every_n_windows=1,
                       hooks=[LambdaHook(before_window=before_window)])
    assert [w for mode, w in evaluated if mode == "eval"] == ["w1", "w2"]


@pytest.mark.parametrize("stop", ["sigterm", "crash"])
def test_a_run_stopped_during_the_evaluation_after_its_last_step_evaluates_on_rerun(
        tmp_path: Path, stop: str) -> None:
    # train_steps=20 ends inside train window w2 (8 steps a window); the evaluation of w2 follows.
    # "sigterm" commits step 20 during it; "crash" leaves the save_steps checkpoint of step 20,
    # written before it (a SIGKILL's view). Either way the rerun resumes at the last step.
    evaluated: list[str] = []

    def before_window(trainer: Trainer, window_id: str) -> None:
        if trainer.state.mode == "eval":
            evaluated.append(window_id)

    def after_eval_step(trainer: Trainer, output: StepOutput) -> None:
        if trainer.state.window_id == "w2" and output.step == 1:
            if stop == "sigterm":
                signal_self()
            else:
                raise RuntimeError("the host went away")

    out = str(tmp_path / "cut")
    t = build(out, [LambdaHook(before_window=before_window, after_eval_step=after_eval_step)],
              eval_windows=3, train_steps=20, save_steps=10)
    if stop == "sigterm":
        assert run_preempted(t, with_eval=True).preemption.step == 20
    else:
        with pytest.raises(RuntimeError, match="the host went away"):
            t.train_and_evaluate()
    assert committed_steps(out) == [10, 20] and evaluated == ["w0", "w1", "w2"]
    evaluated.clear()
    metrics: list[dict[str, float]] = []
    resumed = build(out, [LambdaHook(before_window=before_window,
                                     after_evaluate=lambda tr, m: metrics.append(m))],
                    eval_windows=3, train_steps=20, save_steps=10)
    resumed.train_and_evaluate()
    assert resumed.state.global_step == 20
    assert evaluated == ["w2"] and len(metrics) == 1


def test_sigterm_at_a_window_change_stops_before_the_new_windows_first_step(
        tmp_path: Path) -> None:
    def before_window(trainer: Trainer, window_id: str) -> None:
        if trainer.state.mode == "train" and window_id == "w2":
            signal_self()

    out = str(tmp_path / "cut")
    first = RowRecorder()
    t = build(out, [first, LambdaHook(before_window=before_window)], save_steps=5,
              async_save=False)
    preempted = run_preempted(t)
    assert preempted.preemption.step == 16 and committed_steps(out) == [5, 10, 15, 16]
    assert (t.state.window_index, t.state.batches_in_window) == (2, 0)
    resume_and_compare(tmp_path, out, first, save_steps=5, async_save=False)


def test_a_run_that_saves_nothing_stops_on_the_signal_and_says_nothing_was_saved(
        tmp_path: Path) -> None:
    def after_step(trainer: Trainer, output: StepOutput) -> None:
        if trainer.state.global_step == 3:
            signal_self()

    t = build(str(tmp_path), [LambdaHook(after_step=after_step)])
    preempted = run_preempted(t)
    assert preempted.code == 143 and preempted.preemption.step == 3
    assert not preempted.preemption.committed and "no save trigger" in str(preempted.preemption.error)
    assert os.listdir(tmp_path) == []


def test_a_save_that_misses_the_grace_period_ends_the_process_and_keeps_the_previous_checkpoint(
        tmp_path: Path) -> None:
    # In a subprocess: the process ends with os._exit while the write is still going on.
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(TESTS)!r})
        from test_recovery import build
        from recsys_trainer import LambdaHook
        from recsys_trainer.checkpoint import CheckpointManager

        real = CheckpointManager._write
        def slow(self, loc, *a, **kw):
            if loc.url.endswith("step_00000005"):
                time.sleep(30)
            return real(self, loc, *a, **kw)
        CheckpointManager._write = slow

        def after_step(trainer, output):
            if trainer.state.global_step == 5:
                os.kill(os.getpid(), signal.SIGTERM)
        t = build({str(tmp_path / "out")!r}, [LambdaHook(after_step=after_step)], save_steps=4,
                  train_steps=20, preemption_grace_s=1.5)
        t.train()
        print("NOT REACHED")
    """)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 143, p.stdout + p.stderr[-3000:]
    assert "NOT REACHED" not in p.stdout
    assert "PreemptionError" in p.stderr and "did not commit in time" in p.stderr
    assert time.monotonic() - t0 < 60
    out = str(tmp_path / "out")
    assert committed_steps(out) == [4]
    assert not layout.is_committed(locate(os.path.join(out, "step_00000005")))


def test_a_second_signal_is_the_same_preemption_when_it_comes_at_once_and_ends_the_process_later(
        ) -> None:
    # SIGINT as a process started from a terminal has it (Python's handler): a process a shell
    # started in the background (`.ci/run &` without job control) has it ignored, and the
    # signal handed on below would then be ignored, not raise KeyboardInterrupt.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        killed: list[int] = []
        watcher = PreemptionWatcher(kill=killed.append)
        previous = signal.getsignal(signal.SIGTERM)
        with watcher.watching():
            signal_self()
            signal_self()  # e.g. Slurm's SIGTERM and the one torchrun's agent forwards
            assert watcher.signal_name == "SIGTERM" and killed == []
            assert watcher.received_at is not None
            watcher.received_at -= DUPLICATE_WINDOW_S + 1  # "much later"
            signal_self(signal.SIGINT)
            assert killed == [signal.SIGINT] and watcher.signal_name == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) is previous
        assert not watcher.requested
        # Without the test's stand-in, the later signal goes to the handler from before:
        # Python's SIGINT handler raises KeyboardInterrupt (SIGTERM's default would end the
        # process).
        real = PreemptionWatcher()
        with pytest.raises(KeyboardInterrupt), real.watching():
            signal_self(signal.SIGINT)
            assert real.received_at is not None
            real.received_at -= DUPLICATE_WINDOW_S + 1
            signal_self(signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode boundary
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_preemption_grace_s_is_validated_and_none_leaves_the_signals_alone(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`preemption_grace_s` must be a number > 0 or None, but is 0"):
        TrainingArguments(preemption_grace_s=0)
    seen: list[Any] = []
    handler_before = signal.getsignal(signal.SIGTERM)
    t = build(str(tmp_path), [LambdaHook(after_step=lambda tr, o: seen.append(
        signal.getsignal(signal.SIGTERM)))], train_steps=1, preemption_grace_s=None)
    t.train()
    assert seen == [handler_before]


def test_a_fresh_start_under_torchrun_max_restarts_says_a_restart_needs_resume_from_auto(
        tmp_path: Path, monkeypatch: Any) -> None:
    """``resume_from=None`` under ``--max-restarts``: the restarted attempt meets the first
    attempt's checkpoints and fails on every restart; the error says what to set."""
    build(str(tmp_path), train_steps=2, save_steps=1, resume_from=None).train()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    from recsys_trainer.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"holds committed checkpoints at steps \[1, 2\].*"
                       r"Under torchrun --max-restarts=2 a restarted attempt must resume from "
                       r"them: set `resume_from` to \"auto\" \(the default\)"):
        build(str(tmp_path), train_steps=2, save_steps=1, resume_from=None).train()
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")
    with pytest.raises(CheckpointError, match=r"another `output_dir`\.$"):
        build(str(tmp_path), train_steps=2, save_steps=1, resume_from=None).train()


def test_a_restarted_torchrun_attempt_takes_over_its_earlier_attempts_lease_at_once(
        tmp_path: Path, monkeypatch: Any) -> None:
    """On object storage the output_dir lock is a lease. A restart's new rank 0 may run on
    another host than the dead one, whose lease would otherwise block it for its TTL (60 s):
    the same torchrun run id means an earlier attempt of this job, which torchrun has stopped."""
    import json

    from recsys_trainer.checkpoint.lock import LeaseLock
    from recsys_trainer.storage import resolve

    where = resolve(str(tmp_path))
    earlier = {"host": "node-b", "pid": 4242, "world_size": 2, "started": "x", "token": "t0",
               "run_id": "job-7", "renewed": time.time()}
    with where.filesystem.open_output_stream(where.join("LOCK").path) as f:
        f.write(json.dumps(earlier).encode())
    monkeypatch.setattr(LeaseLock, "SETTLE_S", 0.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    holder = LeaseLock(where).acquire(world_size=2)
    assert holder is not None and "pid 4242 on host node-b (run job-7" in holder
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    lease = LeaseLock(where)
    assert lease.acquire(world_size=2) is None
    lease.release()


def test_a_worker_gets_sigterm_when_its_torchrun_agent_is_killed(tmp_path: Path) -> None:
    """A torchrun agent killed outright used to leave its workers training unsupervised (they
    kept the lock and finished the run on their own). ``stop_with_the_agent`` (called by
    ``init_distributed``) has the kernel send them SIGTERM instead: the preemption path."""
    flag = tmp_path / "got_sigterm"
    worker = textwrap.dedent(f"""
        import os, signal, sys, time
        from recsys_trainer.distributed import stop_with_the_agent
        signal.signal(signal.SIGTERM, lambda *_: (open({str(flag)!r}, "w").close(), sys.exit(0)))
        stop_with_the_agent()
        print("ready", flush=True)
        time.sleep(60)
    """)
    agent = textwrap.dedent(f"""
        import subprocess, sys, time
        w = subprocess.Popen([sys.executable, "-c", {worker!r}], stdout=subprocess.PIPE, text=True)
        assert w.stdout.readline().strip() == "ready"
        print(w.pid, flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job-1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True,
                            env=env)
    worker_pid = None
    try:
        assert proc.stdout is not None
        worker_pid = int(proc.stdout.readline())
        proc.kill()  # SIGKILL: the agent cannot forward anything
        deadline = time.monotonic() + 30
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flag.exists(), "the worker was not signalled when its agent died"
    finally:
        proc.kill()
        proc.wait(10)
        if worker_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker_pid, signal.SIGKILL)


def test_a_restarted_rank_skips_the_dead_attempts_store_and_joins_rank_0s_new_one() -> None:
    """The cause of restarted torchrun groups failing to form: the agent's store keeps the dead
    attempt's keys. Here the agent's store names a store of a dead attempt (nothing listens on
    its port) when rank 1 starts; rank 0 publishes its new one 1 s later. Rank 1 must end up
    on rank 0's new store, not fail or wait on the dead one."""
    import json
    import threading

    import torch.distributed as dist

    from recsys_trainer.distributed import _ATTEMPT_STORE_KEY, _attempt_store, free_port

    agent = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    agent.set(_ATTEMPT_STORE_KEY, json.dumps({"host": "127.0.0.1", "port": free_port(),
                                              "nonce": "dead attempt"}))
    stores: dict[int, Any] = {}

    def rank_0() -> None:
        time.sleep(1.0)  # a slower start than rank 1's
        stores[0] = _attempt_store(0, 2, "127.0.0.1", agent.port, timeout_s=30)
        stores[0].set("written by", "rank 0 of this attempt")

    t0 = time.monotonic()
    thread = threading.Thread(target=rank_0)
    thread.start()
    stores[1] = _attempt_store(1, 2, "127.0.0.1", agent.port, timeout_s=30)
    thread.join()
    assert stores[1].get("written by") == b"rank 0 of this attempt"
    assert time.monotonic() - t0 < 10
