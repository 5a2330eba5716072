"""The owner's reader: a background thread that reads the partitions a rank owns as messages
arrive, decodes them, and keeps each partition's log of rows not yet assigned to a window
(``windowing.PartitionLog``), for the ranks' agreements to close windows from.

What it reports at an agreement (``report``): per partition its watermark's progress, whether
it is idle (read to its end, and no message for ``idle_timeout_s``) or finished (at the end the
source was given), and for the rank: whether the broker has been unreachable and since when,
the first error it met (which every rank then raises), and the id kinds it read. Closing
windows (``close``) runs on the agreement's thread, under the same lock the reading thread
takes to add messages: a message read meanwhile stays pending for a later window.

It holds the decoded rows it reads (up to ``cache_bytes``), so the rank that owns a partition
trains its rows without reading them twice; beyond that, the rows of a span are read again
from the broker (``client.SpanReader``). A partition whose watermark has passed more than
``max_windows_ahead`` windows beyond the last window the job closed is paused (it cannot hold
the next close back: it has passed it). Windows close only when training asks for the next one
(``window_ids``), so this bounds memory when training falls behind the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, TopicPartition

from recsys_trainer.data.errors import DataError
from recsys_trainer.data.kafka.client import (
    DeadLetters,
    TopicMissingError,
    is_transport,
    out_of_range,
    partitions_of,
    watermarks,
    where,
)
from recsys_trainer.data.kafka.formats import EventTimeError, MessageFormat
from recsys_trainer.data.kafka.windowing import Closed, PartitionLog, PartitionStatus, Run
from recsys_trainer.data.spec import FeatureSpec

logger = logging.getLogger("recsys_trainer.data.kafka")

CHECK_INTERVAL_S = 1.0
"""How often the reading thread asks the broker for the topic's metadata while the broker is
unreachable (and every ``METADATA_INTERVAL_S`` otherwise)."""

METADATA_INTERVAL_S = 5.0


@dataclass
class RankReport:
    """What one rank tells the others at an agreement."""

    statuses: list[PartitionStatus]
    error: tuple[str, str] | None = None
    """``(kind, message)`` of the first error the reading thread met."""
    down_for_s: float | None = None
    """How long no broker has been reachable (None: reachable)."""
    down_reason: str = ""
    kinds: dict[str, str] = field(default_factory=dict)
    """The id kinds (integer / string) read, per id column."""
    corrupt: int = 0
    lost: int = 0
    ahead: int = 0
    """Rows windowed by their message's timestamp (``max_event_ahead_s``)."""
    """Messages lost to retention and skipped (``on_out_of_range="skip"``)."""
    partitions: list[int] | None = None
    """The topic's partitions as this rank last saw them (rank 0's are taken)."""
    time: float = 0.0
    """When the report was made (unix s; rank 0's dates the windows closed)."""


