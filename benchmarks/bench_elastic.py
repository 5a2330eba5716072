"""Elastic jobs, measured from outside: a node lost or added mid-window, and what the exact
data position costs.

    python benchmarks/bench_elastic.py recovery [--runs 2]   # node loss -> first step at the
                                                            # new size, and where the time goes
    python benchmarks/bench_elastic.py remap [--rows 2000000]  # planning a window's rest after
                                                            # 1-3 world-size changes vs. a plan

``recovery`` runs tests/elastic_driver.py (the DLRM of tests/serving_utils.py on three windows of
4,000 rows, ``save_steps=5``) under two torchrun agents on 127.0.0.1 (``--nnodes=1:2``, c10d),
SIGKILLs the second node (agent and worker) in the middle of window 0, and reads the surviving
agent's log (``LOGLEVEL=INFO``) and the driver's records: when the surviving worker failed on
its collective, when the rendezvous round without the lost node closed, when the new worker
process started, when it had resumed (imports, process group, model, checkpoint, remap) and
when it trained its first step. Two rendezvous settings: the issue's ``last_call_timeout=10``
with torch's default keep-alive (a node is dead after 3 missed heartbeats of 5 s), and the
tests' (``last_call_timeout=2``, heartbeats every 1 s). Then a node joins the job at world
size 1: from the new agent's start to the first step at world size 2.

``remap`` plans one window (``--rows`` rows in 16 files of 8 row groups, batch 512) for rank 0
as a resume does: at the same world size (the baseline), and after 1, 2 and 3 changes of world
size (8 -> 4, then 2, then 3 ranks, each mid-window), unshuffled and shuffled, and with
``on_nan_label="drop"``, whose old batches are read again to count their rows. Ratios are to
the baseline in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from elastic_utils import Node, jsonl, progress, wait_for  # noqa: E402

_GLOG = r"^{level}(\d{{4}}) (\d\d:\d\d:\d\d\.\d+) \d+ \S+\] {text}"
ISSUE_CONF = "join_timeout=60,last_call_timeout=10,close_timeout=10"
TUNED_CONF = ("join_timeout=60,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,"
              "keep_alive_max_attempt=3")


def _glog_times(text: str, level: str, pattern: str) -> list[float]:
    year = datetime.date.today().year
    return [datetime.datetime.strptime(f"{year}{d} {t}", "%Y%m%d %H:%M:%S.%f").timestamp()
            for d, t in re.findall(_GLOG.format(level=level, text=pattern), text, re.M)]


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def _job(root: Path, rows: int) -> None:
    import serving_utils as su

    su.write_data(str(root / "data"), "dlrm", hours=3, rows=rows)
    (root / "config.json").write_text(json.dumps(
        {"kind": "dlrm", "batch_size": 32, "save_steps": 5, "pace_s": 0.02}))


def node_loss(root: Path, rdzv_conf: str) -> dict[str, float]:
    """One node loss mid-window 0; the phases from the kill to the first step after it."""
    from recsys_trainer.distributed import free_port

    _job(root, 4000)
    port = free_port()
    env = {"LOGLEVEL": "INFO"}
    a = Node(root, "a", port, rdzv_conf=rdzv_conf, env=env)
    time.sleep(0.5)
    b = Node(root, "b", port, rdzv_conf=rdzv_conf, env=env)
    try:
        wait_for("a step in the middle of window 0", lambda: (
            (p := progress(root)) is not None and p["world_size"] == 2 and p["step"] >= 12),
            [a, b], 180)
        killed = b.kill()
        start = wait_for("the first step at world size 1", lambda: next(
            (s for s in jsonl(root / "first_steps.jsonl") if s["world_size"] == 1), None), [a], 300)
        rc = a.wait(300)
        text = a.text()
    finally:
        a.close()
        b.close()
    assert rc == 0, text[-3000:]
    failed = min(t for t in _glog_times(text, "E", r"failed \(exitcode") if t > killed)
    joined = min(t for t in _glog_times(text, "I", r".*Rendezvous complete for workers") if t > failed)
    restart = next(s for s in jsonl(root / "starts.jsonl") if s["world_size"] == 1)
    return {"detect": failed - killed, "rendezvous": joined - failed,
            **_worker_phases(joined, restart, start), "total": start["time"] - killed}


def node_join(root: Path, rdzv_conf: str) -> dict[str, float]:
    """A node joins a job of one mid-window 0: from its start to the first step at size 2."""
    from recsys_trainer.distributed import free_port

    _job(root, 4000)
    port = free_port()
    env = {"LOGLEVEL": "INFO"}
    a = Node(root, "a", port, rdzv_conf=rdzv_conf, env=env)
    b = None
    try:
        wait_for("a step in the middle of window 0", lambda: (
            (p := progress(root)) is not None and p["step"] >= 12), [a], 180)
        joined = time.time()
        b = Node(root, "b", port, rdzv_conf=rdzv_conf, env=env)
        first = wait_for("the first step at world size 2", lambda: next(
            (s for s in jsonl(root / "first_steps.jsonl") if s["world_size"] == 2), None), [a], 300)
        rc = a.wait(300), b.wait(60)
        text = a.text()
    finally:
        a.close()
        if b is not None:
            b.close()
    assert rc == (0, 0), text[-3000:]
    stopped = min(t for t in _glog_times(text, "I", r".*Stopping worker group") if t > joined)
    formed = min(t for t in _glog_times(text, "I", r".*Rendezvous complete for workers") if t > stopped)
    restart = max((s for s in jsonl(root / "starts.jsonl") if s["world_size"] == 2),
                  key=lambda s: s["time"])
    return {"noticed": stopped - joined, "rendezvous": formed - stopped,
            **_worker_phases(formed, restart, first), "total": first["time"] - joined}


def _worker_phases(formed: float, restart: dict[str, Any], first: dict[str, Any],
                   ) -> dict[str, float]:
    """From the rendezvous round's end to the new worker's first step: its process start, its
    resume (imports, process group, model, checkpoint) and the step (the driver's records)."""
    return {"start_process": restart["process_started"] - formed,
            "resume": restart["time"] - restart["process_started"],
            "first_step": first["time"] - restart["time"]}


def _table(title: str, runs: list[dict[str, float]]) -> None:
    keys = list(runs[0])
    print(f"\n{title}")
    print("| phase | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |")
    print("|---|" + "---|" * (len(runs) + 1))
    for k in keys:
        vals = [r[k] for r in runs]
        print(f"| {k} | " + " | ".join(f"{v:.1f} s" for v in vals)
              + f" | {statistics.median(vals):.1f} s |")


def recovery(runs: int) -> int:
    print(f"host load before: {_load()}")
    for title, conf in (("node loss, last_call_timeout=10, torch's keep-alive (5 s x 3)",
                         ISSUE_CONF),
                        ("node loss, last_call_timeout=2, keep-alive 1 s x 3", TUNED_CONF)):
        results = []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                results.append(node_loss(Path(tmp), conf))
        _table(title + f" (rdzv-conf {conf})", results)
    joins = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            joins.append(node_join(Path(tmp), ISSUE_CONF))
    _table(f"node join (rdzv-conf {ISSUE_CONF})", joins)
    print(f"\nhost load after: {_load()}")
    return 0


def remap(rows: int, repeats: int) -> int:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys_trainer.data.base import Segment
    from recsys_trainer.data.inputs import SparseFeature
    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.data.spec import FeatureSpec

    files, groups, bs = 16, 8, 512
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "hour=00"
        d.mkdir()
        per = rows // files
        for f in range(files):
            ids = np.arange(f * per, (f + 1) * per)
            pq.write_table(pa.table({"y": (ids % 3 == 0).astype(np.float32), "x": ids * 1.0,
                                     "item": ids % 1000}), d / f"part-{f}.parquet",
                           row_group_size=max(1, per // groups))
        spec = FeatureSpec(labels=["y"], dense=["x"], sparse=[SparseFeature(name="item", num_embeddings=1000)])
        drop = FeatureSpec(labels=["y"], dense=["x"], sparse=[SparseFeature(name="item", num_embeddings=1000)],
                           on_nan_label="drop")
        # 8 ranks each trained a quarter of their share, then 4, 2 and 3 ranks (mid-window).
        b8 = rows // 8 // bs // 4
        histories = {"1 change": [Segment(8, b8)], "2 changes": [Segment(8, b8), Segment(4, b8)],
                     "3 changes": [Segment(8, b8), Segment(4, b8), Segment(2, b8)]}
        print(f"window: {rows:,} rows, {files} files x {groups} row groups, batch {bs}; "
              f"host load {_load()}")
        print("| plan | unshuffled | ratio | shuffled | ratio | on_nan_label=drop | ratio |")
        print("|---|---|---|---|---|---|---|")
        base: dict[str, float] = {}
        for name, earlier in [("same world size (baseline)", []), *histories.items()]:
            cells = []
            for variant, kw, feats in (("plain", {}, spec), ("shuffle", {"shuffle": True}, spec),
                                       ("drop", {}, drop)):
                ds = ParquetWindowDataset(str(tmp), feats, batch_size=bs, prefetch_batches=0, **kw)
                ds.setup(0, 3 if earlier else 8)
                window = next(iter(ds.window_ids()))
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    ds._plan(ds._window(window), earlier)
                    times.append(time.perf_counter() - t0)
                t = statistics.median(times)
                base.setdefault(variant, t)
                cells += [f"{t * 1e3:.1f} ms", f"{t / base[variant]:.2f}x"]
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recovery")
    r.add_argument("--runs", type=int, default=2)
    m = sub.add_parser("remap")
    m.add_argument("--rows", type=int, default=2_000_000)
    m.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sys.exit(recovery(a.runs) if a.cmd == "recovery" else remap(a.rows, a.repeats))


if __name__ == "__main__":
    main()
