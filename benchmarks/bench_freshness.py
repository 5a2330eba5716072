"""Freshness of online learning, end to end: how long a landed window takes to reach the scores.

    python benchmarks/bench_freshness.py [--windows 12] [--every-s 10] [--shift-at 5] [--ranks 2]
                                         [--quick] [--json OUT]
    python benchmarks/bench_freshness.py --source log [--seconds 60] [--rows-per-s 2000] ...

``--source log`` measures the event-to-served freshness of a job training from a Kafka topic
instead (benchmarks/freshness_log.py says what and how); the rest of this docstring is the
default mode, windows of files.

Real processes on 127.0.0.1 (issue 37, item 4):

* a **SeaweedFS S3 server** (``weed``, as tests/s3_server.py starts it);
* a **writer** (in this process) landing a Criteo-like window (``--rows`` rows, parquet, then
  ``_SUCCESS``) under ``s3://recsys-data/freshness/stream/window=NNN/`` every ``--every-s``
  seconds. **The planted effect**: a value of column ``C20`` ("the item") is rare and unpopular
  (in 1% of the rows, -1 on their click logit) up to window ``--shift-at`` - 1; from window
  ``--shift-at`` on it is in 30% of the rows and strongly clicked (+2.5 on the logit). A model
  that keeps learning picks that up; one frozen before the shift ranks those rows low;
* a **training job** under ``torchrun --nproc_per_node=--ranks`` (this file with ``--worker``):
  ``StreamingWindows`` over the S3 stream (polling every ``--stream-poll-s``), the example DLRM
  (26 hashed tables of ``--num-embeddings`` x 16), ``PublishHook(every_n_windows=1)`` to
  ``s3://recsys-data/freshness/published`` (a base, then deltas; a new base every
  ``--full-every`` deltas);
* **recsys-serve** following that location (``--poll-s``);
* a **load generator** (a separate process, so that its clock does not share this process's
  GIL): ``--rate`` requests/s of ``--request-rows`` JSON rows each to ``POST /score``, from
  ``--concurrency`` keep-alive connections, all along the timed windows.

The training job and the server are started first; once the job is ready (its
``before_train``), windows 0..``--windows``-1 land every ``--every-s`` s. Once a model is
served, the base of that first served state (the first published base, window 0's) is loaded in
this process's own ``Scorer``: the **frozen** model; the load starts then.

Definitions (what is reported per window W):

* **landed**: the unix time the writer's PUT of W's ``_SUCCESS`` returned (the pointer's
  ``window_time`` is that object's mtime on the server: 0.03-0.13 s earlier in the runs in
  docs/benchmarks.md; the JSON has the difference per window, ``window_time_skew_s``);
* **freshness(W)** = the first ``loaded_at`` (the server's unix time of the swap, from
  ``GET /model``) of a served state whose ``window`` (the newest train window the published
  model reflects, from the ``LATEST`` pointer) is W or a later window, minus landed(W). "Or a
  later one": when publishes fall behind, the publisher skips to the newest checkpoint and W
  may never be named on its own; the model of a later window reflects W too. ``/model`` is
  polled every 0.2 s, but ``loaded_at`` is the server's own swap time, so the figure is exact
  unless two swaps fall within one 0.2 s poll (then it is the later one: an upper bound);
* where the time goes: **train** = the training job's end of window W on rank 0 (a hook's
  ``after_window``) minus landed(W) (the stream's poll wait, reading, training the window);
  **to publish** = the pointer's ``published_at`` minus that (the checkpoint save and commit, the
  hand-over, waiting for a publish in flight, the export and the upload); **export+upload** =
  the publisher's own time for that publish (``PublishRecord.seconds``); **follow** =
  ``loaded_at`` minus ``published_at`` (the server's poll wait and loading the delta or base);
* **hand-over** = when rank 0 handed window W's checkpoint to its publisher (its
  ``after_save_checkpoint``) minus the end of W, and the resume point it happened at. The
  PublishHook saves at a window's end with the asynchronous save; the commit is handed over at
  the next step, or, when the stream waits for its next window, at the wait's first heartbeat
  (the ``"wait"`` resume point, where ``CheckpointHook`` waits for the commit: every rank is
  there and nothing is left to train). **waiting** = to publish minus export+upload: the
  hand-over, the publisher's poll and a publish in flight;
* **AUC (served / frozen)**: as W lands, its rows are scored through ``POST /score`` (Arrow IPC,
  by the model served at that moment, whose own window is reported: the served model's AUC on
  its *next* windows) and by the frozen ``Scorer``; AUC against W's labels;
* **requests**: every load request's status and latency (client side, from send to the whole
  answer); a request is **during a swap** when it overlaps ``[published_at, loaded_at + 1 s]``
  of a swap (``/model``'s ``sequence`` changed): from the moment the new pointer exists, through
  the server's poll, its load and the swap, to one second after; all others are **between
  swaps**. Failed = an exception or a status other than 200.

The host's load (``os.getloadavg()``) is sampled every second and reported: this is a shared
2-core machine, and every figure here is wall-clock time on it.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import freshness_log  # noqa: E402  (this folder: the log mode)

REPO = os.path.dirname(HERE)

NUM_ROWS_DEFAULT = 8192
EFFECT_COLUMN = "C20"
EFFECT_VALUE = "f7e5a1b0"  # hashed like any other string; not among the generator's values
EFFECT_BEFORE = (0.01, -1.0)  # (share of rows, logit added): rare and unpopular
EFFECT_AFTER = (0.30, 2.5)  # from --shift-at on: popular and clicked
SWAP_PAD_S = 1.0


def window_id(w: int) -> str:
    return f"window={w:03d}"


def window_index(wid: str | None) -> int:
    if not wid:
        return -1
    try:
        return int(wid.rsplit("=", 1)[-1])
    except ValueError:
        return -1


# ------------------------------------------------------------------------ the data

def make_window(w: int, rows: int, shift_at: int) -> Any:
    """Window ``w``'s rows: the Criteo-like generator's, with the planted effect."""
    import pyarrow as pa

    from recsys_trainer.data.generators.criteo_synthetic import generate_hour

    signal_ = _signal()
    rng = np.random.default_rng([7, w])
    table, probs = generate_hour(signal_, rows, rng, first_row_id=w * rows)
    share, boost = EFFECT_AFTER if w >= shift_at else EFFECT_BEFORE
    mask = rng.random(rows) < share
    p = np.clip(probs["label"], 1e-6, 1 - 1e-6)
    logit = np.log(p / (1 - p)) + boost * mask
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    col = np.array(table.column(EFFECT_COLUMN).to_pylist(), dtype=object)
    col[mask] = EFFECT_VALUE
    table = table.set_column(table.schema.get_field_index(EFFECT_COLUMN), EFFECT_COLUMN,
                             pa.array(col, type=pa.string()))
    return table.set_column(table.schema.get_field_index("label"), "label", pa.array(label))


_SIGNAL: Any = None


def _signal() -> Any:
    global _SIGNAL
    if _SIGNAL is None:
        from recsys_trainer.data.generators.criteo_synthetic import CriteoSignal

        _SIGNAL = CriteoSignal.make(max_vocab=5000)
    return _SIGNAL


def land(fs: Any, stream_path: str, w: int, table: Any) -> float:
    """Write window ``w`` (parquet, then ``_SUCCESS``) to the stream; the time ``_SUCCESS``'s
    PUT returned."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    d = f"{stream_path}/{window_id(w)}"
    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(d, recursive=True)
    with fs.open_output_stream(f"{d}/part-0.parquet") as out:
        pq.write_table(table, out, row_group_size=4096)
    with fs.open_output_stream(f"{d}/_SUCCESS") as out:
        out.write(b"")
    return time.time()


