"""Run many 2-rank Trainer jobs that each end with a real interpreter exit, cheaply.

    python tests/exit_driver.py RUNS OUT_DIR

The stack (torch, torchrec, recsys_trainer) is imported once; every run forks two ranks (a gloo
job on a fresh port). Each rank trains and evaluates a tiny model with a checkpoint save and the
metrics hook, calls ``shutdown()``, and leaves through the normal interpreter exit, finalization
included (a multiprocessing child would skip it with ``os._exit``). A check registered with
``atexit`` before the job starts (so it runs after the library's own exit handlers) records how
many gloo threads are still alive when interpreter finalization begins. Prints one JSON line:
per run and rank, the exit status, whether stderr says "terminate called", and that count.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time

from helpers import batches, make_trainer

from recsys_trainer import MetricReportHook, shutdown
from recsys_trainer.distributed import free_port

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _count_gloo_threads(path: str) -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    with open(path, "w") as f:
        f.write(str(sum(n in GLOO_THREADS for n in names)))


def _job(rank: int, out: str) -> None:
    trainer = make_trainer(train=batches(4, seed=rank), eval_=batches(2, seed=10 + rank),
                           hooks=[MetricReportHook()], train_steps=3, save_steps=2,
                           output_dir=out, resume_from=None)
    trainer.train_and_evaluate()
    shutdown()


def _rank_process(run: int, rank: int, port: int, out: str) -> None:
    """The body of a forked rank; returns normally, so its frames (and the Trainer) are gone
    before the caller exits the interpreter."""
    err = os.open(os.path.join(out, f"run{run}_rank{rank}.err"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(err, 2)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
    })
    atexit.register(_count_gloo_threads, os.path.join(out, f"run{run}_rank{rank}.threads"))
    _job(rank, os.path.join(out, f"run{run}"))


def main() -> None:
    runs, out = int(sys.argv[1]), sys.argv[2]
    results = []
    for run in range(runs):
        port = free_port()
        pids = {}
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                _rank_process(run, rank, port, out)
                sys.exit(0)  # through interpreter finalization, like a script's end
            pids[pid] = rank
        deadline = time.monotonic() + 120
        while pids:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    for p in pids:
                        os.kill(p, 9)
                time.sleep(0.05)
                continue
            rank = pids.pop(pid)
            prefix = os.path.join(out, f"run{run}_rank{rank}")
            with open(prefix + ".err", errors="replace") as f:
                err = f.read()
            threads = None
            if os.path.exists(prefix + ".threads"):
                with open(prefix + ".threads") as f:
                    threads = int(f.read())
            results.append({"run": run, "rank": rank, "exit": os.waitstatus_to_exitcode(status),
                            "terminate": "terminate called" in err, "gloo_threads_at_exit": threads,
                            "stderr_tail": err[-400:]})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
