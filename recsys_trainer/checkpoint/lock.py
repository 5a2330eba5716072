"""One job per ``output_dir``: an OS file lock on ``output_dir/LOCK`` held by rank 0 while it trains.

Two jobs saving into one directory skip each other's steps as "already committed" and resume
from each other's state. The lock is ``flock`` on ``LOCK``: the kernel drops it when the holding
process ends, however it ends (SIGKILL and OOM kills included), so a lock never outlives its job
and there is no stale lock to detect or clean up by hand. The file's content names the holder
(host, pid, start time, torchrun's run id) for the refusal message; the file itself stays on
disk after a release (removing it would let two processes hold locks on two different files).
On a filesystem without file locks (some FUSE mounts) the lock is skipped with a warning.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket

logger = logging.getLogger(__name__)

LOCK_FILE = "LOCK"


class OutputDirLock:
    """The lock of one ``output_dir`` (see the module docstring)."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, world_size: int) -> str | None:
        """Take the lock; None on success (or when locks are unsupported), else a description
        of the job holding it. Idempotent while held."""
        if self._fd is not None:
            return None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 4096, 0))
            os.close(fd)
            return holder
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                logger.warning("cannot lock %s (%s): this filesystem has no file locks, so another "
                               "job could use the same output_dir unnoticed", self.path, e)
                return None
            raise
        owner = {
            "host": socket.gethostname(), "pid": os.getpid(), "world_size": world_size,
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: see the module docstring."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _describe(content: bytes) -> str:
    try:
        o = json.loads(content.decode())
        run = f"run {o['run_id']}, " if o.get("run_id") else ""
        return (f"the job whose rank 0 is pid {o['pid']} on host {o['host']} ({run}{o['world_size']} "
                f"rank(s), started {o['started']})")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another job (its LOCK file does not say which: it may be starting right now)"
