#!/usr/bin/env python3
"""The GPU acceptance driver behind ``scripts/gpu-check``: every check in its own process with
its own timeout, one summary file.

    scripts/gpu-check                          # setup (CUDA variant), then this driver on cuda
    scripts/gpu-check --rehearse               # the same checks on the CPU, with .venv as it is
    .venv/bin/python scripts/gpu_check.py --device cpu --only c,d --summary /tmp/s.md

Checks (``--only`` takes groups or names, comma-separated: ``--only a,c`` or ``--only d.din``):

- ``a.*``: the ``gpu`` pytest tier (``tests/test_gpu.py``) in three parts run side by side:
  ``a.precision``, ``a.optimizers``, ``a.rest`` (on the CPU every test skips: SKIP).
- ``b.*``: every example on one device, small settings, its final figures and the device each
  Trainer actually used (``TrainingArguments(device="auto")``): ``b.dlrm``, ``b.din``,
  ``b.multitask``, ``b.dynamic`` (with its serving export), ``b.two_tower`` (two_tower and
  sasrec, with evaluation), ``b.dcn`` (DCN-v2 on planted crosses), ``b.hstu`` (HSTU retrieval
  with event times, evaluated, exported and its served queries compared).
- ``c.async`` / ``c.sync``: a run saving every 4 steps (``async_save`` True / False) is
  SIGKILLed mid-training after a committed checkpoint, resumed by a fresh process, and compared
  bitwise with an uninterrupted run (the pattern of tests/test_recovery.py). c.async fails
  unless the victim's manager was in async mode and staged saves (counted at its ``_stage``)
  before the kill; whether a save was still being written at the kill is reported
  (``save_in_flight_at_kill``: its future not done), as it is a race.
- ``d.*``: serving parity of a trained model of each bundled kind (``dlrm``, ``din``, ``mmoe``,
  ``dynamic``, ``mixed``, ``dcn``, ``hstu`` (ranking, with event times), ``two_tower``'s and
  ``hstu_retrieval``'s user side): the CPU ``Scorer`` against ``predict``
  (or the live model's query vectors), max |diff| <= 1e-5, (i) from ``export_for_serving`` on
  the live trainer and (ii) from its committed checkpoint exported by a process that sees no
  GPU (``CUDA_VISIBLE_DEVICES=``), as a CPU serving host would.
- ``e``: ``benchmarks/bench_trainer.py`` on the DLRM shape (26 x 1M x 128, batch 8192 on cuda),
  its ratios to the hand-written TorchRec loop. It runs alone, after the others.

The checks other than ``e`` run ``--jobs`` at a time (they share the one GPU; each is small).
The whole run stops at ``--deadline`` (epoch seconds; ``scripts/gpu-check`` sets it from its
own start and ``GPU_CHECK_BUDGET_S``): a check's timeout is cut to what is left, a check with
too little left is SKIPped, never started. The summary file is rewritten after every check, so
a run killed from outside still leaves what finished.

This module imports only the standard library at the top: the driver itself stays light (and
``-p gpu_check`` loads it into pytest as a plugin that records each test's outcome as it ends,
so a timed-out tier still reports what passed). Workers import torch and the trainer.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
TESTS = os.path.join(ROOT, "tests")
EXAMPLES = os.path.join(ROOT, "examples")
DEFAULT_SUMMARY = os.path.join("output", "gpu-check", "summary.md")
PARITY_TOL = 1e-5
# The lent GPU machine: ~8 minutes per call, setup 33-62 s of it.
DEFAULT_BUDGET_S = 465
# A check is not started with less than this left (it could only time out).
MIN_START_S = 20.0
# Seconds a worker keeps for itself after its inner work times out (parse, write the result).
INNER_MARGIN_S = 8.0
# Kept of a check's log in the logs folder (head + tail), so the folder stays small enough
# to come back from the device machine.
LOG_HEAD, LOG_TAIL = 64 * 1024, 192 * 1024


# ----------------------------------------------------------------------------- the checks


@dataclass
class Check:
    name: str
    timeout_gpu: float
    timeout_cpu: float
    exclusive: bool = False  # runs alone, after every other check (the benchmark)
    what: str = ""

    @property
    def group(self) -> str:
        return self.name.split(".")[0]


D_KINDS = ("dlrm", "din", "mmoe", "dynamic", "mixed", "two_tower", "dcn", "hstu", "hstu_retrieval")
QUERY_KINDS = ("two_tower", "hstu_retrieval")
"""Retrieval kinds: their served query vectors are compared with the live model's."""
EXAMPLE_NAMES = ("dlrm", "din", "multitask", "dynamic", "two_tower", "dcn", "hstu")

# The gpu tier in three parts that run side by side (-k expressions of tests/test_gpu.py): the
# precision runs (one process, 5 configurations), the fused optimizers (4 processes), the rest.
A_PARTS = {
    "precision": "fp16 or bf16",
    "optimizers": "fused_optimizers",
    "rest": "not fp16 and not bf16 and not fused_optimizers",
}

# The run order: the longest part of a first, then c and d (they show the CUDA fixes to async
# saves and to the serving export), the rest of a, b; e alone at the end (a benchmark).
CHECKS: list[Check] = [
    Check("stack", 60, 120, what="versions, the device"),
    Check("a.precision", 240, 300, what=f"pytest -m gpu tests/test_gpu.py -k '{A_PARTS['precision']}'"),
    Check("c.async", 150, 420, what="async saves, SIGKILL, resume == uninterrupted, bitwise"),
    Check("c.sync", 150, 420, what="blocking saves, SIGKILL, resume == uninterrupted, bitwise"),
    *(Check(f"d.{k}", 120, 420, what=f"serving parity: {k}") for k in D_KINDS),
    Check("a.optimizers", 240, 300, what=f"pytest -m gpu tests/test_gpu.py -k '{A_PARTS['optimizers']}'"),
    Check("a.rest", 240, 300, what=f"pytest -m gpu tests/test_gpu.py -k '{A_PARTS['rest']}'"),
    *(Check(f"b.{k}", 180 if k in ("dlrm", "two_tower") else 150, 600, what=f"examples/train_{k}.py")
      for k in EXAMPLE_NAMES),
    Check("e", 120, 420, exclusive=True, what="benchmarks/bench_trainer.py"),
]


def select(only: str | None) -> list[Check]:
    """The checks ``--only`` names (groups like ``d`` or names like ``d.din``); ``stack``
    always runs: the summary's header comes from it."""
    if not only:
        return list(CHECKS)
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    known = {c.name for c in CHECKS} | {c.group for c in CHECKS}
    unknown = sorted(wanted - known)
    if unknown:
        raise SystemExit(f"--only: unknown check(s) {unknown}; known: {sorted(known)}")
    return [c for c in CHECKS if c.name == "stack" or c.name in wanted or c.group in wanted]


# ----------------------------------------------------------------------------- results


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    notes: list[str] = field(default_factory=list)
    log: str = ""

    def line(self) -> str:
        figs = " ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        err = f" | {self.error}" if self.error else ""
        return f"[gpu-check] {self.name} {self.status} {self.seconds:.1f} s {figs}{err}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    if isinstance(v, (list, tuple)):
        return ",".join(_fmt(x) for x in v)
    return str(v)


ERROR_RE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt|Failed|Timeout)\b.*")


