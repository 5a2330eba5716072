"""A stop signal while a stream waits for its next window (recsys_trainer/data/windows.py,
``WaitInterrupted``): the wait ends on every rank within about a poll interval, the Trainer
stops as for a signal at a batch fetch (the step's checkpoint, ``on_preempt``, ``Preempted``),
and the ``PublishHook``'s publisher, in a session of its own, survives the signal meant for the
job and publishes that step before the job ends.

- unit (no process group): the wait of ``agreed_windows`` ends on a local stop within a
  fraction of the poll interval, and on another rank's stop at the next heartbeat (``FakeGang``);
- one process: SIGTERM to a Trainer waiting on a stream with ``poll_interval_s=30``;
- two ranks (``run_distributed``): SIGTERM to rank 1 only, which waits in the broadcast for
  rank 0's listing: both stop at rank 0's next heartbeat;
- a 2-rank ``torchrun`` job (this file is its driver): SIGINT to the agent, as a terminal's
  Ctrl-C, while both ranks wait; both ranks exit 130 within seconds (the grace period is 30 s),
  the step is committed and ``LATEST`` names it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import serving_utils as su  # noqa: E402
import torch  # noqa: E402

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments  # noqa: E402
from recsys_trainer.checkpoint import layout  # noqa: E402
from recsys_trainer.data.parquet import ParquetWindowDataset  # noqa: E402
from recsys_trainer.data.windows import (  # noqa: E402
    StreamingWindows,
    WaitInterrupted,
    Window,
    agreed_windows,
    partitioned_windows,
)
from recsys_trainer.distributed import FakeGang  # noqa: E402
from recsys_trainer.hooks.base import Hook, ResumePoint  # noqa: E402
from recsys_trainer.hooks.publish import PublishHook  # noqa: E402
from recsys_trainer.preemption import Preempted  # noqa: E402
from recsys_trainer.serving import published as pub  # noqa: E402

POLL_S = 30.0  # far longer than any wait below: only the stop ends them
GRACE_S = 30.0


# ---------------------------------------------------------------------- unit


def _one_window_stream(poll_s: float = POLL_S) -> StreamingWindows:
    return StreamingWindows(lambda: [Window("w0", ())], end_marker=lambda: False,
                            poll_interval_s=poll_s)


@pytest.mark.timeout(30)
def test_a_local_stop_ends_the_wait_within_a_fraction_of_the_poll_interval() -> None:
    stopped = threading.Event()
    it = agreed_windows(_one_window_stream(), None, stop=stopped.is_set)
    assert next(it).id == "w0"
    threading.Timer(0.3, stopped.set).start()
    t0 = time.monotonic()
    with pytest.raises(WaitInterrupted, match="stop was requested"):
        next(it)
    assert 0.25 < time.monotonic() - t0 < 1.5
    # Without a check the stream is what it was: it keeps waiting (here: one more heartbeat).
    polls = _one_window_stream(0.01).polls()
    assert [next(polls), next(polls)] == [Window("w0", ()), None]


@pytest.mark.timeout(30)
def test_every_heartbeat_of_a_waiting_stream_runs_the_wait_hook_on_every_rank() -> None:
    # One rank: each poll that finds nothing new is a heartbeat (3 before the end marker), and
    # each runs the hook; a stop seen at a heartbeat ends the wait there instead.
    polls, waits = iter(range(100)), []
    stream = StreamingWindows(lambda: [Window("w0", ())], end_marker=lambda: next(polls) >= 3,
                              poll_interval_s=0.01)
    assert [w.id for w in agreed_windows(stream, None, on_wait=lambda: waits.append(1))] == ["w0"]
    assert len(waits) == 3
    waits.clear()
    it = agreed_windows(_one_window_stream(0.01), None, stop=lambda: True,
                        on_wait=lambda: waits.append(1))
    assert next(it).id == "w0"
    with pytest.raises(WaitInterrupted):
        next(it)
    assert waits == []
    # Rank 1 of 2 runs it at each of rank 0's heartbeats (where both ranks are).
    gang = FakeGang(1, 2, broadcasts=[("window", Window("w0", ())), ("wait", None),
                                      ("wait", None), ("end", None)])
    assert [w.id for w in agreed_windows("unused", gang, on_wait=lambda: waits.append(1))] == ["w0"]
    assert len(waits) == 2


class _EndsTheStreamOnCommit(Hook):
    """Records each commit (checkpoint, the resume point it was seen at, whether the stream had
    ended); a commit seen while the stream waits ends the stream (writes ``_END``)."""

    def __init__(self, end: str) -> None:
        self.end, self.point, self.commits = end, "", []  # type: ignore[var-annotated]

    def on_resume_point(self, trainer: Trainer, point: ResumePoint) -> None:
        self.point = point

    def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
        self.commits.append((os.path.basename(path), self.point, os.path.exists(self.end)))
        if self.point == "wait":
            open(self.end, "w").close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trigger", [{"save_every_n_windows": 1}, {"save_steps": 1}])
def test_a_quiet_stream_commits_its_last_windows_checkpoint_while_it_waits(
        tmp_path: Path, trigger: dict[str, int]) -> None:
    """No next window and no ``_END``: the asynchronous save of the last window's end commits at
    the wait's first heartbeat (every rank is there), not at a next step that never comes."""
    root = str(tmp_path)
    land(os.path.join(root, "data"), hours=2)
    hook = _EndsTheStreamOnCommit(os.path.join(root, "data", "_END"))
    # A short stream timeout: without the commit while waiting, nothing ends the stream.
    trainer = build(root, 0.05, [hook], timeout_s=20, **trigger)
    trainer.train()
    final = trainer.state.global_step
    assert hook.commits[-1] == (f"step_{final:08d}", "wait", False), hook.commits
    assert layout.is_committed(os.path.join(root, "ckpt", f"step_{final:08d}"))


