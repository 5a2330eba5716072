"""Checkpoints on object storage, against a real S3 server (SeaweedFS on 127.0.0.1, the
``s3_server`` fixture of tests/s3_server.py): save, resume, rotation and export from a bucket
(1 rank and 2 gloo ranks), a SIGKILL while shards upload, the lease lock, reader leases, and the
errors for a missing bucket and for denied credentials.

The server is reached the standard way (AWS_* environment variables, or an explicit
``filesystem=``); each test writes under its own prefix of the shared bucket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch
from dist_utils import run_distributed
from test_checkpoint_dist import _bitwise, check_bitwise
from test_checkpoint_trainer import (
    RowRecorder,
    RowWindows,
    assert_bitwise_equal,
    build,
    committed_steps,
    snapshot,
)

from recsys_trainer import Hook, JsonlMetricsHook
from recsys_trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    export_model_state_dict,
    layout,
)
from recsys_trainer.checkpoint.lock import LeaseLock
from recsys_trainer.storage import read_bytes, resolve

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def s3_env(s3_server: Any, monkeypatch: Any) -> Any:
    """The server's standard AWS environment in this process."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


def keys_under(server: Any, prefix: str) -> list[str]:
    fs = server.filesystem()
    sel = pafs.FileSelector(f"{server.bucket}/{prefix}", recursive=True, allow_not_found=True)
    return sorted(i.path.split(f"{prefix}/", 1)[1] for i in fs.get_file_info(sel)
                  if i.type == pafs.FileType.File)


def test_a_checkpoint_in_a_bucket_resumes_bitwise_rotates_and_exports(
        s3_env: Any, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)  # hooks' local files land under ./logs/<bucket>/<prefix>
    out = s3_env.url("one_rank")
    full = build(str(tmp_path / "full"), RowWindows(), train_steps=10, train_epoch=2)
    full.train()
    # Async saves (the default) at 3, 6; max_to_keep=2.
    build(out, RowWindows(), save_steps=3, train_steps=7, train_epoch=2, max_to_keep=2).train()
    assert committed_steps(out) == [3, 6]
    rec = RowRecorder()
    resumed = build(out, RowWindows(), hooks=[rec, JsonlMetricsHook(every=1)], save_steps=3,
                    train_steps=10, train_epoch=2, max_to_keep=2)
    resumed.train()
    assert rec.events[0] == ("loaded", "step_00000006")
    assert_bitwise_equal(snapshot(resumed), snapshot(full))
    # Rotation deleted step 3 entirely (marker first, then every object) after 9 committed.
    assert committed_steps(out) == [6, 9]
    files = keys_under(s3_env, "one_rank")
    assert not [f for f in files if f.startswith("step_00000003")]
    assert {"COMMITTED", ".metadata", "args.json", "rank_00000.pt", "__0_0.distcp"} <= \
        {f.split("/", 1)[1] for f in files if f.startswith("step_00000009/")}
    index = json.loads(read_bytes(out + "/checkpoints.json") or b"{}")
    assert index["latest"] == "step_00000009"
    assert "LOCK" not in files  # the lease ends with the run
    # The hooks' files: local, under ./logs/<bucket>/<prefix>, not in the bucket.
    assert (tmp_path / "logs" / s3_env.bucket / "one_rank" / "metrics.jsonl").exists()
    # Export straight from the bucket, without torch.distributed.
    # (Step 9 is the state after 9 steps: compare with a local checkpoint of the same step.)
    sd = export_model_state_dict(out + "/step_00000009", str(tmp_path / "model.pt"))
    ref_dir = str(tmp_path / "ref")
    build(ref_dir, RowWindows(), train_steps=9, train_epoch=2, save_end=True).train()
    ref = export_model_state_dict(os.path.join(ref_dir, "step_00000009"))
    assert sd.keys() == ref.keys() and sd
    assert all(torch.equal(sd[k], ref[k]) for k in sd)
    assert torch.load(tmp_path / "model.pt", weights_only=True).keys() == sd.keys()


