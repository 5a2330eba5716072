"""Run every benchmark, each in its own subprocess, and write one markdown report.

    python benchmarks/run_all.py [--quick] [--out benchmarks/results.md] [--only trainer scaling]

Benchmarks (run in this order, those present): ``bench_trainer.py`` (Trainer overhead vs a
hand-written TorchRec loop and plain PyTorch), ``bench_batch_check.py`` (the id check on
hand-built batches vs the step), ``bench_scaling.py`` (table rows, batch size,
memory), ``bench_data.py`` (reader throughput), ``bench_vocab.py`` (vocabularies vs hashing: AUC and
reader cost), ``bench_checkpoint.py`` (save/restore),
``bench_predict.py`` (offline scoring vs evaluation), ``bench_serving.py`` (the exported
model's scorer vs the eager model; quantized tables), ``bench_dynamic.py`` (dynamic vs
hashed tables on a churny id stream: AUC at equal rows and bytes, step time),
``bench_dynamic_step.py`` (where a dynamic table's step time goes),
``bench_mixed_step.py`` (some of a DLRM's tables dynamic vs all hashed),
``bench_dynamic_lookup.py`` (a dynamic table's id lookup: binary search vs the bucket index),
``bench_memory.py`` (bytes per id of hashed and dynamic tables by precision and dim, checked
against the process's memory growth), ``bench_precision.py`` (updates an fp16 table loses to
rounding on CPU, and what they cost),
``bench_storage.py`` (the reader over a local S3 server vs local disk), ``bench_checkpoint.py
--s3`` (checkpoints in a local S3 server vs local disk), ``bench_recovery.py faults`` (steps
lost and time to recover per fault kind, under torchrun), ``bench_retrieval.py`` (the retrieval
losses' step cost vs a pointwise loss; full-corpus evaluation cost vs the corpus size).

The contract with a benchmark script: it runs with the arguments ``BENCHMARKS`` gives it (none
for most; a script with several modes is listed once per mode); it accepts ``--quick`` if its
``--help`` mentions it (otherwise ``QUICK_FALLBACK`` names smaller settings from its own
options, used only if its ``--help`` lists them); it prints its results to stdout. Output with
markdown tables or headings (lines starting with ``|`` or ``#``) is merged as is; anything else
is merged as a code block. A benchmark that fails or times out is reported in the document, the
others still run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

BENCHMARKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "trainer": ("bench_trainer.py", ()),
    "batch_check": ("bench_batch_check.py", ()),
    "scaling": ("bench_scaling.py", ()),
    "data": ("bench_data.py", ()),
    "vocab": ("bench_vocab.py", ()),
    "checkpoint": ("bench_checkpoint.py", ()),
    "predict": ("bench_predict.py", ()),
    "serving": ("bench_serving.py", ()),
    "dynamic": ("bench_dynamic.py", ()),
    "dynamic_step": ("bench_dynamic_step.py", ()),
    "mixed_step": ("bench_mixed_step.py", ()),
    "dynamic_lookup": ("bench_dynamic_lookup.py", ()),
    "memory": ("bench_memory.py", ()),
    "precision": ("bench_precision.py", ()),
    "storage": ("bench_storage.py", ()),
    "checkpoint_s3": ("bench_checkpoint.py", ("--s3",)),
    "recovery": ("bench_recovery.py", ("faults",)),
    "retrieval": ("bench_retrieval.py", ()),
    "freshness": ("bench_freshness.py", ()),
}
"""Name (for ``--only``) -> (script in benchmarks/, the arguments that select its mode)."""

# For scripts without --quick: smaller settings from their own options.
QUICK_FALLBACK = {
    "bench_data.py": ["--rows", "200000", "--train-steps", "10"],
    "bench_checkpoint.py": ["--rows", "1e5", "1e6"],
    "bench_dynamic_lookup.py": ["--reps", "2"],
}


def _help(script: str) -> str:
    p = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    return p.stdout + p.stderr


def script_args(script: str, quick: bool) -> list[str]:
    """The arguments ``run_all`` passes to ``script`` (see the module docstring)."""
    if not quick:
        return []
    text = _help(script)
    if "--quick" in text:
        return ["--quick"]
    fallback = QUICK_FALLBACK.get(os.path.basename(script), [])
    if all(tok in text for tok in fallback if tok.startswith("--")):
        return list(fallback)
    return []


def as_markdown(output: str) -> str:
    """A benchmark's stdout as markdown (see the module docstring)."""
    text = output.strip()
    if any(line.startswith(("|", "#")) for line in text.splitlines()):
        return text
    return f"```text\n{text}\n```"


def run_one(name: str, script: str, quick: bool, timeout_s: float,
            mode: tuple[str, ...] = ()) -> tuple[str, bool, float]:
    """Run one benchmark (``mode``: its ``BENCHMARKS`` arguments); returns (markdown section,
    ok, seconds)."""
    args = [*mode, *script_args(script, quick)]
    cmd = [sys.executable, script, *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=os.path.dirname(HERE))
    except subprocess.TimeoutExpired as exc:
        took = time.perf_counter() - t0
        tail = (exc.stderr or b"")[-2000:]
        tail_s = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return (f"## {name}: TIMED OUT after {timeout_s:.0f} s\n\n`{' '.join(cmd[1:])}`\n\n"
                f"```text\n{tail_s}\n```", False, took)
    took = time.perf_counter() - t0
    command = f"`python {os.path.relpath(script, os.path.dirname(HERE))} {' '.join(args)}`".replace(" `", "`")
    if p.returncode != 0:
        return (f"## {name}: FAILED (exit status {p.returncode})\n\n{command}\n\n"
                f"```text\n{(p.stdout + p.stderr)[-4000:]}\n```", False, took)
    body = as_markdown(p.stdout)
    if not body.lstrip().startswith("#"):
        body = f"## {name}\n\n{body}"
    return f"{body}\n\n_{command}, {took:.0f} s_", True, took


def header(quick: bool) -> str:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=HERE, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return "\n".join([
        "# recsys_trainer benchmarks",
        "",
        f"{datetime.datetime.now().isoformat(timespec='seconds')}, commit {commit}, "
        f"{'--quick' if quick else 'full'} run; {platform.machine()} {os.cpu_count()} cores, "
        f"load average {load:.1f} at start; Python {platform.python_version()}, torch {torch.__version__}.",
        "",
        "Compare ratios within a table (measured in the same run); absolute rates vary with the host.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small settings (< 5 minutes in all)")
    p.add_argument("--out", default=os.path.join(HERE, "results.md"), help="the markdown report")
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per benchmark (default 240 with --quick, 900 without)")
    a = p.parse_args(argv)
    timeout = a.timeout or (240 if a.quick else 900)
    sections, ok_all = [header(a.quick)], True
    for name, (file, mode) in BENCHMARKS.items():
        if a.only and name not in a.only:
            continue
        script = os.path.join(HERE, file)
        if not os.path.exists(script):
            print(f"run_all: {file} not present, skipped", file=sys.stderr)
            continue
        label = " ".join([file, *mode])
        print(f"run_all: {label} ...", file=sys.stderr, flush=True)
        section, ok, took = run_one(name, script, a.quick, timeout, mode)
        print(f"run_all: {label} {'ok' if ok else 'FAILED'} in {took:.0f} s", file=sys.stderr, flush=True)
        sections.append(section)
        ok_all &= ok
    doc = "\n\n".join(sections) + "\n"
    with open(a.out, "w") as f:
        f.write(doc)
    print(doc)
    print(f"run_all: wrote {a.out}", file=sys.stderr)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