def error_line(text: str) -> str:
    """The error's last line: the last ``SomethingError: ...`` line of ``text`` (a traceback's
    last line), else its last non-empty line."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines[-400:]):
        if ERROR_RE.match(ln):
            return ln.strip()[:400]
    return lines[-1].strip()[:400] if lines else ""


class CheckFailed(Exception):
    """A check ran and its result is wrong: the message and the figures it got that far."""

    def __init__(self, message: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


class CheckSkipped(Exception):
    """Nothing to check here (e.g. the CUDA-only tier on the CPU)."""

    def __init__(self, message: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


def write_summary(path: str, results: list[Result], header: dict[str, Any],
                  pending: list[str]) -> None:
    """The one summary file: a header, a markdown table (a row per check), the notes (final
    lines of examples, benchmark rows, the tier's [gpu] lines), and the same as JSON lines.
    Written to a temporary name and renamed: a reader never sees half a file."""
    n = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    out = ["# scripts/gpu-check summary", ""]
    for k, v in header.items():
        out.append(f"- {k}: {v}")
    out.append(f"- result: {n['PASS']} PASS, {n['FAIL']} FAIL, {n['SKIP']} SKIP"
               + (f"; not finished: {', '.join(pending)}" if pending else ""))
    out += ["", "| check | result | seconds | figures | error (last line) |", "|---|---|---|---|---|"]
    for r in results:
        figs = ", ".join(f"{k}={_fmt(v)}" for k, v in r.figures.items())
        out.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {figs.replace('|', '/')} | "
                   f"{r.error.replace('|', '/')} |")
    noted = [r for r in results if r.notes]
    if noted:
        out += ["", "## Notes", ""]
        for r in noted:
            out += [f"### {r.name}", "", "```", *r.notes, "```", ""]
    out += ["", "## JSON lines", "", "```jsonl"]
    out += [json.dumps({"check": r.name, "status": r.status, "seconds": round(r.seconds, 1),
                        "figures": r.figures, "error": r.error, "log": r.log}, default=str)
            for r in results]
    out += ["```", ""]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(out))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the driver


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): torchrun's workers may sit in their own
    session, out of the process group a timeout kills."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the check's process group and every descendant (torchrun forwards it to its
    workers), then SIGKILL what is left after 5 s. Only processes this driver started."""
    pids = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


def _trim_log(path: str) -> None:
    try:
        size = os.path.getsize(path)
        if size <= LOG_HEAD + LOG_TAIL:
            return
        with open(path, "rb") as f:
            head = f.read(LOG_HEAD)
            f.seek(size - LOG_TAIL)
            tail = f.read()
        with open(path, "wb") as f:
            f.write(head + f"\n[... {size - LOG_HEAD - LOG_TAIL} bytes cut ...]\n".encode() + tail)
    except OSError:
        pass


@dataclass
class Running:
    check: Check
    proc: subprocess.Popen[Any]
    started: float
    timeout: float
    result_file: str
    log_file: str
    log_handle: Any


def _env_for(device: str, jobs: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [ROOT, TESTS, *filter(None, [os.environ.get("PYTHONPATH")])])}
    # The cores shared by the checks running together.
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, jobs)))
    if device == "cpu":
        # The rehearsal: no check may see a GPU, so device="auto" picks the CPU exactly as a
        # CPU host would (the same code paths; only the device differs).
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _start(check: Check, a: argparse.Namespace, timeout: float, work: str, logs: str) -> Running:
    result_file = os.path.join(work, f"{check.name}.result.json")
    log_file = os.path.join(logs, f"{check.name}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", check.name, "--device", a.device,
           "--work", os.path.join(work, check.name), "--result", result_file,
           "--timeout", f"{timeout:.0f}"]
    if a.pytest_args:
        cmd += ["--pytest-args", a.pytest_args]
    handle = open(log_file, "w")
    handle.write(f"$ {' '.join(cmd)}\n")
    handle.flush()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env_for(a.device, a.jobs), stdout=handle,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return Running(check, proc, time.monotonic(), timeout, result_file, log_file, handle)


def _finish(r: Running, timed_out: bool) -> Result:
    seconds = time.monotonic() - r.started
    r.log_handle.close()
    with open(r.log_file, errors="replace") as f:
        log_text = f.read()[-200_000:]
    _trim_log(r.log_file)
    res: dict[str, Any] = {}
    if os.path.exists(r.result_file):
        try:
            with open(r.result_file) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {}
    rel_log = os.path.relpath(r.log_file, ROOT) if r.log_file.startswith(ROOT) else r.log_file
    out = Result(r.check.name, res.get("status", "FAIL"), seconds, res.get("figures", {}),
                 res.get("error", ""), res.get("notes", []), rel_log)
    if timed_out:
        out.status = "FAIL"
        out.error = f"timed out after {r.timeout:.0f} s; last line: {error_line(log_text)}"
    elif not res:
        out.status = "FAIL"
        out.error = (f"the check process exited with {r.proc.returncode} without a result: "
                     f"{error_line(log_text)}")
    elif r.proc.returncode != 0 and out.status == "PASS":
        out.status = "FAIL"
        out.error = f"exit status {r.proc.returncode} after a PASS result: {error_line(log_text)}"
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def drive(a: argparse.Namespace, checks: list[Check]) -> list[Result]:
    """Run ``checks``: ``--jobs`` at a time, the exclusive ones alone at the end; each with its
    timeout cut to the deadline; the summary rewritten after each."""
    t_start = time.time()
    deadline_wall = a.deadline if a.deadline else t_start + a.budget
    mono0 = time.monotonic()
    deadline = mono0 + (deadline_wall - t_start)
    summary = os.path.abspath(a.summary)
    logs = os.path.join(os.path.dirname(summary), "gpu-check-logs")
    work = os.path.abspath(a.work)
    for d in (logs, work):
        shutil.rmtree(d, ignore_errors=True)  # a fresh run: examples resume from old dirs
        os.makedirs(d, exist_ok=True)
    dirty = _git("status", "--porcelain")
    header: dict[str, Any] = {
        "started": datetime.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
        "mode": f"--device {a.device}, {a.jobs} check(s) at a time, "
                f"budget {deadline_wall - t_start:.0f} s",
        # A copy of the working tree on a device machine may have no .git: say so.
        "commit": f"{_git('rev-parse', '--short', 'HEAD') or 'unknown (no git)'}"
                  + (f" + {len(dirty.splitlines())} uncommitted file(s)" if dirty else ""),
        "logs": os.path.relpath(logs, os.path.dirname(summary)) + "/<check>.log",
    }
    if a.setup_seconds is not None:
        header["setup"] = f"{a.setup_seconds:.0f} s (scripts/setup)"
    queue = [c for c in checks if not c.exclusive]
    exclusive = [c for c in checks if c.exclusive]
    results: list[Result] = []
    running: list[Running] = []

    def timeout_of(c: Check) -> float:
        return c.timeout_gpu if a.device == "cuda" else c.timeout_cpu * a.cpu_timeout_scale

    def save() -> None:
        header["elapsed"] = f"{time.monotonic() - mono0:.0f} s"
        pending = [r.check.name for r in running] + [c.name for c in queue + exclusive]
        write_summary(summary, results, header, pending)

    def record(res: Result) -> None:
        results.append(res)
        if res.name == "stack":
            for k in ("stack", "device", "gpus"):
                if k in res.figures:
                    header[k] = res.figures[k]
        print(res.line(), flush=True)
        save()

    save()
    while queue or exclusive or running:
        now = time.monotonic()
        for r in list(running):
            done = r.proc.poll() is not None
            over = now - r.started > r.timeout
            if over and not done:
                _kill_tree(r.proc)
            if done or over:
                running.remove(r)
                record(_finish(r, timed_out=over and not done))
        # What the exclusive checks need at the end is kept from the others.
        reserve = sum(min(timeout_of(c), 1e9) for c in exclusive) if exclusive else 0.0
        while queue and len(running) < a.jobs:
            c = queue.pop(0)
            left = deadline - time.monotonic() - (reserve if c.name != "stack" else 0.0)
            t = min(timeout_of(c), left)
            if t < MIN_START_S:
                record(Result(c.name, "SKIP", 0.0, error=f"not started: {max(0, left):.0f} s of the "
                              f"budget left (needs its own timeout, {timeout_of(c):.0f} s, "
                              f"or at least {MIN_START_S:.0f} s)"))
                continue
            running.append(_start(c, a, t, work, logs))
        if not queue and not running and exclusive:
            c = exclusive.pop(0)
            left = deadline - time.monotonic()
            t = min(timeout_of(c), left)
            if t < MIN_START_S:
                record(Result(c.name, "SKIP", 0.0, error=f"not started: {max(0, left):.0f} s of the "
                              "budget left"))
            else:
                running.append(_start(c, a, t, work, logs))
        time.sleep(0.2)
    save()
    return results