def test_auto_resume_moves_a_bad_checkpoint_in_a_bucket_aside_object_by_object(
        s3_env: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """Object storage has no directory rename: the quarantine moves each object, the marker
    last, and the run falls back and saves that step anew under its own name."""
    monkeypatch.chdir(tmp_path)
    out = s3_env.url("bad_newest")
    build(out, RowWindows(), train_steps=4, save_steps=2, max_to_keep=5).train()
    s3_env.filesystem().delete_file(f"{s3_env.bucket}/bad_newest/step_00000004/__0_0.distcp")
    rec = RowRecorder()
    build(out, RowWindows(), hooks=[rec], train_steps=6, save_steps=2, max_to_keep=5).train()
    assert rec.events[0] == ("loaded", "step_00000002")
    assert committed_steps(out) == [2, 4, 6]
    files = keys_under(s3_env, "bad_newest")
    (moved,) = {f.split("/", 1)[0] for f in files if layout.QUARANTINE_INFIX in f}
    kept = {f.split("/", 1)[1] for f in files if f.startswith(moved + "/")}
    assert {"COMMITTED", ".metadata", "rank_00000.pt", "UNVERIFIED.txt"} <= kept
    assert "__0_0.distcp" not in kept


def test_an_explicit_filesystem_and_resume_from_a_bucket_path(s3_server: Any) -> None:
    """``CheckpointManager(filesystem=...)``: paths are in that filesystem, no environment."""
    fs = s3_server.filesystem()
    out = f"{s3_server.bucket}/explicit"
    mgr = CheckpointManager(out, save_steps=2, filesystem=fs)
    build(out, RowWindows(), train_steps=4, checkpointer=mgr).train()
    assert [i.step for i in layout.list_committed(resolve(out, fs))] == [2, 4]
    rec = RowRecorder()
    mgr2 = CheckpointManager(f"{out}/other", resume_from=f"{out}/step_00000002", filesystem=fs)
    t = build(f"{out}/other", RowWindows(), hooks=[rec], train_steps=3, checkpointer=mgr2)
    t.train()
    assert rec.events[0] == ("loaded", "step_00000002") and t.state.global_step == 3


def test_the_model_bank_warm_starts_from_a_checkpoint_in_a_bucket(s3_env: Any, tmp_path: Any) -> None:
    src = build(s3_env.url("bank"), RowWindows(), train_steps=3, save_end=True)
    src.train()
    t = build(str(tmp_path / "warm"), RowWindows(), train_steps=100,
              model_bank=[{"path": s3_env.url("bank"), "include": {"tables": ["*"]}}])
    t.resume()
    mine, theirs = snapshot(t), snapshot(src)
    tables = [k for k in theirs if "embedding_bags" in k and k.startswith("model.")]
    assert tables and all(torch.equal(mine[k], theirs[k]) for k in tables)
    assert t.state.global_step == 0  # only the tables were taken


@pytest.mark.distributed
def test_two_ranks_resume_from_a_bucket_bitwise_and_read_every_row_once(s3_server: Any) -> None:
    check_bitwise(run_distributed(_bitwise, world_size=2, timeout_s=240,
                                  args=(s3_server.url("two_ranks"),), env=s3_server.env()))
    files = keys_under(s3_server, "two_ranks/cut/step_00000006")
    assert {"rank_00000.pt", "rank_00001.pt", "__0_0.distcp", "__1_0.distcp"} <= set(files)


# ---------------------------------------------------------------------------- SIGKILL mid-upload

_KILLED_MID_UPLOAD = textwrap.dedent("""
    import os, signal, sys
    from contextlib import contextmanager
    sys.path.insert(0, {tests!r})
    from test_checkpoint_trainer import RowWindows, build
    from recsys_trainer.checkpoint import writer

    class DieMidUpload:
        # An upload stream of step 4: once 1 MiB went into it (its multipart upload is open,
        # the object not yet complete), the process is killed.
        def __init__(self, stream):
            self.stream, self.n = stream, 0
        def write(self, b):
            r = self.stream.write(b)
            self.n += memoryview(b).nbytes
            if self.n > (1 << 20):
                open({marker!r}, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return r
        def __getattr__(self, name):
            return getattr(self.stream, name)

    real = writer.ArrowFileSystem.create_stream
    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as s:
            yield DieMidUpload(s) if mode == "wb" and "step_00000004" in str(path) else s
    writer.ArrowFileSystem.create_stream = create_stream
    build({out!r}, RowWindows(), train_steps=6, save_steps=2, rows=[{rows}] * 4).train()
""")


@pytest.mark.distributed  # starts a training process (and kills it)
def test_a_sigkill_while_shards_upload_keeps_the_previous_checkpoint_and_is_ignored(
        s3_env: Any, tmp_path: Any) -> None:
    out = s3_env.url("killed")
    marker = str(tmp_path / "killed")
    code = _KILLED_MID_UPLOAD.format(tests=os.path.dirname(__file__), marker=marker, out=out,
                                     rows=200_000)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ}, timeout=240,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert os.path.exists(marker), "the process was not killed while step 4 uploaded"
    assert committed_steps(out) == [2]
    assert not layout.is_committed(out + "/step_00000004")
    # The next run resumes from step 2, removes the half-written step 4 at its start, and
    # saves 4 and 6 itself.
    rec = RowRecorder()
    t = build(out, RowWindows(), hooks=[rec], train_steps=6, save_steps=2,
              rows=[200_000] * 4)
    t.train()
    assert rec.events[0] == ("loaded", "step_00000002") and t.state.global_step == 6
    assert len(rec.rows) == 4 * 16  # steps 3..6 only
    assert committed_steps(out) == [2, 4, 6]


