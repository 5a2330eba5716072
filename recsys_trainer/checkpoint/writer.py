"""The fast path of a save: zero-copy views for DCP, reusable (pre-warmed) staging buffers, and a
DCP ``FileSystemWriter`` that computes each file's CRC32 while writing it.

Why (profiled on a 2-core VM, ``benchmarks/bench_checkpoint.py``, one 1e7 x 16 table):

* DCP's writer ``clone()``\\ s every tensor whose storage is larger than the tensor, so that
  ``torch.save`` does not write the whole storage. FBGEMM keeps all tables of a collection in
  one buffer, so every table is such a view: a synchronous save copied the whole model into
  fresh memory (page faults: ~5 s for 640 MB here, more than the write itself).
  :func:`exact_views` gives DCP tensors whose storage is exactly their bytes, aliasing the live
  memory: no copy at all.
* The first async save allocated its staging buffers on the loop's thread (``copy.deepcopy`` of
  every ShardedTensor, then ``empty`` + copy: two passes of page faults). :class:`StagingBuffers`
  allocates plain ``empty`` buffers once, can fault them in on a background thread before the
  first save, and reuses them per leaf (a new leaf, e.g. lazily created optimizer state, only
  allocates itself).
* Hashing for the manifest re-read every file after writing. :class:`HashingFileSystemWriter`
  hashes each buffer while it is written (on a helper thread, overlapping the write syscall),
  so the bytes hashed are the bytes handed to the file, and no read pass is needed.

Object storage (``s3://``, ``gs://``, any ``pyarrow.fs`` filesystem): :class:`ArrowFileSystem`
is DCP's ``FileSystemBase`` over the same ``pyarrow.fs`` filesystem that ``storage.resolve``
gives the data readers, so checkpoints use the same credentials, endpoint and retry settings as
the data, and no second S3 client (s3fs/aiobotocore, which DCP's ``FsspecWriter`` needs) is
required. pyarrow's S3 output streams upload in parts in the background while DCP serialises,
and reads are ranged (``open_input_file``), so a rank reads only its shards' byte ranges.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import ctypes
import io
import os
import posixpath
import threading
import time
import zlib
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import IO, Any

import pyarrow.fs as pafs
import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from recsys_trainer.storage import Location

_PIPELINE_MIN = 1 << 20
"""Buffers at least this large are hashed on a helper thread while they are written."""
_WRITE_CHUNK = 16 << 20
_READ_BUFFER = 1 << 20


# ---------------------------------------------------------------------------- state-dict walking

def _map_tensors(obj: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], path: str = "") -> Any:
    """``obj`` with every tensor ``t`` (and every local shard of a ShardedTensor) replaced by
    ``fn(path, t)``; containers are rebuilt, other values kept. ShardedTensors are rebuilt from
    their metadata (no copy of their data, unlike ``copy.deepcopy``)."""
    if isinstance(obj, ShardedTensor):
        return _rebuild_sharded(obj, [fn(f"{path}#{i}", s.tensor)
                                      for i, s in enumerate(obj.local_shards())])
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise TypeError(f"unsupported tensor type {type(obj).__name__} at {path!r}")
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        out = [_map_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(obj)]
        return tuple(out) if isinstance(obj, tuple) else out
    return obj


def _rebuild_sharded(st: ShardedTensor, tensors: list[torch.Tensor]) -> ShardedTensor:
    """``st`` over ``tensors`` (its local shards' replacements, same shapes and dtypes).

    This is where a save crosses from the device to the host: staging copies a GPU shard into
    a (pinned) host buffer, and ShardedTensor refuses a shard whose tensor is not where its
    metadata's placement says, or whose pinning differs from the metadata's. So when the new
    tensors live elsewhere, the metadata is rewritten to their device (every shard's, as
    ``ShardedTensor.to`` does) and pinning; offsets and sizes, which DCP saves by, stay.
    """
    local = st.local_shards()
    metadata = st.metadata()
    props = metadata.tensor_properties
    if tensors and (any(s.metadata.placement is None or s.metadata.placement.device() != t.device
                        for s, t in zip(local, tensors, strict=True))
                    or props.pin_memory != tensors[0].is_pinned()
                    or props.requires_grad != tensors[0].requires_grad):
        device = tensors[0].device
        metadata = copy.deepcopy(metadata)
        metadata.tensor_properties.pin_memory = tensors[0].is_pinned()
        metadata.tensor_properties.requires_grad = tensors[0].requires_grad
        for m in metadata.shards_metadata:
            m.placement._device = device  # type: ignore[union-attr]
        shard_meta = []
        for s in local:
            m = copy.deepcopy(s.metadata)
            m.placement._device = device  # type: ignore[union-attr]
            shard_meta.append(m)
    else:
        shard_meta = [s.metadata for s in local]
    shards = [Shard(tensor=t, metadata=m) for t, m in zip(tensors, shard_meta, strict=True)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=st._process_group)


def iter_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor (every local shard of a ShardedTensor) in ``obj``, with
    the paths ``_map_tensors`` uses."""
    if isinstance(obj, ShardedTensor):
        for i, s in enumerate(obj.local_shards()):
            yield f"{path}#{i}", s.tensor
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, f"{path}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, f"{path}[{i}]")


def _exact_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` aliased by a tensor whose storage is exactly ``t``'s bytes (so DCP does not clone
    it), or ``t`` itself if it already is one or is not a contiguous CPU tensor."""
    t = t.detach()
    storage = t.untyped_storage()
    if t.device.type != "cpu" or storage.nbytes() == t.nbytes or not t.is_contiguous() \
            or t.nbytes == 0:
        return t
    start = t.storage_offset() * t.element_size()
    view = torch.empty(0, dtype=t.dtype).set_(storage[start:start + t.nbytes], 0, t.shape,
                                              t.stride())
    return view


def exact_views(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict with views of larger storages replaced by zero-copy exact aliases (for a
    synchronous save: the loop is blocked, so the live memory cannot change under the write).
    Anything that cannot be aliased (e.g. DTensor) is left as is."""
    try:
        return _map_tensors(state, lambda _p, t: _exact_view(t))
    except TypeError:
        return state


_TOUCH_CHUNK = 64 << 20


def _touch(t: torch.Tensor) -> torch.Tensor:
    """Fault ``t``'s pages in now, not during the first staging copy. A plain single-threaded
    memset through ctypes (which releases the GIL): ``zero_()`` would use the intra-op thread
    pool and fight the training loop's threads for the cores."""
    ptr, n = t.data_ptr(), t.nbytes
    for off in range(0, n, _TOUCH_CHUNK):
        ctypes.memset(ptr + off, 0, min(_TOUCH_CHUNK, n - off))
    return t


class StagingBuffers:
    """CPU buffers an async save copies the state into, allocated once and reused per leaf.

    ``prepare(state, background=True)`` allocates (and faults in) buffers for ``state`` on a
    helper thread, so the first save finds them ready. ``stage(state)`` waits for that, then
    copies ``state`` into the buffers (allocating only leaves not seen before, or whose shape or
    dtype changed) and returns a state dict of the same structure over the buffers.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.prepared_s: float | None = None
        """Seconds the last ``prepare`` took (on its thread)."""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def _buffer(self, path: str, t: torch.Tensor, touch: bool) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype,
                              pin_memory=torch.cuda.is_available() and t.numel() > 0)
            if touch:
                _touch(buf)
            self._buffers[path] = buf
        return buf

    def _allocate(self, specs: list[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        try:
            with self._lock, torch.no_grad():
                for path, like in specs:
                    self._buffer(path, like, touch=True)
        except BaseException as e:  # noqa: BLE001 - staging then allocates what is missing
            self._error = e
        self.prepared_s = time.perf_counter() - t0

    def prepare(self, state: dict[str, Any], background: bool = True) -> None:
        """Allocate buffers for ``state``'s tensors (their shapes and dtypes; values are not
        read), on a helper thread if ``background``."""
        self.wait_prepared()
        specs = [(p, torch.empty(t.shape, dtype=t.dtype, device="meta"))
                 for p, t in iter_leaves(state)]
        if not background:
            self._allocate(specs)
            return
        self._thread = threading.Thread(target=self._allocate, args=(specs,), daemon=True,
                                        name="ckpt-staging-alloc")
        self._thread.start()

    def wait_prepared(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._error = None  # a failed prepare only costs the first stage its allocations

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        self.wait_prepared()

        def copy(path: str, t: torch.Tensor) -> torch.Tensor:
            buf = self._buffer(path, t, touch=False)
            buf.copy_(t.detach())
            return buf

        with self._lock, torch.no_grad():
            return _map_tensors(state, copy)


# ---------------------------------------------------------------------------- hashing writer

class _HashingFile(io.RawIOBase):
    """A write-only file that CRC32s everything written through it. Big buffers are hashed on
    a helper thread while this thread writes them (zlib and the write both release the GIL);
    ``write`` returns only when both are done, so the caller's buffer is never used after."""

    def __init__(self, raw: Any, pool: cf.ThreadPoolExecutor | None) -> None:
        super().__init__()
        self._raw = raw
        self._pool = pool
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if self._pool is not None and n >= _PIPELINE_MIN:
            fut = self._pool.submit(zlib.crc32, mv, self.crc)
            try:
                # 16 MiB writes: faster here than one huge write (or 1 MiB ones) into the
                # page cache while writeback runs.
                for off in range(0, n, _WRITE_CHUNK):
                    self._raw.write(mv[off:off + _WRITE_CHUNK])
            finally:
                self.crc = fut.result()
        else:
            self.crc = zlib.crc32(mv, self.crc)
            self._raw.write(mv)
        self.size += n
        return n

    def tell(self) -> int:
        return int(self._raw.tell())

    def seek(self, *a: Any) -> int:  # a seek would make the running CRC wrong
        raise io.UnsupportedOperation("checkpoint streams are append-only")

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def flush(self) -> None:
        if not self._raw.closed:  # io.IOBase.__del__ flushes after the raw file is closed
            self._raw.flush()


class ArrowFileSystem(FileSystemBase):
    """DCP's filesystem interface over a ``pyarrow.fs.FileSystem`` (paths are that filesystem's
    paths, e.g. ``bucket/prefix/step_00000120``). DCP's only rename (``.metadata.tmp`` ->
    ``.metadata``) becomes a server-side copy; nothing relies on it being atomic, since a
    checkpoint counts only once ``COMMITTED`` exists."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self.arrow = fs

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode == "wb":
            with self.arrow.open_output_stream(str(path)) as out:
                yield out  # type: ignore[misc]  # a pyarrow NativeFile: write/tell/close
        elif mode == "rb":
            # Random access (ranged GETs). Every read of a pyarrow S3 file is a request, and
            # pickle (.metadata) reads a few bytes at a time: buffer those; the readers below
            # fetch each stored item with one ranged read.
            with self.arrow.open_input_file(str(path)) as f:
                yield io.BufferedReader(f, buffer_size=_READ_BUFFER)  # type: ignore[arg-type]
        else:
            raise ValueError(f"unsupported mode {mode!r}")

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(str(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.arrow.move(str(path), str(new_path))

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        if isinstance(self.arrow, pafs.LocalFileSystem):
            self.arrow.create_dir(str(path), recursive=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return bool(self.arrow.get_file_info(str(path)).type != pafs.FileType.NotFound)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.arrow.delete_file(str(path))


class _Hashing:
    """Mixin for a DCP filesystem: every file opened ``"wb"`` is written through a
    :class:`_HashingFile`, and its ``(size, crc32)`` is recorded by file name."""

    def __init__(self, pool: cf.ThreadPoolExecutor | None, *args: Any) -> None:
        super().__init__(*args)
        self._pool = pool
        self._lock = threading.Lock()
        self.digests: dict[str, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as s:  # type: ignore[misc]
                yield s
            return
        with super().create_stream(path, mode) as raw:  # type: ignore[misc]
            f = _HashingFile(raw, self._pool)
            yield f
            f.flush()
            if f.size == raw.tell():
                with self._lock:
                    self.digests[posixpath.basename(str(path))] = (f.size, f.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # type: ignore[misc]
        with self._lock:
            d = self.digests.pop(posixpath.basename(str(path)), None)
            if d is not None:
                self.digests[posixpath.basename(str(new_path))] = d


class _HashingLocalFileSystem(_Hashing, FileSystem):
    pass


class _HashingArrowFileSystem(_Hashing, ArrowFileSystem):
    pass


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that records ``(size, crc32)`` of every file it writes, computed
    while writing (``digests``, by file name). A local ``Location`` is written with DCP's own
    filesystem (fsync per file when ``sync_files``); any other through :class:`ArrowFileSystem`
    (no fsync: an upload is durable once it completes)."""

    def __init__(self, where: Location, *, thread_count: int,
                 pool: cf.ThreadPoolExecutor | None, **kwargs: Any) -> None:
        local = where.is_local
        super().__init__(where.path, thread_count=thread_count,
                         **{**kwargs, **({} if local else {"sync_files": False})})
        fs: _HashingLocalFileSystem | _HashingArrowFileSystem = \
            _HashingLocalFileSystem(pool) if local else _HashingArrowFileSystem(pool,
                                                                                where.filesystem)
        self._hashing_fs = fs
        self.fs = fs  # type: ignore[assignment]  # DCP only calls FileSystemBase methods
        self.path = fs.init_path(where.path)

    @property
    def digests(self) -> dict[str, tuple[int, int]]:
        return dict(self._hashing_fs.digests)


class _ArrowFileSystemReader(FileSystemReader):
    """DCP's reader over :class:`ArrowFileSystem`. Each stored item (a tensor or shard) is
    fetched with one ranged read: DCP's file view would let ``torch.load`` issue many small
    reads, each a request to the server (1.7 s for a 7 MB checkpoint on the local S3 server,
    against one request per item)."""

    def __init__(self, where: Location) -> None:
        super().__init__(where.path)
        self.fs = ArrowFileSystem(where.filesystem)  # type: ignore[assignment]
        self.path = where.path

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        file.seek(sinfo.offset)
        return io.BytesIO(file.read(sinfo.length))


def storage_reader(where: Location) -> FileSystemReader:
    """DCP's reader for a checkpoint directory on any filesystem (DCP's own for local paths)."""
    return FileSystemReader(where.path) if where.is_local else _ArrowFileSystemReader(where)
