"""Torchrun agents on 127.0.0.1 standing in for the nodes of an elastic job running
tests/elastic_driver.py, and what the driver leaves behind (tests/test_elastic.py,
benchmarks/bench_elastic.py)."""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "elastic_driver.py"

RDZV_CONF = "join_timeout=60,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
"""The tests' rendezvous settings: a round closes 2 s after its minimum is there, a node that
stops heart-beating is taken for dead after 3 s (torch's defaults: 30 s and 15 s)."""


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [d for k in kids for d in descendants(k)]


class Node:
    """One torchrun agent (a "node", ``--nnodes=1:max_nodes``, one worker) running the driver
    on ``root``; its output goes to ``root/<name>.log``."""

    def __init__(self, root: Path, name: str, port: int, *, rdzv_conf: str = RDZV_CONF,
                 max_nodes: int = 2, env: dict[str, str] | None = None) -> None:
        self.log = root / f"{name}.log"
        self._out = open(self.log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{max_nodes}",
             "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=elastic", "--max-restarts=3", "--monitor-interval=0.5",
             f"--rdzv-conf={rdzv_conf}", str(DRIVER), str(root)],
            stdout=self._out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            # The agents must not share the rendezvous TCP store with the workers: a round a
            # new node joins then never completes (pytorch/pytorch#135712, docs/checkpoint.md).
            env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                 "PYTHONPATH": str(REPO), **(env or {})})

    def text(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the node did not end in {timeout} s:\n"
                                 + self.text()[-4000:]) from None

    def kill(self) -> float:
        """SIGKILL the node: its agent and every process under it (torchrun's workers run in
        sessions of their own, and a publisher under rank 0). Returns when it was killed."""
        killed = time.time()
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def close(self) -> None:
        if self.proc.poll() is None or descendants(self.proc.pid):
            self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()


def wait_for(what: str, ok: Callable[[], Any], nodes: list[Node], timeout: float) -> Any:
    """Poll ``ok()`` until it returns something true; a node that exits meanwhile fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ok()
        if got:
            return got
        for n in nodes:
            if n.proc.poll() is not None:
                raise AssertionError(f"a node exited ({n.proc.returncode}) while waiting for "
                                     f"{what}:\n{n.text()[-4000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s:\n"
                         + (nodes[0].text()[-4000:] if nodes else ""))


def progress(root: Path) -> dict[str, Any] | None:
    """The driver's last step (rank 0's ``progress.json``), None before the first."""
    try:
        return json.loads((root / "progress.json").read_text())
    except (OSError, ValueError):
        return None


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trained(root: Path) -> tuple[collections.Counter[int], dict[tuple[int, str], int]]:
    """Every row id the final model trained on (with multiplicity), and rank 0's steps per
    (world size, window)."""
    rows: collections.Counter[int] = collections.Counter()
    parts: collections.Counter[tuple[int, str]] = collections.Counter()
    for path in glob.glob(str(root / "records" / "step_*.json")):
        rec = json.loads(Path(path).read_text())
        rows.update(rec["rows"])
        if path.endswith(".rank0.json"):
            parts[(rec["world_size"], rec["window"])] += 1
    return rows, dict(parts)


def all_rows(root: Path) -> list[int]:
    """Every row id of the train windows under ``root/data``."""
    return sorted(i for f in glob.glob(str(root / "data" / "*" / "*.parquet"))
                  for i in pq.read_table(f, columns=["row_id"]).column("row_id").to_pylist())