@pytest.mark.timeout(120)
def test_a_signal_while_the_wait_finishes_a_slow_save_is_acted_on_within_the_grace_period(
        tmp_path: Path) -> None:
    # In a subprocess: a save that misses the grace period ends the process with os._exit. The
    # last window's save takes 60 s; SIGTERM comes 0.5 s into the wait that finishes it. The
    # wait gives way to the signal: the stop and the preemption save (which cannot commit in
    # the 3 s of grace) end the process within the grace period, not after the slow save.
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_stream_stop as t
        from recsys_trainer.checkpoint import CheckpointManager
        from recsys_trainer.hooks.base import Hook

        root = {str(tmp_path)!r}
        t.GRACE_S = 3.0
        t.land(os.path.join(root, "data"), hours=2)
        real, saves = CheckpointManager._write, []
        def slow(self, loc, *a, **kw):
            saves.append(loc.url)
            if len(saves) == 2:  # the second window's save
                time.sleep(60)
            return real(self, loc, *a, **kw)
        CheckpointManager._write = slow

        class SignalInTheWait(Hook):
            def on_resume_point(self, trainer, point):
                if (point == "wait" and trainer.state.windows_done == 2
                        and not hasattr(self, "fired")):
                    self.fired = time.time()
                    print("SIGNAL", self.fired, flush=True)
                    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t.build(root, 0.2, [SignalInTheWait()], save_every_n_windows=1).train()
        print("NOT REACHED")
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    ended = time.time()
    assert p.returncode == 143, p.stdout + p.stderr[-3000:]
    assert "NOT REACHED" not in p.stdout
    assert "PreemptionError" in p.stderr and "did not commit in time" in p.stderr
    signalled = float(next(ln for ln in p.stdout.splitlines() if ln.startswith("SIGNAL")).split()[1])
    assert ended - signalled < 15, ended - signalled  # was: the 60 s save, then the stop


@pytest.mark.timeout(30)
def test_another_ranks_stop_ends_the_wait_on_every_rank_at_the_next_heartbeat() -> None:
    # Rank 1 of 2, no signal of its own: rank 0 sends a window, then heartbeats; the all-reduce
    # at the second heartbeat says rank 0 is stopping.
    gang = FakeGang(1, 2, broadcasts=[("window", Window("w0", ())), ("wait", None), ("wait", None)],
                    peer_max=[[0], [1]])
    waits: list[int] = []
    it = agreed_windows("unused", gang, stop=lambda: False, on_wait=lambda: waits.append(1))
    assert next(it).id == "w0"
    with pytest.raises(WaitInterrupted):
        next(it)
    assert gang._broadcasts == []  # both heartbeats taken, nothing more
    assert waits == [1]  # the wait hook ran at the first heartbeat, not at the stopping one
    # Rank 0 of 2, no signal of its own: rank 1's stop ends rank 0's wait at its first heartbeat.
    gang0 = FakeGang(0, 2, peer_max=[[1]])
    it = agreed_windows(_one_window_stream(), gang0, stop=lambda: False)
    assert next(it).id == "w0"
    with pytest.raises(WaitInterrupted):
        next(it)