# ---------------------------------------------------------------------------- ownership

def test_the_lease_lock_refuses_a_live_holder_takes_over_a_dead_one_and_notices_a_takeover(
        s3_server: Any) -> None:
    where = resolve(f"{s3_server.bucket}/lease", s3_server.filesystem())
    first, second = LeaseLock(where, ttl_s=2.0), LeaseLock(where, ttl_s=2.0)
    assert first.acquire(world_size=2) is None
    holder = second.acquire(world_size=1)
    assert holder is not None and f"pid {os.getpid()}" in holder and "2 rank(s)" in holder
    first.release()
    assert second.acquire(world_size=1) is None
    second.release()
    # A lease left by a killed process on this host is stale at once.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"host": os.uname().nodename, "pid": dead.pid, "world_size": 1, "started": "x",
             "run_id": None, "token": "t0", "renewed": time.time()}
    with where.filesystem.open_output_stream(where.join("LOCK").path) as f:
        f.write(json.dumps(stale).encode())
    assert first.acquire(world_size=1) is None
    # Another job overwrites the lease: the holder finds out at its next renewal.
    with where.filesystem.open_output_stream(where.join("LOCK").path) as f:
        f.write(json.dumps({**stale, "pid": 1, "token": "other"}).encode())
    deadline = time.monotonic() + 10
    while first.lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.lost is not None and "taken over" in first.lost
    first.release()


def test_a_second_job_on_a_bucket_prefix_in_use_is_refused_naming_the_first(
        s3_env: Any) -> None:
    out = s3_env.url("busy")
    first = build(out, RowWindows(), train_steps=2, save_steps=1)
    first.checkpointer.resume()  # claims output_dir (takes the lease) as train() does
    try:
        with pytest.raises(CheckpointError, match="in use by the job whose rank 0 is pid") as e:
            build(out, RowWindows(), train_steps=2, save_steps=1).train()
        assert e.value.kind == "locked" and "lease" in str(e.value)
    finally:
        first.checkpointer.close()
    build(out, RowWindows(), train_steps=2, save_steps=1).train()  # released: now it may


