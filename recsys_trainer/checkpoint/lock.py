"""One job per ``output_dir``: an OS file lock on ``output_dir/LOCK`` held by rank 0 while it trains.

Two jobs saving into one directory skip each other's steps as "already committed" and resume
from each other's state. The lock is ``flock`` on ``LOCK``: the kernel drops it when the holding
process ends, however it ends (SIGKILL and OOM kills included), so a lock never outlives its job
and there is no stale lock to detect or clean up by hand. The file's content names the holder
(host, pid, start time, torchrun's run id) for the refusal message; the file itself stays on
disk after a release (removing it would let two processes hold locks on two different files).
On a filesystem without file locks (some FUSE mounts) the lock is skipped with a warning.

Object storage has no locks: :class:`LeaseLock` replaces ``flock`` there with a lease, a
``LOCK`` object naming its holder that the holder rewrites every ``ttl_s / 4`` seconds. A lease
whose last renewal is older than ``ttl_s``, whose holder is a process on this host that no
longer exists, or whose holder is an earlier attempt of this very torchrun job (the same
``TORCHELASTIC_RUN_ID``: torchrun restarts a worker group only once all of it has stopped), is
stale and is taken over. Two jobs that start within the same second can both
write the object; the later write wins, the earlier job reads back the other's token before it
trains and is refused, and a job that finds its lease taken over later (by a renewal that finds
another token) fails its next save instead of writing next to the other job.

``lock_for(location)`` picks the right one; ``claim_output_dir`` is what a run that saves does
with it at the start of training (on every rank: the writability probe, the lock on rank 0, one
collective so every rank learns the outcome).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.distributed import Gang
from recsys_trainer.storage import Location, probe_writable

logger = logging.getLogger(__name__)

LOCK_FILE = "LOCK"


class OutputDirLock:
    """The lock of one ``output_dir`` (see the module docstring)."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd: int | None = None
        self.lost: str | None = None
        """Never set: an OS lock cannot be taken over (see ``LeaseLock.lost``)."""

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


class LeaseLock:
    """The lock of one ``output_dir`` on object storage (see the module docstring). Same
    interface as :class:`OutputDirLock`, plus ``lost``: why the lease was lost, if it was."""

    SETTLE_S = 0.5
    """Wait between writing the lease and reading it back (lets a racing writer land first)."""

    def __init__(self, output_dir: Location, ttl_s: float = 60.0) -> None:
        self.location = output_dir.join(LOCK_FILE)
        self.path = self.location.url
        self.ttl_s = ttl_s
        self._token: str | None = None
        self._owner: dict[str, object] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    @property
    def held(self) -> bool:
        return self._token is not None

    def _read(self) -> dict[str, object] | None:
        fs = self.location.filesystem
        try:
            with fs.open_input_stream(self.location.path) as f:
                data = json.loads(bytes(f.read()))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self) -> None:
        self._owner["renewed"] = time.time()
        with self.location.filesystem.open_output_stream(self.location.path) as out:
            out.write((json.dumps(self._owner) + "\n").encode())

    def _stale(self, o: dict[str, object]) -> bool:
        renewed = o.get("renewed")
        if not isinstance(renewed, int | float) or time.time() - renewed > self.ttl_s:
            return True
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id and o.get("run_id") == run_id:
            # An earlier attempt of this torchrun job (a restart after a worker died, or after a
            # node joined): torchrun stops every worker of an attempt before it starts the next,
            # on every node, so its holder is gone even when on another host.
            return True
        pid = o.get("pid")
        if o.get("host") == socket.gethostname() and isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True  # its process is gone (killed): the lease cannot be renewed
            except PermissionError:
                return False
        return False

    def acquire(self, world_size: int) -> str | None:
        """Take the lease; None on success, else a description of the job holding it."""
        if self._token is not None:
            return None
        current = self._read()
        if current and not self._stale(current):
            return _describe(json.dumps(current).encode()) + \
                f" (its lease is renewed every {self.ttl_s / 4:.0f} s and expires {self.ttl_s:.0f} s after the last renewal)"
        if current:
            logger.warning("taking over the stale lease %s of %s", self.path,
                           _describe(json.dumps(current).encode()))
        token = uuid.uuid4().hex
        self._owner = {
            "host": socket.gethostname(), "pid": os.getpid(), "world_size": world_size,
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "token": token,
        }
        self._write()
        time.sleep(self.SETTLE_S)
        now = self._read() or {}
        if now.get("token") != token:
            return _describe(json.dumps(now).encode())
        self._token = token
        self.lost = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, daemon=True, name="ckpt-lease")
        self._thread.start()
        return None

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                now = self._read() or {}
                if now.get("token") != self._token:
                    self.lost = (f"the lease {self.path} was taken over by "
                                 f"{_describe(json.dumps(now).encode())}")
                    return
                self._write()
            except OSError as e:  # transient: try again at the next period
                logger.warning("could not renew the lease %s: %s", self.path, e)

    def release(self) -> None:
        """End the lease (idempotent): delete the object if it is still this job's."""
        if self._token is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if (self._read() or {}).get("token") == self._token:
                self.location.filesystem.delete_file(self.location.path)
        except OSError as e:
            logger.warning("could not delete the lease %s: %s (it expires by itself)", self.path, e)
        self._token = None


