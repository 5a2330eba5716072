"""Elastic jobs: a node lost or added in the middle of a window, and the job goes on at the new
size with every row trained exactly once.

Two torchrun agents on 127.0.0.1 stand in for two nodes (``--nnodes=1:2``, c10d rendezvous,
``--max-restarts``), one worker each, running tests/elastic_driver.py. The agent started first
hosts the rendezvous store and is kept alive (production runs the store elsewhere, or etcd).
Each step's rows are recorded (the driver's ``RowLog``), and a resumed run deletes the records of
steps its checkpoint does not hold, so the records are what the final model trained on.

- A node dies while its rank writes a checkpoint (an asynchronous save in flight), in the middle
  of a window of a stream that a ``PublishHook`` publishes and a follower serves: the uncommitted
  checkpoint is never used, the other agent re-forms the job at world size 1, which resumes from
  the checkpoint before it, mid-window, on the rows no old rank consumed; publishing goes on
  (``LATEST`` never goes back) and the follower serves the windows landed after the loss. The
  job ends 0; every row of every window is trained exactly once; the model is a DIN (sequence
  features in an ``EmbeddingCollection`` beside pooled tables: both reshard).
- A node joins a 1-node job in the middle of a window: the agents stop the worker (SIGTERM: it
  saves that step), re-form at world size 2 and resume on the rows the one rank left, with
  ``train_and_evaluate`` (every window evaluated once, on all its rows), a shuffled window,
  gradient accumulation, and dynamic tables beside hashed ones (both reshard).

torch's agents share the rendezvous TCP store with the workers by default, and a round that a
new node joins then never completes (pytorch/pytorch#135712; measured here: both agents wait 60
s for each other's keys and exit 1): the agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
as docs/checkpoint.md tells users to.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import serving_utils as su
from elastic_utils import Node, all_rows, jsonl, progress, trained, wait_for

from recsys_trainer.distributed import free_port
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.runtime import follow

ROWS = 320  # per window: 20 steps of 8 rows per rank at world size 2, 40 at world size 1


def _setup(root: Path, kind: str, hours: int, cfg: dict[str, Any], eval_rows: int = 0) -> None:
    su.write_data(str(root / "data"), kind, hours=hours, rows=ROWS)
    if eval_rows:
        su.write_data(str(root / "eval"), kind, hours=hours, rows=eval_rows, seed=5)
    (root / "config.json").write_text(json.dumps({"kind": kind, "batch_size": 8, **cfg}))


def _assert_exactly_once(root: Path) -> dict[tuple[int, str], int]:
    """Every row of every train window was trained once by the final model; returns rank 0's
    steps per (world size, window)."""
    rows, parts = trained(root)
    twice = sorted(i for i, n in rows.items() if n > 1)
    never = sorted(set(all_rows(root)) - set(rows))
    assert not twice and not never, (f"{len(twice)} rows trained twice, e.g. {twice[:8]}; "
                                     f"{len(never)} never, e.g. {never[:8]}")
    assert sorted(rows) == all_rows(root)
    return parts


class PointerWatch:
    """Reads ``LATEST`` every 0.1 s in a thread: every (sequence, step, window) seen."""

    def __init__(self, location: str) -> None:
        self.location, self.seen = location, []  # type: list[tuple[int, int, str | None]]
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                p = pub.read_pointer(self.location)
            except Exception as e:  # noqa: BLE001 - a pointer that cannot be read fails the test
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            if p is not None and (not self.seen or self.seen[-1][0] != p.sequence):
                self.seen.append((p.sequence, p.step, p.window))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_node_lost_mid_window_during_a_save_leaves_a_smaller_job_that_trains_every_row_once_and_keeps_publishing(
        tmp_path: Path) -> None:
    root = tmp_path
    # Window 1 at world size 2: saves at steps 24 (4 batches per rank in) and 28; rank 1's node
    # dies while writing step 28's files.
    _setup(root, "din", hours=3, cfg={"stream": True, "publish": True, "save_steps": 4,
                                        "pace_s": 0.05, "die": {"rank": 1, "at_save_of_step": 28}})
    data, location = root / "data", str(root / "published")
    land = lambda h: (data / f"hour={h:02d}" / "_SUCCESS").touch()  # noqa: E731
    land(0)
    land(1)
    port = free_port()
    a = Node(root, "a", port)
    time.sleep(0.5)  # a hosts the rendezvous store: it starts first
    b = Node(root, "b", port)
    follower, watch = None, PointerWatch(location)
    try:
        died = wait_for("node b's death", lambda: (root / "died.json").exists()
                         and json.loads((root / "died.json").read_text()), [a], 120)
        assert b.wait(10) == -signal.SIGKILL
        # The survivor resumes at world size 1 from the checkpoint before the lost one.
        start = wait_for("a restart at world size 1", lambda: next(
            (s for s in jsonl(root / "starts.jsonl") if s["world_size"] == 1), None), [a], 120)
        assert (start["resumed_step"], start["window_index"], start["segments"]) == (24, 1, [[2, 4]])
        follower = follow.follow(location, poll_s=0.2)
        land(2)
        wait_for("a publish of the window landed after the loss", lambda: (
            (p := pub.read_pointer(location)) is not None and p.window == "hour=02"), [a], 120)
        (data / "_END").touch()
        assert a.wait(120) == 0, a.text()[-4000:]
        first = jsonl(root / "first_steps.jsonl")[-1]
        recovery_s = first["time"] - died["time"]
        text = a.text()
        wait_for("the follower to serve the last window", lambda: (
            follower.served is not None and follower.served.window == "hour=02"), [], 30)
    finally:
        watch.stop()
        if follower is not None:
            follower.stop()
        a.close()
        b.close()
    parts = _assert_exactly_once(root)
    # Window 1 was trained at both sizes: the loss was in its middle.
    assert parts[(2, "hour=01")] == 4 and parts[(1, "hour=01")] == 32, parts
    assert (1, "hour=02") in parts and (2, "hour=02") not in parts
    assert "resuming on the rows no old rank consumed" in text
    # The save node B died in was never loaded: the resume cleared it away as incomplete.
    assert "removing incomplete checkpoint" in text and "step_00000028 (its save never" in text
    # LATEST never went back (sequence or step) and went on after the loss, to the last step.
    assert watch.errors == []
    seqs, steps = [q for q, _, _ in watch.seen], [t for _, t, _ in watch.seen]
    assert seqs == sorted(seqs) and steps == sorted(steps), watch.seen
    final_step = max(int(p.name[5:11]) for p in (root / "records").glob("step_*.json"))
    assert watch.seen[-1][1:] == (final_step, "hour=02"), watch.seen
    assert any(t > 28 for _, t, _ in watch.seen[:-1]), "published after the loss, before the end"
    assert recovery_s < 60, recovery_s


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_node_that_joins_mid_window_grows_the_job_and_every_row_and_evaluation_counts_once(
        tmp_path: Path) -> None:
    root = tmp_path
    _setup(root, "mixed", hours=3, eval_rows=96,
           cfg={"mode": "train_and_evaluate", "shuffle": True, "accum": 2, "save_steps": 4,
                "pace_s": 0.05, "hold": {"window_index": 1, "batches": 8}})
    port = free_port()
    a = Node(root, "a", port)
    b = None
    try:
        # Alone, a trains at world size 1 (window 1: 20 steps of 2 micro-batches of 8 rows),
        # and holds after 8 micro-batches of window 1 until the join's stop signal.
        wait_for("a step in the middle of window 1", lambda: (
            (p := progress(root)) is not None and p["window_index"] == 1
            and p["batches_in_window"] >= 8), [a], 120)
        b = Node(root, "b", port)
        assert a.wait(180) == 0, a.text()[-4000:]
        assert b.wait(60) == 0, b.text()[-4000:]
        text = a.text()
    finally:
        a.close()
        if b is not None:
            b.close()
    starts = jsonl(root / "starts.jsonl")
    grown = [s for s in starts if s["world_size"] == 2]
    assert len(grown) == 2 and {s["rank"] for s in grown} == {0, 1}
    # The agent's SIGTERM made the one rank save the step it stopped after: the new ranks
    # start from it, on the rows the one rank left of window 1.
    assert "SIGTERM: checkpoint of step" in text
    assert (grown[0]["resumed_step"], grown[0]["window_index"], grown[0]["segments"]) == (
        24, 1, [[1, 8]])  # 20 steps of window 0, 4 of window 1
    parts = _assert_exactly_once(root)
    assert (1, "hour=01") in parts and (2, "hour=01") in parts, parts
    # Each train window's evaluation ran once in the final run, on every eval row.
    evals = jsonl(root / "evals.jsonl")
    last = {e["window"]: e for e in evals}
    assert sorted(last) == ["hour=00", "hour=01", "hour=02"]
    assert [last[w]["rows"] for w in sorted(last)] == [96, 96, 99]  # the last hour's edge rows