# ----------------------------------------------------------------------------- workers
# Each runs in its own process (``--worker NAME``), writes {status, figures, error, notes} to
# --result, and prints its progress to stdout (the check's log).


@dataclass
class Ctx:
    device: str  # "cuda" | "cpu": the device every trainer must have used
    work: str
    deadline: float  # monotonic: the worker's own end, a little before the driver's timeout
    pytest_args: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def small(self) -> bool:
        return self.device == "cpu"

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def _python() -> str:
    return sys.executable


def _sub_env(cpu_only: bool = False) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, *filter(None, [os.environ.get("PYTHONPATH")])])
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(cmd: list[str], ctx: Ctx, timeout: float | None = None, cpu_only: bool = False,
         label: str = "") -> str:
    """Run ``cmd`` (its output goes to this check's log and is returned); a non-zero exit or a
    timeout raises CheckFailed with the error's last line."""
    t = min(timeout or ctx.left(), ctx.left())
    log(f"$ {' '.join(cmd)}  (timeout {t:.0f} s)")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_sub_env(cpu_only), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    chunks: list[str] = []
    import threading

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            chunks.append(line)
            sys.stdout.write(line)
        sys.stdout.flush()

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        proc.wait(t)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        th.join(5)
        raise CheckFailed(f"{label or cmd[1]} timed out after {t:.0f} s; last line: "
                          f"{error_line(''.join(chunks))}") from None
    th.join(10)
    text = "".join(chunks)
    if proc.returncode != 0:
        raise CheckFailed(f"{label or os.path.basename(cmd[1])} exited with {proc.returncode}: "
                          f"{error_line(text)}")
    return text


def _device_of(trainer: Any) -> str:
    return str(trainer.device)


def _expect_device(ctx: Ctx, devices: list[str], figures: dict[str, Any]) -> None:
    figures["device"] = ",".join(sorted(set(devices))) or "?"
    bad = [d for d in devices if not d.startswith(ctx.device)]
    if not devices or bad:
        raise CheckFailed(f"trained on {figures['device']}, expected {ctx.device}", figures)


# --- stack


def w_stack(ctx: Ctx) -> dict[str, Any]:
    import platform

    import torch

    figs: dict[str, Any] = {}
    try:
        import fbgemm_gpu
        fb = getattr(fbgemm_gpu, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - reported, the checks then say more
        fb = f"(import failed: {e})"
    try:
        import torchrec
        tr = getattr(torchrec, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        tr = f"(import failed: {e})"
    figs["stack"] = (f"python {platform.python_version()}, torch {torch.__version__} "
                     f"(CUDA {torch.version.cuda}), fbgemm-gpu {fb}, torchrec {tr}")
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    figs["gpus"] = "; ".join(gpus) or "none visible"
    figs["device"] = ctx.device
    figs["cores"] = os.cpu_count()
    log(str(figs))
    if ctx.device == "cuda" and not gpus:
        raise CheckFailed("--device cuda, but torch.cuda.is_available() is False", figs)
    if "import failed" in fb or "import failed" in tr:
        raise CheckFailed(f"fbgemm-gpu {fb}, torchrec {tr}", figs)
    return figs


# --- a: the gpu pytest tier

PYTEST_LOG_ENV = "GPU_CHECK_PYTEST_LOG"


def pytest_runtest_logreport(report: Any) -> None:
    """pytest hook (``-p gpu_check``): one JSON line per test outcome, written as it happens."""
    path = os.environ.get(PYTEST_LOG_ENV)
    if not path:
        return
    # The call phase of every test; setup/teardown only when they fail or skip the test.
    if report.when == "call" or report.outcome != "passed":
        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid.split("::")[-1], "when": report.when,
                                "outcome": report.outcome, "seconds": round(report.duration, 1),
                                "error": error_line(str(report.longrepr)) if report.failed else ""})
                    + "\n")


def w_a(ctx: Ctx, part: str) -> dict[str, Any]:
    record = os.path.join(ctx.work, "outcomes.jsonl")
    os.makedirs(ctx.work, exist_ok=True)
    os.environ[PYTEST_LOG_ENV] = record
    cmd = [_python(), "-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu_check", "-m", "gpu",
           "tests/test_gpu.py", "-k", A_PARTS[part], "-rA", "-v", "-s", *ctx.pytest_args.split()]
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([SCRIPTS, env_path]) if env_path else SCRIPTS
    err: CheckFailed | None = None
    try:
        text = _run(cmd, ctx, timeout=ctx.left() - INNER_MARGIN_S, label="pytest -m gpu")
    except CheckFailed as e:
        err, text = e, ""
    outcomes = []
    if os.path.exists(record):
        with open(record) as f:
            outcomes = [json.loads(ln) for ln in f if ln.strip()]
    count = {k: sum(o["outcome"] == k for o in outcomes) for k in ("passed", "failed", "skipped")}
    figs: dict[str, Any] = dict(count)
    failed = [o for o in outcomes if o["outcome"] == "failed"]
    if failed:
        figs["failed_tests"] = [o["test"] for o in failed]
    ctx.notes += [f"{o['outcome'].upper():7s} {o['test']} ({o['seconds']} s)"
                  + (f": {o['error']}" if o["error"] else "") for o in outcomes]
    ctx.notes += [ln for ln in text.splitlines() if ln.startswith("[gpu]")]
    if failed:
        raise CheckFailed(f"{len(failed)} failed: {failed[0]['test']}: {failed[0]['error']}", figs)
    if err is not None:
        raise CheckFailed(str(err), figs)
    if count["passed"] == 0:
        if ctx.device == "cpu":
            raise CheckSkipped("the gpu tier needs CUDA: every test skipped on the CPU", figs)
        raise CheckFailed("no gpu test passed", figs)
    return figs


# --- b: the examples


