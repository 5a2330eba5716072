"""Recovery from faults without a human, measured from outside: 2 ranks under ``torchrun``, CPU.

    python benchmarks/bench_recovery.py faults [--quick]     # per fault kind: steps lost, seconds
                                                             # from the fault to training again
    python benchmarks/bench_recovery.py restarts --runs 20   # SIGKILL of a rank under
                                                             # --max-restarts: every run ends 0,
                                                             # bitwise equal to an uninterrupted run
    python benchmarks/bench_recovery.py repeating --runs 5   # a corrupt file under --max-restarts=2:
                                                             # every run ends non-zero, in bounded time
    python benchmarks/bench_recovery.py repro --runs 3       # the restart race in torch's env://
                                                             # rendezvous vs. attempt_store

``faults`` runs ``examples/train_dlrm.py`` (the README's main job: 26 tables x 50k rows x 16,
9 train hours x 60k rows, ``pipeline="sparse_dist"``) with ``--save-steps``; ``--quick`` uses 4
hours of 20k rows. Fault kinds: SIGTERM to the torchrun agent (a scheduler's preemption), then
the same command again; SIGKILL of rank 1 under ``--max-restarts=1`` (torchrun restarts the
group); SIGKILL of the agent (its workers get SIGTERM from the kernel,
``distributed.stop_with_the_agent``), then the same command again. "Steps lost" is the last
step trained before the fault minus the step training resumed from; "fault -> training" runs
from the fault to the first step trained after it (a rerun is started as soon as the previous
job has exited). Every faulted job's final model is compared with an uninterrupted run's.

``restarts`` and ``repeating`` run the CLI (``python -m recsys_trainer`` under torchrun) on a
small model and report, per run, the exit status, whether the final model is bitwise equal to
the reference, and where the time from the kill to the first step after the restart goes:
detection (the agent sees the worker gone), the agent's restart (stopping the survivor, the
next rendezvous round, starting processes), the new workers' imports, forming their process
groups, building the model and restoring the checkpoint, and the first step.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]

_STEP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO recsys_trainer: step (\d+) \|", re.M)
_RESUME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO recsys_trainer\.checkpoint\."
                     r"manager: resuming from \S+ \(step (\d+)\)", re.M)
_FORMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO recsys_trainer\.distributed: "
                     r"process group formed: rank 0 .* in ([\d.]+) s \(torchrun restart (\d+)\)", re.M)
_AGENT_SAW = re.compile(r"^E(\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ \S+\] failed \(exitcode: (-?\d+)\)", re.M)


def _log_time(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _glog_time(mmdd: str, hms: str) -> float:
    year = datetime.date.today().year
    return datetime.datetime.strptime(f"{year}{mmdd} {hms}", "%Y%m%d %H:%M:%S.%f").timestamp()


def _load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


class Job:
    """One torchrun agent; its stdout and stderr go to ``log``."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._file = open(log, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(list(args), stdout=self._file, stderr=subprocess.STDOUT,
                                     cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                    "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)

    def text(self) -> str:
        self._file.flush()
        return self.log.read_text(errors="replace")

    def steps(self) -> list[tuple[float, int]]:
        """``(time, step)`` of rank 0's step lines (``log_steps=1``)."""
        return [(_log_time(t), int(s)) for t, s in _STEP.findall(self.text())]

    def workers(self) -> dict[int, int]:
        out: dict[int, int] = {}
        kids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                              text=True).stdout.split()
        for pid in kids:
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = int(pid)
        return out

    def wait_for_step(self, step: int, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self.steps()
            if done and done[-1][1] >= step:
                return done[-1][0]
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended before step {step}:\n{self.text()[-3000:]}")
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(f"the job did not reach step {step} in {timeout_s} s")

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None (and the job killed) past ``timeout_s``."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        # torchrun starts its workers in sessions of their own: kill them by pid first.
        for pid in self.workers().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _first_attempt_last_step(steps: list[tuple[float, int]]) -> int:
    """The last step of the first attempt in a log: the steps until they stop increasing (a
    restarted attempt starts again from its checkpoint's step)."""
    last = 0
    for _, s in steps:
        if s <= last:
            break
        last = s
    return last


def _same_model(a_dir: str, b_dir: str) -> bool:
    import torch

    from recsys_trainer.checkpoint import export_model_state_dict

    a, b = export_model_state_dict(a_dir), export_model_state_dict(b_dir)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _newest(out: Path) -> str:
    from recsys_trainer.checkpoint import layout

    info = layout.latest_committed(str(out))
    assert info is not None, f"no committed checkpoint in {out}"
    return info.path


# ---------------------------------------------------------------------------- the CLI job

def _cli_config(tmp: Path, out: Path, steps: int, save_steps: int, data: Path | None = None,
                pace_s: float = 0.0) -> Path:
    import yaml

    raw: dict[str, Any] = {
        "run": "train",
        "args": {"output_dir": str(out), "train_steps": steps, "log_steps": 1,
                 "save_steps": save_steps, "save_end": True, "seed": 3},
        "model": {"sparse_features": 4, "num_dense": 4, "num_embeddings": 2000,
                  "embedding_dim": 16, "dense_arch": [32], "over_arch": [32, 1]},
        "data": {"kind": "synthetic", "batch_size": 256, "train_batches": steps + 10,
                 "eval_batches": 0},
        "dense_optimizer": {"name": "adam", "lr": 0.01},
        "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.05},
    }
    if data is not None:
        raw["model"] = {"embedding_dim": 8, "dense_arch": [16], "over_arch": [16, 1]}
        raw["data"] = {"kind": "parquet", "train": str(data), "batch_size": 64,
                       "features": {"labels": ["y"], "dense": ["x"],
                                    "sparse": [{"name": "item", "num_embeddings": 100}]}}
    if pace_s:
        raw["args"]["log_steps"] = 1
    path = tmp / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli(cfg: Path, *torchrun_args: str) -> list[str]:
    return [*TORCHRUN, "--standalone", "--nproc_per_node=2", *torchrun_args, "-m",
            "recsys_trainer", str(cfg)]


def restarts(runs: int, steps: int, save_steps: int, seed: int, job_timeout_s: float) -> int:
    """``runs`` jobs under ``--max-restarts=2``, each with rank 1 SIGKILLed at a random step."""
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    ref_out = tmp / "reference"
    ref = Job(_cli(_cli_config(tmp, ref_out, steps, save_steps)), tmp / "reference.log")
    if ref.wait(600) != 0:
        print(ref.text()[-3000:])
        return 1
    reference = _newest(ref_out)
    print(f"## SIGKILL of rank 1 under torchrun --max-restarts=2: {runs} runs\n")
    print(f"CLI job: 2 ranks, {steps} steps, save_steps={save_steps}; load average at start "
          f"{_load()}\n")
    print("| run | last step of the killed attempt | resumed from | steps lost | exit | bitwise equal | "
          "detect s | agent restart s | imports s | groups s | model + resume s | first step s | "
          "fault -> training s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows, failures = [], 0
    for run in range(runs):
        out = tmp / f"run{run}"
        kill_at = rng.randrange(save_steps // 2, steps - save_steps)
        job = Job(_cli(_cli_config(tmp, out, steps, save_steps), "--max-restarts=2"),
                  tmp / f"run{run}.log")
        t_kill, t_spawn = float("nan"), None
        try:
            job.wait_for_step(kill_at, job_timeout_s)
            victim = job.workers()[1]
            before = {p for p in job.workers().values()}
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            t_spawn = None
            while job.proc.poll() is None and t_spawn is None:
                now = set(job.workers().values())
                if now - before:
                    t_spawn = time.time()
                time.sleep(0.02)
            rc = job.wait(job_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            rc = None
            print(f"run {run}: {e}", file=sys.stderr)
        text = job.text()
        trained = job.steps()
        last = _first_attempt_last_step(trained)  # rank 0 may finish a step after the kill
        resumes = [(_log_time(t), int(s)) for t, s in _RESUME.findall(text)]
        saw = [(_glog_time(d, h), int(c)) for d, h, c in _AGENT_SAW.findall(text)]
        t_detect = next((t for t, c in saw if c == -9), float("nan"))
        t_resume, resumed = resumes[-1] if resumes else (float("nan"), 0)
        t_first = next((t for t, s in trained if t > t_kill and s == resumed + 1), float("nan"))
        formed = [(_log_time(t), float(d)) for t, d, r in _FORMED.findall(text) if r != "0"]
        t_formed, group_s = formed[-1] if formed else (float("nan"), float("nan"))
        equal = rc == 0 and _same_model(_newest(out), reference)
        failures += not (rc == 0 and equal)
        if rc is None:
            print(f"run {run} hung; its log: {job.log}", file=sys.stderr)
        spawn = t_spawn or float("nan")
        row = {"detect": t_detect - t_kill, "restart": spawn - t_detect,
               "imports": t_formed - group_s - spawn, "groups": group_s,
               "build": t_resume - t_formed, "resume": t_first - t_resume,
               "total": t_first - t_kill, "lost": last - resumed}
        rows.append(row)
        print(f"| {run} | {last} | {resumed} | {row['lost']} | {rc} | {'yes' if equal else 'NO'} | "
              + " | ".join(f"{row[k]:.2f}" for k in ("detect", "restart", "imports", "groups",
                                                       "build", "resume", "total")) + " |",
              flush=True)
        if rc != 0:
            print(text[-3000:], file=sys.stderr)
    print()
    for key, name in (("detect", "detection (the agent sees the worker gone)"),
                      ("restart", "agent restart (stop the survivor, rendezvous, spawn)"),
                      ("imports", "worker imports"), ("groups", "process groups formed"),
                      ("build", "model build, sharding, checkpoint verify + load"),
                      ("resume", "first step after the resume"),
                      ("total", "fault -> training")):
        vals = [r[key] for r in rows if r[key] == r[key]]
        if vals:
            print(f"- {name}: median {statistics.median(vals):.2f} s (min {min(vals):.2f}, "
                  f"max {max(vals):.2f})")
    print(f"\n{runs - failures} of {runs} runs ended 0 with a bitwise-equal final model; load "
          f"average at the end {_load()}.")
    return 1 if failures else 0


def _write_rows(root: Path, windows: int, rows: int, files: int = 2) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for w in range(windows):
        d = root / f"hour={w:02d}"
        d.mkdir(parents=True)
        for f in range(files):
            n = rows // files
            pq.write_table(pa.table({"y": rng.integers(0, 2, n).astype(np.float32),
                                     "x": rng.random(n, dtype=np.float32),
                                     "item": rng.integers(0, 100, n)}), d / f"part-{f}.parquet")


def _verifies(where: Any) -> bool:
    from recsys_trainer.checkpoint import CheckpointError, layout

    manifest = layout.read_manifest(where)
    if manifest is None:
        return False
    try:
        layout.verify_files(where, manifest, checksums=True)
    except CheckpointError:
        return False
    return True


def repeating(runs: int, bound_s: float) -> int:
    """``runs`` jobs under ``--max-restarts=2`` whose second window holds a corrupt file."""
    from recsys_trainer.checkpoint import layout

    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_bad_"))
    data = tmp / "data"
    _write_rows(data, windows=3, rows=512)
    (data / "hour=01" / "part-1.parquet").write_bytes(b"PAR1 this is not a parquet file")
    print(f"## A repeating fault (a corrupt file in window 2) under torchrun --max-restarts=2: "
          f"{runs} runs\n")
    print(f"load average at start {_load()}\n")
    print("| run | exit | seconds | attempts | named error on the last attempt | committed before / after | all verify |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for run in range(runs):
        out = tmp / f"run{run}"
        cfg = _cli_config(tmp, out, steps=1000, save_steps=4, data=data)
        t0 = time.monotonic()
        job = Job(_cli(cfg, "--max-restarts=2"), tmp / f"run{run}.log")
        rc = job.wait(bound_s)
        took = time.monotonic() - t0
        text = job.text()
        errors = re.findall(r"DataError: (file \S+hour=01/part-1\.parquet: [^\n(]{0,60})", text)
        attempts = len(_AGENT_SAW.findall(text))
        committed = [i.step for i in layout.list_committed(str(out))]
        first = sorted({int(s) for s in re.findall(r"checkpoint step (\d+) committed", text)})
        ok_files = all(_verifies(i.where) for i in layout.list_committed(str(out)))
        ok = rc not in (0, None) and took < bound_s and bool(errors) and committed == first
        bad += not ok
        print(f"| {run} | {rc} | {took:.1f} | {attempts} | {errors[-1] if errors else 'NONE'} | "
              f"{first} / {committed} | {ok_files} |", flush=True)
    print(f"\n{runs - bad} of {runs} runs ended non-zero within {bound_s:.0f} s naming the "
          f"DataError, their committed checkpoints unchanged; load average at the end {_load()}.")
    return 1 if bad else 0


# ---------------------------------------------------------------------------- the example

def _example(out: Path, data: Path, hours: int, rows: int, save_steps: int) -> list[str]:
    return [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1",
            "examples/train_dlrm.py", "--data", str(data), "--hours", str(hours),
            "--rows-per-hour", str(rows), "--output-dir", str(out), "--log-steps", "1",
            "--save-steps", str(save_steps)]


def faults(quick: bool, save_steps: int) -> int:
    """The table of item 4: per fault kind, steps lost and seconds from the fault to training."""
    hours, rows = (4, 20_000) if quick else (10, 60_000)
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_faults_"))
    data = tmp / "data"
    ref_out = tmp / "reference"
    ref = Job(_example(ref_out, data, hours, rows, save_steps), tmp / "reference.log")
    if ref.wait(1200) != 0:
        print(ref.text()[-3000:])
        return 1
    total = ref.steps()[-1][1]
    fault_at = (total // 2 // save_steps) * save_steps + save_steps // 2  # halfway between saves
    reference = _newest(ref_out)
    print("## Progress lost per fault kind (examples/train_dlrm.py, 2 ranks)\n")
    print(f"{hours - 1} train hours x {rows} rows, {total} steps, save_steps={save_steps}, "
          f"async saves; fault at step >= {fault_at}; load average at start {_load()}\n")
    print("| fault | steps lost | fault -> training again s | how it came back | preemption save | exit statuses | final model bitwise equal |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for kind in ("SIGTERM to the agent", "SIGKILL of rank 1", "SIGKILL of the agent"):
        out = tmp / kind.replace(" ", "_")
        cmd = _example(out, data, hours, rows, save_steps)
        job = Job(cmd, tmp / f"{out.name}.log")
        job.wait_for_step(fault_at, 1200)
        workers = list(job.workers().values())
        t_fault = time.time()
        if kind == "SIGTERM to the agent":
            job.proc.send_signal(signal.SIGTERM)
        elif kind == "SIGKILL of rank 1":
            os.kill(job.workers()[1], signal.SIGKILL)
        else:
            os.kill(job.proc.pid, signal.SIGKILL)
        rc = job.wait(1200)
        # A killed agent's workers outlive it (they save their step first): wait for them.
        deadline = time.monotonic() + 120
        while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        statuses = [rc]
        # Steps the faulted attempt trained, those after the fault until the stop included.
        last = _first_attempt_last_step(job.steps())
        text = job.text()
        save = re.search(r"committed ([\d.]+) s after the signal", text)
        second = job
        if kind != "SIGKILL of rank 1":
            # A scheduler (or the user) runs the same command again.
            second = Job(cmd, tmp / f"{out.name}.rerun.log")
            statuses.append(second.wait(1200))
        resumes = [int(s) for _, s in _RESUME.findall(second.text())]
        resumed = resumes[-1] if resumes else 0
        t_first = next((t for t, s in second.steps() if t > t_fault and s == resumed + 1),
                       float("nan"))
        equal = statuses[-1] == 0 and _same_model(_newest(out), reference)
        bad += not equal
        how = "torchrun restarted the group" if second is job else "the same command again"
        print(f"| {kind} | {last - resumed} (step {last} -> {resumed}) | {t_first - t_fault:.1f} | "
              f"{how} | {f'committed {save.group(1)} s after the signal' if save else '-'} | "
              f"{statuses} | {'yes' if equal else 'NO'} |", flush=True)
    print(f"\nload average at the end {_load()}")
    return 1 if bad else 0


# ---------------------------------------------------------------------------- the race itself

_REPRO = textwrap.dedent('''
    """Attempt 0: rank 1 is killed after the groups formed. Attempt 1 (a torchrun restart):
    rank 0 starts 2 s after rank 1, as a slower import or model build would."""
    import os, sys, time
    import torch, torch.distributed as dist
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if restart > 0 and rank == 0:
        time.sleep(2.0)
    t0 = time.time()
    if sys.argv[1] == "torch":
        dist.init_process_group("gloo")  # torch's env:// rendezvous on the agent's store
    else:
        from recsys_trainer.distributed import init_distributed
        init_distributed("cpu")
    extra = dist.new_group(backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.all_reduce(t, group=extra)
    print(f"attempt {restart} rank {rank}: groups formed in {time.time() - t0:.2f} s", flush=True)
    if restart == 0 and rank == 1:
        os.kill(os.getpid(), 9)
    if restart == 0:
        time.sleep(60)
    dist.barrier()
''')


def repro(runs: int, timeout_s: float) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_repro_"))
    script = tmp / "restart_repro.py"
    script.write_text(_REPRO)
    print("## Restarted attempts forming their process groups (torchrun --max-restarts=1)\n")
    print("Attempt 0's rank 1 is killed; in attempt 1 rank 0 starts 2 s after rank 1. "
          f"load average {_load()}\n")
    print("| store | run | exit | seconds | what attempt 1 said |")
    print("|---|---|---|---|---|")
    for mode in ("torch", "attempt_store"):
        for run in range(runs):
            t0 = time.monotonic()
            job = Job([*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1",
                       str(script), "torch" if mode == "torch" else "ours"], tmp / f"{mode}{run}.log")
            rc = job.wait(timeout_s)
            text = job.text()
            said = re.findall(r"attempt 1 rank \d: groups formed", text)
            err = re.search(r"RuntimeError: Gloo connectFullMesh failed with \[[^\]]*\] ([^\n]{0,70})",
                            text)
            what = f"{len(said)} of 2 ranks formed their groups" if said else \
                (f"connectFullMesh failed: {err.group(1)}" if err else ("hung: killed after the timeout" if rc is None else "?"))
            print(f"| {mode} | {run} | {rc} | {time.monotonic() - t0:.1f} | {what} |", flush=True)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("faults", help="steps lost and time to recover per fault kind")
    f.add_argument("--quick", action="store_true")
    f.add_argument("--save-steps", type=int, default=50)
    r = sub.add_parser("restarts", help="N kill + restart runs, each checked bitwise")
    r.add_argument("--runs", type=int, default=20)
    r.add_argument("--steps", type=int, default=120)
    r.add_argument("--save-steps", type=int, default=20)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--job-timeout-s", type=float, default=600.0,
                   help="a job still running after this is killed and counted as hung")
    b = sub.add_parser("repeating", help="N runs of a repeating fault under --max-restarts=2")
    b.add_argument("--runs", type=int, default=5)
    b.add_argument("--bound-s", type=float, default=180.0)
    x = sub.add_parser("repro", help="the stale-store race of restarted attempts")
    x.add_argument("--runs", type=int, default=3)
    x.add_argument("--timeout-s", type=float, default=60.0)
    a = p.parse_args()
    if a.mode == "faults":
        sys.exit(faults(a.quick, a.save_steps))
    if a.mode == "restarts":
        sys.exit(restarts(a.runs, a.steps, a.save_steps, a.seed, a.job_timeout_s))
    if a.mode == "repeating":
        sys.exit(repeating(a.runs, a.bound_s))
    sys.exit(repro(a.runs, a.timeout_s))


if __name__ == "__main__":
    main()
