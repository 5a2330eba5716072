"""Run a function on N real processes with a gloo group, with a hard timeout.

``run_distributed(fn, world_size=2, timeout_s=120, args=(...))`` starts ``world_size``
processes, each with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set as torchrun would, calls
``fn(*args)`` in each, and returns the per-rank return values (must be picklable). A rank that
raises fails the test with its traceback; a hang past ``timeout_s`` kills every rank and fails.
``fn`` must be defined at module level (it is pickled by reference). Under pytest only a test
marked ``@pytest.mark.distributed`` may call it (``conftest.py`` says which test runs), so the
fast tier (``-m "not distributed"``) never starts a process group.

The ranks are forked by a multiprocessing forkserver that imports the stack (torch, torchrec,
recsys_trainer: ``PRELOAD``) once per test session. A spawned rank spent ~3.5 s of CPU importing
it and ~1 s more collecting the import-time objects at its exit, most of a short 2-rank test.
Each rank is still a process of its own, forked from a single-threaded server that never ran a
Trainer or formed a group: it inherits the imported modules and nothing else. Like a spawned
rank, it gets the caller's environment and working directory as they are at the call, and writes
to the caller's stdout and stderr (the test's captured output).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from recsys_trainer.distributed import free_port

PRELOAD = ["torch", "torchrec", "torch.distributed.checkpoint", "pyarrow.parquet",
           "recsys_trainer.trainer", "recsys_trainer.models", "dist_utils", "helpers"]
"""Imported once by the forkserver that forks every rank: what nearly every rank imports."""

current_test_is_distributed = True
"""Set by ``conftest.py`` for every test: whether it carries the ``distributed`` marker."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return ctx


class _CallerStream:
    """The caller's stdout or stderr, handed to a rank as a duplicate of the same open file (as
    a spawned rank inherits it: one file offset, so the test's captured output interleaves)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while the rank starts: multiprocessing passes the descriptor to the forkserver.
        return _received_stream, (self.fd, reduction.DupFd(self.fd))


def _received_stream(fd: int, dup: Any) -> tuple[int, int]:
    return fd, dup.detach()


def _like_the_caller(env: dict[str, str], streams: list[tuple[int, int]]) -> None:
    """The caller's environment and output streams, as a spawned rank would inherit them (the
    forkserver's are those of the call that started it)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, dup in streams:
        os.dup2(dup, fd)
        os.close(dup)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, env: dict[str, str],
           args: tuple[Any, ...], results: Any, streams: list[tuple[int, int]]) -> None:
    _like_the_caller(env, streams)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    })
    try:
        out = fn(*args)
        # Plain pickle bytes: torch's mp reductions would pass tensors as shared-memory handles
        # that vanish when this process exits.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
        # Flush the queue's feeder thread before the hard exit, or the traceback is lost.
        results.close()
        results.join_thread()
        os._exit(1)
    try:
        import recsys_trainer.distributed as rd

        rd.shutdown()
    except Exception:  # noqa: BLE001 - teardown best effort
        pass


def run_distributed(fn: Callable[..., Any], world_size: int = 2, timeout_s: float = 120,
                    args: tuple[Any, ...] = (), env: dict[str, str] | None = None) -> list[Any]:
    if not current_test_is_distributed:
        raise RuntimeError("run_distributed starts real processes: mark the test "
                           "@pytest.mark.distributed (the fast tier deselects those).")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    rank_env = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, rank_env, args, results,
                                         [_CallerStream(1), _CallerStream(2)]),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed test timed out after {timeout_s}s; ranks done: {sorted(out)}"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and not errors and len(out) + len(errors) < world_size:
                    # a rank died without reporting (e.g. SIGABRT in a collective)
                    time.sleep(1.0)
                    if results.empty():
                        raise RuntimeError(
                            f"rank process exited with code {dead[0].exitcode} without a result"
                        ) from None
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
        if errors:
            raise AssertionError("\n".join(errors))
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``recsys_trainer.cli.main(argv)`` in a rank of ``run_distributed``: its exit status and
    what it printed (the rank's summary line). The CLI's own code path, without the start of a
    torchrun agent and of workers that import the stack: for a job a test needs the result of
    (a trained checkpoint, a reference model), not the launch."""
    import contextlib
    import io

    from recsys_trainer.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def train_recording_failure(trainer: Any, out: str, rank: int, since: list[float]) -> None:
    """``trainer.train()``; if it raises, write ``out/rank{rank}.json`` (the error's type, its
    message and the seconds since ``since[0]``, when a peer was stopped) before re-raising: what a
    stalled-peer test reads back, as the rank's traceback alone does not carry the timing."""
    import json
    import time

    try:
        trainer.train()
    except Exception as e:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"type": type(e).__name__, "message": str(e),
                       "seconds": time.monotonic() - since[0]}, f)
        raise