EXAMPLE_PARSERS: dict[str, list[tuple[str, str]]] = {
    # (figure name prefix, regex whose named groups are the figures); every one must match.
    "dlrm": [("", r"final eval AUC (?P<auc>[\d.]+) \(chance 0\.5; the planted signal allows at most "
                  r"(?P<oracle>[\d.]+)\) after (?P<steps>\d+) steps")],
    "din": [("", r"final eval AUC: din (?P<din_auc>[\d.]+), dlrm (?P<dlrm_auc>[\d.]+), margin "
                 r"(?P<margin>[-+\d.]+) \(oracle (?P<oracle>[\d.]+)\) after (?P<steps>\d+) steps")],
    "multitask": [("", r"mmoe eval click AUC (?P<mmoe_click_auc>[\d.]+)"),
                  ("", r"final eval like-AUC: mmoe (?P<mmoe_like_auc>[\d.]+), dlrm "
                       r"(?P<dlrm_like_auc>[\d.]+), margin (?P<margin>[-+\d.]+) \(oracle "
                       r"(?P<oracle>[\d.]+)\)")],
    "dynamic": [("", r"final eval AUC (?P<auc>[\d.]+) \(the planted effects allow at most "
                     r"(?P<oracle>[\d.]+) on that hour\) after (?P<steps>\d+) steps"),
                ("", r"serving artifact: \S+ \((?P<artifact_bytes>[\d,]+) bytes\)")],
    "two_tower": [("", r"two_tower final recall@10 [\d.]+ recall@50 (?P<two_tower_recall50>[\d.]+)"),
                  ("", r"sasrec\s+final recall@10 [\d.]+ recall@50 (?P<sasrec_recall50>[\d.]+)"),
                  ("", r"oracle .*recall@50 (?P<oracle_recall50>[\d.]+)")],
    "dcn": [("", r"dcn\s+final eval AUC (?P<dcn_auc>[\d.]+)"),
            ("", r"best possible AUC (?P<oracle>[\d.]+); without the crosses "
                 r"(?P<oracle_without_crosses>[\d.]+)")],
    "hstu": [("", r"hstu\s+recall@10 (?P<hstu_recall10>[\d.]+)"),
             ("", r"oracle\s+recall@10 (?P<oracle_recall10>[\d.]+)"),
             ("", r"oracle w/o times\s+recall@10 (?P<oracle_without_time_recall10>[\d.]+)"),
             ("", r"max \|served - trained\| query = (?P<served_max_diff>[-+.\de]+)")],
}


def example_args(name: str, ctx: Ctx) -> list[str]:
    """Settings small enough to fit the budget: on cuda a few windows of the examples' data,
    on the CPU (the rehearsal) a few thousand rows each."""
    w = ctx.work
    common = ["--output-dir", os.path.join(w, "out")]
    if name == "dlrm":
        sizes = (["--hours", "3", "--rows-per-hour", "6000", "--batch-size", "512",
                  "--num-embeddings", "5000"] if ctx.small else
                 ["--hours", "4", "--rows-per-hour", "30000"])
        return ["--data", os.path.join(w, "data"), *sizes, *common]
    if name in ("din", "multitask"):
        sizes = (["--hours", "3", "--rows-per-hour", "3000", "--num-embeddings", "2000",
                  "--max-len", "20"] if ctx.small else ["--hours", "3", "--rows-per-hour", "15000"])
        return ["--data", os.path.join(w, "data"), *sizes, *common]
    if name == "dynamic":
        sizes = (["--hours", "3", "--rows-per-hour", "3072", "--ids", "3000", "--slots", "400"]
                 if ctx.small else ["--hours", "4", "--rows-per-hour", "10240"])
        return ["--data", os.path.join(w, "data"), *sizes, *common]
    if name == "dcn":
        sizes = (["--hours", "3", "--rows-per-hour", "4000", "--num-embeddings", "5000"]
                 if ctx.small else ["--hours", "4", "--rows-per-hour", "25000"])
        return ["--data", os.path.join(w, "data"), *sizes, *common]
    if name == "hstu":
        sizes = (["--hours", "3", "--rows-per-hour", "3000"] if ctx.small else
                 ["--hours", "4", "--rows-per-hour", "20000"])
        return ["--data", os.path.join(w, "data"), "--serve", os.path.join(w, "art"), *sizes, *common]
    assert name == "two_tower"
    sizes = (["--hours", "3", "--rows-per-hour", "3000"] if ctx.small else
             ["--hours", "4", "--rows-per-hour", "15000"])
    return ["--data", os.path.join(w, "data"), "--models", "two_tower", "sasrec", *sizes, *common]


def run_example(path: str, argv: list[str], device_file: str) -> None:
    """Run an example script as ``__main__`` in this process, recording the device of every
    Trainer it builds (one JSON line each in ``device_file``): the examples choose it with
    TrainingArguments(device="auto") and do not print it."""
    import runpy

    from recsys_trainer import Trainer

    original = Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        with open(device_file, "a") as f:
            f.write(json.dumps({"device": _device_of(self), "model": type(self.model).__name__})
                    + "\n")
        print(f"[gpu-check] Trainer on {_device_of(self)}", flush=True)

    Trainer.__init__ = init  # type: ignore[method-assign]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # train_multitask imports train_din
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def w_b(ctx: Ctx, name: str) -> dict[str, Any]:
    os.makedirs(ctx.work, exist_ok=True)
    device_file = os.path.join(ctx.work, "devices.jsonl")
    script = os.path.join(EXAMPLES, f"train_{name}.py")
    t0 = time.monotonic()
    text = _run([_python(), os.path.abspath(__file__), "--example", script, "--device-file",
                 device_file, "--", *example_args(name, ctx)], ctx,
                timeout=ctx.left() - INNER_MARGIN_S, label=f"examples/train_{name}.py")
    figs: dict[str, Any] = {}
    devices = []
    if os.path.exists(device_file):
        with open(device_file) as f:
            devices = [json.loads(ln)["device"] for ln in f if ln.strip()]
    ctx.notes += [ln for ln in text.splitlines()
                  if re.search(r"final|per window|per epoch|oracle|serving artifact|steps in|bytes on",
                               ln) and not ln.startswith("[gpu-check] $")][-12:]
    for _, pattern in EXAMPLE_PARSERS[name]:
        matches = list(re.finditer(pattern, text))
        if not matches:
            raise CheckFailed(f"no line matching {pattern!r} in the example's output", figs)
        for k, v in matches[-1].groupdict().items():  # the last match: the final figures
            v = v.replace(",", "")
            figs[k] = int(v) if v.lstrip("+-").isdigit() else float(v)
    figs["trainers"] = len(devices)
    figs["example_s"] = round(time.monotonic() - t0, 1)
    _expect_device(ctx, devices, figs)
    return figs


# --- c: save async / sync, SIGKILL, resume, bitwise

C_SAVE_STEPS = 4
C_KILL_AT = 14  # after the saves of steps 4 and 8 (committed) and 12 (maybe in flight)
C_NEED_COMMITTED = 8


def c_sharding(device: str) -> dict[str, str]:
    """Every ShardedTensor layout a world-size-1 CUDA plan can hold (the GPU tier's override
    set), so the staging copy meets row-, column- and table-wise shards; the CPU's planner
    offers table- and column-wise."""
    if device == "cuda":
        return {"t_f0": "row_wise", "t_f1": "table_row_wise", "t_f2": "column_wise",
                "t_f3": "table_wise"}
    return {"t_f0": "table_wise", "t_f1": "table_wise", "t_f2": "column_wise", "t_f3": "table_wise"}


