"""Real 2-rank gloo checkpoint tests (each through run_distributed, with a hard timeout): bitwise
resume, SIGKILL of a rank mid-save, resharding between world sizes 2 and 1, and output_dir
faults (a full disk, a read-only mount, a second job on the same directory)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_trainer import (
    LogCapture,
    RowRecorder,
    RowWindows,
    bitwise_verdict,
    build,
    committed_steps,
    snapshot,
)

from recsys_trainer import Hook, Trainer
from recsys_trainer.checkpoint import CheckpointError, layout
from recsys_trainer.checkpoint.export import read_full, saved_keys
from recsys_trainer.data.base import IterableAsWindow

TIMEOUT = 180
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _rank() -> int:
    return int(os.environ["RANK"])


# ---------------------------------------------------------------------------- bitwise resume

def _bitwise(root: str) -> dict[str, Any]:
    # 2 ranks: 4 batches per rank per window, 8 steps per epoch; stop at 6 (mid-window), end at 11.
    full_rec = RowRecorder()
    full = build(os.path.join(root, "full"), RowWindows(), hooks=[full_rec], train_steps=11, train_epoch=2)
    full.train()
    cut = os.path.join(root, "cut")
    first = RowRecorder()
    build(cut, RowWindows(), hooks=[first], train_steps=6, save_steps=3, train_epoch=2).train()
    second = RowRecorder()
    resumed = build(cut, RowWindows(), hooks=[second], train_steps=11, train_epoch=2)
    resumed.train()
    equal = bitwise_verdict(snapshot(resumed), snapshot(full))
    return {"equal": equal, "full_rows": full_rec.rows, "rows": first.rows + second.rows,
            "loaded": second.events, "step": resumed.state.global_step}


def check_bitwise(results: list[dict[str, Any]]) -> None:
    """``_bitwise``'s 2 ranks: bitwise equal to the straight run, resumed from step 6, every row
    read exactly once."""
    for r in results:
        assert r["equal"] == "yes", r["equal"]
        assert r["step"] == 11 and ("loaded", "step_00000006") in r["loaded"]
        assert sorted(r["rows"]) == sorted(r["full_rows"])
    all_rows = results[0]["rows"] + results[1]["rows"]
    assert len(all_rows) == len(set(all_rows)) == 11 * 2 * 16


def test_two_rank_resume_is_bitwise_identical_and_reads_every_row_exactly_once(tmp_path: Any) -> None:
    check_bitwise(run_distributed(_bitwise, world_size=2, timeout_s=TIMEOUT, args=(str(tmp_path),)))


# ---------------------------------------------------------------------------- a bad newest checkpoint

def _fall_back_past_a_corrupt_shard(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    # 2 ranks: 8 steps per epoch; train into the second.
    out = os.path.join(root, "out")
    build(out, RowWindows(), train_steps=6, save_steps=2, max_to_keep=10,
          train_epoch=2).train()
    ref = build(os.path.join(root, "ref"), RowWindows(), train_steps=10,
                train_epoch=2, resume_from=os.path.join(out, "step_00000004"))
    ref.train()
    dist.barrier()
    shard = os.path.join(out, "step_00000006", "__1_0.distcp")  # rank 1's shard
    if _rank() == 0:
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    dist.barrier()
    rec = RowRecorder()
    with LogCapture("recsys_trainer.checkpoint.manager") as log:
        t = build(out, RowWindows(), hooks=[rec], train_steps=10, save_steps=2, max_to_keep=2,
                  train_epoch=2)
        t.train()
    moved = sorted(n for n in os.listdir(out) if n.startswith("step_00000006."))
    strict = None
    try:
        build(os.path.join(root, f"strict{_rank()}"), RowWindows(), train_steps=12,
              resume_from=os.path.join(out, moved[0])).train()
    except CheckpointError as e:
        strict = (str(e), e.path, e.kind)
    return {"loaded": rec.events[0], "equal": bitwise_verdict(snapshot(t), snapshot(ref)),
            "warnings": log.messages, "moved": moved, "steps": committed_steps(out),
            "strict": strict, "shard": shard}


def test_two_ranks_fall_back_past_a_corrupt_newest_checkpoint_together_and_an_explicit_path_stays_strict(
        tmp_path: Any) -> None:
    results = run_distributed(_fall_back_past_a_corrupt_shard, world_size=2, timeout_s=TIMEOUT,
                              args=(str(tmp_path),))
    for r in results:
        # Both ranks resumed from step 4, exactly as a run resumed from it by path.
        assert r["loaded"] == ("loaded", "step_00000004") and r["equal"] == "yes", r["equal"]
        warning = next(w for w in r["warnings"] if "fails verification" in w)
        assert "step_00000006" in warning and "__1_0.distcp" in warning and "CRC32" in warning
        assert len(r["moved"]) == 1 and r["moved"][0] in warning
        assert r["steps"] == [4, 8, 10]
        message, path, kind = r["strict"]
        assert kind == "corrupt" and path.endswith("__1_0.distcp") and "CRC32" in message
        assert "Load an older one by its path" in message
    assert results[0]["moved"] == results[1]["moved"]


# ---------------------------------------------------------------------------- SIGKILL mid-save

def _killed_mid_save(out: str) -> None:
    if _rank() == 1:
        import torch.distributed.checkpoint as dcp

        real = dcp.save

        def die_after_dcp_at_step_4(state: Any, **kw: Any) -> Any:
            result = real(state, **kw)
            # DCP has written every shard and even .metadata: only the commit is missing.
            if "step_00000004" in str(kw["storage_writer"].path):
                open(os.path.join(out, "killed_rank1"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        dcp.save = die_after_dcp_at_step_4  # type: ignore[assignment]
    build(out, RowWindows(), train_steps=6, save_steps=2).train()


def _resume_after_crash(out: str) -> dict[str, Any]:
    rec = RowRecorder()
    t = build(out, RowWindows(), hooks=[rec], train_steps=6, save_steps=2)
    t.train()
    return {"events": rec.events, "step": t.state.global_step, "rows": rec.rows}


def test_sigkill_of_a_rank_mid_save_keeps_the_previous_checkpoint_and_the_next_run_resumes_from_it(
        tmp_path: Any) -> None:
    out = str(tmp_path)
    with pytest.raises((RuntimeError, AssertionError)) as e:
        run_distributed(_killed_mid_save, world_size=2, timeout_s=TIMEOUT, args=(out,))
    assert "exited with code" in str(e.value) or "failed" in str(e.value)
    assert os.path.exists(os.path.join(out, "killed_rank1")), "rank 1 was not killed mid-save"
    os.remove(os.path.join(out, "killed_rank1"))
    half = os.path.join(out, "step_00000004")
    assert os.path.exists(os.path.join(half, ".metadata")), "the kill came before DCP finished"
    assert not layout.is_committed(half)
    assert committed_steps(out) == [2]
    results = run_distributed(_resume_after_crash, world_size=2, timeout_s=TIMEOUT, args=(out,))
    for r in results:
        assert r["events"][0] == ("loaded", "step_00000002") and r["step"] == 6
        assert len(r["rows"]) == 4 * 16  # steps 3..6 only: nothing re-read, nothing skipped
    assert committed_steps(out) == [2, 4, 6]


# ---------------------------------------------------------------------------- resharding

def _train_two_ranks(out: str) -> None:
    # Saves at 3 (mid-window), 4 (window boundary), 6 (8 ends training, not a window).
    build(out, RowWindows(), train_steps=8, save_steps=3, save_every_n_windows=1,
          max_to_keep=10).train()


def _load_and_resave(src: str, dst: str) -> dict[str, Any]:
    t = build(os.path.join(dst, "run"), RowWindows(), resume_from=src, train_steps=100)
    t.resume()
    t.save_checkpoint(dst + "/resaved")
    return t.state.state_dict()


def _all_tensors(ckpt: str) -> dict[str, torch.Tensor]:
    full = read_full(ckpt, set(saved_keys(ckpt)))
    return {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}


def test_resharding_2_to_1_and_1_to_2_restores_model_and_both_optimizers(tmp_path: Any) -> None:
    two = str(tmp_path / "two")
    run_distributed(_train_two_ranks, world_size=2, timeout_s=TIMEOUT, args=(two,))
    assert committed_steps(two) == [3, 4, 6]
    boundary = os.path.join(two, "step_00000004")

    # 2 -> 1 (this process, world size 1): load, re-save, compare every tensor whole.
    one = str(tmp_path / "one")
    state = _load_and_resave(boundary, one)
    assert (state["global_step"], state["window_index"], state["batches_in_window"]) == (4, 1, 0)
    a, b = _all_tensors(boundary), _all_tensors(one + "/resaved")
    assert a.keys() == b.keys() and any(k.startswith("optim.state.sparse.") for k in a)
    assert any(k.startswith("optim.state.dense.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []

    # A mid-window position maps to another world size as the part trained so far (the new
    # ranks read the rows the old ones left: tests/test_elastic_plan.py) ...
    state = _load_and_resave(os.path.join(two, "step_00000003"), str(tmp_path / "exact"))
    assert (state["global_step"], state["window_index"], state["batches_in_window"],
            state["window_segments"]) == (3, 0, 0, [[2, 3]])
    # A model bank's include "data" maps it the same way (its source ignores the policy) ...
    bank = [{"path": os.path.join(two, "step_00000003"), "include": {"counters": ["*"], "data": ["*"]}}]
    t = build(str(tmp_path / "bank"), RowWindows(), model_bank=bank, train_steps=100)
    t.resume()
    assert (t.state.global_step, t.state.window_segments, t.state.batches_in_window) == (3, [[2, 3]], 0)
    # ... and refuses a dataset that cannot tell which rows were consumed, saying what to drop.
    with pytest.raises(CheckpointError, match="drop 'data' from its include") as e:
        build(str(tmp_path / "bank2"), IterableAsWindow(lambda: iter(())), model_bank=bank,
              train_steps=100).resume()
    assert e.value.kind == "reshard"
    # ... or, asked to refuse, is a clear error ...
    with pytest.raises(CheckpointError, match="restart_window") as e:
        t = build(str(tmp_path / "bad"), RowWindows(), train_steps=100,
                  resume_from=os.path.join(two, "step_00000003"), reshard_data_position="error")
        t.resume()
    assert e.value.kind == "reshard"
    # ... or restarts that window when asked to.
    t = build(str(tmp_path / "rw"), RowWindows(), resume_from=os.path.join(two, "step_00000003"),
              reshard_data_position="restart_window", train_steps=100)
    t.resume()
    assert (t.state.global_step, t.state.window_index, t.state.batches_in_window) == (3, 0, 0)

    # 1 -> 2: both ranks load the world-size-1 checkpoint and re-save it.
    back = str(tmp_path / "back")
    states = run_distributed(_load_and_resave, world_size=2, timeout_s=TIMEOUT,
                             args=(one + "/resaved", back))
    assert all(s["window_index"] == 1 and s["global_step"] == 4 for s in states)
    c = _all_tensors(back + "/resaved")
    assert c.keys() == a.keys() and [k for k in a if not torch.equal(a[k], c[k])] == []


# ---------------------------------------------------------------------------- a rank fails mid-save

def _one_rank_fails_a_save(out: str) -> dict[str, Any]:
    import shutil

    from recsys_trainer.checkpoint import contents

    t = build(out, RowWindows(), train_steps=2)
    t.train()
    errors: list[str] = []
    # Rank 0 cannot clear a stale directory of this step (before the first collective).
    stale = os.path.join(out, "step_00000002")
    if _rank() == 0:
        os.makedirs(stale)
    real_rmtree, real_name = shutil.rmtree, contents.extra_file_name

    def no_rmtree(path: Any, *a: Any, **kw: Any) -> None:
        raise PermissionError(f"denied: {path}")

    if _rank() == 0:
        shutil.rmtree = no_rmtree  # type: ignore[assignment]
    try:
        t.save_checkpoint()
    except CheckpointError as e:
        errors.append(str(e))
    finally:
        shutil.rmtree = real_rmtree
    # Rank 1 cannot write its extra-state file (after DCP's collectives).
    if _rank() == 1:
        contents.extra_file_name = lambda r: os.path.join("no_such_dir", real_name(r))  # type: ignore[assignment]
    try:
        t.save_checkpoint()
    except CheckpointError as e:
        errors.append(str(e))
    finally:
        contents.extra_file_name = real_name  # type: ignore[assignment]
    committed_after_failures = layout.is_committed(stale)
    # The group's collectives are still in step: the next save commits.
    t.save_checkpoint()
    return {"errors": errors, "committed_after_failures": committed_after_failures,
            "committed": committed_steps(out)}


def test_a_save_that_fails_on_one_rank_raises_on_every_rank_and_never_hangs(tmp_path: Any) -> None:
    results = run_distributed(_one_rank_fails_a_save, world_size=2, timeout_s=120,
                              args=(str(tmp_path),))
    for r in results:
        assert len(r["errors"]) == 2, r["errors"]
        assert "rank 0: PermissionError" in r["errors"][0]
        assert "rank 1: FileNotFoundError" in r["errors"][1]
        assert not r["committed_after_failures"] and r["committed"] == [2]


# ---------------------------------------------------------------------------- output_dir faults

def _disk_fills_after_the_first_save(out: str) -> dict[str, Any]:
    from fs_utils import fill

    class FillAfterFirstCommit(Hook):
        def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
            if _rank() == 0 and path.endswith("step_00000002"):
                fill(out)

    t = build(out, RowWindows(), hooks=[FillAfterFirstCommit()], train_steps=6, save_steps=2)
    try:
        t.train()
    except CheckpointError as e:
        return {"message": str(e), "kind": e.kind, "path": e.path, "cause": repr(e.__cause__),
                "step": t.state.global_step}
    return {"message": None}


def test_a_full_disk_during_a_save_is_a_checkpoint_error_naming_path_rank_and_no_space_and_keeps_the_last_one(
        tmp_path: Any) -> None:
    from fs_utils import small_tmpfs

    out = str(tmp_path / "small")
    with small_tmpfs(out, size_kib=2048):
        results = run_distributed(_disk_fills_after_the_first_save, world_size=2, timeout_s=TIMEOUT,
                                  args=(out,))
        failing = os.path.join(out, "step_00000004")
        for r in results:
            assert r["kind"] == "save_failed" and r["path"] == failing, r
            assert r["message"].startswith(f"saving checkpoint step 4 to {failing!r} failed: rank "), r
            assert "OSError: [Errno 28] No space left on device" in r["message"]
            assert "The last committed checkpoint is kept" in r["message"]
            assert "\n" not in r["message"] and r["cause"] == "None"  # not DCP's 190 lines
        # Both ranks stop at the same step (the next save), not one rank as soon as its writer
        # thread fails while the other trains on and waits for it.
        assert results[0]["step"] == results[1]["step"] == 6
        assert committed_steps(out) == [2]
        last = os.path.join(out, "step_00000002")
        layout.verify_files(last, layout.read_manifest(last) or {}, checksums=True)


def _train_into(out: str) -> dict[str, Any]:
    t = build(out, RowWindows(), train_steps=4, save_steps=2)
    try:
        t.train()
    except CheckpointError as e:
        return {"message": str(e), "kind": e.kind, "step": t.state.global_step}
    return {"message": None, "kind": None, "step": t.state.global_step}


def test_a_read_only_output_dir_fails_every_rank_before_training_starts(tmp_path: Any) -> None:
    from fs_utils import read_only

    out = str(tmp_path / "ro")
    with read_only(out):
        results = run_distributed(_train_into, world_size=2, timeout_s=TIMEOUT, args=(out,))
    for r in results:
        assert r["kind"] == "unwritable" and r["step"] == 0, r
        assert r["message"].startswith(f"`output_dir` {out!r} is not writable: rank 0 (host "), r
        assert "Read-only file system" in r["message"] and "training did not start" in r["message"]


_HOLDER = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
from test_checkpoint_trainer import RowWindows, build
from recsys_trainer import LambdaHook

out = sys.argv[1]

def hold(trainer, output):
    open(os.path.join(out, "holding"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)

build(out, RowWindows(), hooks=[LambdaHook(after_step=hold)], train_steps=2, save_steps=1).train()
"""


def test_a_second_job_on_a_running_jobs_output_dir_is_refused_naming_it_and_a_killed_jobs_lock_does_not_linger(
        tmp_path: Any) -> None:
    import subprocess
    import sys
    import time

    out = str(tmp_path / "shared")
    os.makedirs(out)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, out, tests_dir],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "holding")):
            assert holder.poll() is None, holder.stderr.read() if holder.stderr else ""
            assert time.monotonic() < deadline, "the first job never started training"
            time.sleep(0.1)
        refused = run_distributed(_train_into, world_size=2, timeout_s=TIMEOUT, args=(out,))
        for r in refused:
            assert r["kind"] == "locked" and r["step"] == 0, r
            assert r["message"].startswith(
                f"`output_dir` {out!r} is in use by the job whose rank 0 is pid {holder.pid} on host "), r
        # The first job is killed while it holds the lock: the OS drops the lock with it.
        holder.kill()
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)
    after = run_distributed(_train_into, world_size=2, timeout_s=TIMEOUT, args=(out,))
    assert [r["message"] for r in after] == [None, None] and after[0]["step"] == 4
