"""``KafkaWindowDataset``: event-time windows of a Kafka topic, behind the ``WindowedDataset``
contract, with the log's position in the job's own checkpoints.

How it runs on ``world_size`` ranks (see ``windowing`` for the rules):

* Each rank reads the partitions it owns (``windowing.owner``) as messages arrive, in a thread
  (``tracker.Tracker``), decodes them and keeps them by partition.
* ``window_ids()`` runs on every rank together: at each agreement (every ``poll_interval_s``
  while a window is open; one all-gather) the ranks exchange their partitions' progress and
  close what every partition has passed (``windowing.closable``); each owner assigns its
  partitions' rows and a second all-gather gives every rank the closed windows' plans
  (``WindowPlan``). A window with rows is yielded; while none closes, the agreement is the
  stream's heartbeat (a stop signal ends the wait on every rank, and the Trainer commits a
  checkpoint in flight there).
* ``iter_window`` gives this rank its share of the window's rows (``windowing.share``): every
  rank takes the same number of batches, so the ranks never leave rows unread; a rank trains
  rows it read itself from memory, and reads the others' from the broker by offset.

**Exactly once.** The checkpoint (``state_dict``, the same on every rank) holds the windows
closed and not yet trained (their plans), and per partition the offset up to which every row
has been assigned to a window (with its watermark there, and the rows read early for windows
still open); the Trainer's position says how many batches of the current window each rank
trained. A restarted job reads from those offsets, closes no window twice, and trains each
window's rows from the batch it stopped at: at another world size too (``exact_reshard``: the
earlier parts' cuts are replayed). The broker's consumer-group offsets are never read; with
``commit_group`` they are written, for lag monitoring only.

``KafkaWindowDataset.following()`` is the evaluation side of ``train_and_evaluate``: its window
``i`` is the train window ``i + 1`` (train on T, evaluate on T + 1 once T + 1 closes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from confluent_kafka import Consumer, TopicPartition

from recsys_trainer.batch import Batch
from recsys_trainer.data.base import Segment, WindowedDataset
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.kafka import client
from recsys_trainer.data.kafka.client import (
    BrokerUnavailableError,
    DeadLetters,
    KafkaSourceError,
    OffsetsOutOfRangeError,
    PartitionsChangedError,
    SpanReader,
    TopicMissingError,
    consumer_settings,
)
from recsys_trainer.data.kafka.formats import Decoder, MessageFormat
from recsys_trainer.data.kafka.options import KafkaSourceOptions
from recsys_trainer.data.kafka.positions import (
    KafkaStats,
    PartitionPosition,
    SourceState,
    ends_now,
    first_state,
    lost_early_rows,
    saved_end_offsets,
)
from recsys_trainer.data.kafka.reading import KafkaWindowIterator, ShareReader
from recsys_trainer.data.kafka.tracker import RankReport, Tracker
from recsys_trainer.data.kafka.windowing import (
    Bucket,
    Clock,
    PartitionLog,
    Share,
    Span,
    WindowPlan,
    closable,
    owner,
    range_in,
    share,
)
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.windows import WaitInterrupted
from recsys_trainer.distributed import FakeGang, Gang

logger = logging.getLogger("recsys_trainer.data.kafka")

_ERRORS: dict[str, type[Exception]] = {
    c.__name__: c for c in (BrokerUnavailableError, TopicMissingError, OffsetsOutOfRangeError,
                            PartitionsChangedError, KafkaSourceError, DataError)}


def placeholder(index: int) -> str:
    """The id ``window_ids`` gives a window trained before the checkpoint a run resumed from
    (the Trainer skips it by position; its plan is gone)."""
    return f"#{index} (trained before the resume)"


class KafkaWindowDataset(WindowedDataset):
    """Event-time windows of a Kafka topic (see the module docstring and docs/kafka.md).

    Args:
        features: the ``FeatureSpec`` (the same as for files: vocabularies, transforms and
            checks apply alike).
        decoder: a callable ``bytes -> pyarrow.RecordBatch`` for another message format
            (Avro, Protobuf); replaces ``format``.
        **options: ``KafkaSourceOptions``' fields (``bootstrap_servers`` and ``topic`` at
            least), validated there.
    """

    features: FeatureSpec
    exact_reshard = True

    def __init__(self, features: FeatureSpec, *, decoder: Decoder | None = None,
                 **options: Any) -> None:
        self.options = o = KafkaSourceOptions(**options)
        self.features = features
        self.decoder = decoder
        self.clock = Clock(float(o.window_s), float(o.allowed_lateness_s))
        self.start_window = None if o.start_time is None else \
            int(self.clock.window_of(np.array([o.start_time]))[0])
        self.end_window = None if o.end_time is None else \
            math.ceil(o.end_time / o.window_s) - 1
        self.rank, self.world_size = 0, 1
        self._buckets: dict[tuple[int, int], Bucket] = {}
        """``(window, partition) -> Bucket``: rows this rank's reading thread kept, to train."""
        self.stats = KafkaStats()
        self._base = KafkaStats()
        """The counts of the runs before the checkpoint this one resumed from."""
        self._state: SourceState | None = None
        self._floor = 0
        self._tracker: Tracker | None = None
        self._reading = ShareReader(
            o.topic, o.batch_size, o.prefetch_batches, 0, self.clock,
            features=lambda: self.features, buckets=self._buckets,
            spans=lambda: SpanReader(o.topic, self._settings(), self._fmt_or_make, self.clock,
                                     o.late_rows, self.start_window, o.broker_timeout_s),
            kinds=lambda: dict(self._state.id_kinds) if self._state is not None else {})
        self._committer: Consumer | None = None
        self._ended = False
        self._current = -1
        self._by_id: dict[str, WindowPlan] = {}
        self._fmt: MessageFormat | None = None
        self._saved_ends: Any = saved_end_offsets(o)
        """The ``end_offsets`` of the run that wrote the checkpoint resumed from."""

    # ------------------------------------------------------------------ WindowedDataset

    def setup(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` must be in [0, {world_size}), but is {rank}.")
        if self._tracker is not None and (rank, world_size) != (self.rank, self.world_size):
            raise RuntimeError("a KafkaWindowDataset that has started reading cannot be set "
                               "up for another rank or world size; make a new one.")
        self.rank, self.world_size = rank, world_size
        self._reading.rank = rank

    def set_epoch(self, epoch: int) -> None:
        if epoch > 0:
            raise ValueError(
                f"a Kafka stream is read once, but the Trainer asks for epoch {epoch + 1}: set "
                "train_epoch=1 (a run ends at the source's end_time or end_offsets, or when it "
                "is stopped).")

    def window_ids(self) -> Iterator[str]:
        index = 0
        while True:
            wid = self._id_at(index)
            if wid is None:
                return
            yield wid
            index += 1

    def landed_at(self, window_id: str) -> float | None:
        """The window's end in event time (unix s): what ``PublishHook`` puts in the pointer, so
        that a follower's freshness is measured from the newest event the window may hold."""
        return self.window_end_time(window_id)

    def window_end_time(self, window_id: str) -> float | None:
        plan = self._by_id.get(window_id)
        return None if plan is None else self.clock.end(plan.number)

    def iter_window(self, window_id: str, skip_batches: int = 0, *,
                    earlier: Sequence[Segment] = ()) -> Iterator[Batch]:
        plan = self._plan(window_id)
        self._train_from(plan)
        segments = [(s.world_size, s.batches) for s in earlier]
        return self._iterator(plan, share(plan.spans, segments, self.world_size, self.rank,
                                          self.options.batch_size, skip_batches))

    def padding_batch(self) -> Batch | None:
        return self.features.padding_batch()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fingerprint": self.options.fingerprint()}
        st = self._state
        if st is None:
            return out
        out.update({
            "closed": st.closed, "next_index": st.next_index,
            "plans": [p.to_json() for i, p in sorted(st.plans.items()) if i >= self._current],
            "partitions": {str(p): v.to_json() for p, v in sorted(st.partitions.items())},
            "id_kinds": dict(st.id_kinds), "stats": dataclasses.asdict(self.stats),
            "end_offsets": self._saved_ends})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_fingerprint(state.get("fingerprint", {}))
        if "partitions" not in state:
            return
        if self._tracker is not None:
            raise RuntimeError("a KafkaWindowDataset restores its position before it reads.")
        plans = [WindowPlan.from_json(p) for p in state["plans"]]
        self._state = SourceState({int(p): PartitionPosition.from_json(v)
                                   for p, v in state["partitions"].items()},
                                  None if state["closed"] is None else int(state["closed"]),
                                  int(state["next_index"]), {p.index: p for p in plans},
                                  dict(state.get("id_kinds", {})))
        self._by_id = {self.clock.name(p.number): p for p in plans}
        self._floor = min([p.index for p in plans] + [self._state.next_index])
        self.stats = KafkaStats(**state.get("stats", {}))
        self._base = dataclasses.replace(self.stats)
        # Older checkpoints did not say: their ends stand.
        self._saved_ends = state.get("end_offsets", saved_end_offsets(self.options))

    def load_resharded_state_dict(self, state: dict[str, Any], world_size: int) -> None:
        """The state is the same on every rank (rank 0's serves any world size): the partitions
        are owned anew at this run's world size."""
        self.load_state_dict(state)

    def following(self) -> KafkaFollowingWindows:
        """The evaluation side of ``train_and_evaluate``: window ``i`` is this source's window
        ``i + 1`` (see ``KafkaFollowingWindows``)."""
        return KafkaFollowingWindows(self)

    def close(self) -> None:
        """Stop reading (the thread, the consumers)."""
        if self._tracker is not None:
            self._tracker.stop()
            self._tracker = None
        self._reading.close()
        if self._committer is not None:
            with contextlib.suppress(Exception):
                self._committer.poll(0.5)  # the last commit's answer
                self._committer.close()
            self._committer = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._tracker is not None:
                self._tracker.stop(timeout_s=0)

    # ------------------------------------------------------------------ windows

    def _check_fingerprint(self, saved: dict[str, Any]) -> None:
        now = self.options.fingerprint()
        diff = {k: (saved.get(k), v) for k, v in now.items() if k in saved and saved[k] != v}
        if diff:
            listed = ", ".join(f"`{k}` {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"the checkpoint's Kafka source was configured otherwise ({listed}): its "
                "offsets and windows would not mean the same rows.")

    def _id_at(self, index: int) -> str | None:
        """The id of the source's window ``index`` (waiting for it to close), None after the
        last."""
        self._start()
        st = self._state
        assert st is not None
        if index < self._floor:
            return placeholder(index)
        while True:
            plan = st.plans.get(index)
            if plan is not None:
                return self.clock.name(plan.number)
            if index < st.next_index:  # trained and let go (a later walk over the windows)
                return placeholder(index)
            if self._ended:
                return None
            self._agree()

    def _plan(self, window_id: str) -> WindowPlan:
        plan = self._by_id.get(window_id)
        if plan is None:
            raise KeyError(f"window {window_id!r} is not a closed window of this Kafka source "
                           "(windows are read in order, through window_ids()).")
        return plan

    @property
    def _fmt_or_make(self) -> MessageFormat:
        if self._fmt is None:
            o = self.options
            self._fmt = MessageFormat(self.features, self.decoder or o.format,
                                      schema=o.arrow_schema(), time_column=o.time_column,
                                      time_unit=o.time_unit, max_ahead_s=o.max_event_ahead_s)
        return self._fmt

    def _settings(self, group_id: str | None = None) -> dict[str, Any]:
        return consumer_settings(self.options.bootstrap_servers, self.options.consumer_config,
                                 group_id=group_id)

    def _start(self) -> None:
        """Every rank, once: the partitions and where they start (rank 0 asks the broker and
        tells the others, for a new run), then this rank's reading thread."""
        if self._tracker is not None or self._ended:
            return
        gang = self._gang or FakeGang()
        if self._state is None:
            self._state = _from_rank0(gang, lambda: first_state(
                self.options, self._settings(), self.start_window))
        else:
            self._set_ends(gang)
            if self.options.on_out_of_range == "skip":
                lost = lost_early_rows(self._state, self.options.topic, self._settings()) \
                    if gang.rank == 0 else None
                self._drop_early_rows(gang.broadcast_object(lost, src=0))
        st = self._state
        assert st is not None
        o = self.options
        fmt = self._fmt_or_make
        mine = {p: PartitionLog(p, self.clock, o.late_rows, frontier=v.frontier,
                                watermark=v.watermark, deferred=v.deferred,
                                start_window=self.start_window)
                for p, v in st.partitions.items() if owner(p, self.world_size) == self.rank}
        dead = DeadLetters(o.dead_letter_dir, o.topic) if o.dead_letter_dir else None
        self._tracker = Tracker(
            o.topic, self._settings(), fmt, self.features, mine,
            end_offsets={p: v.end for p, v in st.partitions.items() if v.end is not None},
            idle_timeout_s=o.idle_timeout_s, on_corrupt=o.on_corrupt, dead_letters=dead,
            on_out_of_range=o.on_out_of_range, cache_bytes=int(o.cache_mb * 2**20),
            max_windows_ahead=o.max_windows_ahead, list_partitions=self.rank == 0)
        self._tracker.set_closed_window(st.closed)
        self._tracker.start()
        logger.info("%s: rank %d reads partitions %s (of %s) from offsets %s", o.topic,
                    self.rank, sorted(mine), sorted(st.partitions),
                    {p: v.frontier for p, v in sorted(st.partitions.items())})

    def _set_ends(self, gang: Gang) -> None:
        """A resumed run whose ``end_offsets`` differs from the checkpoint's run ends where its
        own setting says (a bounded run resumed as a stream reads on; a stream resumed with
        ``"log_end"`` ends at the log's end now); the same setting keeps the checkpoint's ends
        (one job through its restarts)."""
        st, o = self._state, self.options
        assert st is not None
        if self._saved_ends == saved_end_offsets(o):
            return
        ends = _from_rank0(gang, lambda: ends_now(o, sorted(st.partitions), self._settings()))
        for p, v in st.partitions.items():
            v.end = ends.get(p)
        logger.info("%s: end_offsets changed since the checkpoint (%r -> %r): the partitions "
                    "end at %s", o.topic, self._saved_ends, o.end_offsets, ends)
        self._saved_ends = saved_end_offsets(o)

    def _drop_early_rows(self, lost: dict[int, list[int]] | None) -> None:
        st = self._state
        assert st is not None
        for p, windows in (lost or {}).items():
            v = st.partitions[p]
            rows = sum(v.deferred.pop(w)[1] for w in windows)
            self.stats.lost_rows += rows
            logger.warning("%s: %d rows read early for windows still open (%s) were deleted by "
                           "retention before they were trained; they are counted as lost "
                           "(on_out_of_range='skip')", client.where(self.options.topic, p),
                           rows, ", ".join(self.clock.name(w) for w in windows))

    def _agree(self) -> None:
        """One agreement of every rank (see the module docstring): close what can close, or
        wait (the heartbeat: a stop check, the Trainer's wait hook, a sleep)."""
        gang = self._gang or FakeGang()
        st, tracker, o = self._state, self._tracker, self.options
        assert st is not None and tracker is not None
        report = tracker.report()
        stopping = self._stop is not None and bool(self._stop())
        reports: list[tuple[RankReport, bool]] = gang.all_gather_object((report, stopping))
        for r, (rep, _) in enumerate(reports):
            if rep.error is not None:
                kind, message = rep.error
                raise _ERRORS.get(kind, KafkaSourceError)(
                    f"{message}" if r == self.rank else
                    f"rank {r} stopped reading: {message} (rank {self.rank} stops too)")
        down = max((rep.down_for_s or 0.0 for rep, _ in reports), default=0.0)
        if down > o.broker_timeout_s:
            reason = next((rep.down_reason for rep, _ in reports if rep.down_reason), "")
            raise BrokerUnavailableError(
                f"{o.topic}: no broker of {o.bootstrap_servers!r} reachable for {down:.0f} s "
                f"(broker_timeout_s={o.broker_timeout_s:g}; last error: {reason}). Training "
                "stopped at a window boundary: a rerun resumes from the last checkpoint's "
                "offsets once the brokers are back.")
        if any(s for _, s in reports):
            raise WaitInterrupted(f"a stop was requested while topic {o.topic!r} waited for "
                                  "its next window to close")
        self.stats.corrupt_skipped = self._base.corrupt_skipped + sum(
            rep.corrupt for rep, _ in reports)
        self.stats.lost_messages = self._base.lost_messages + sum(rep.lost for rep, _ in reports)
        self.stats.ahead_of_message = self._base.ahead_of_message + sum(
            rep.ahead for rep, _ in reports)
        for rep, _ in reports:
            for column, kind in rep.kinds.items():
                st.id_kinds.setdefault(column, kind)
        statuses = [s for rep, _ in reports for s in rep.statuses]
        known = {s.partition for s in statuses}
        if known != set(st.partitions):
            raise PartitionsChangedError(
                f"{o.topic}: the ranks report partitions {sorted(known)}, but the source reads "
                f"{sorted(st.partitions)}.")
        # After the check: a partition added now reports from the next agreement on.
        self._pick_up_partitions(reports[0][0].partitions)
        span = closable(statuses, st.closed, self.end_window)
        if span is None:
            if self._stream_ended(statuses):
                self._ended = True
                tracker.stop()
                logger.info("%s: the stream ended after window %s", o.topic,
                            None if st.closed is None else self.clock.name(st.closed))
                return
            if self._on_wait is not None:
                self._on_wait()
            time.sleep(o.poll_interval_s)
            return
        first, last = span
        mine = tracker.close(first, last)
        summary = {p: (c.lo, c.hi, c.bounds,
                       {w: (b.rows, b.first, b.index()) for w, b in c.windows.items()},
                       c.late_trained, c.late_dropped, c.before_start,
                       tracker.logs[p].frontier_watermark, tracker.logs[p].deferred_state())
                   for p, c in mine.items()}
        merged: dict[int, Any] = {}
        for part in gang.all_gather_object(summary):
            merged.update(part)
        for p, (_, hi, _, _, _, _, _, wm, deferred) in merged.items():
            v = st.partitions[p]
            v.frontier, v.watermark, v.deferred = hi, wm, dict(deferred)
        with_rows = sorted({w for s in merged.values() for w, n in s[3].items() if n[0] > 0})
        idle = sorted(s.partition for s in statuses if s.idle)
        for w in with_rows:
            spans = {}
            for p, (lo, hi, bounds, windows, *_rest) in merged.items():
                a, b = range_in(lo, hi, bounds, first, w)
                rows, f, index = windows.get(w, (0, -1, ()))
                spans[p] = Span(rows, f, a, b, tuple(index))
            late_t = sum(s[4].get(w, 0) for s in merged.values())
            late_d = sum(s[5].get(w, 0) for s in merged.values())
            plan = WindowPlan(w, st.next_index, spans, late_t, late_d, reports[0][0].time)
            st.plans[plan.index] = plan
            self._by_id[self.clock.name(w)] = plan
            st.next_index += 1
            self.stats.windows += 1
            self.stats.rows += plan.rows
            self.stats.idle_closes += bool(idle)
            logger.info("%s: window %s closed: %d rows%s%s", o.topic, self.clock.name(w),
                        plan.rows, f", {late_t} late (trained)" if late_t else "",
                        f", {late_d} late (dropped)" if late_d else "")
        self.stats.late_trained += sum(sum(s[4].values()) for s in merged.values())
        self.stats.late_dropped += sum(sum(s[5].values()) for s in merged.values())
        self.stats.before_start += sum(s[6] for s in merged.values())
        if idle:
            logger.warning("%s: windows up to %s closed while partitions %s were idle", o.topic,
                           self.clock.name(last), idle)
        for p, c in mine.items():
            for w, bucket in c.windows.items():
                if bucket.cached:
                    self._buckets[(w, p)] = bucket
                else:
                    tracker.release(bucket.drop_tables())
        st.closed = last
        tracker.set_closed_window(last)

    def _pick_up_partitions(self, listed: list[int] | None) -> None:
        """Partitions added to the topic (as rank 0 last listed it, the same on every rank):
        read from offset 0 by their owners from now on (their rows of closed windows are late
        rows). Only when the source reads all partitions (``partitions=None``)."""
        st, tracker, o = self._state, self._tracker, self.options
        assert st is not None and tracker is not None
        if listed is None or o.partitions is not None:
            return
        new = sorted(set(listed) - set(st.partitions))
        if not new:
            return
        gone = sorted(set(st.partitions) - set(listed))
        if gone:
            raise PartitionsChangedError(
                f"{o.topic}: partitions {gone} are gone (the topic now has {sorted(listed)}): "
                "the topic was deleted and created again? Start a new run.")
        logger.warning("%s: partitions %s were added to the topic: reading them from offset 0 "
                       "(rows of windows already closed are late rows)", o.topic, new)
        for p in new:
            st.partitions[p] = PartitionPosition(0)
        tracker.add_partitions({
            p: PartitionLog(p, self.clock, o.late_rows, frontier=0,
                            start_window=self.start_window)
            for p in new if owner(p, self.world_size) == self.rank})

    def _stream_ended(self, statuses: Sequence[Any]) -> bool:
        st = self._state
        assert st is not None
        if self.end_window is not None and st.closed is not None and st.closed >= self.end_window:
            return True
        return bool(statuses) and all(s.finished and s.first_window is None for s in statuses)

    # ------------------------------------------------------------------ reading a window

    def _train_from(self, plan: WindowPlan) -> None:
        """Training reaches ``plan``: earlier plans and their rows are let go, the owner's
        reading may run ahead of it, and (``commit_group``) the trained offsets are committed."""
        st = self._state
        assert st is not None
        if plan.index <= self._current:
            return
        self._current = plan.index
        for i in [i for i in st.plans if i < plan.index]:
            old = st.plans.pop(i)
            self._by_id.pop(self.clock.name(old.number), None)
        for key in [k for k in self._buckets if k[0] < plan.number]:
            freed = self._buckets.pop(key).drop_tables()
            if self._tracker is not None:
                self._tracker.release(freed)
        if self.options.commit_group and self.rank == 0:
            self._commit()

    def _commit(self) -> None:
        """Commit, per partition, the offset before which every row is trained."""
        st, o = self._state, self.options
        assert st is not None
        offsets = {}
        for p, v in st.partitions.items():
            firsts = [v.frontier, *(f for f, _ in v.deferred.values())]
            firsts += [plan.spans[p].first for plan in st.plans.values()
                       if p in plan.spans and plan.spans[p].rows]
            offsets[p] = min(firsts)
        try:
            if self._committer is None:
                self._committer = Consumer({**self._settings(group_id=o.commit_group),
                                            "on_commit": self._committed})
            self._committer.poll(0)  # the last commit's answer (``_committed``)
            self._committer.commit(offsets=[TopicPartition(o.topic, p, off)
                                            for p, off in sorted(offsets.items())],
                                   asynchronous=True)
        except Exception as exc:  # noqa: BLE001 - monitoring only: never stops training
            logger.warning("%s: committing offsets to consumer group %r failed: %s", o.topic,
                           o.commit_group, exc)

    def _committed(self, err: Any, partitions: Any) -> None:
        """The broker's answer to an asynchronous commit: a refusal is logged (monitoring
        only, never stops training), else it went unseen."""
        failed = [tp for tp in partitions or [] if tp.error is not None]
        if err is not None or failed:
            logger.warning("%s: committing offsets to consumer group %r failed: %s",
                           self.options.topic, self.options.commit_group,
                           err if err is not None else failed[0].error)

    def _iterator(self, plan: WindowPlan, sh: Share) -> KafkaWindowIterator:
        return self._reading.iterator(plan, sh)


def _from_rank0(gang: Gang, ask: Callable[[], Any]) -> Any:
    """What rank 0 asks the broker, on every rank; rank 0's error raised on every rank."""
    message: tuple[str, Any] = ("ok", None)
    if gang.rank == 0:
        try:
            message = ("ok", ask())
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            message = ("error", (type(exc).__name__, str(exc)))
    kind, payload = gang.broadcast_object(message, src=0)
    if kind == "error":
        raise _ERRORS.get(payload[0], KafkaSourceError)(
            f"rank 0 could not start reading: {payload[1]}")
    return payload


class KafkaFollowingWindows(WindowedDataset):
    """The evaluation side of ``train_and_evaluate`` over a ``KafkaWindowDataset``: its window
    ``i`` is the source's window ``i + 1``, read whole (every rank an even share) when it is
    evaluated, after the train window before it. No state of its own: the source's checkpoint
    holds the windows (an evaluation cut short is redone on resume)."""

    features: FeatureSpec
    exact_reshard = False

    def __init__(self, source: KafkaWindowDataset) -> None:
        self.source = source
        self.features = source.features

    def setup(self, rank: int, world_size: int) -> None:
        self.source.setup(rank, world_size)

    def set_gang(self, gang: Gang) -> None:
        self.source.set_gang(gang)

    def window_ids(self) -> Iterator[str]:
        index = 1
        while True:
            wid = self.source._id_at(index)
            if wid is None:
                return
            yield wid
            index += 1

    def landed_at(self, window_id: str) -> float | None:
        return self.source.landed_at(window_id)

    def iter_window(self, window_id: str, skip_batches: int = 0, *,
                    earlier: Sequence[Segment] = ()) -> Iterator[Batch]:
        src = self.source
        plan = src._plan(window_id)
        return src._iterator(plan, share(plan.spans, [], src.world_size, src.rank,
                                         src.options.batch_size, skip_batches))

    def padding_batch(self) -> Batch | None:
        return self.features.padding_batch()

    def set_vocabularies(self, vocabularies: Any) -> None:
        super().set_vocabularies(vocabularies)
        self.source.set_vocabularies(vocabularies)