def c_trainer(out: str, device: str, async_save: bool, hooks: list[Any]) -> Any:
    """The tiny DLRM of tests/test_checkpoint_trainer.py (its RowWindows: 3 windows x 8 steps,
    each row's id in dense[:, 0]) at embedding dim 16 (column-wise needs a split), saving every
    C_SAVE_STEPS steps."""
    import torch
    from test_checkpoint_trainer import FEATS, NUM_DENSE, ROWS, RowWindows

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.models import DLRMClassifier

    torch.manual_seed(0)
    model = DLRMClassifier(FEATS, NUM_DENSE, ROWS, embedding_dim=16, dense_arch=(16,),
                           over_arch=(16, 1))
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=out, device="auto", log_steps=1000,
                               save_steps=C_SAVE_STEPS, async_save=async_save,
                               sharding_types=c_sharding(device)),
        train_dataset=RowWindows(num_windows=3),
        hooks=hooks,
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2),
                          lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False,
    )


def c_leg(role: str, out: str, device: str, async_save: bool, info_file: str) -> None:
    """One process of check c: ``full`` (uninterrupted), ``victim`` (stops at C_KILL_AT after a
    committed checkpoint, says so in ``info_file`` and waits for its SIGKILL) or ``resume``
    (the same command in the victim's directory). full/resume save their final state."""
    import torch
    from test_checkpoint_trainer import RowRecorder, committed_steps, snapshot

    from recsys_trainer import Hook

    class KillPoint(Hook):
        def after_step(self, trainer: Any, output: Any) -> None:
            if trainer.state.global_step != C_KILL_AT:
                return
            limit = time.monotonic() + 120
            while max(committed_steps(out), default=0) < C_NEED_COMMITTED:
                if time.monotonic() > limit:
                    raise RuntimeError(f"no checkpoint >= step {C_NEED_COMMITTED} committed "
                                       f"within 120 s (committed: {committed_steps(out)})")
                time.sleep(0.05)
            manager = trainer.checkpointer
            # ``in_flight``: a pending future not yet done (``_pending`` alone is also set for
            # a save that finished but was not collected yet). ``staged``: the async saves that
            # went through the staging copy (counted below); the buffers' bytes alone prove
            # nothing, as they are allocated ahead of the first save.
            pending = getattr(manager, "_pending", None)
            staging = getattr(manager, "_staging", None)
            tmp = info_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"step": trainer.state.global_step, "committed": committed_steps(out),
                           "save_in_flight": bool(manager.in_flight),
                           "save_pending_uncollected": pending is not None,
                           "async_mode": bool(manager.settings.async_save),
                           "staged_saves": list(staged_steps),
                           "staged_bytes": int(staging.nbytes) if staging is not None else 0,
                           "device": str(trainer.device), "pid": os.getpid()}, f)
            os.replace(tmp, info_file)
            while True:  # mid-training: the parent SIGKILLs this process here
                time.sleep(1)

    rec = RowRecorder()
    hooks: list[Any] = [rec] + ([KillPoint()] if role == "victim" else [])
    trainer = c_trainer(out, device, async_save, hooks)
    staged_steps: list[int] = []
    if role == "victim":
        # Count the saves that took the async path: CheckpointManager._save calls _stage (the
        # copy into the staging buffers) only when it does not block. Wrapped on this instance.
        manager = trainer.checkpointer
        stage = manager._stage

        def counted_stage(tensors: dict[str, Any]) -> dict[str, Any]:
            staged_steps.append(int(trainer.state.global_step))
            return stage(tensors)

        manager._stage = counted_stage
    trainer.train()
    if role == "victim":
        raise RuntimeError("the victim finished training without reaching its kill point")
    snap = {k: v.detach().cpu() for k, v in snapshot(trainer).items()}
    torch.save({"snapshot": snap, "step": trainer.state.global_step,
                "loaded": [e[1] for e in rec.events if e[0] == "loaded"],
                "saved": [e[1] for e in rec.events if e[0] == "saved"],
                "device": str(trainer.device), "rows": rec.rows,
                "save_history": [dict(step=s.step, blocked_s=s.blocked_s, total_s=s.total_s)
                                 for s in getattr(trainer.checkpointer, "history", [])
                                 if hasattr(s, "blocked_s")]},
               info_file)


