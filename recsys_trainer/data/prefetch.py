"""A bounded background producer: reading and decoding run ahead of the training step.

``Prefetcher(gen_factory, max_items)`` runs the generator on a daemon thread and hands items over
a ``queue.Queue(maxsize=max_items)``: memory is bounded by ``max_items`` decoded batches plus the
one being built. The thread holds no reference to the consumer, so an abandoned consumer is
garbage-collected and its ``__del__`` stops the thread; ``close()`` does it explicitly. pyarrow
and numpy release the GIL in their kernels, so decoding overlaps the training step.

``BatchStream`` is a window's batches for a reader (the parquet and Kafka readers'
``iter_window``): ``(batch, source rows)`` pairs made ahead by a ``Prefetcher``, handed out as
batches, counting the rows not yet handed out.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from recsys_trainer.batch import Batch

T = TypeVar("T")

_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _run(make: Callable[[], Iterator[T]], q: queue.Queue[object], stop: threading.Event) -> None:
    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    gen: Iterator[T] | None = None
    try:
        gen = make()
        for item in gen:
            if not put(item):
                return
        put(_END)
    except BaseException as exc:  # noqa: BLE001 - re-raised on the consumer's thread
        put(_Failure(exc))
    finally:
        close = getattr(gen, "close", None)
        if close is not None:
            close()


class Prefetcher(Generic[T]):
    """Iterate ``make()`` on a background thread, at most ``max_items`` ahead."""

    def __init__(self, make: Callable[[], Iterator[T]], max_items: int, name: str = "prefetch") -> None:
        if max_items < 1:
            raise ValueError(f"`max_items` must be >= 1, but is {max_items}.")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_items)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_run, args=(make, self._queue, self._stop), name=name, daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            self._thread.join()
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            self._thread.join()
            raise item.exc
        return item  # type: ignore[return-value]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the producer thread and drop what it read ahead (idempotent)."""
        self._done = True
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class BatchStream:
    """A window's batches from ``make()`` (a generator of ``(batch, source rows it consumed)``),
    ``prefetch`` of them made ahead on a background thread (0: made on the caller's thread).

    ``rows_remaining()`` (``rows``, the stream's source rows, less those handed out) lets the
    Trainer log how many rows a window left unread when another rank ran out first.
    ``close()`` stops the background thread (and closes the generator: its ``finally`` blocks
    run); so does dropping the stream.
    """

    def __init__(self, make: Callable[[], Iterator[tuple[Batch, int]]], rows: int,
                 prefetch: int, name: str) -> None:
        self._rows_left = rows
        self._source: Iterator[tuple[Batch, int]]
        self._prefetcher: Prefetcher[tuple[Batch, int]] | None = None
        if prefetch > 0:
            self._prefetcher = Prefetcher(make, prefetch, name=name)
            self._source = self._prefetcher
        else:
            self._source = make()

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        try:
            batch, rows = next(self._source)
        except StopIteration:
            self._rows_left = 0  # rows dropped after the last batch, or discarded ones
            raise
        self._rows_left -= rows
        return batch

    def rows_remaining(self) -> int:
        """Rows of this rank's share of the window not yet returned (cheap: no reading)."""
        return max(0, self._rows_left)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        else:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()  # a generator: its ``finally`` closes what it reads

    def __del__(self) -> None:
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close(timeout_s=0)  # type: ignore[union-attr]
