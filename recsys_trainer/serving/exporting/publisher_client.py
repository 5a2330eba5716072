"""The pipe between a training job and its publisher process: both ends, and what travels on it.

``PublishHook`` (rank 0 of the training job) hands each committed checkpoint it wants published
to a publisher process, which runs the ``Publisher`` (build, upload, point, rotate:
``serving.exporting.publisher``) and reports back. This module is that pipe:

* ``PublishJob`` (a checkpoint to publish) and ``PublishRecord`` (what became of it) are what
  travels, one JSON line each (``encode`` / ``decode``: the wire format, written once);
* ``PublisherClient`` is the training side: it starts the process, writes jobs to its stdin,
  reads its reports on a thread, and stops it;
* ``run_publisher`` is the process side (``python -m
  recsys_trainer.serving.exporting._publish_worker INIT``): it reads jobs, publishes the newest
  (older ones queued behind a long publish are answered ``superseded``) and writes reports;
* ``save_init`` / ``load_init``: the ``Publisher``'s arguments (the architecture among them),
  handed over pickled in a file.

The process runs in a session of its own, so the signal a terminal or torchrun's agent sends to
the job's process group does not end it mid-publish; it ends when the training process does
(its stdin closes, or its parent is gone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Protocol

import torch

PARENT_CHECK_S = 0.5
"""How often the publisher process checks that the training process that started it lives."""

Line = bytes
"""One message on the pipe: a JSON object and a newline."""

_PARENT_ENV = "RECSYS_PUBLISH_PARENT"
_WORKER = "recsys_trainer.serving.exporting._publish_worker"


@dataclass(frozen=True)
class PublishJob:
    """A committed checkpoint to publish: its directory, its ``step``, the newest train
    ``window`` in it and when that window landed (``window_time``, the pointer's; None when
    unknown), and how long the training loop was blocked for it so far (``blocked_s``)."""

    checkpoint: str
    step: int
    window: str | None
    window_time: float | None
    blocked_s: float

    def encode(self) -> Line:
        return json.dumps(dataclasses.asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: Line) -> PublishJob:
        return cls(**json.loads(line))


@dataclass(frozen=True)
class PublishRecord:
    """One publish, as reported: ``kind`` is ``"base"`` or ``"delta"`` (what it published,
    ``ref`` its name under the location), ``"failed"`` (``error`` says why) or
    ``"superseded"`` (a newer checkpoint was handed over before this one was started); the
    pointer's ``sequence`` (-1 when none was taken), the ``step`` and newest train ``window``,
    the ``bytes`` uploaded, how long the publisher took (``seconds``), and how long the training
    loop was blocked for it (``blocked_s``: the save's snapshot, rank 0's read lease and the
    hand-over; with ``background=False`` the whole publish). ``checkpoint``: the checkpoint it
    published from; ``rotation_error``: why rotating the location after it failed (the
    publish stands; rotation is tried again after the next one)."""

    sequence: int
    kind: str
    ref: str | None
    step: int
    window: str | None
    bytes: int
    seconds: float
    blocked_s: float
    error: str | None = None
    checkpoint: str | None = None
    rotation_error: str | None = None

    @classmethod
    def unpublished(cls, job: PublishJob, kind: str, error: str | None = None, *,
                    sequence: int = -1, seconds: float = 0.0) -> PublishRecord:
        """The record of ``job`` when nothing was published: ``"failed"`` or
        ``"superseded"``."""
        return cls(sequence, kind, None, job.step, job.window, 0, seconds, job.blocked_s, error,
                   job.checkpoint)

    def encode(self) -> Line:
        return json.dumps(dataclasses.asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: Line) -> PublishRecord:
        return cls(**json.loads(line))


def save_init(path: str, init: dict[str, Any]) -> None:
    """Write the ``Publisher``'s keyword arguments for the process (pickled: the architecture
    is a module). Raises what ``torch.save`` raises (``OSError``, pickling errors)."""
    torch.save(init, path)


def load_init(path: str) -> dict[str, Any]:
    return dict(torch.load(path, weights_only=False))


# ---------------------------------------------------------------------- the training side

class PublisherClient:
    """The training side of the pipe: one publisher process at a time (``start`` again after
    it has exited). ``on_arrival`` is called on the reader thread with each report as it
    arrives, for what must not wait until the training thread takes it (``reports``): a
    training thread blocked in a stream's wait would otherwise leave an outage unlogged."""

    def __init__(self, init_path: str,
                 on_arrival: Callable[[PublishRecord], None] | None = None) -> None:
        self.init_path = init_path
        self._on_arrival = on_arrival
        self._proc: subprocess.Popen[bytes] | None = None
        self._reports: queue.Queue[PublishRecord | None] = queue.Queue()

    def start(self) -> None:
        """Start the publisher process (its reports arrive in a fresh queue)."""
        self._reports = queue.Queue()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["OMP_NUM_THREADS"] = "1"
        env[_PARENT_ENV] = str(os.getpid())
        # A session of its own: the SIGINT/SIGTERM a terminal or torchrun's agent sends to the
        # training process's group is the job's to handle (its preemption path then hands the
        # publisher the stopped step); the publisher ends when this process does.
        self._proc = subprocess.Popen([sys.executable, "-m", _WORKER, self.init_path],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                      start_new_session=True)
        assert self._proc.stdout is not None
        threading.Thread(target=self._read, args=(self._proc.stdout, self._reports),
                         name="recsys-publish-results", daemon=True).start()

    def _read(self, stream: IO[bytes], out: queue.Queue[PublishRecord | None]) -> None:
        for line in stream:
            try:
                record = PublishRecord.decode(line)
            except (ValueError, TypeError):
                continue  # not a report
            if self._on_arrival is not None:
                with contextlib.suppress(Exception):
                    self._on_arrival(record)
            out.put(record)
        out.put(None)  # its stdout closed: it exited

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def send(self, job: PublishJob) -> None:
        """Hand ``job`` over (one line on the process's stdin); ``OSError`` when it is gone."""
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(job.encode())
        self._proc.stdin.flush()

    def reports(self) -> list[PublishRecord]:
        """The reports that arrived since the last call (non-blocking)."""
        out: list[PublishRecord] = []
        while True:
            try:
                record = self._reports.get_nowait()
            except queue.Empty:
                return out
            if record is not None:
                out.append(record)

    def exit_code(self) -> int | None:
        """The process's exit code once it has exited and every report was taken; else None."""
        proc = self._proc
        if proc is None or proc.poll() is None or not self._reports.empty():
            return None
        return proc.returncode

    def close(self, timeout: float) -> None:
        """Close its stdin (it ends after the publish in hand) and wait up to ``timeout``
        (at least 0.1 s) for it to exit, then kill it."""
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        try:
            proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