def w_c(ctx: Ctx, mode: str) -> dict[str, Any]:
    import torch

    async_save = mode == "async"
    os.makedirs(ctx.work, exist_ok=True)
    full_dir, cut_dir = os.path.join(ctx.work, "full"), os.path.join(ctx.work, "cut")
    full_info, victim_info, resume_info = (os.path.join(ctx.work, f"{n}.out")
                                           for n in ("full", "victim", "resume"))

    def leg_cmd(role: str, out: str, info: str) -> list[str]:
        return [_python(), os.path.abspath(__file__), "--c-leg", role, "--c-out", out,
                "--device", ctx.device, "--c-async", str(int(async_save)), "--c-info", info]

    figs: dict[str, Any] = {"async_save": async_save, "save_steps": C_SAVE_STEPS,
                            "sharding": "/".join(sorted(set(c_sharding(ctx.device).values())))}
    # The uninterrupted run and the victim side by side (separate processes, one GPU).
    log("starting the uninterrupted run and the victim")
    logs = {n: os.path.join(ctx.work, f"{n}.log") for n in ("full", "victim")}

    def tail(n: str) -> str:
        with open(logs[n], errors="replace") as f:
            return error_line(f.read())

    def start(role: str, out: str, info: str) -> subprocess.Popen[Any]:
        with open(logs[role], "w") as f:  # the child keeps its own descriptor
            return subprocess.Popen(leg_cmd(role, out, info), cwd=ROOT, env=_sub_env(),
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    full_proc = start("full", full_dir, full_info)
    victim = start("victim", cut_dir, victim_info)
    try:
        limit = ctx.deadline - 40  # leave time for the resume
        while not os.path.exists(victim_info):
            if victim.poll() is not None:
                raise CheckFailed(f"the victim exited with {victim.returncode} before its kill "
                                  f"point: {tail('victim')}", figs)
            if time.monotonic() > limit:
                raise CheckFailed("the victim did not reach its kill point in time", figs)
            time.sleep(0.1)
        with open(victim_info) as f:
            at_kill = json.load(f)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
        figs.update(killed_at_step=at_kill["step"], committed_at_kill=at_kill["committed"],
                    save_in_flight_at_kill=at_kill["save_in_flight"],
                    save_uncollected_at_kill=at_kill["save_pending_uncollected"],
                    victim_async_mode=at_kill["async_mode"],
                    victim_staged_saves=len(at_kill["staged_saves"]),
                    victim_staged_steps=",".join(map(str, at_kill["staged_saves"])),
                    victim_staged_bytes=at_kill["staged_bytes"], exit=victim.returncode)
        log(f"SIGKILLed the victim at step {at_kill['step']} (committed {at_kill['committed']}, "
            f"a save still being written: {at_kill['save_in_flight']}, async saves staged at "
            f"steps {at_kill['staged_saves']}); exit {victim.returncode}")
        if victim.returncode != -signal.SIGKILL:
            raise CheckFailed(f"the victim ended with {victim.returncode}, not by SIGKILL", figs)
        # c.async exists to exercise the async path (staging copy, writer thread): a victim
        # that saved blocking, or never staged, would pass the bitwise comparison vacuously.
        if async_save and not at_kill["async_mode"]:
            raise CheckFailed("the victim's checkpoint manager was not in async mode", figs)
        if async_save and (not at_kill["staged_saves"] or at_kill["staged_bytes"] <= 0):
            raise CheckFailed("the victim staged no async save before its kill (staged at "
                              f"steps {at_kill['staged_saves']}, {at_kill['staged_bytes']} "
                              "bytes in the staging buffers)", figs)
        if not async_save and at_kill["staged_saves"]:
            raise CheckFailed("c.sync's victim staged a save: it did not save blocking", figs)
        _run(leg_cmd("resume", cut_dir, resume_info), ctx, timeout=ctx.left() - INNER_MARGIN_S,
             label="the resumed run")
        try:
            full_proc.wait(max(1.0, ctx.left() - INNER_MARGIN_S))
        except subprocess.TimeoutExpired:
            raise CheckFailed("the uninterrupted run did not finish in time", figs) from None
        if full_proc.returncode != 0:
            raise CheckFailed(f"the uninterrupted run exited with {full_proc.returncode}: "
                              f"{tail('full')}", figs)
    finally:
        for p in (victim, full_proc):
            if p.poll() is None:
                _kill_tree(p)
        for n, path in logs.items():  # into this check's log
            with open(path, errors="replace") as f:
                print(f"----- the {n} run's output -----\n{f.read()[-20000:]}", flush=True)
    full = torch.load(full_info, weights_only=False)
    resumed = torch.load(resume_info, weights_only=False)
    figs.update(device=resumed["device"], resumed_from=",".join(resumed["loaded"]) or "nothing",
                steps=resumed["step"])
    if full["save_history"]:
        blocked = [h["blocked_s"] for h in full["save_history"]]
        figs["loop_blocked_s_max"] = round(max(blocked), 4)
    a, b = full["snapshot"], resumed["snapshot"]
    differ = sorted(k for k in a.keys() | b.keys()
                    if k not in a or k not in b or not torch.equal(a[k], b[k]))
    worst = max((float((a[k].double() - b[k].double()).abs().max()) for k in differ
                 if k in a and k in b and a[k].shape == b[k].shape and a[k].numel()), default=0.0)
    figs.update(tensors=len(a), bitwise="yes" if not differ else f"no ({len(differ)} differ)",
                max_abs_diff=worst)
    _expect_device(ctx, [full["device"], resumed["device"], at_kill["device"]], figs)
    if not resumed["loaded"]:
        raise CheckFailed("the resumed run loaded no checkpoint (started afresh)", figs)
    if resumed["step"] != full["step"]:
        raise CheckFailed(f"resumed run ended at step {resumed['step']}, the full one at "
                          f"{full['step']}", figs)
    if differ:
        raise CheckFailed(f"resumed != uninterrupted: {differ[:4]} (max |diff| {worst:.3g})", figs)
    return figs


# --- d: serving parity


def tt_build(root: str) -> tuple[Any, Any]:
    """The two-tower of tests/test_retrieval_trainer.py on its small interaction log (``root``
    holds it): (spec, model); built the same in the trainer and in the CPU export process."""
    import torch

    from recsys_trainer.data.generators.interactions_synthetic import interaction_features
    from recsys_trainer.models import TwoTowerModel

    with open(os.path.join(root, "_signal.json")) as f:
        meta = json.load(f)
    torch.manual_seed(0)
    spec = interaction_features(meta)
    model = TwoTowerModel(
        ["user_id", "segment"], num_items=meta["num_items"],
        user_num_embeddings=[meta["num_users"], meta["num_segments"]],
        item_side_features={"item_cat": meta["num_clusters"]},
        item_catalog=f"{root}/_items.parquet", max_len=meta["max_len"], embedding_dim=16,
        tower_dims=(32, 16), num_uniform_negatives=8)
    return spec, model


def hr_build(root: str) -> tuple[Any, Any]:
    """HSTU retrieval on a small timed-sequence log (``root`` holds it): (spec, model); built
    the same in the trainer and in the CPU export process."""
    import torch

    from recsys_trainer.data.generators.sequences_synthetic import sequence_features
    from recsys_trainer.models import HSTURetrievalModel

    with open(os.path.join(root, "_signal.json")) as f:
        meta = json.load(f)
    torch.manual_seed(0)
    model = HSTURetrievalModel(num_items=meta["num_items"], max_len=meta["max_len"], embedding_dim=16,
                               num_heads=2, num_uniform_negatives=8)
    return sequence_features(meta), model


def d_export_on_cpu(kind: str, ckpt: str, art: str, rows: str, data: str, out_npz: str) -> None:
    """The CPU serving host's side (``CUDA_VISIBLE_DEVICES=``): export the committed checkpoint
    a GPU run wrote, score ``rows`` (a parquet file) with the Scorer, save the scores."""
    import numpy as np
    import torch

    from recsys_trainer.serving import export_for_serving

    assert not torch.cuda.is_available(), "the CPU export process sees a GPU"
    if kind in QUERY_KINDS:
        spec, model = (tt_build if kind == "two_tower" else hr_build)(data)
        summary = export_for_serving(ckpt, art, model=model, features=spec, activation="none")
    else:
        import serving_utils as su

        spec, model = su.spec_and_model(kind)
        summary = export_for_serving(ckpt, art, model=model, features=spec)
    scored = _scores_of(art, rows)
    np.savez(out_npz, scores=np.stack(list(scored.values())), row_ids=np.asarray(list(scored)),
             content_hash=summary.content_hash, step=int(summary.step or 0),
             cuda=torch.cuda.is_available())
    print(f"[gpu-check] CPU export of {ckpt} (step {summary.step}) scored {len(scored)} rows; "
          f"cuda visible: {torch.cuda.is_available()}", flush=True)


def _d_train(kind: str, root: str) -> tuple[Any, dict[int, Any], str, str, dict[str, Any]]:
    """Train the ``kind`` model on this check's device, score its reference rows: (trainer,
    {row: reference scores}, rows file to score, data folder, export keyword arguments)."""
    import torch

    data = os.path.join(root, "data")
    if kind not in QUERY_KINDS:
        import serving_utils as su

        windows = su.write_data(data, kind)
        trainer = su.make_trainer(kind, root, windows, steps=6, save_steps=3)
        trainer.train()
        return (trainer, su.predicted(trainer, windows[-1], os.path.join(root, "pred")),
                windows[-1], data, {})
    # A retrieval model's user side: the query vectors the live model ranks the corpus with (the
    # pattern of test_retrieval_trainer.py's serving test), on the eval window's first batch.
    import pyarrow.parquet as pq

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.data.generators.interactions_synthetic import (
        InteractionSignal,
        write_dataset,
    )
    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.data.windows import partitioned_windows

    if kind == "two_tower":
        write_dataset(data, hours=3, rows_per_hour=4000, ks=(20,),
                      signal=InteractionSignal.make(num_users=300, num_items=600, num_clusters=12,
                                                    max_len=20))
        spec, model = tt_build(data)
    else:  # HSTU retrieval's user side, the event times included
        from recsys_trainer.data.generators import sequences_synthetic as seqs

        seqs.write_dataset(data, hours=3, rows_per_hour=4000, ks=(10,),
                           signal=seqs.SequenceSignal.make(num_items=600, num_clusters=12, max_len=20))
        spec, model = hr_build(data)
    windows = partitioned_windows(data)
    trainer = Trainer(
        model, TrainingArguments(output_dir=os.path.join(root, "ckpt"), log_steps=10**6,
                                 train_steps=4, save_steps=2),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=256, shuffle=True, seed=1),
        eval_dataset=ParquetWindowDataset(windows[-1:], spec, batch_size=1024),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=5e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1), add_logger_hook=False)
    trainer.train()
    ds: Any = trainer.eval_dataset
    wid = next(iter(ds.window_ids()))
    batch = next(iter(ds.iter_window(wid)))
    rows_table = next(iter(ds.read_columns(wid, ds.features.columns())))
    trainer.model.eval()
    with torch.no_grad():
        _, out = trainer.model(batch.to(trainer.device))
    ref = out["query"].float().cpu().numpy()
    rows_table = rows_table.slice(0, len(ref))
    rows_file = os.path.join(root, "rows.parquet")
    pq.write_table(rows_table, rows_file)
    # Keyed as _scores_of keys the Scorer's: by row_id, else by row number.
    keys = (rows_table.column("row_id").to_pylist() if "row_id" in rows_table.column_names
            else list(range(len(ref))))
    return (trainer, {int(k): ref[i] for i, k in enumerate(keys)}, rows_file, data,
            {"activation": "none"})