class Tracker:
    """Reads the owned partitions' ``logs`` in a thread (see the module docstring)."""

    def __init__(self, topic: str, settings: dict[str, Any], fmt: MessageFormat,
                 spec: FeatureSpec, logs: Mapping[int, PartitionLog], *,
                 end_offsets: Mapping[int, int] | None, idle_timeout_s: float,
                 on_corrupt: Literal["error", "skip"], dead_letters: DeadLetters | None,
                 on_out_of_range: Literal["error", "skip"], cache_bytes: int,
                 max_windows_ahead: int, list_partitions: bool) -> None:
        self.topic = topic
        self.fmt, self.spec = fmt, spec
        self.logs = dict(logs)
        self.end_offsets = dict(end_offsets or {})
        self.idle_timeout_s = idle_timeout_s
        self.on_corrupt, self.dead_letters = on_corrupt, dead_letters
        self.on_out_of_range = on_out_of_range
        self.cache_bytes = cache_bytes
        self.max_windows_ahead = max_windows_ahead
        self.list_partitions = list_partitions
        self._settings = {**settings, "error_cb": self._on_error}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = time.monotonic()
        self._last_message = dict.fromkeys(self.logs, now)
        self._caught_up = dict.fromkeys(self.logs, False)
        self._idle_logged: set[int] = set()
        self._down_since: float | None = None
        self._down_reason = ""
        self._contact_at = 0.0
        self._error: tuple[str, str] | None = None
        self._kinds: dict[str, str] = {}
        self.corrupt = 0
        self.lost = 0
        self.ahead = 0
        self.cached = 0
        """Bytes of decoded rows held (pending here, and in closed windows' buckets)."""
        self._closed_window: int | None = None
        self._paused: set[int] = set()
        self._partitions: list[int] | None = None
        self._added: dict[int, PartitionLog] = {}
        self._ends_unknown = False

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"kafka-{self.topic}",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._thread = None

    def set_closed_window(self, window: int | None) -> None:
        """The last window the job closed: partitions far ahead of it pause."""
        self._closed_window = window

    # ------------------------------------------------------------------ the agreement's side

    def report(self) -> RankReport:
        now = time.monotonic()
        with self.lock:
            statuses = []
            for p, log in sorted(self.logs.items()):
                finished = p in self.end_offsets and log.position >= self.end_offsets[p]
                idle = (not finished and self._down_since is None and self._caught_up[p]
                        and now - self._last_message[p] >= self.idle_timeout_s)
                if idle and p not in self._idle_logged:
                    self._idle_logged.add(p)
                    logger.warning(
                        "%s: no message for %.1f s (idle_timeout_s=%g): windows close without "
                        "it; its rows that arrive later for closed windows are late rows",
                        where(self.topic, p), now - self._last_message[p], self.idle_timeout_s)
                statuses.append(PartitionStatus(p, log.crossed, log.first_window(),
                                                log.last_window(), idle, finished))
            down = None if self._down_since is None else now - self._down_since
            return RankReport(statuses, self._error, down, self._down_reason,
                              dict(self._kinds), self.corrupt, self.lost, self.ahead,
                              self._partitions, time.time())

    def close(self, first: int, last: int) -> dict[int, Closed]:
        """Close windows ``first..last`` in every owned partition."""
        with self.lock:
            return {p: log.close(first, last)
                    for p, log in sorted(self.logs.items())}

    def release(self, nbytes: int) -> None:
        """Decoded rows of this many bytes are no longer held (a trained window's)."""
        with self.lock:
            self.cached = max(0, self.cached - nbytes)

    # ------------------------------------------------------------------ the reading thread

    def _on_error(self, err: KafkaError) -> None:
        # librdkafka reports its reconnection attempts late: an error within a second of the
        # broker answering is one of those, not a new outage.
        if is_transport(err) and self._down_since is None and \
                time.monotonic() - self._contact_at > 1.0:
            self._down_since = time.monotonic()
            self._down_reason = err.str()
            logger.warning("%s: the broker cannot be reached (%s): waiting for it; the job "
                           "stops after broker_timeout_s without it", self.topic, err.str())

    def _reachable(self) -> None:
        self._contact_at = time.monotonic()
        if self._down_since is not None:
            logger.warning("%s: the broker is reachable again after %.1f s: reading on from "
                           "offsets %s", self.topic, time.monotonic() - self._down_since,
                           {p: log.position for p, log in sorted(self.logs.items())})
            self._down_since = None
            # What each partition's end was before the outage says nothing now; the broker
            # reports a partition's end once per new end, so a quiet partition would never be
            # idle again: its end is asked for (``_recheck_ends``).
            for p in self._caught_up:
                self._caught_up[p] = False
            self._ends_unknown = True

    def _fail(self, exc: Exception) -> None:
        if self._error is None:
            self._error = (type(exc).__name__, str(exc))
            logger.error("%s: %s: %s", self.topic, type(exc).__name__, exc)

    def add_partitions(self, logs: Mapping[int, PartitionLog]) -> None:
        """Partitions added to the topic while the job runs, owned by this rank: read from
        the reading thread's next turn."""
        with self.lock:
            for p, log in logs.items():
                self.logs[p] = log
                self._last_message[p] = time.monotonic()
                self._caught_up[p] = False
            self._added.update(logs)

    def _run(self) -> None:
        try:
            self._read()
        except Exception as exc:  # noqa: BLE001 - reported at the next agreement, on every rank
            self._fail(exc)

    def _read(self) -> None:
        consumer = Consumer(self._settings)
        try:
            self._assign(consumer, self.logs)
            last_check = 0.0
            while not self._stop.is_set() and self._error is None:
                if self._added:
                    with self.lock:
                        added, self._added = self._added, {}
                    consumer.incremental_assign([TopicPartition(self.topic, p, log.position)
                                                 for p, log in sorted(added.items())])
                self._pause_ahead(consumer)
                msgs = consumer.consume(num_messages=1000, timeout=0.1) if self.logs else []
                if not self.logs:
                    if not self.list_partitions:
                        self._stop.wait(0.5)
                        continue
                    time.sleep(0.1)
                by_partition: dict[int, list[Any]] = defaultdict(list)
                ends: dict[int, int] = {}
                for m in msgs:
                    err = m.error()
                    if err is None:
                        by_partition[m.partition() or 0].append(m)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        ends[m.partition() or 0] = m.offset() or 0
                    else:
                        self._on_message_error(consumer, m, err)
                if msgs:
                    self._reachable()
                for p, ms in by_partition.items():
                    self._add(p, ms)
                for p, offset in ends.items():  # after the messages before it
                    self._at_end(p, offset)
                now = time.monotonic()
                interval = CHECK_INTERVAL_S if (self._down_since is not None or not msgs) \
                    else METADATA_INTERVAL_S
                if now - last_check >= interval:
                    last_check = now
                    self._check(consumer)
                if self._ends_unknown and self._down_since is None:
                    self._recheck_ends(consumer)
        finally:
            consumer.close()

    def _assign(self, consumer: Consumer, logs: Mapping[int, PartitionLog]) -> None:
        consumer.assign([TopicPartition(self.topic, p, log.position)
                         for p, log in sorted(logs.items())
                         if not (p in self.end_offsets and log.position >= self.end_offsets[p])])

    def _check(self, consumer: Consumer) -> None:
        """The topic's metadata: reachability, a deleted topic, the partitions."""
        try:
            parts = partitions_of(consumer, self.topic, 1.0,
                                  self._settings["bootstrap.servers"])
        except TopicMissingError as exc:
            self._fail(exc)
            return
        if parts is None:
            if self._down_since is None and self.logs:
                self._down_since = time.monotonic()
                self._down_reason = "no answer to a metadata request"
                logger.warning("%s: the broker does not answer: waiting for it; the job stops "
                               "after broker_timeout_s without it", self.topic)
            return
        self._reachable()
        self._partitions = parts
        missing = sorted(set(self.logs) - set(parts))
        if missing:
            self._fail(TopicMissingError(
                f"{where(self.topic, missing[0])}: the partition no longer exists (the topic "
                f"has {len(parts)}); the job cannot read its windows. Start a new run."))

    def _recheck_ends(self, consumer: Consumer) -> None:
        """After an outage: a partition read to the log's end is caught up again (it may turn
        idle); one with messages past its position is not until they are read."""
        for p, log in sorted(self.logs.items()):
            if self._caught_up[p]:
                continue
            marks = watermarks(consumer, self.topic, p, 2.0)
            if marks is None:
                return  # the broker is not answering yet: asked again on the next turn
            if marks[1] <= log.position:
                self._caught_up[p] = True
        self._ends_unknown = False

    def _at_end(self, p: int, offset: int) -> None:
        """Partition ``p`` is read to its end, ``offset`` (every message before it added)."""
        if p in self.logs:
            with self.lock:
                self.logs[p].skip_to(offset)
            self._caught_up[p] = True

    def _on_message_error(self, consumer: Consumer, m: Any, err: KafkaError) -> None:
        p = m.partition()
        code = err.code()
        if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
            log = self.logs[p]
            marks = watermarks(consumer, self.topic, p, 5.0)
            if (self.on_out_of_range == "skip" and marks is not None
                    and log.position < marks[0]):
                lost = marks[0] - log.position
                logger.warning(
                    "%s: %d messages before offset %d were deleted by retention before the "
                    "job read them; going on from the log's start (on_out_of_range='skip')",
                    where(self.topic, p, log.position), lost, marks[0])
                with self.lock:
                    self.lost += lost
                    log.skip_to(marks[0])
                self._assign(consumer, self.logs)
                return
            self._fail(out_of_range(self.topic, p, log.position, marks))
        elif code == KafkaError.UNKNOWN_TOPIC_OR_PART:
            self._fail(TopicMissingError(
                f"{where(self.topic, p)}: the topic or partition no longer exists ({err.str()})"
                "; the job cannot read its windows. Recreate the topic and start a new run."))
        elif is_transport(err):
            self._on_error(err)
        else:
            logger.warning("%s: %s", where(self.topic, p), err.str())

    def _add(self, p: int, msgs: list[Any]) -> None:
        """Decode a partition's new messages and add them to its log, in offset order."""
        log = self.logs.get(p)
        if log is None:
            return
        end = self.end_offsets.get(p)
        if end is not None:
            msgs = [m for m in msgs if m.offset() < end]
        msgs = [m for m in msgs if m.offset() >= log.position]  # a re-delivery after a seek
        if not msgs:
            return
        batch = self.fmt.decode([m.value() for m in msgs],
                                lambda i: where(self.topic, p, msgs[i].offset()))
        for i, error in batch.corrupt.items():
            self._corrupt(p, msgs[i], error)
        row_ms = np.repeat(np.array([m.timestamp()[1] for m in msgs], dtype=np.int64),
                           batch.rows)
        try:
            times, ahead = self.fmt.times_and_ahead(batch.table, row_ms)
        except TypeError as exc:
            raise DataError(str(exc), file=where(self.topic, p, msgs[0].offset())) from None
        except EventTimeError as exc:
            i = int(np.searchsorted(np.cumsum(batch.rows), exc.row, side="right"))
            raise DataError(str(exc), file=where(self.topic, p, msgs[i].offset()),
                            column=self.fmt.time_column) from None
        if ahead.any():
            self._ahead(p, msgs, batch.rows, ahead)
        for c, kind in self.spec.id_kinds(batch.table.schema).items():
            if not pa.types.is_null(batch.table.schema.field(c).type):
                self._kinds.setdefault(c, kind)
        keep = self.cached < self.cache_bytes
        run = Run.of(log.clock, [m.offset() for m in msgs], batch.rows, times,
                     batch.table if keep else None)
        with self.lock:
            if keep:
                self.cached += batch.table.nbytes
            log.add(run)
            self._last_message[p] = time.monotonic()
            self._caught_up[p] = False
            if p in self._idle_logged:
                self._idle_logged.discard(p)
                logger.warning("%s: messages again after an idle time", where(self.topic, p))
            if end is not None and log.position >= end:
                logger.info("%s: read to its end offset %d", where(self.topic, p), end)

    def _ahead(self, p: int, msgs: list[Any], rows: np.ndarray, ahead: np.ndarray) -> None:
        row = int(np.flatnonzero(ahead)[0])
        m = msgs[int(np.searchsorted(np.cumsum(rows), row, side="right"))]
        self.ahead += int(ahead.sum())
        logger.warning("%s: %d row(s) with event times more than max_event_ahead_s=%g s past "
                       "their message's timestamp (a producer's clock ahead?): windowed by the "
                       "message's timestamp (counted: ahead_of_message)",
                       where(self.topic, p, m.offset()), int(ahead.sum()),
                       self.fmt.max_ahead_s)

    def _corrupt(self, p: int, m: Any, error: str) -> None:
        name = where(self.topic, p, m.offset())
        if self.on_corrupt == "error":
            raise DataError(
                f"the message cannot be decoded ({error}); fix the producer, or set "
                "on_corrupt='skip' to skip such messages (counted, their offsets written to "
                "the dead-letter file).", file=name)
        self.corrupt += 1
        logger.warning("%s: skipping a message that cannot be decoded (%s)", name, error)
        if self.dead_letters is not None:
            self.dead_letters.write(p, m.offset(), m.timestamp()[1], error, m.value())

    def _pause_ahead(self, consumer: Consumer) -> None:
        """Pause the partitions more than ``max_windows_ahead`` windows past the last closed."""
        w = self._closed_window
        if w is None:
            return
        ahead, back = [], []
        for p, log in self.logs.items():
            crossed = log.crossed
            far = crossed is not None and crossed > w + self.max_windows_ahead
            if far and p not in self._paused:
                ahead.append(p)
            elif not far and p in self._paused:
                back.append(p)
        if ahead:
            consumer.pause([TopicPartition(self.topic, p) for p in ahead])
            self._paused.update(ahead)
        if back:
            consumer.resume([TopicPartition(self.topic, p) for p in back])
            self._paused.difference_update(back)