# ------------------------------------------------------------------------ the training job

def worker(a: argparse.Namespace) -> None:
    """One rank of the training job (under torchrun)."""
    import faulthandler
    import logging
    import warnings

    import torch

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.data.generators.criteo_synthetic import SPARSE_COLUMNS, criteo_features
    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.data.windows import StreamingWindows, partitioned_windows
    from recsys_trainer.hooks.base import Hook
    from recsys_trainer.hooks.lambda_hook import LambdaHook
    from recsys_trainer.hooks.publish import PublishHook
    from recsys_trainer.models import DLRMClassifier

    faulthandler.register(signal.SIGUSR1)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank %(process)d] %(name)s: "
                        "%(message)s")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    stream = StreamingWindows(
        lambda: partitioned_windows(a.stream, ready_marker="_SUCCESS"),
        end_marker=f"{a.stream}/_END", poll_interval_s=a.stream_poll_s, timeout_s=600)
    torch.manual_seed(0)
    spec = criteo_features(a.num_embeddings)
    model = DLRMClassifier(SPARSE_COLUMNS, 13, a.num_embeddings, 16, dense_arch=(64, 16),
                           over_arch=(64, 32, 1), dense_log1p=True)
    hook = PublishHook(a.published, every_n_windows=1, full_every=a.full_every, keep_bases=2)
    ended: dict[str, float] = {}
    started: dict[str, float] = {}
    end_step: dict[str, int] = {}  # window -> the step its training ended at
    handed: dict[int, tuple[float, str]] = {}  # step -> (when its checkpoint was handed over,
    # the resume point then)

    class HandOver(Hook):
        point = "start"

        def on_resume_point(self, trainer: Trainer, point: Any) -> None:
            self.point = point

        def after_window(self, trainer: Trainer, window_id: str) -> None:
            end_step[window_id] = trainer.state.global_step

        def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
            step = int(path.rstrip("/").rsplit("_", 1)[-1])
            handed.setdefault(step, (time.time(), self.point))

    def ready(trainer: Trainer) -> None:
        if trainer.rank == 0:
            open(a.out + ".ready", "w").close()

    hooks: list[Any] = [hook, HandOver()]
    hooks.append(LambdaHook(
        before_train=ready,
        before_window=lambda t, w: started.setdefault(w, time.time()),
        after_window=lambda t, w: ended.setdefault(w, time.time())))
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=a.ckpt, log_steps=10**6, seed=0, max_to_keep=3),
        train_dataset=ParquetWindowDataset(stream, spec, batch_size=a.batch_size, shuffle=True,
                                           seed=0),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False, hooks=hooks,
    )
    trainer.train()
    if trainer.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"records": [r.__dict__ for r in hook.records], "window_end": ended,
                       "window_start": started, "end_step": end_step,
                       "handed_over": {str(k): v for k, v in handed.items()},
                       "steps": trainer.state.global_step}, f)
    from recsys_trainer.distributed import shutdown

    shutdown()