def _scores_of(art: str, rows_file: str) -> dict[int, Any]:
    """The CPU Scorer's scores of ``rows_file``: {row_id (or row number): scores}."""
    import numpy as np
    import pyarrow.parquet as pq

    from recsys_trainer.serving import Scorer

    table = pq.read_table(rows_file)
    out = Scorer(art).score(table).reshape(table.num_rows, -1)
    ids = (table.column("row_id").to_pylist() if "row_id" in table.column_names
           else list(range(table.num_rows)))
    return {int(r): np.asarray(s) for r, s in zip(ids, out, strict=True)}


def _max_diff(a: dict[int, Any], b: dict[int, Any]) -> float:
    import numpy as np

    if set(a) != set(b):
        raise CheckFailed(f"scored {len(a)} rows, the reference has {len(b)}")
    return max(float(np.abs(np.asarray(a[k]).reshape(-1) - np.asarray(b[k]).reshape(-1)).max())
               for k in b)


def w_d(ctx: Ctx, kind: str) -> dict[str, Any]:
    """(i) ``export_for_serving`` on the live trainer, (ii) its committed checkpoint exported
    by a process that sees no GPU; each scored by the CPU Scorer against the trained model's
    own scores. (ii) runs even when (i) fails, so each export path reports on its own."""
    import numpy as np

    from recsys_trainer.checkpoint import layout
    from recsys_trainer.serving import export_for_serving

    os.makedirs(ctx.work, exist_ok=True)
    root = ctx.work
    figs: dict[str, Any] = {}
    errors: list[str] = []
    trainer, reference, rows_file, data, export_kw = _d_train(kind, root)
    step = trainer.state.global_step
    figs.update(device=_device_of(trainer), step=step, rows=len(reference))
    _expect_device(ctx, [_device_of(trainer)], figs)
    live_hash = None
    try:  # (i): the path a training job takes (it saves the step, then rank 0 exports it)
        art_live = os.path.join(root, "art_live")
        live_hash = export_for_serving(trainer, art_live, **export_kw).content_hash
        figs["live_max_diff"] = _max_diff(_scores_of(art_live, rows_file), reference)
        log(f"{kind}: live export max |reference - Scorer| = {figs['live_max_diff']:.3g}")
    except Exception as e:  # noqa: BLE001 - reported; (ii) still runs
        traceback.print_exc()
        figs["live_max_diff"] = "error"
        errors.append(f"live export: {error_line(''.join(traceback.format_exception_only(e)))}")
    ckpt = os.path.join(root, "ckpt")
    if step not in [i.step for i in layout.list_committed(ckpt)]:
        trainer.save_checkpoint()  # the live export failed before it saved the trained step
    # (ii): the committed checkpoint, exported and scored by a process that sees no GPU.
    out_npz = os.path.join(root, "cpu_scores.npz")
    try:
        _run([_python(), os.path.abspath(__file__), "--d-export", kind, "--d-ckpt", ckpt,
              "--d-art", os.path.join(root, "art_ckpt"), "--d-rows", rows_file, "--d-data", data,
              "--d-out", out_npz], ctx, timeout=ctx.left() - INNER_MARGIN_S, cpu_only=True,
             label="the CPU-only export")
        z = np.load(out_npz)
        cpu = {int(r): s for r, s in zip(z["row_ids"], z["scores"], strict=True)}
        figs["ckpt_cpu_max_diff"] = _max_diff(cpu, reference)
        figs["ckpt_step"] = int(z["step"])
        if live_hash is not None:
            figs["same_content_hash"] = "yes" if str(z["content_hash"]) == live_hash else "no"
        if bool(z["cuda"]):
            errors.append("the CPU export process saw a GPU")
    except CheckFailed as e:
        figs["ckpt_cpu_max_diff"] = "error"
        errors.append(f"checkpoint export on the CPU: {e}")
    for name in ("live_max_diff", "ckpt_cpu_max_diff"):
        v = figs.get(name)
        if isinstance(v, float) and not v <= PARITY_TOL:
            errors.append(f"{name} {v:.3g} > {PARITY_TOL:g}")
    if errors:
        raise CheckFailed("; ".join(errors), figs)
    return figs


# --- e: the trainer benchmark

BENCH_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\w+)\s*\|\s*([\d,]+)\s*\|\s*([\d.]+|-)\s*\|\s*([\d.]+|-)\s*\|"
                       r"\s*([\d.]+|nan)\s*\|")


def bench_args(ctx: Ctx) -> list[str]:
    if ctx.small:
        return ["--device", "cpu", "--ranks", "1", "--num-embeddings", "10000", "--embedding-dim",
                "16", "--batch-size", "512", "--sparse-optimizer", "rowwise_adagrad", "--warmup",
                "2", "--steps", "5", "--rounds", "2", "--distinct-batches", "4",
                "--variants", "torchrec_loop", "torchrec_pipeline", "trainer", "trainer_pipeline"]
    # The shape of docs/gpu.md (26 x 1M x 128, batch 8192); 4 variants x 13.3 GB of tables fit
    # an 80 GB GPU (plain_pytorch's dense Adagrad state would not); fewer steps than there.
    return ["--device", "cuda", "--ranks", "1", "--num-embeddings", "1000000", "--embedding-dim",
            "128", "--batch-size", "8192", "--sparse-optimizer", "rowwise_adagrad", "--warmup",
            "5", "--steps", "20", "--rounds", "3",
            "--variants", "torchrec_loop", "torchrec_pipeline", "trainer", "trainer_pipeline"]