def lock_for(output_dir: Location, lease_ttl_s: float = 60.0) -> OutputDirLock | LeaseLock:
    """``flock`` on a local ``output_dir``, a lease on object storage."""
    if output_dir.is_local:
        return OutputDirLock(output_dir.path)
    return LeaseLock(output_dir, ttl_s=lease_ttl_s)


def claim_output_dir(lock: OutputDirLock | LeaseLock, out: Location, output_dir: str,
                     gang: Gang) -> None:
    """At the start of training, when the run will save: ``out`` must be writable on every rank
    (a probe file) and not in use by another job (rank 0 takes ``lock``; the caller releases it
    when training ends). Every rank learns the outcome, so all stop together before anything is
    trained instead of failing at the first save. ``output_dir`` is the name messages use."""
    problem = probe_writable(out)
    holder = None
    if problem is None and gang.rank == 0:
        try:
            holder = lock.acquire(gang.world_size)
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
    reports = gang.all_gather_object((socket.gethostname(), problem, holder))
    unwritable = [f"rank {r} (host {h}): {p}" for r, (h, p, _) in enumerate(reports) if p]
    holders = [x for _, _, x in reports if x]
    if not unwritable and not holders:
        return
    lock.release()
    if unwritable:
        raise CheckpointError(
            f"`output_dir` {output_dir!r} is not writable: {'; '.join(unwritable)}. "
            "Checkpoints could not be saved there, so training did not start. "
            + ("Fix its permissions or mount" if out.is_local else
               "Fix the bucket name, the credentials or the endpoint (AWS_* environment "
               "variables, or the filesystem's own config)")
            + ", or choose another output_dir.",
            path=output_dir, kind="unwritable")
    how = ("an OS file lock that ends with that process, however it ends: it cannot go "
           "stale") if out.is_local else \
        ("a lease object that its job renews; it expires by itself when that job is gone")
    raise CheckpointError(
        f"`output_dir` {output_dir!r} is in use by {holders[0]}. Two jobs saving into "
        "one output_dir skip each other's steps as already saved and resume from each "
        "other's state. Wait for that job to end, or use another output_dir. (Its lock, "
        f"{lock.path}, is {how}.)", path=output_dir, kind="locked")


def _describe(content: bytes) -> str:
    try:
        o = json.loads(content.decode())
        run = f"run {o['run_id']}, " if o.get("run_id") else ""
        return (f"the job whose rank 0 is pid {o['pid']} on host {o['host']} ({run}{o['world_size']} "
                f"rank(s), started {o['started']})")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another job (its LOCK file does not say which: it may be starting right now)"
