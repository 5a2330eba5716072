"""A bounded background producer: reading and decoding run ahead of the training step.

``Prefetcher(gen_factory, max_items)`` runs the generator on a daemon thread and hands items over
a ``queue.Queue(maxsize=max_items)``: memory is bounded by ``max_items`` decoded batches plus the
one being built. The thread holds no reference to the consumer, so an abandoned consumer is
garbage-collected and its ``__del__`` stops the thread; ``close()`` does it explicitly. pyarrow
and numpy release the GIL in their kernels, so decoding overlaps the training step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

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
