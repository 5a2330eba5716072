"""The cross-rank exit flag: one all-reduce per fetched batch, below any prefetching.

Ranks often hold uneven data (a window's rows do not split evenly). Every rank fetches its next
local batch, then one ``all_reduce(MAX)`` of ``[out_of_data, has_data, stop, non_finite]`` tells
all ranks the same thing at the same fetch. ``stop`` is 1 for a requested stop and 2 for a
preemption signal (``recsys_trainer.preemption``): the MAX says whether any rank was signalled. The same vector carries one slot per rank for the
rows of the batch it fetched (MAX of zeros and one rank's count is that count), so every rank
also learns how many rows all ranks fetched, at no extra collective: the Trainer's
``rows_seen``, on which periods in rows agree. A rank whose fetch raised (bad data) still takes part
(``out_of_data = 2``), then re-raises; the other ranks raise too, naming that rank's error,
instead of waiting for it. Because TorchRec pipelines pull batches ahead, this
must live inside the iterator's ``__next__``, never in the training loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from recsys_trainer.batch import Batch
from recsys_trainer.data.errors import DataError
from recsys_trainer.distributed import Gang


@dataclass
class SyncState:
    """What the last agreement said (read by the Trainer after the iterator stops)."""

    out_of_data: bool = False
    stop_requested: bool = False
    preempted: bool = False
    """A rank got a preemption signal (``stop`` level 2); ``stop_requested`` is set too."""
    non_finite_loss: bool = False
    rows_unread: int = 0
    fetched: int = 0
    padding: int = 0


class SyncedIterator(Iterator[Batch]):
    """Yields this rank's batches until the ranks agree to stop.

    Training (``pad=False``): stops on every rank as soon as *any* rank is out of data; the batch
    other ranks fetched is not trained (``rows_unread`` counts it and, when the iterator can tell
    cheaply, the rest of the local window). Evaluation (``pad=True``): ranks that are out of data
    yield padding batches (zero weights, ``Batch.as_padding``) until *all* ranks are out, so
    every row is evaluated and model collectives stay matched.

    ``local_flags`` returns this rank's ``(stop, non_finite)`` before each agreement: ``stop`` 0
    (go on), 1 (a stop was requested) or 2 (a preemption signal arrived); any rank's non-zero
    stop or non-finite flag ends the iteration on every rank.
    """

    def __init__(
        self,
        source: Iterator[Batch],
        gang: Gang,
        *,
        pad: bool,
        local_flags: Callable[[], tuple[int, bool]] = lambda: (0, False),
        padding_batch: Callable[[], Batch | None] = lambda: None,
    ) -> None:
        self._source = source
        self._gang = gang
        self._pad = pad
        self._local_flags = local_flags
        self._padding_batch = padding_batch
        self._last: Batch | None = None
        self._exhausted = False
        self._done = False
        self.last_was_padding = False
        self.state = SyncState()
        self._global_rows: deque[int] = deque()

    def __iter__(self) -> SyncedIterator:
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        local: Batch | None = None
        failure: Exception | None = None
        if not self._exhausted:
            try:
                local = next(self._source, None)
            except Exception as exc:  # noqa: BLE001 - re-raised after the agreement below
                failure = exc  # e.g. a DataError: the other ranks must not wait for this rank
            self._exhausted = local is None
        stop, non_finite = self._local_flags()
        rows = [0] * self._gang.world_size
        rows[self._gang.rank] = local.num_real_rows() if local is not None else 0
        # The first flag is 2 on a rank whose fetch failed (MAX keeps the flags at 4 ints).
        agreed = self._gang.all_reduce_max(
            [2 if failure is not None else int(local is None), int(local is not None), int(stop),
             int(non_finite), *rows]
        )
        out_of_data, has_data, stop_any, nf_any = agreed[:4]
        if out_of_data == 2:
            self._done = True
            self.close()
            # Every rank names what failed where (one all-gather, on this failure path only).
            reports = self._gang.all_gather_object(
                None if failure is None
                else (isinstance(failure, DataError), f"{type(failure).__name__}: {failure}"))
            if failure is not None:
                raise failure
            raise _peer_failure(reports, self._gang.rank)
        st = self.state
        st.stop_requested, st.non_finite_loss = bool(stop_any), bool(nf_any)
        st.preempted = stop_any >= 2
        finished = (not has_data) if self._pad else bool(out_of_data)
        if finished or stop_any or nf_any:
            st.out_of_data = bool(finished)
            if local is not None:
                st.rows_unread += local.num_real_rows()
                if not self._pad:
                    st.rows_unread += self._count_rest()
            self._done = True
            self.close()
            raise StopIteration
        if local is None:
            pad = self._last if self._last is not None else self._padding_batch()
            if pad is None:
                raise RuntimeError(
                    f"rank {self._gang.rank} has no evaluation data to shape a padding batch while "
                    "other ranks still evaluate; give the eval dataset a padding_batch()."
                )
            st.padding += 1
            self.last_was_padding = True
            return pad.as_padding()
        self.last_was_padding = False
        st.fetched += 1
        self._last = local
        if not self._pad:
            self._global_rows.append(sum(agreed[4:]))
        return local

    def take_rows(self, batches: int) -> int:
        """Rows all ranks fetched in the next ``batches`` training batches yielded (first in,
        first out: a pipeline fetches ahead of the batches it has trained)."""
        return sum(self._global_rows.popleft() for _ in range(min(batches, len(self._global_rows))))

    def close(self) -> None:
        """Release the source (e.g. stop a dataset's read-ahead thread), if it can be closed."""
        close = getattr(self._source, "close", None)
        if callable(close):
            close()

    def _count_rest(self) -> int:
        rows_remaining = getattr(self._source, "rows_remaining", None)
        if callable(rows_remaining):
            return int(rows_remaining())
        # Reads (but does not train) the rest of the window so the log can say what was left.
        return sum(b.num_real_rows() for b in self._source)


def _peer_failure(reports: list[tuple[bool, str] | None], rank: int) -> Exception:
    """The error a rank raises when another rank's fetch failed: the same kind (a
    ``DataError`` stays one), with the first failing rank's message."""
    failed, (is_data_error, message) = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
    text = (f"rank {failed} failed to read its next batch: {message} (rank {rank} stops too "
            "instead of waiting for it).")
    return DataError(text) if is_data_error else RuntimeError(text)