# ---------------------------------------------------------------------- the job


class WaitingMarker(Hook):
    """After the ``windows``-th train window's resume point (the stream then waits), writes
    ``path`` with the step (and rank 0 the pid of ``publish``'s publisher). At ``on_preempt``
    (after the ``PublishHook``'s), notes the publisher's pid again."""

    def __init__(self, path: str, windows: int, publish: PublishHook | None = None) -> None:
        self.path, self.windows, self.seen = path, windows, 0
        self.publish = publish
        self.publisher_pid_at_preempt: int | None = None

    def _publisher_pid(self) -> int | None:
        return self.publish.publisher_pid if self.publish is not None else None

    def on_preempt(self, trainer: Trainer, preemption: Any) -> None:
        self.publisher_pid_at_preempt = self._publisher_pid()

    def after_window(self, trainer: Trainer, window_id: str) -> None:
        if trainer.state.mode == "train":
            self.seen += 1

    def on_resume_point(self, trainer: Trainer, point: ResumePoint) -> None:
        if point == "window" and self.seen == self.windows:
            if trainer.rank == 0 and self.publish is not None:
                with open(self.path + ".pid", "w") as f:
                    json.dump(self._publisher_pid(), f)
            tmp = f"{self.path}.{trainer.rank}.tmp"  # the ranks write it side by side
            with open(tmp, "w") as f:
                json.dump({"step": trainer.state.global_step}, f)
            os.replace(tmp, self.path)


def land(data: str, hours: int) -> None:
    for f in su.write_data(data, "dlrm", hours=hours):
        open(os.path.join(os.path.dirname(f), "_SUCCESS"), "w").close()


def build(root: str, poll_s: float, hooks: list[Hook], timeout_s: float = 600,
          **args: Any) -> Trainer:
    data = os.path.join(root, "data")
    stream = StreamingWindows(lambda: partitioned_windows(data, ready_marker="_SUCCESS"),
                              end_marker=os.path.join(data, "_END"), poll_interval_s=poll_s,
                              timeout_s=timeout_s)
    spec, model = su.spec_and_model("dlrm")
    # save_steps: a save trigger (so the preemption saves) that never fires by itself.
    args = {"save_steps": 10_000, **args}
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=os.path.join(root, "ckpt"), log_steps=1000, seed=0,
                               preemption_grace_s=GRACE_S, **args),
        train_dataset=ParquetWindowDataset(stream, spec, batch_size=32),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False, hooks=hooks,
    )


