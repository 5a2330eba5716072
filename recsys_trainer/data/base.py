"""What the Trainer needs from a dataset: ordered windows of this rank's batches.

A *window* is an ordered unit of data (e.g. one hour of parquet). Training walks windows in
order; ``train_and_evaluate`` pairs train window ``i`` with eval window ``i`` and checks the
pairs by id (``WindowPairing``). Any plain iterable of ``Batch`` also works: it is one window
named ``"all"``, re-iterated every epoch.

A window may be trained at more than one world size: an elastic job that loses or gains a node
in the middle of a window resumes at the new size. The part trained before each change is a
``Segment`` (world size, batches per rank); ``iter_window(..., earlier=segments)`` then yields
this rank's share of the rows no earlier part consumed, for a dataset that can tell which rows
those were (``exact_reshard``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import pyarrow as pa

from recsys_trainer.batch import Batch
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.vocab import Vocabulary
from recsys_trainer.data.windows import describe_source
from recsys_trainer.distributed import Gang
from recsys_trainer.validation import check_int


@dataclasses.dataclass(frozen=True)
class Segment:
    """A part of a train window trained at one world size, before the job changed size: each
    of ``world_size`` ranks trained ``batches`` micro-batches of its share of the window (the
    ranks agree at every fetch, so the count is the same on every rank). Saved in checkpoints
    (``TrainerState.window_segments``)."""

    world_size: int
    batches: int

    def __post_init__(self) -> None:
        # A checkpoint's counters come from a file: a malformed part must not plan nothing.
        check_int("Segment.world_size", self.world_size)
        check_int("Segment.batches", self.batches, minimum=0)


class WindowedDataset(ABC):
    """Base class of windowed datasets.

    ``setup(rank, world_size)`` is called by the Trainer before any iteration so the dataset can
    shard itself; ``iter_window`` then yields only this rank's batches. All ranks must see the
    same window ids in the same order (the Trainer agrees on batches, not on windows).
    """

    features: FeatureSpec | None = None
    """The spec the dataset decodes with, if any: the Trainer checks it against the model's
    tables when it is built (feature names, and id bounds against table sizes)."""

    exact_reshard: bool = False
    """Whether ``iter_window`` takes ``earlier`` segments: the rows each rank of another world
    size consumed follow from the dataset's plan, so a checkpoint saved in the middle of a
    window resumes at any world size with every row trained exactly once
    (``reshard_data_position="exact"``, the default). A dataset without it gets a named error
    at such a resume, or follows ``"restart_window"`` / ``"next_window"``."""

    def setup(self, rank: int, world_size: int) -> None:
        """Choose this rank's share of every window. Default: no sharding (rank reads all)."""

    _gang: Gang | None = None
    _stop: Callable[[], bool] | None = None
    _on_wait: Callable[[], None] | None = None

    def set_gang(self, gang: Gang) -> None:
        """Called by the Trainer after ``setup`` with the gang its ranks agree through. A
        dataset whose listing can differ between ranks (files on shared storage) lists on rank
        0 and hands the listing to the others through it. Default: kept as ``_gang`` (None
        until then) for a subclass that agrees through it."""
        self._gang = gang

    def set_stop_check(self, stop: Callable[[], bool] | None) -> None:
        """Called by the Trainer with ``stop()``: whether a stop (a preemption signal) was
        requested on this rank. A dataset that waits for data (a stream waiting for its next
        window) asks it while waiting and, when any rank's says True, ends the wait on every
        rank with ``WaitInterrupted`` (``windows.agreed_windows``); the Trainer then stops as
        for a signal at a batch fetch. None: no check. Default: kept as ``_stop`` for a
        subclass that waits."""
        self._stop = stop

    def set_wait_hook(self, on_wait: Callable[[], None] | None) -> None:
        """Called by the Trainer with ``on_wait()``: what to do while the dataset waits for
        data. A dataset that waits (a stream waiting for its next window) calls it at points
        every rank reaches together (its heartbeats, ``windows.agreed_windows``), on every
        rank; the Trainer finishes a checkpoint in flight there (the ``"wait"`` resume point),
        so a window's checkpoint commits and is published while the stream waits. None:
        nothing. Default: kept as ``_on_wait`` for a subclass that waits."""
        self._on_wait = on_wait

    def landed_at(self, window_id: str) -> float | None:
        """When window ``window_id`` landed (unix time), as its source records it, or None
        when it does not (the default). ``PublishHook`` puts it in the published pointer
        (``window_time``), from which freshness is measured: for a partitioned directory it is
        the modification time of the partition's ready marker (``_SUCCESS``)."""
        return None

    def window_end_time(self, window_id: str) -> float | None:
        """Where window ``window_id`` ends in event time (unix s), for a source whose windows
        are intervals of event time (a Kafka topic's), else None (the default). The Trainer
        counts the event time trained through from it (``TrainerState.event_time_s``: periods
        in ``event_seconds``)."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer before each epoch's windows (e.g. to reseed a shuffle)."""

    @abstractmethod
    def window_ids(self) -> Iterator[str]:
        """Window ids in training order (may block, for streaming sources)."""

    @abstractmethod
    def iter_window(self, window_id: str, skip_batches: int = 0, *,
                    earlier: Sequence[Segment] = ()) -> Iterator[Batch]:
        """This rank's batches of ``window_id``, starting after ``skip_batches`` batches.

        ``earlier`` (only passed to a dataset with ``exact_reshard``): the parts of the window
        trained before the job changed its world size, oldest first. This rank's share is then
        planned over the rows no rank of any earlier part consumed, and ``skip_batches`` counts
        batches of that share."""

    def padding_batch(self) -> Batch | None:
        """A batch shaped like real ones, used (with zero weights) to pad exhausted ranks in
        evaluation when the rank saw no batch at all. None: use the last batch seen."""
        return None

    def read_columns(self, window_id: str, columns: Sequence[str]) -> Iterator[pa.Table]:
        """This rank's share of the window's rows (each row read by exactly one rank), raw
        (undecoded) and projected on ``columns``: what a vocabulary built from the data
        (``VocabFromData``) counts. Default: not supported."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot read raw columns, which a vocabulary built from the "
            "data (VocabFromData) counts; train on a ParquetWindowDataset, or give the "
            "vocabulary as a list or file.")

    def set_vocabularies(self, vocabularies: Mapping[str, Vocabulary]) -> None:
        """Decode with these vocabularies from now on (``{feature name: Vocabulary}``, built from
        the data or restored from a checkpoint by the Trainer); the default puts them into
        ``features``, which a dataset must decode with."""
        if self.features is not None:
            self.features = with_vocabularies(self.features, vocabularies)

    def follow_id_kinds(self, train: WindowedDataset | None) -> None:
        """Read each sparse id column as the kind of ids (integer / string) ``train`` (the
        Trainer's train dataset) records for it, not as this dataset first sees it: an eval or
        predict window of strings beside integer training ids would otherwise hash the strings
        as text, other rows than training's. Default: nothing (no kinds recorded)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def load_resharded_state_dict(self, state: dict[str, Any], world_size: int) -> None:
        """Restore from the state rank 0 saved at another world size (``world_size``; an
        elastic resume): what is the same on every rank (e.g. the id kinds read so far), never
        a per-rank position. Default: nothing."""


class IterableAsWindow(WindowedDataset):
    """Any re-iterable of batches (a list, a DataLoader) or a factory of iterators, as one window
    ``"all"``. No sharding: pass each rank its own data."""

    def __init__(self, source: Iterable[Batch] | Callable[[], Iterable[Batch]]) -> None:
        self._source = source

    def window_ids(self) -> Iterator[str]:
        yield "all"

    def iter_window(self, window_id: str, skip_batches: int = 0, *,
                    earlier: Sequence[Segment] = ()) -> Iterator[Batch]:
        src = self._source() if callable(self._source) and not isinstance(self._source, Iterable) else self._source
        it = iter(src)  # type: ignore[arg-type]
        for _ in range(skip_batches):
            if next(it, None) is None:
                break
        return it


def with_vocabularies(spec: FeatureSpec, vocabularies: Mapping[str, Vocabulary]) -> FeatureSpec:
    """``spec`` with the named id features' ``vocab`` replaced (the others unchanged)."""
    def swap(f: Any) -> Any:
        v = vocabularies.get(f.name)
        return f if v is None or f.vocab is v else dataclasses.replace(f, vocab=v)

    return dataclasses.replace(spec, sparse=[swap(s) for s in spec.sparse],
                               sequence=[swap(q) for q in spec.sequence])


def as_windowed(dataset: Any) -> WindowedDataset | None:
    if dataset is None:
        return None
    if isinstance(dataset, WindowedDataset):
        return dataset
    if isinstance(dataset, Iterable) or callable(dataset):
        return IterableAsWindow(dataset)
    raise TypeError(
        f"a dataset must be a recsys_trainer.data.WindowedDataset, an iterable of Batch, or a "
        f"callable returning one; got {type(dataset).__name__}."
    )


def nothing_to_train_error(ds: WindowedDataset, windows_listed: int, rows_unread: int) -> DataError:
    """The error of a ``train()`` that trained no step although nothing asked it to stop: an
    empty glob or directory, empty windows, or (uneven data) a rank with no rows at all. A job
    that exits 0 having trained nothing hides a wrong path or an upstream failure."""
    source = getattr(ds, "windows", None)
    what = f"{type(ds).__name__}" + (f" over {describe_source(source)!r}" if source is not None else "")
    if windows_listed == 0:
        found = "lists no window (a glob or directory that matches no data files?)"
    else:
        # A step needs a batch on every rank (the ranks agree at each fetch).
        found = f"listed {windows_listed} window(s) that held no batch to train on every rank"
        if rows_unread:
            found += f" (this rank left {rows_unread} rows unread: another rank had none)"
    return DataError(
        f"training ran 0 steps: the train data, {what}, {found}. Check the path and that the "
        "data was written; a stream (StreamingWindows) waits for windows instead."
    )


class WindowPairingError(DataError):
    """Train and eval windows whose ids do not pair up (``train_and_evaluate``)."""


class WindowPairing:
    """Checks ``train_and_evaluate``'s pairs (train window ``i``, eval window ``i``) by id.

    Pairs go by position, and the first two pairs tell how the ids relate:

    * the same id (train and eval data partitioned by the same hours): every train window must
      meet an eval window of its own id, checked before it is trained;
    * eval window ``i`` is train window ``i + 1`` (train on ``windows[:-1]``, evaluate on
      ``windows[1:]``): each eval window must be the train window after its pair's, checked
      before the pair is evaluated (``check_before_eval``, given the next train window's id);
    * anything else (unrelated names): positions alone, as documented.

    A pair that breaks the relation (a partition missing from one listing shifts every pair
    after it) is a ``WindowPairingError`` naming both windows, instead of evaluating each train
    window on another window's data. Every rank sees the same ids, so every rank raises.
    """

    def __init__(self) -> None:
        self._pairs = 0
        self._relation: str | None = None  # "same", "next", "position"; None: undecided
        self._last: tuple[str, str | None] | None = None

    def check(self, train_id: str, eval_id: str | None) -> None:
        """The next pair, before its train window is trained (``eval_id`` None: the eval
        windows ran out)."""
        last, self._last = self._last, (train_id, eval_id)
        self._pairs += 1
        if last is None:
            self._relation = "same" if eval_id == train_id else None
        elif self._relation is None:
            self._relation = "next" if last[1] == train_id else "position"
        n = self._pairs
        if self._relation == "same" and eval_id != train_id:
            found = f"eval window {eval_id!r}" if eval_id is not None else "no eval window (the eval windows ran out)"
            raise WindowPairingError(
                f"train window {train_id!r} (pair {n}) meets {found}, but the train and eval "
                "windows paired by id so far: one listing lacks a window the other has. Add the "
                "missing partition (one holding only _SUCCESS is a window of 0 rows), or give both "
                "datasets the same window ids.")
        if self._relation == "next" and last is not None and last[1] != train_id:
            # Reached only when the pair before was not checked before its evaluation (an eval
            # period in steps or rows evaluates it inside its train window).
            found = (f"was evaluated on eval window {last[1]!r}" if last[1] is not None
                     else "had no eval window (the eval windows ran out)")
            raise WindowPairingError(
                f"train window {last[0]!r} (pair {n - 1}) {found}, but the train window after it "
                f"is {train_id!r}: until then each eval window was the next train window, so one "
                "listing lacks a window the other has. Add the missing partition (one holding only "
                "_SUCCESS is a window of 0 rows), or slice both datasets from one listing "
                "(windows[:-1], windows[1:]).")

    def needs_next_train_id(self) -> bool:
        """Whether the current pair's evaluation can be checked only against the next train
        window's id (``check_before_eval``): eval window ``i`` is, or may be, train window
        ``i + 1``."""
        return (self._last is not None and self._last[1] is not None
                and self._relation in (None, "next"))

    def check_before_eval(self, next_train_id: str | None) -> None:
        """Before the current pair is evaluated, given the id of the train window after it
        (None: the train windows end here, nothing to check): where each eval window has been
        the next train window, a pair that breaks that is an error now, before its evaluation
        reports metrics of another window's data. The first such call decides the relation."""
        if self._last is None or next_train_id is None:
            return
        train_id, eval_id = self._last
        if self._relation is None:  # the first pair, whose ids differ
            self._relation = "next" if eval_id == next_train_id else "position"
        elif self._relation == "next" and eval_id is not None and eval_id != next_train_id:
            raise WindowPairingError(
                f"train window {train_id!r} (pair {self._pairs}) would be evaluated on eval "
                f"window {eval_id!r}, but the train window after it is {next_train_id!r}: until "
                "then each eval window was the next train window, so one listing lacks a window "
                "the other has. Add the missing partition (one holding only _SUCCESS is a window "
                "of 0 rows), or slice both datasets from one listing (windows[:-1], windows[1:]).")


T = TypeVar("T")


class Lookahead(Iterator[T]):
    """An iterator whose next item can be seen before it is taken (``peek``): ``Trainer``
    walks the train windows through one to check a pair against the window after it."""

    _NONE: Any = object()

    def __init__(self, items: Iterable[T]) -> None:
        self._it = iter(items)
        self._next: Any = self._NONE

    def __iter__(self) -> Lookahead[T]:
        return self

    def __next__(self) -> T:
        if self._next is self._NONE:
            return next(self._it)
        item, self._next = self._next, self._NONE
        return cast(T, item)

    def peek(self) -> T | None:
        """The next item without taking it; None when there is none. On a stream this waits
        for the next item, as taking it would."""
        if self._next is self._NONE:
            try:
                self._next = next(self._it)
            except StopIteration:
                return None
        return cast(T, self._next)
