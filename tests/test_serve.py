"""``recsys-serve`` (recsys_trainer/serving/runtime/server.py) as a real process on 127.0.0.1, following
a published location built by hand from real exports (tests/follow_utils.py): 503 before
anything is published, JSON and Arrow IPC scoring equal to the Scorer's, named 400s, /health
and /model, a new pointer followed, no failed request while the model swaps under load, and a
SIGTERM that lets an in-flight request finish and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import follow_utils as fu
import numpy as np
import pyarrow as pa
import pytest
from s3_server import free_ports

from recsys_trainer.serving import Scorer
from recsys_trainer.serving.runtime.server import ARROW_STREAM, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> fu.Chain:
    return fu.build_chain(str(tmp_path_factory.mktemp("chain")))


def _request(url: str, body: bytes | None = None, content_type: str = "application/json",
             accept: str | None = None, timeout: float = 30) -> tuple[int, Any, bytes]:
    headers = {"Content-Type": content_type} if body is not None else {}
    if accept:
        headers["Accept"] = accept
    req = urllib.request.Request(url, data=body, headers=headers,
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()  # headers: case-insensitive
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _json(url: str, payload: Any = None) -> tuple[int, Any]:
    status, _, data = _request(url, None if payload is None else json.dumps(payload).encode())
    return status, json.loads(data)


def _arrow(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _wait(predicate: Any, what: str, proc: subprocess.Popen[bytes], log: str,
          timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"recsys-serve exited ({proc.returncode}) waiting for {what}:\n"
                                 + open(log).read()[-3000:])
        try:
            if predicate():
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n" + open(log).read()[-3000:])


@pytest.mark.timeout(120)
def test_recsys_serve_scores_follows_the_pointer_and_stops_gracefully_on_sigterm(
        chain: fu.Chain, tmp_path) -> None:
    loc = chain.fresh_location(str(tmp_path / "pub"))  # artifacts, but no LATEST yet
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = str(tmp_path / "serve.log")
    refs = {step: Scorer(path) for step, path in chain.full.items()}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "recsys_trainer.serving.runtime.server", loc,
                                 "--port", str(port), "--poll-s", "0.1"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait(lambda: _request(f"{url}/health")[0] == 503, "the server", proc, log, 90)
        status, health = _json(f"{url}/health")
        assert health["status"] == "no model" and health["last_error"] is None
        assert _json(f"{url}/score", {"rows": []})[1]["error"] == "NoModel"

        chain.point(loc, 1, "bases/b0", (), 1)
        _wait(lambda: _request(f"{url}/health")[0] == 200, "the first model", proc, log)
        status, model = _json(f"{url}/model")
        assert status == 200 and model["step"] == 1 and model["sequence"] == 1
        assert model["content_hash"] == chain.hashes[1] and model["window"] == "hour=01"
        assert model["window_time"] == 1.7e9 + 1 and model["deltas"] == []
        assert model["base"] == "bases/b0" and model["loaded_at"] <= time.time()

        # JSON rows (edge rows with nulls and an unseen string among them) and Arrow IPC.
        batch = chain.rows.slice(len(chain.rows) - 20)
        rows = batch.to_pylist()
        status, got = _json(f"{url}/score", {"rows": rows})
        assert status == 200, got
        assert (got["step"], got["content_hash"], got["outputs"]) == (1, chain.hashes[1], ["label"])
        assert np.array_equal(np.asarray(got["scores"], dtype=np.float32),
                              refs[1].score(rows).reshape(-1, 1))
        status, headers, data = _request(f"{url}/score", _arrow(batch), ARROW_STREAM)
        assert status == 200 and headers["X-Model-Step"] == "1"
        assert np.array_equal(np.asarray(json.loads(data)["scores"], dtype=np.float32),
                              refs[1].score(batch).reshape(-1, 1))
        status, headers, data = _request(f"{url}/score", _arrow(batch), ARROW_STREAM,
                                         accept=ARROW_STREAM)
        table = pa.ipc.open_stream(data).read_all()
        assert status == 200 and table.column_names == ["label"]
        assert np.array_equal(table.column("label").to_numpy(), refs[1].score(batch))

        status, got = _json(f"{url}/score", {"rows": []})
        assert status == 200 and got["scores"] == [] and got["step"] == 1
        status, _, data = _request(f"{url}/score", _arrow(batch.slice(0, 0)), ARROW_STREAM)
        assert status == 200 and json.loads(data)["scores"] == []

        # Named 400s: the scorer's DataError (column and row), a body it cannot read.
        status, err = _json(f"{url}/score", {"rows": [{**rows[0], "I1": "abc"}]})
        assert status == 400 and err["error"] == "DataError" and err["column"] == "I1"
        assert "I1" in err["message"]
        no_c1 = [{k: v for k, v in rows[0].items() if k != "C1"}]
        status, err = _json(f"{url}/score", {"rows": no_c1})
        assert status == 400 and err["error"] == "DataError" and "C1" in err["message"]
        status, _, data = _request(f"{url}/score", b"{not json")
        assert status == 400 and json.loads(data)["error"] == "BadRequest"
        assert _json(f"{url}/score", {"rows": [1]})[0] == 400
        status, _, data = _request(f"{url}/score", b"x", "text/csv")
        assert status == 415
        status, _, data = _request(f"{url}/score", b"not arrow", ARROW_STREAM)
        assert status == 400 and "Arrow IPC" in json.loads(data)["message"]

        # A new pointer is followed.
        chain.point(loc, 2, "bases/b0", ("deltas/d1",), 3)
        _wait(lambda: _json(f"{url}/model")[1]["step"] == 3, "the delta", proc, log)
        status, got = _json(f"{url}/score", {"rows": rows})
        assert got["step"] == 3 and np.array_equal(np.asarray(got["scores"], dtype=np.float32),
                                                    refs[3].score(rows).reshape(-1, 1))

        # A pointer to a base that cannot be read: the last good model stays, /health says why.
        chain.point(loc, 3, "bases/gone", (), 5, check=False)
        _wait(lambda: _json(f"{url}/health")[1]["last_error"] is not None, "the error", proc, log)
        status, health = _json(f"{url}/health")
        assert status == 200 and health["step"] == 3 and health["sequence"] == 2
        assert health["last_error"]["kind"] == "base" and "bases/gone" in health["last_error"]["message"]
        assert _json(f"{url}/score", {"rows": rows})[1]["step"] == 3

        # Steady requests while the model swaps: none fails, each scored by the model it names.
        expected = {s: refs[s].score(rows).reshape(-1, 1) for s in refs}
        states = [("bases/b0", ("deltas/d1", "deltas/d2"), 5), ("bases/b0", (), 1),
                  ("bases/b0", ("deltas/d1",), 3)]
        done = threading.Event()

        def publish() -> None:
            seq = 3
            while not done.is_set():
                for base, deltas, step in states:
                    seq += 1
                    chain.point(loc, seq, base, deltas, step)
                    time.sleep(0.3)

        publisher = threading.Thread(target=publish)
        publisher.start()
        steps = []
        try:
            for _ in range(60):
                status, got = _json(f"{url}/score", {"rows": rows})
                assert status == 200, got
                steps.append(got["step"])
                assert np.array_equal(np.asarray(got["scores"], dtype=np.float32),
                                      expected[got["step"]])
        finally:
            done.set()
            publisher.join(30)
        assert len(set(steps)) >= 2, steps
        status, model = _json(f"{url}/model")
        assert model["swaps"] >= 3 and model["last_error"] is None

        # SIGTERM with a request in flight (its headers sent, its body not yet): it is
        # answered, then the server exits 0.
        body = json.dumps({"rows": rows}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            s.sendall(body[10:])
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert b'"scores"' in answer
        assert proc.wait(30) == 0, open(log).read()[-3000:]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.timeout(30)
def test_recsys_serve_options_and_console_script() -> None:
    args = parse_args(["s3://bucket/prefix"])
    assert (args.host, args.port, args.poll_s, args.workers) == ("127.0.0.1", 8080, 2.0, 1)
    args = parse_args(["/x", "--host", "0.0.0.0", "--port", "9", "--poll-s", "0.5",
                       "--workers", "2"])
    assert (args.host, args.port, args.poll_s, args.workers) == ("0.0.0.0", 9, 0.5, 2)
    with pytest.raises(SystemExit):
        parse_args(["/x", "--poll-s", "0"])
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        assert 'recsys-serve = "recsys_trainer.serving.runtime.server:main"' in f.read()
    # A serving host needs no training stack: the server imports none of it.
    code = ("import sys, recsys_trainer.serving.runtime.server; "
            "print(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('torchrec', 'fbgemm_gpu', 'accelerate', 'tensorboard') or "
            "m == 'recsys_trainer.trainer'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=25, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _asgi_post(app: Any, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[str, Any]]:
    """POST /score to the ASGI app in this process, the body in ``chunks`` (as a client streams
    it); returns the status and the JSON body of the answer."""
    import asyncio

    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
               for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/score", "raw_path": b"/score", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


@pytest.mark.timeout(60)
def test_an_oversized_body_is_refused_without_being_held_whole(tmp_path) -> None:
    from recsys_trainer.serving.runtime.follow import Follower
    from recsys_trainer.serving.runtime.server import create_app

    app = create_app(Follower(str(tmp_path / "nothing-published")), start_follower=False,
                     max_body_bytes=100)
    # A declared size over the limit: refused from the header, before the body is read.
    status, err = _asgi_post(app, [b"x" * 10], [(b"content-length", b"1000")])
    assert status == 413 and err["error"] == "TooLarge" and "1000 bytes" in err["message"]
    # No declared size (chunked): refused as soon as the pieces pass the limit.
    status, err = _asgi_post(app, [b"x" * 60, b"x" * 60, b"x" * 60], [])
    assert status == 413 and "over 100 bytes" in err["message"]
    # Under the limit it is read and answered (nothing published yet: 503 NoModel).
    status, err = _asgi_post(app, [b'{"rows": []}'], [])
    assert status == 503 and err["error"] == "NoModel"


@pytest.mark.timeout(60)
def test_health_says_stalled_when_a_poll_hangs(tmp_path, monkeypatch) -> None:
    import asyncio

    from recsys_trainer.serving.runtime.follow import Follower
    from recsys_trainer.serving.runtime.server import create_app

    follower = Follower(str(tmp_path / "nothing-published"), poll_s=0.05)
    release = threading.Event()
    # A read of the store that never answers (a stalled mount): the poll thread blocks in it.
    monkeypatch.setattr(follower, "_poll", lambda: release.wait(30) and False)
    app = create_app(follower, start_follower=False)

    def health() -> tuple[int, dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "GET", "scheme": "http", "path": "/health", "raw_path": b"/health",
                 "query_string": b"", "root_path": "", "headers": [],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        asyncio.run(app(scope, receive, send))
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent
                                                     if m["type"] == "http.response.body"))

    follower.start()
    try:
        assert follower.stalled_s() is None  # just started: on time
        follower._started_at -= 120  # ... and two minutes later, still in that first poll
        status, body = health()
        assert status == 503 and body["status"] == "stalled" and body["stalled_s"] >= 60
    finally:
        release.set()
        follower.stop()
    assert follower.stalled_s() is None  # no thread polls: nothing to call stalled