# ------------------------------------------------------------------------ the load generator

def loadgen(a: argparse.Namespace) -> None:
    """``--rate`` requests/s to ``/score`` until ``--stop-file`` exists; writes every request
    (start, end, status, sequence) as JSON to ``--out``."""
    with open(a.bodies) as f:
        bodies = [b.encode() for b in json.load(f)]
    host, port = a.url.split("//", 1)[1].split(":")
    lock = threading.Lock()
    counter = [0]
    t0 = time.time() + 0.5
    records: list[tuple[float, float, int, int]] = []
    stop = threading.Event()

    def run() -> None:
        conn: http.client.HTTPConnection | None = None
        while not stop.is_set():
            with lock:
                i = counter[0]
                counter[0] += 1
            due = t0 + i / a.rate
            delay = due - time.time()
            if delay > 0:
                if stop.wait(delay):
                    return
            body = bodies[i % len(bodies)]
            start = time.time()
            status, seq = -1, -1
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request("POST", "/score", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                status = resp.status
                seq = int(resp.headers.get("X-Model-Sequence", -1))
                del data
            except (OSError, http.client.HTTPException, ValueError):
                status = -1
                with contextlib.suppress(Exception):
                    if conn is not None:
                        conn.close()
                conn = None
            end = time.time()
            with lock:
                records.append((start, end, status, seq))

    threads = [threading.Thread(target=run, daemon=True) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    while not os.path.exists(a.stop_file):
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(35)
    with open(a.out, "w") as f:
        json.dump(records, f)


# ------------------------------------------------------------------------ the benchmark

class Monitor(threading.Thread):
    """Polls ``GET /model`` (and the host's load) every 0.2 s; keeps every distinct state."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.states: dict[int, dict[str, Any]] = {}
        self.loads: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.last: dict[str, Any] | None = None

    def get(self) -> dict[str, Any] | None:
        host, port = self.url.split("//", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            conn.request("GET", "/model")
            resp = conn.getresponse()
            data = resp.read()
            return json.loads(data) if resp.status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None
        finally:
            conn.close()

    def run(self) -> None:
        last_load = 0.0
        while not self.stop.is_set():
            m = self.get()
            if m is not None:
                self.last = m
                self.states.setdefault(int(m["sequence"]), m)
            now = time.time()
            if now - last_load >= 1.0:
                self.loads.append((now, os.getloadavg()[0]))
                last_load = now
            self.stop.wait(0.2)


def _score_served(url: str, table: Any) -> tuple[np.ndarray, int]:
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    host, port = url.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/score", sink.getvalue().to_pybytes(),
                     {"Content-Type": "application/vnd.apache.arrow.stream"})
        resp = conn.getresponse()
        body = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"/score answered {resp.status}: {body}")
    finally:
        conn.close()
    return np.asarray(body["scores"], dtype=np.float64).reshape(-1), int(body["sequence"])


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    import torch

    from recsys_trainer.metrics import weighted_auc

    return float(weighted_auc(torch.from_numpy(scores.astype(np.float32)),
                              torch.from_numpy(labels.astype(np.float32)),
                              torch.ones(len(labels))))


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else math.nan


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM,
          timeout: float = 30) -> None:
    """Stop a process this benchmark started (its own process group), by pid."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def run(a: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from s3_server import S3Server

    from recsys_trainer.serving import Scorer

    work = a.workdir or tempfile.mkdtemp(prefix="bench_freshness_")
    os.makedirs(work, exist_ok=True)
    print(f"work dir: {work}", flush=True)
    server = S3Server.start(os.path.join(work, "s3"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[Any] = []
    monitor: Monitor | None = None
    stop_file = os.path.join(work, "loadgen.stop")
    try:
        env = {**os.environ, **server.env(), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        fs = server.filesystem()
        stream_url = server.url("freshness", "stream")
        published_url = server.url("freshness", "published")
        stream_path = f"{server.bucket}/freshness/stream"
        port = _free_port()
        url = f"http://127.0.0.1:{port}"

        def start(name: str, argv: list[str]) -> None:
            log = open(os.path.join(work, f"{name}.log"), "wb")  # noqa: SIM115
            logs.append(log)
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           cwd=REPO, start_new_session=True)

        def check_alive() -> None:
            for name, p in procs.items():
                if name != "load" and p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; see "
                                       f"{work}/{name}.log")

        tables = {w: make_window(w, a.rows, a.shift_at) for w in range(a.windows)}
        # The stream's root exists before its first window (an empty root is not listable).
        fs.create_dir(stream_path)
        with fs.open_output_stream(f"{stream_path}/_STREAM") as out:
            out.write(b"windows land here; _SUCCESS marks each, _END the stream's end")
        train_out = os.path.join(work, "train.json")
        t_start = time.time()
        start("train", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={a.ranks}", os.path.abspath(__file__), "--worker",
                        "--stream", stream_url, "--published", published_url,
                        "--ckpt", os.path.join(work, "ckpt"), "--out", train_out,
                        "--num-embeddings", str(a.num_embeddings),
                        "--batch-size", str(a.batch_size), "--full-every", str(a.full_every),
                        "--stream-poll-s", str(a.stream_poll_s)])
        start("serve", [os.path.join(os.path.dirname(sys.executable), "recsys-serve"),
                        published_url, "--port", str(port), "--poll-s", str(a.poll_s),
                        "--log-level", "info"])
        deadline = time.time() + a.warmup_timeout_s
        while not os.path.exists(train_out + ".ready"):
            check_alive()
            if time.time() > deadline:
                raise RuntimeError(f"the training job was not ready in {a.warmup_timeout_s} s")
            time.sleep(0.2)
        startup_s = time.time() - t_start
        print(f"training job ready after {startup_s:.1f} s; landing {a.windows} windows every "
              f"{a.every_s:g} s", flush=True)
        monitor = Monitor(url)
        monitor.start()
        feature_cols = [c for c in tables[0].column_names if c not in ("label", "row_id")]
        rows = tables[0].select(feature_cols).to_pylist()
        bodies = [json.dumps({"rows": rows[i:i + a.request_rows]})
                  for i in range(0, min(len(rows), 200 * a.request_rows), a.request_rows)]
        with open(os.path.join(work, "bodies.json"), "w") as f:
            json.dump(bodies, f)
        load_out = os.path.join(work, "load.json")
        frozen: Any = None
        frozen_info: dict[str, Any] = {}

        def first_model() -> None:
            """Once something is served: the frozen model (the first published base, in this
            process) and the load generator."""
            nonlocal frozen, frozen_info
            if frozen is not None or monitor is None or not monitor.states:
                return
            first = monitor.states[min(monitor.states)]
            frozen = Scorer(f"{published_url}/{first['base']}", filesystem=fs)
            frozen_info = {k: first.get(k) for k in ("sequence", "window", "step", "base",
                                                     "loaded_at")}
            start("load", [sys.executable, os.path.abspath(__file__), "--loadgen", "--url",
                           url, "--rate", str(a.rate), "--concurrency", str(a.concurrency),
                           "--bodies", os.path.join(work, "bodies.json"), "--stop-file",
                           stop_file, "--out", load_out])
            print(f"first model served: {first.get('window')} (sequence {first['sequence']}); "
                  "the load starts", flush=True)

        landed: dict[int, float] = {}
        aucs: dict[int, dict[str, Any]] = {}
        t0 = time.time()
        for w in range(a.windows):
            due = t0 + w * a.every_s
            while time.time() < due:
                check_alive()
                first_model()
                time.sleep(min(0.2, max(0.0, due - time.time())))
            landed[w] = land(fs, stream_path, w, tables[w])
            first_model()
            if frozen is None:
                print(f"window {w} landed; nothing served yet", flush=True)
                continue
            table = tables[w]
            labels = table.column("label").to_numpy()
            served_scores, seq = _score_served(url, table.select(feature_cols))
            served_state = monitor.states.get(seq) or monitor.get() or {}
            frozen_scores = frozen.score(table.select(feature_cols)).reshape(-1)
            aucs[w] = {"served": _auc(served_scores, labels),
                       "frozen": _auc(frozen_scores.astype(np.float64), labels),
                       "served_sequence": seq, "served_window": served_state.get("window")}
            print(f"window {w} landed; served model (seq {seq}, {served_state.get('window')}) "
                  f"AUC {aucs[w]['served']:.4f}, frozen {aucs[w]['frozen']:.4f}", flush=True)
        with fs.open_output_stream(f"{stream_path}/_END") as out:
            out.write(b"")
        # Wait for the last window to be served and the job to end.
        deadline = time.time() + a.drain_timeout_s
        while time.time() < deadline:
            first_model()
            last = monitor.last or {}
            if window_index(last.get("window")) >= a.windows - 1 and \
                    procs["train"].poll() is not None:
                break
            time.sleep(0.5)
        time.sleep(2 * a.poll_s)
        open(stop_file, "w").close()
        requests: list[Any] = []
        if "load" in procs:
            procs["load"].wait(timeout=60)
            with open(load_out) as f:
                requests = json.load(f)
        monitor.stop.set()
        monitor.join(5)
        train: dict[str, Any] = {}
        if procs["train"].poll() is None:
            print("the training job did not end in time: stopping it", flush=True)
        elif os.path.exists(train_out):
            with open(train_out) as f:
                train = json.load(f)
        return summarize(a, landed, monitor, aucs, requests, train, startup_s, frozen_info,
                         train_exit=procs["train"].poll())
    finally:
        if monitor is not None:
            monitor.stop.set()
        if not os.path.exists(stop_file):
            with contextlib.suppress(OSError):
                open(stop_file, "w").close()
        for name in ("load", "serve", "train"):
            _stop(procs.get(name))
        for log in logs:
            log.close()
        server.stop()
        if a.workdir is None and not a.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def summarize(a: argparse.Namespace, landed: dict[int, float], monitor: Monitor,
              aucs: dict[int, dict[str, Any]], requests: list[list[float]],
              train: dict[str, Any], startup_s: float, frozen: dict[str, Any],
              train_exit: int | None) -> dict[str, Any]:
    states = sorted(monitor.states.values(), key=lambda s: s["loaded_at"])
    records = {r["window"]: r for r in train.get("records", [])
               if r["kind"] in ("base", "delta")}
    ends = train.get("window_end", {})
    rows = []
    for w in range(a.windows):
        first = next((s for s in states if window_index(s.get("window")) >= w), None)
        row: dict[str, Any] = {"window": w, "landed": landed[w], "effect": w >= a.shift_at,
                               **{k: aucs.get(w, {}).get(k) for k in
                                  ("served", "frozen", "served_window")}}
        if first is not None:
            row.update(freshness_s=first["loaded_at"] - landed[w],
                       served_as=first.get("window"), sequence=first["sequence"],
                       follow_s=first["loaded_at"] - first["published_at"],
                       window_time_skew_s=(first["window_time"] - landed[w]
                                           if first.get("window") == window_id(w)
                                           and first.get("window_time") else None))
        end = ends.get(window_id(w))
        if end is not None:
            row["train_s"] = end - landed[w]
            if first is not None and first.get("window") == window_id(w):
                row["to_publish_s"] = first["published_at"] - end
        step = train.get("end_step", {}).get(window_id(w))
        handed = train.get("handed_over", {}).get(str(step))
        if handed is not None and end is not None:
            row["hand_over_s"], row["handed_at"] = handed[0] - end, handed[1]
        rec = records.get(window_id(w))
        if rec is not None:
            row.update(publish_kind=rec["kind"], export_upload_s=rec["seconds"],
                       blocked_ms=1e3 * rec["blocked_s"])
        rows.append(row)
    # Requests: during swaps vs between.
    swaps = [(s["published_at"], s["loaded_at"] + SWAP_PAD_S) for s in states[1:]]
    during, between, failed = [], [], 0
    for start, end, status, _seq in requests:
        if status != 200:
            failed += 1
            continue
        lat = end - start
        if any(start < hi and end > lo for lo, hi in swaps):
            during.append(lat)
        else:
            between.append(lat)
    fresh = [r["freshness_s"] for r in rows if "freshness_s" in r]
    before = [r for r in rows if not r["effect"] and r["served"] is not None]
    after = [r for r in rows if r["effect"] and r["served"] is not None]
    caught = [r for r in after if window_index(r["served_window"]) >= a.shift_at]
    loads = [x for _, x in monitor.loads]

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs)) if xs else math.nan

    span = (requests[-1][1] - requests[0][0]) if requests else 0.0
    out = {
        "config": {k: v for k, v in vars(a).items() if k not in ("json",)},
        "host": {"cpus": os.cpu_count(), "load_mean": mean(loads),
                 "load_max": max(loads) if loads else math.nan,
                 "load_min": min(loads) if loads else math.nan},
        "startup_s": startup_s, "frozen": frozen, "windows": rows,
        "freshness_median_s": float(np.median(fresh)) if fresh else math.nan,
        "freshness_max_s": max(fresh) if fresh else math.nan,
        "windows_served": len(fresh),
        "auc": {"before_shift": {"served": mean([r["served"] for r in before]),
                                 "frozen": mean([r["frozen"] for r in before]),
                                 "windows": len(before)},
                "after_shift": {"served": mean([r["served"] for r in after]),
                                "frozen": mean([r["frozen"] for r in after]),
                                "windows": len(after)},
                "after_shift_reached_serving": {
                    "served": mean([r["served"] for r in caught]),
                    "frozen": mean([r["frozen"] for r in caught]), "windows": len(caught)}},
        "requests": {"total": len(requests), "failed": failed,
                     "rate_achieved": len(requests) / span if span > 0 else math.nan,
                     "during_swaps": {"n": len(during), "p50_ms": 1e3 * _pct(during, 50),
                                      "p99_ms": 1e3 * _pct(during, 99)},
                     "between_swaps": {"n": len(between), "p50_ms": 1e3 * _pct(between, 50),
                                       "p99_ms": 1e3 * _pct(between, 99)},
                     "swaps": len(swaps)},
        "train_exit": train_exit,
        "publishes": train.get("records", []),
    }
    return out