def _publish(root: str) -> PublishHook:
    # A period the run never reaches: only the preemption publishes.
    return PublishHook(os.path.join(root, "published"), every_n_windows=100,
                       staging_dir=os.path.join(root, "stage"), final_timeout_s=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("save_steps", [10_000, None], ids=["save-trigger", "publish-only"])
def test_sigterm_while_a_trainer_waits_stops_commits_and_publishes_the_step(
        tmp_path: Path, save_steps: int | None) -> None:
    # publish-only: no save trigger in args; the PublishHook's requests make the run one that
    # saves (Hook.requests_saves), so the preemption still commits and publishes the step.
    root = str(tmp_path)
    land(os.path.join(root, "data"), hours=2)
    marker = os.path.join(root, "waiting.json")
    signalled: list[float] = []

    class SignalWhileWaiting(WaitingMarker):
        def on_resume_point(self, trainer: Trainer, point: ResumePoint) -> None:
            super().on_resume_point(trainer, point)
            if point == "window" and os.path.exists(marker) and not signalled:
                def fire() -> None:
                    signalled.append(time.monotonic())
                    os.kill(os.getpid(), signal.SIGTERM)
                threading.Timer(0.5, fire).start()  # the stream is waiting by then

    publish = _publish(root)
    trainer = build(root, POLL_S, [publish, SignalWhileWaiting(marker, 2)], save_steps=save_steps)
    with pytest.raises(Preempted) as info:
        trainer.train()
    took = time.monotonic() - signalled[0]
    step = json.load(open(marker))["step"]
    p = info.value.preemption
    assert (info.value.code, p.signal, p.step, p.committed) == (143, "SIGTERM", step, True)
    assert took < 10, took  # not the 30 s poll interval
    assert layout.is_committed(p.checkpoint)
    pointer = pub.read_pointer(os.path.join(root, "published"))
    assert pointer is not None and pointer.step == step
    assert publish.publisher_pid is None  # the publisher was let go


def _rank_one_signalled(root: str, poll_s: float) -> dict[str, Any]:
    """One rank of ``test_sigterm_to_one_rank_while_waiting...``: rank 1 SIGTERMs itself once
    both ranks wait (rank 0 between polls, rank 1 in the broadcast for rank 0's listing)."""
    rank = int(os.environ["RANK"])
    signalled: list[float] = []
    marker = os.path.join(root, "waiting.json")

    class SignalRankOne(WaitingMarker):
        def on_resume_point(self, trainer: Trainer, point: ResumePoint) -> None:
            super().on_resume_point(trainer, point)
            if point == "window" and rank == 1 and os.path.exists(marker) and not signalled:
                def fire() -> None:
                    signalled.append(time.monotonic())
                    os.kill(os.getpid(), signal.SIGTERM)
                threading.Timer(0.5, fire).start()

    trainer = build(root, poll_s, [SignalRankOne(marker, 2)])
    try:
        trainer.train()
    except Preempted as e:
        p = e.preemption
        return {"code": e.code, "signal": p.signal, "step": p.step, "committed": p.committed,
                "took": time.monotonic() - signalled[0] if signalled else None,
                "marker_step": json.load(open(marker))["step"]}
    return {"code": 0}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sigterm_to_one_rank_while_both_wait_stops_both_at_the_next_heartbeat(
        tmp_path: Path) -> None:
    from dist_utils import run_distributed

    root = str(tmp_path)
    land(os.path.join(root, "data"), hours=2)
    poll_s = 2.0
    results = run_distributed(_rank_one_signalled, world_size=2, timeout_s=100,
                              args=(root, poll_s))
    for r in results:
        assert (r["code"], r["signal"], r["step"], r["committed"]) == (143, "SIGTERM", r["marker_step"], True), r
    assert results[1]["took"] < poll_s + 3, results  # the next heartbeat, not the grace's end


def driver() -> None:
    """One rank of the torchrun job of ``test_sigint_to_torchrun_while_both_ranks_wait...``."""
    root = sys.argv[1]
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    publish = _publish(root)
    waiting = WaitingMarker(os.path.join(root, "waiting.json"), 2, publish)
    trainer = build(root, float(sys.argv[2]), [publish, waiting])
    out: dict[str, Any] = {"code": 0}
    try:
        trainer.train()
    except Preempted as e:
        p = e.preemption
        out = {"code": e.code, "signal": p.signal, "step": p.step, "committed": p.committed,
               "checkpoint": p.checkpoint, "publisher_pid": waiting.publisher_pid_at_preempt}
        raise
    finally:
        out["ended_at"] = time.time()
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_sigint_to_torchrun_while_both_ranks_wait_stops_both_and_publishes_the_step(
        tmp_path: Path) -> None:
    root = str(tmp_path)
    land(os.path.join(root, "data"), hours=2)
    poll_s = 2.0
    log = open(tmp_path / "job.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         __file__, root, str(poll_s)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def text() -> str:
        return (tmp_path / "job.log").read_text()[-6000:]

    try:
        marker = os.path.join(root, "waiting.json")
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert job.poll() is None, text()
            assert time.monotonic() < deadline, text()
            time.sleep(0.1)
        time.sleep(1.0)  # both ranks wait: rank 0 between polls, rank 1 in the broadcast
        t0 = time.time()
        os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C: the agent's process group
        job.wait(timeout=GRACE_S)
        took = time.time() - t0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    step = json.load(open(marker))["step"]
    ranks = [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in (0, 1)]
    for r in ranks:
        assert (r["code"], r["signal"], r["step"], r["committed"]) == (130, "SIGINT", step, True), (r, text())
        assert r["ended_at"] - t0 < 10, (r["ended_at"] - t0, text())
    assert took < 15, (took, text())  # well below the 30 s grace (the launcher's SIGKILL)
    assert layout.is_committed(ranks[0]["checkpoint"])
    # The publisher that published it is the one started with the job: the SIGINT missed it.
    started = json.load(open(marker + ".pid"))
    assert started is not None and ranks[0]["publisher_pid"] == started, (started, ranks[0])
    pointer = pub.read_pointer(os.path.join(root, "published"))
    assert pointer is not None and pointer.step == step, (pointer, text())
    assert "PublishError" not in text()


if __name__ == "__main__":
    driver()