# ---------------------------------------------------------------------- the publisher's side

class Publishes(Protocol):
    """What ``run_publisher`` drives (``Publisher``)."""

    def publish(self, job: PublishJob) -> PublishRecord: ...


def _exit_with_parent(parent: int) -> None:
    """End this process when ``parent`` is gone (reparented), even mid-publish: the publisher
    runs in a session of its own, out of reach of the signals that end the job, so it must not
    outlive it (a publish cut short leaves no pointer naming a partial artifact)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def _job_batches(fd: int) -> Iterator[list[PublishJob]]:
    """The jobs on ``fd``, as they queue up: each batch is every job that has arrived (at
    least one); ends at EOF."""
    buffer, eof = b"", False
    while not eof:
        if b"\n" not in buffer:
            data = os.read(fd, 1 << 16)
            if not data:
                return
            buffer += data
        while select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 1 << 16)
            if not data:
                eof = True
                break
            buffer += data
        *lines, buffer = buffer.split(b"\n")
        jobs = [PublishJob.decode(line) for line in lines if line.strip()]
        if jobs:
            yield jobs


def run_publisher(init_path: str, make: Callable[..., Publishes]) -> None:
    """The publisher process: ``make(**load_init(init_path))``, then jobs from stdin, reports
    to the original stdout (everything else it prints goes to stderr). When jobs queue up,
    only the newest is published (the others are answered ``superseded``). Ends at EOF, or
    when the training process that started it is gone."""
    parent = int(os.environ.get(_PARENT_ENV, os.getppid()))
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True,
                     name="recsys-publisher-parent").start()
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING,
                        format="%(levelname)s:publisher:%(name)s:%(message)s")
    logging.getLogger("recsys_trainer").setLevel(logging.INFO)
    # Background work: one thread, and a lower priority than the training process it serves.
    torch.set_num_threads(1)
    with contextlib.suppress(OSError):
        os.nice(10)
    publisher = make(**load_init(init_path))
    for jobs in _job_batches(0):
        for old in jobs[:-1]:
            results.write(PublishRecord.unpublished(old, "superseded").encode())
            results.flush()
        results.write(publisher.publish(jobs[-1]).encode())
        results.flush()


__all__ = ["PARENT_CHECK_S", "Line", "PublishJob", "PublishRecord", "PublisherClient", "Publishes",
           "load_init", "run_publisher", "save_init"]