def _f(x: Any, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def report(out: dict[str, Any]) -> None:
    sys.path.insert(0, HERE)
    from common import markdown_table

    c = out["config"]
    print(f"## Freshness: a window's landing to the served scores ({c['windows']} windows every "
          f"{c['every_s']:g} s, effect from window {c['shift_at']}, {c['ranks']} ranks)")
    print()
    header = ["window", "effect", "freshness s", "served as", "train s", "hand-over s (at)",
              "to publish s", "waiting s", "export+upload s", "follow s",
              "AUC served (model's window)", "AUC frozen"]
    rows = []
    for r in out["windows"]:
        rows.append([r["window"], "yes" if r["effect"] else "no", _f(r.get("freshness_s")),
                     r.get("served_as") or "-", _f(r.get("train_s")),
                     f"{_f(r.get('hand_over_s'), '.2f')} ({r.get('handed_at') or '-'})",
                     _f(r.get("to_publish_s")),
                     _f(r["to_publish_s"] - r["export_upload_s"]
                        if "to_publish_s" in r and "export_upload_s" in r else None),
                     _f(r.get("export_upload_s")), _f(r.get("follow_s")),
                     f"{_f(r.get('served'), '.4f')} ({r.get('served_window') or '-'})",
                     _f(r.get("frozen"), ".4f")])
    print(markdown_table(header, rows))
    q, auc, h = out["requests"], out["auc"], out["host"]
    print()
    print(markdown_table(
        ["requests", "n", "p50 ms", "p99 ms"],
        [["during swaps", q["during_swaps"]["n"], _f(q["during_swaps"]["p50_ms"]),
          _f(q["during_swaps"]["p99_ms"])],
         ["between swaps", q["between_swaps"]["n"], _f(q["between_swaps"]["p50_ms"]),
          _f(q["between_swaps"]["p99_ms"])]]))
    print()
    hand = [r["hand_over_s"] for r in out["windows"] if "hand_over_s" in r]
    at_wait = sum(r.get("handed_at") == "wait" for r in out["windows"])
    blocked = [r["blocked_ms"] for r in out["windows"] if "blocked_ms" in r]
    print(f"training loop blocked per publish (the save's snapshot and hand-over): median "
          f"{_f(float(np.median(blocked)) if blocked else None)} ms, max "
          f"{_f(max(blocked) if blocked else None)} ms; a window's checkpoint handed to the "
          f"publisher a median {_f(float(np.median(hand)) if hand else None, '.2f')} s (max "
          f"{_f(max(hand) if hand else None, '.2f')} s) after the window's end, {at_wait} of "
          f"{len(hand)} while the stream waited")
    print(f"summary: freshness median {_f(out['freshness_median_s'])} s, max "
          f"{_f(out['freshness_max_s'])} s over {out['windows_served']} windows "
          f"({out['config']['every_s']:g} s windows, {out['config']['ranks']} ranks); AUC before the shift served "
          f"{_f(auc['before_shift']['served'], '.4f')} vs frozen "
          f"{_f(auc['before_shift']['frozen'], '.4f')}, after "
          f"{_f(auc['after_shift']['served'], '.4f')} vs {_f(auc['after_shift']['frozen'], '.4f')}"
          f" (once serving reflects the shift: "
          f"{_f(auc['after_shift_reached_serving']['served'], '.4f')} vs "
          f"{_f(auc['after_shift_reached_serving']['frozen'], '.4f')}, "
          f"{auc['after_shift_reached_serving']['windows']} windows); requests "
          f"{q['total']} ({_f(q['rate_achieved'])}/s), failed {q['failed']}, {q['swaps']} swaps;"
          f" host load {_f(h['load_min'])}-{_f(h['load_max'])} (mean {_f(h['load_mean'])}) on "
          f"{h['cpus']} CPUs", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=12, help="windows landed")
    p.add_argument("--every-s", type=float, default=10.0, help="seconds between windows")
    p.add_argument("--shift-at", type=int, default=5, help="first window with the new effect")
    p.add_argument("--ranks", type=int, default=2, help="training processes (torchrun)")
    p.add_argument("--rows", type=int, default=NUM_ROWS_DEFAULT, help="rows per window")
    p.add_argument("--batch-size", type=int, default=512, help="batch size per rank")
    p.add_argument("--num-embeddings", type=int, default=5000, help="rows per table")
    p.add_argument("--full-every", type=int, default=10, help="a new base every N deltas")
    p.add_argument("--stream-poll-s", type=float, default=1.0,
                   help="the training job's poll of the stream")
    p.add_argument("--poll-s", type=float, default=1.0, help="recsys-serve's poll of LATEST")
    p.add_argument("--rate", type=float, default=20.0, help="load: requests per second")
    p.add_argument("--request-rows", type=int, default=8, help="load: rows per request")
    p.add_argument("--concurrency", type=int, default=4, help="load: connections")
    p.add_argument("--warmup-timeout-s", type=float, default=300.0)
    p.add_argument("--drain-timeout-s", type=float, default=180.0)
    p.add_argument("--workdir", default=None, help="keep logs and data here")
    p.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    p.add_argument("--quick", action="store_true", help="6 windows, the effect from window 3")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    # internal modes
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", help=argparse.SUPPRESS)
    p.add_argument("--published", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--bodies", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", help=argparse.SUPPRESS)
    freshness_log.add_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.source == "log":
        if a.worker:
            freshness_log.worker(a)
        elif a.reader:
            freshness_log.reader(a)
        else:
            out = freshness_log.run(a, sys.modules[__name__])
            freshness_log.report(out)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(out, f, indent=1)
        return
    if a.quick:
        a.windows, a.shift_at = min(a.windows, 6), min(a.shift_at, 3)
    if a.worker:
        worker(a)
        return
    if a.loadgen:
        loadgen(a)
        return
    if a.windows < 1 or a.every_s <= 0 or a.ranks < 1:
        raise SystemExit("--windows and --ranks must be >= 1, --every-s > 0")
    out = run(a)
    report(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