def w_e(ctx: Ctx) -> dict[str, Any]:
    t = ctx.left() - INNER_MARGIN_S
    text = _run([_python(), "benchmarks/bench_trainer.py", *bench_args(ctx), "--timeout",
                 f"{max(10.0, t - 5):.0f}"], ctx, timeout=t, label="bench_trainer.py")
    figs: dict[str, Any] = {}
    for ln in text.splitlines():
        m = BENCH_ROW.match(ln)
        if m:
            ctx.notes.append(ln)
            name, sps, ratio, spread = m.group(2), m.group(3), m.group(4), m.group(6)
            if name == "torchrec_loop":
                figs["loop_samples_per_s"] = int(sps.replace(",", ""))
            elif ratio != "-":
                figs[f"{name}_x_loop"] = float(ratio)
            if spread != "nan":  # the noisiest variant's slowest / fastest round
                figs["max_round_spread"] = max(figs.get("max_round_spread", 0.0), float(spread))
        elif ln.startswith("26 tables") or " tables x " in ln:
            ctx.notes.insert(0, ln)
    if "trainer_x_loop" not in figs:
        raise CheckFailed("no 'trainer' row in the benchmark's table", figs)
    figs["goal_trainer_ge_0.95x"] = "met" if figs["trainer_x_loop"] >= 0.95 else "missed"
    dev = re.search(r"after \d+ warmup, on (.*)$", text, re.M)
    figs["device"] = dev.group(1) if dev else "?"
    if ctx.device == "cuda" and "CPU" in figs["device"]:
        raise CheckFailed(f"the benchmark ran on {figs['device']}", figs)
    return figs


WORKERS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "stack": w_stack,
    **{f"a.{k}": functools.partial(w_a, part=k) for k in A_PARTS},
    "c.async": functools.partial(w_c, mode="async"),
    "c.sync": functools.partial(w_c, mode="sync"),
    **{f"d.{k}": functools.partial(w_d, kind=k) for k in D_KINDS},
    **{f"b.{k}": functools.partial(w_b, name=k) for k in EXAMPLE_NAMES},
    "e": w_e,
}


def _selftest(ctx: Ctx, how: str) -> dict[str, Any]:
    """For tests/test_gpu_check.py only: a check that passes, fails, or hangs."""
    if how == "fail":
        raise ValueError("a planted failure\nsecond line")
    if how == "hang":
        time.sleep(3600)
    return {"ok": 1, "device": ctx.device,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")}


def worker(name: str, a: argparse.Namespace) -> int:
    ctx = Ctx(device=a.device, work=os.path.abspath(a.work),
              deadline=time.monotonic() + max(5.0, a.timeout - 3.0), pytest_args=a.pytest_args or "")
    os.makedirs(ctx.work, exist_ok=True)
    out: dict[str, Any] = {"status": "PASS", "figures": {}, "error": "", "notes": []}
    try:
        if name.startswith("selftest."):
            out["figures"] = _selftest(ctx, name.split(".", 1)[1])
        else:
            out["figures"] = WORKERS[name](ctx)
    except CheckSkipped as e:
        out.update(status="SKIP", figures=e.figures, error=str(e))
    except CheckFailed as e:
        out.update(status="FAIL", figures=e.figures, error=str(e))
        traceback.print_exc()
    except BaseException as e:  # noqa: BLE001 - every failure becomes a FAIL line
        traceback.print_exc()
        out.update(status="FAIL", error=error_line("".join(traceback.format_exception_only(e))))
    out["notes"] = ctx.notes
    with open(a.result + ".tmp", "w") as f:
        json.dump(out, f, default=str)
    os.replace(a.result + ".tmp", a.result)
    print(f"[gpu-check] {name}: {out['status']} {out['error']}", flush=True)
    sys.stdout.flush()
    # Leave at once: a worker's process group, trainer threads or CUDA teardown must not turn
    # a reported result into a hang.
    os._exit(0)


# ----------------------------------------------------------------------------- entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the acceptance on a GPU host; cpu: the rehearsal (no check sees "
                        "a GPU; smaller shapes)")
    p.add_argument("--rehearse", action="store_true", help="the same as --device cpu")
    p.add_argument("--only", default=os.environ.get("GPU_CHECK_ONLY"),
                   help="checks to run, comma-separated: groups (a,b,c,d,e) or names (d.din)")
    p.add_argument("--summary", default=os.environ.get("GPU_CHECK_SUMMARY") or DEFAULT_SUMMARY,
                   help=f"the summary file (env GPU_CHECK_SUMMARY; default {DEFAULT_SUMMARY}); "
                        "each check's log goes to gpu-check-logs/ beside it")
    p.add_argument("--work", default=os.path.join("output", "gpu-check", "work"),
                   help="scratch folder (data, checkpoints, artifacts); cleared at the start")
    p.add_argument("--jobs", type=int, default=None,
                   help="checks run at a time (default: 5 on cuda, 2 on the CPU)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole run (default {DEFAULT_BUDGET_S} on cuda, 3600 on "
                        "the CPU; env GPU_CHECK_BUDGET_S)")
    p.add_argument("--deadline", type=float, default=None,
                   help="end of the run in epoch seconds (scripts/gpu-check passes its start + "
                        "the budget, so setup time counts)")
    p.add_argument("--cpu-timeout-scale", type=float, default=1.0,
                   help="multiplies the CPU rehearsal's per-check timeouts (a slow host)")
    p.add_argument("--setup-seconds", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--pytest-args", default="", help="extra arguments for check a's pytest")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    # Internal: one check's process, and the processes the checks start.
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument("--example", help=argparse.SUPPRESS)
    p.add_argument("--device-file", help=argparse.SUPPRESS)
    p.add_argument("--c-leg", choices=("full", "victim", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--c-out", help=argparse.SUPPRESS)
    p.add_argument("--c-async", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--c-info", help=argparse.SUPPRESS)
    p.add_argument("--d-export", help=argparse.SUPPRESS)
    p.add_argument("--d-ckpt", help=argparse.SUPPRESS)
    p.add_argument("--d-art", help=argparse.SUPPRESS)
    p.add_argument("--d-rows", help=argparse.SUPPRESS)
    p.add_argument("--d-data", help=argparse.SUPPRESS)
    p.add_argument("--d-out", help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rehearse:
        a.device = "cpu"
    if a.jobs is None:
        a.jobs = 5 if a.device == "cuda" else 2
    if a.budget is None:
        env = os.environ.get("GPU_CHECK_BUDGET_S")
        a.budget = float(env) if env else (DEFAULT_BUDGET_S if a.device == "cuda" else 3600.0)
    if a.rest and a.rest[0] == "--":
        a.rest = a.rest[1:]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a.worker, a)
    if a.example:
        run_example(a.example, a.rest, a.device_file)
        return 0
    if a.c_leg:
        c_leg(a.c_leg, a.c_out, a.device, bool(a.c_async), a.c_info)
        return 0
    if a.d_export:
        d_export_on_cpu(a.d_export, a.d_ckpt, a.d_art, a.d_rows, a.d_data, a.d_out)
        return 0
    checks = select(a.only)
    if a.list:
        for c in checks:
            print(f"{c.name:16s} {c.timeout_gpu:4.0f} s on cuda  {c.what}")
        return 0
    t0 = time.monotonic()
    results = drive(a, checks)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"[gpu-check] {len(results) - len(failed)} of {len(results)} checks passed or skipped "
          f"in {time.monotonic() - t0:.0f} s; summary: {a.summary}", flush=True)
    if failed:
        print(f"[gpu-check] FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
