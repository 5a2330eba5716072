"""Typed checkpoint errors: every message names the step and/or the file involved."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found, verified or loaded.

    Attributes:
        step: the checkpoint's global step, when known.
        path: the checkpoint directory or the file at fault, when known.
        kind: a short machine-readable reason (``"missing"``, ``"incomplete"``, ``"corrupt"``,
            ``"mismatch"``, ``"save_failed"``, ``"load_failed"``, ``"reshard"``,
            ``"unwritable"``, ``"locked"``, ``"deadline"``).
    """

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None,
                 kind: str = "error") -> None:
        super().__init__(message)
        self.step = step
        self.path = path
        self.kind = kind


def describe_failure(exc: BaseException) -> str:
    """A short account of why a save failed: for DCP's ``CheckpointException`` (one traceback
    per rank, ~190 lines for a full disk, naming no file) one line per failing rank with the
    innermost OS error, which names the file, e.g. "rank 1: OSError: [Errno 28] No space left
    on device: '.../__1_0.distcp'"; for anything else, its type and message."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return _innermost(exc)
    return "; ".join(f"rank {rank}: {_innermost(pair[0])}" for rank, pair in sorted(failures.items()))


def only_os_errors(exc: BaseException) -> bool:
    """Whether every failure in ``exc`` (per rank, for DCP) comes from the OS (disk full,
    read-only, permissions): then ``describe_failure`` says everything there is to say."""
    failures = getattr(exc, "failures", None)
    excs = [pair[0] for pair in failures.values()] if isinstance(failures, dict) else [exc]
    return all(isinstance(_os_error(e), OSError) for e in excs)


def _os_error(exc: BaseException) -> OSError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _innermost(exc: BaseException) -> str:
    os_error = _os_error(exc)
    e = os_error if os_error is not None else exc
    return f"{type(e).__name__}: {e}"
