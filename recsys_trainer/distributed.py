"""Everything the Trainer and the checkpoint manager need from ``torch.distributed`` for control
flow, in one place.

Decisions that depend on what each rank sees (out of data, stop requested, non-finite loss) are
agreed by *one* small all-reduce at the same point on every rank. It runs on a dedicated gloo
group so that, on GPU, it never synchronises a CUDA stream. The checkpoint manager's barriers,
error gathering and commit broadcast go through a ``Gang`` too (its own group, so its writer
thread never interleaves with the loop's collectives). ``FakeGang`` lets single-process tests
play rank k of n, and is the gang of a process without ``torch.distributed``.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Imported now, before any process group exists. Some torch modules bind the default group into
# function defaults *when first imported* (``ZeroRedundancyOptimizer(group=dist.group.WORLD)``
# in torch.distributed.optim, which torchrec's apply_optimizer_in_backward imports lazily, after
# the group is up). That reference keeps the group alive for good: destroy_process_group() can
# then not end its gloo threads, which abort the interpreter at exit (see
# ``_collect_process_groups_at_exit``).
import torch.distributed.optim  # noqa: F401, E402  isort: skip

logger = logging.getLogger(__name__)


class Gang(ABC):
    """The collectives of control flow: small, CPU-side, the same call on every rank."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group behind this gang, for libraries that take one (DCP); None means
        torch's default group."""
        return None

    @abstractmethod
    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        """Element-wise max of small integer vectors across ranks."""

    @abstractmethod
    def all_reduce_sum_float(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of small float vectors across ranks (float64 on the wire)."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank (pickled: small control data only)."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (pickled: small control data only; the other
        ranks' arguments are ignored)."""

    @abstractmethod
    def barrier(self) -> None: ...


class ProcessGroupGang(Gang):
    """A gang over a real (gloo) process group."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        if self._world_size == 1:
            # One rank agrees with itself: skip the per-fetch collective (~0.1 ms a step, about
            # 1% of a GPU step).
            return [int(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return [int(v) for v in t.tolist()]

    def all_reduce_sum_float(self, values: Sequence[float]) -> list[float]:
        if self._world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
        return [float(v) for v in t.tolist()]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self._world_size == 1:
            return [obj]
        out: list[Any] = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self._world_size == 1:
            return obj
        box = [obj]
        # broadcast_object_list names the source by its global rank, even within a subgroup.
        global_src = dist.get_global_rank(self._group, src) if self._group is not None else src
        dist.broadcast_object_list(box, src=global_src, group=self._group)
        return box[0]

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier(group=self._group)


class FakeGang(Gang):
    """A single-process stand-in that plays rank ``rank`` of ``world_size``.

    ``peer_max`` scripts what the other ranks contribute to ``all_reduce_max``: a list of
    vectors consumed in order, each by the next call with a vector of the same length (so a
    script of 4-element fetch flags is not consumed by other agreements); calls with nothing
    scripted see the other ranks agree with this one (the result is this rank's own values).

    ``broadcasts`` scripts what ``broadcast_object`` receives from another rank, in order
    (unscripted: this rank's own object). ``peer_objects`` scripts ``all_gather_object``: each
    call consumes the next list of the other ranks' objects (in rank order, this rank left out);
    unscripted calls see every rank send this rank's object. With the defaults it is the gang
    of a single process.
    """

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        peer_max: list[list[int]] | None = None,
        broadcasts: list[Any] | None = None,
        peer_objects: list[list[Any]] | None = None,
    ) -> None:
        self._rank = rank
        self._world_size = world_size
        self._peer_max = list(peer_max or [])
        self._broadcasts = list(broadcasts or [])
        self._peer_objects = list(peer_objects or [])
        self.num_collectives = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce_max(self, values: Sequence[int]) -> list[int]:
        self.num_collectives += 1
        peer = list(values)
        for i, scripted in enumerate(self._peer_max):
            if len(scripted) == len(values):
                peer = self._peer_max.pop(i)
                break
        return [max(a, b) for a, b in zip(values, peer, strict=True)]

    def all_reduce_sum_float(self, values: Sequence[float]) -> list[float]:
        self.num_collectives += 1
        return [float(v) for v in values]

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.num_collectives += 1
        peers = self._peer_objects.pop(0) if self._peer_objects else [obj] * (self._world_size - 1)
        if len(peers) != self._world_size - 1:
            raise ValueError(f"a scripted all_gather_object needs {self._world_size - 1} peer "
                             f"objects, but has {len(peers)}.")
        return [*peers[: self._rank], obj, *peers[self._rank:]]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.num_collectives += 1
        if src != self._rank and self._broadcasts:
            return self._broadcasts.pop(0)
        return obj

    def barrier(self) -> None:
        self.num_collectives += 1


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    initialized_by_us: bool


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_one_gpu_per_rank(local_rank: int, local_world_size: int, num_gpus: int,
                           visible_devices: str | None = None) -> int:
    """The CUDA device index this rank uses: ``cuda:LOCAL_RANK`` when the host's GPUs are all
    visible, or ``cuda:0`` when each process sees exactly one GPU of its own (a launcher that
    sets ``CUDA_VISIBLE_DEVICES`` per process, e.g. SLURM's ``--gpus-per-task=1``). Each rank
    needs its own GPU: nccl refuses two ranks on one device, and a rank without a device would
    fail later with "invalid device ordinal"."""
    if num_gpus >= local_world_size and local_rank < num_gpus:
        return local_rank
    own = [d for d in (visible_devices or "").split(",") if d.strip()]
    if num_gpus == 1 and len(own) == 1:
        return 0  # this process was given one GPU; nccl names a duplicate if two share it
    raise ValueError(
        f"this host runs {local_world_size} ranks (this is local rank {local_rank}) but has "
        f"{num_gpus} visible CUDA device(s); each rank needs its own GPU. Start at most "
        f"{num_gpus} ranks per host (torchrun --nproc_per_node={num_gpus}), give each process "
        "its own GPU with CUDA_VISIBLE_DEVICES, or train on the CPU with device='cpu'."
    )


DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""How long a collective waits for the other ranks before failing (torch's NCCL default; its
gloo default, 30 minutes, leaves a job silently stuck behind a stopped rank for that long)."""


def init_distributed(device: str = "auto", timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> DistInfo:
    """Make sure a default process group exists and pick this rank's device.

    Under ``torchrun`` the env vars describe the job (``accelerate`` has normally initialised the
    group already; if not, we do). In a plain single process we create a world-size-1 group on an
    in-memory store, so the same DMP code path runs everywhere. ``timeout_s`` is how long a
    collective on the default group waits for the other ranks; it is applied to a group that
    already exists too.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested, but CUDA is not available on this machine.")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda_index = 0
    if use_cuda:
        cuda_index = check_one_gpu_per_rank(local_rank, local_world_size,
                                            torch.cuda.device_count(),
                                            os.environ.get("CUDA_VISIBLE_DEVICES"))
    initialized_by_us = False
    _collect_process_groups_at_exit()
    stop_with_the_agent()
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            if use_cuda:
                torch.cuda.set_device(cuda_index)
            t0 = time.perf_counter()
            store = attempt_store(timeout_s)
            if store is None:
                dist.init_process_group(backend=backend, timeout=timeout)
            else:
                dist.init_process_group(backend=backend, store=store, timeout=timeout,
                                        rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]))
            logger.info("process group formed: rank %d of %d, %s, in %.2f s (torchrun restart "
                        "%s)", dist.get_rank(), dist.get_world_size(), backend,
                        time.perf_counter() - t0, os.environ.get("TORCHELASTIC_RESTART_COUNT", "-"))
        else:
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        initialized_by_us = True
    else:
        # Created by accelerate or the user with their timeout (30 min for gloo by default);
        # there is no public API to change it afterwards.
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    if use_cuda:
        torch.cuda.set_device(cuda_index)
        dev = torch.device("cuda", cuda_index)
    else:
        dev = torch.device("cpu")
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=dev,
        initialized_by_us=initialized_by_us,
    )


_ATTEMPT_STORE_KEY = "recsys_trainer/attempt_store"
"""The key, in torchrun's agent store, under which rank 0 publishes its attempt's store."""
_NONCE_KEY = "recsys_trainer/nonce"
_PROBE_S = 5.0
"""How long a rank tries to reach a published store that accepts connections before it reads
the key again."""


def attempt_store(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> dist.Store | None:
    """A store of this attempt's own for the process groups, under torchrun; None elsewhere.

    Why: torchrun's agent hosts one TCPStore for the whole job (``TORCHELASTIC_USE_AGENT_STORE``,
    torch's default with the c10d rendezvous and ``--standalone``) and keeps it across
    ``--max-restarts`` restarts, and torch's ``env://`` rendezvous puts no attempt prefix on its
    keys ("a new TCPStore for every retry", which this agent does not do). Gloo's rendezvous
    keys (each rank's listening address, per process group) of the dead attempt are still in the
    store when the next attempt starts, so a rank that reads its peer's address before that peer
    has written its new one connects to the dead attempt: ``Gloo connectFullMesh failed ...
    Connection refused`` when nothing listens there any more, or a wait in
    ``Pair::waitUntilConnected`` that lasts the whole timeout when the port has been reused.
    Which rank comes first is a race (import and start-up times), so it failed in some runs only.
    A prefix per ``TORCHELASTIC_RESTART_COUNT`` is not enough: that count is per agent, and
    agents of a multi-node job restart their workers with different counts (a node that only
    saw another node rejoin does not count a restart).

    So rank 0 starts a new TCPStore (a port the OS picks) for every attempt and publishes its
    address with a random nonce in the agent's store; the other ranks read the address and use
    the store only once it holds that nonce, reading the key again while it still names a store
    of a dead attempt (one that refuses connections, or holds another nonce). Nothing of an earlier attempt can be read: every
    key the process groups use lives in a store that did not exist before this attempt.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return _attempt_store(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                          os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)


def _attempt_store(rank: int, world_size: int, host: str, port: int,
                   timeout_s: float) -> dist.Store:
    """``attempt_store`` for this rank, with the agent's store at ``host:port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout,
                            wait_for_workers=False)
        nonce = uuid.uuid4().hex
        own.set(_NONCE_KEY, nonce)
        agent.set(_ATTEMPT_STORE_KEY, json.dumps({"host": host, "port": own.port, "nonce": nonce}))
        return own
    deadline = time.monotonic() + timeout_s
    while True:
        published = json.loads(agent.get(_ATTEMPT_STORE_KEY))  # waits for rank 0's first one
        address = (published["host"], int(published["port"]))
        # A store of a dead attempt refuses the connection at once, where TCPStore's client
        # would retry until its timeout: ask the OS first.
        if _accepts_connections(address):
            try:
                store = dist.TCPStore(*address, world_size, is_master=False,
                                      timeout=datetime.timedelta(seconds=_PROBE_S))
                if store.check([_NONCE_KEY]) and \
                        store.get(_NONCE_KEY).decode() == published["nonce"]:
                    store.set_timeout(timeout)
                    return store
            except RuntimeError:  # DistNetworkError / DistStoreError: not this attempt's store
                pass
        if time.monotonic() > deadline:
            raise PeerLostError(
                f"rank {rank}: rank 0 did not start this attempt's store within "
                f"collective_timeout_s={timeout_s:g} s ({_ATTEMPT_STORE_KEY} in torchrun's store "
                f"at {host}:{port} still names {published['host']}:{published['port']}); check "
                "rank 0's log.", reason="timeout")
        time.sleep(0.05)


def _accepts_connections(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=_PROBE_S):
            return True
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_the_agent() -> None:
    """Under torchrun on Linux: have the kernel send this worker SIGTERM when its agent dies.

    A torchrun agent killed outright (SIGKILL, an OOM kill of the agent alone) cannot stop its
    workers: they were left training unsupervised, holding ``output_dir``'s lock and the
    devices, and nothing restarted them. With ``PR_SET_PDEATHSIG`` the worker gets SIGTERM
    instead, which the Trainer treats as a preemption (``recsys_trainer.preemption``): every
    rank stops after the same step, saves it and exits, and a rerun resumes there. Idempotent;
    a no-op outside torchrun (``TORCHELASTIC_RUN_ID`` unset) and off Linux.
    """
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        ok = prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.warning("could not ask to be signalled when torchrun's agent dies (prctl "
                       "PR_SET_PDEATHSIG failed): if the agent is killed, stop this worker by hand.")
        return
    if os.getppid() != agent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def new_control_group(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> dist.ProcessGroup | None:
    """A gloo group for control-flow collectives (None means: the default group is gloo already)."""
    if dist.get_backend() == "gloo":
        return None
    return new_gloo_group(timeout_s)


def new_gloo_group(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> dist.ProcessGroup:
    """A new gloo group of all ranks (collective) whose collectives wait at most ``timeout_s``
    (``new_group`` would give it gloo's 30-minute default, not the default group's timeout)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
"""What gloo says when a peer's process exited (the wording depends on where it noticed)."""


class PeerLostError(RuntimeError):
    """A collective failed because another rank stopped answering or went away.

    Attributes:
        reason: ``"timeout"`` (no answer within the collective timeout: a stopped or stuck
            process, a frozen host) or ``"closed"`` (the peer's connection closed: it exited).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def peer_lost_error(exc: BaseException, *, rank: int, timeout_s: float, where: str) -> PeerLostError | None:
    """``exc`` (or an exception it was raised from) as a ``PeerLostError`` naming what
    happened, ``where`` (e.g. "after step 12, train window 'hour=03'") and what to check; None
    when ``exc`` is something else. Gloo reports both cases as a bare ``RuntimeError`` naming
    a C++ source line."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, PeerLostError):
        text = str(seen)
        if isinstance(seen, RuntimeError) and "Timed out waiting" in text:
            return PeerLostError(
                f"rank {rank}: a peer rank stopped answering: a collective waited "
                f"collective_timeout_s={timeout_s:g} s for it, {where}. Check the other ranks: a "
                "stopped process (SIGSTOP, a debugger), a read stuck on a network filesystem or "
                "object store, a frozen host, or one killed for memory; their logs and "
                "`py-spy dump --pid PID` show where they are. If a rank is only slow there (a "
                "long save or read), raise TrainingArguments.collective_timeout_s. "
                f"(gloo: {text.strip()})", reason="timeout")
        if isinstance(seen, RuntimeError) and any(m in text for m in _PEER_GONE):
            return PeerLostError(
                f"rank {rank}: a peer rank went away (its connection closed), {where}; it "
                "exited or crashed: its log has the cause (a non-zero exit code 137 or -9 means "
                f"it was killed, e.g. for memory). (gloo: {text.strip()})", reason="closed")
        seen = seen.__cause__ or seen.__context__
    return None


def configure_cpu_threads(local_world_size: int) -> None:
    """Denormals slow CPU training 2-4x after a few steps; ranks on one host share its cores."""
    torch.set_flush_denormal(True)
    if "OMP_NUM_THREADS" not in os.environ:
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, local_world_size)))


_UNLIMITED = 1 << 60
"""Cgroup v1 writes "no limit" as a huge number (9223372036854771712); v2 as "max"."""


def usable_memory_bytes(cgroup_root: str = "/sys/fs/cgroup",
                        proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, str]:
    """The host memory this process may use, and where the figure comes from.

    The smallest of: the cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes`` of this
    process's cgroup (a container's or a job scheduler's limit, which the kernel enforces by
    OOM-killing with exit 137 and no message) and the physical RAM. Both the cgroup's own
    directory (from ``/proc/self/cgroup``) and the mount's root are read, since in a container
    the namespace's root is the container's cgroup.
    """
    candidates: list[tuple[str, str]] = []  # (limit file, its name in messages)
    try:
        with open(proc_cgroup) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        entries = []
    for _, controllers, path in entries:
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            candidates += [(os.path.join(cgroup_root, rel, "memory.max"), "cgroup v2 memory.max"),
                           (os.path.join(cgroup_root, "memory.max"), "cgroup v2 memory.max")]
        elif "memory" in controllers.split(","):
            candidates += [
                (os.path.join(cgroup_root, "memory", rel, "memory.limit_in_bytes"),
                 "cgroup v1 memory.limit_in_bytes"),
                (os.path.join(cgroup_root, "memory", "memory.limit_in_bytes"),
                 "cgroup v1 memory.limit_in_bytes"),
            ]
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    best, source = physical, "physical memory"
    for path, name in candidates:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < min(best, _UNLIMITED):
            best, source = int(text), f"{name} ({path})"
    return best, source


def shutdown() -> None:
    """End a job cleanly: barrier, then destroy the process groups.

    Call on the success path at the end of a script. On the error path don't: destroying can
    deadlock against peers still in a collective; exit non-zero instead. Keep the Trainer and
    the model inside a function (e.g. ``main()``) rather than in module globals, so that they
    are released before the interpreter exits (see ``_collect_process_groups_at_exit``).
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # process groups held only by garbage: their threads end now, see below


_exit_collection_registered = False


def _collect_process_groups_at_exit() -> None:
    """Register (once) a garbage collection at interpreter exit, before finalization.

    Why: ``destroy_process_group()`` does not stop a gloo group that is still referenced, and
    the Trainer, its DMP/DDP model and its checkpoint manager reference theirs, from reference
    cycles. Python frees cycles only in its finalization GC, after it has stopped letting other
    threads take the GIL. A gloo worker thread that drops its last reference to a finished
    collective there must take the GIL (the collective's tensors belong to Python objects; a
    barrier keeps the collectives still in flight alive until it is dropped) and is killed by
    the interpreter inside C++ code: "terminate called without an active exception", SIGABRT,
    after a complete job (1 run in 30 here). Collecting at ``atexit`` time, while the
    interpreter is intact, destroys those groups and joins their threads first (0 in 40 runs
    of the same pattern, against 8 in 40 without).

    What is left after that collection lives until the process ends, so it is then frozen:
    finalization's own collections would walk the ~400k objects torch and torchrec made at
    import again, ~1 s of CPU per rank that a job's end and every torchrun restart (the agent
    waits for its workers to exit) would wait for.
    """
    global _exit_collection_registered
    if not _exit_collection_registered:
        atexit.register(_collect_then_freeze)
        _exit_collection_registered = True


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()