def test_rotation_skips_a_checkpoint_while_it_is_being_read(s3_env: Any) -> None:
    out = s3_env.url("reading")
    build(out, RowWindows(), train_steps=2, save_steps=2, max_to_keep=1).train()
    with layout.reading(out + "/step_00000002"):
        build(out, RowWindows(), train_steps=4, save_steps=2, max_to_keep=1).train()
        assert committed_steps(out) == [2, 4]  # step 2 is read: rotation left it
    build(out, RowWindows(), train_steps=6, save_steps=2, max_to_keep=1).train()
    assert committed_steps(out) == [4, 6]  # 2 is gone now; 4 is the one this run resumed from


# ---------------------------------------------------------------------------- errors

def test_a_missing_bucket_is_refused_before_training_naming_the_bucket(s3_env: Any) -> None:
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="bucket 'no-such-bucket-x' of 's3://no-such-bucket"
                       "-x/run' does not exist") as e:
        build("s3://no-such-bucket-x/run", RowWindows(), train_steps=2, save_steps=1).train()
    assert e.value.kind == "unwritable"
    print(f"refused in {time.monotonic() - t0:.2f} s")


def test_denied_credentials_are_refused_before_training_naming_the_url_and_the_server_error(
        s3_server: Any) -> None:
    fs = s3_server.filesystem(secret_key="not-the-secret", connect_timeout=2, request_timeout=5)
    out = f"{s3_server.bucket}/denied"
    mgr = CheckpointManager(out, save_steps=1, filesystem=fs)
    with pytest.raises(CheckpointError, match="is not writable: rank 0 .*SIGNATURE_DOES_NOT_MATCH"
                       "|is not writable: rank 0 .*(ACCESS_DENIED|AccessDenied)") as e:
        build(out, RowWindows(), train_steps=2, checkpointer=mgr).train()
    assert e.value.kind == "unwritable" and out in str(e.value)


def test_resume_from_a_missing_bucket_path_is_a_clear_error(s3_env: Any) -> None:
    with pytest.raises(CheckpointError, match="`resume_from` is 's3://.*/nothing/here', which "
                       "does not exist") as e:
        build(s3_env.url("resume_missing"), RowWindows(), train_steps=1,
              resume_from=s3_env.url("nothing", "here")).train()
    assert e.value.kind == "missing"


class OverwriteLease(Hook):
    """At step 2, another job overwrites the lease (as one that started in the same instant
    would), and the loop waits for a renewal to notice."""

    def __init__(self, lease_path: str, fs: pafs.FileSystem) -> None:
        self.lease_path, self.fs = lease_path, fs

    def after_step(self, trainer: Any, output: Any) -> None:
        if trainer.state.global_step == 2:
            with self.fs.open_output_stream(self.lease_path) as f:
                f.write(json.dumps({"host": "other", "pid": 1, "world_size": 1, "started": "x",
                                    "run_id": None, "token": "other",
                                    "renewed": time.time()}).encode())
            time.sleep(1.0)  # > ttl / 4: a renewal runs and finds the foreign token


def test_a_job_whose_lease_was_taken_over_stops_saving_there(s3_server: Any) -> None:
    fs = s3_server.filesystem()
    out = f"{s3_server.bucket}/taken_over"
    mgr = CheckpointManager(out, save_steps=1, async_save=False, filesystem=fs, lease_ttl_s=2.0)
    trainer = build(out, RowWindows(), train_steps=5, checkpointer=mgr,
                    hooks=[OverwriteLease(f"{out}/LOCK", fs)])
    with pytest.raises(CheckpointError, match="taken over by the job whose rank 0 is pid 1 on "
                       "host other.*another job is saving into"):
        trainer.train()
    # Hooks' after_step runs before the step's save: the save of step 2 is the first after the
    # takeover, and it refused to write.
    assert [i.step for i in layout.list_committed(resolve(out, fs))] == [1]
