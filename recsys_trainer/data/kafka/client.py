"""The Kafka side of the source: the client's settings, the named errors, the topic's metadata,
reading a span of a partition again, and the dead-letter file. Everything that talks to the
broker goes through confluent-kafka (librdkafka); nothing here knows windows or ranks beyond
the span it is asked to read.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from recsys_trainer.data.errors import DataError
from recsys_trainer.data.kafka.formats import MessageFormat
from recsys_trainer.data.kafka.windowing import Clock, LatePolicy, Span, in_window

logger = logging.getLogger("recsys_trainer.data.kafka")
librdkafka_logger = logging.getLogger("recsys_trainer.data.kafka.librdkafka")
"""librdkafka's own log lines (connection failures, retries), at their levels."""

_TRANSPORT_ERRORS = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                     KafkaError._RESOLVE, KafkaError._TIMED_OUT}


class KafkaSourceError(RuntimeError):
    """The Kafka source cannot go on; the message names the topic, the partition and the fix."""


class BrokerUnavailableError(KafkaSourceError):
    """No broker could be reached for longer than the source's ``broker_timeout_s``."""


class TopicMissingError(KafkaSourceError):
    """The topic (or one of its partitions being read) no longer exists (deleted)."""


class OffsetsOutOfRangeError(KafkaSourceError):
    """An offset the job must read is no longer in the log: deleted by retention before it was
    read, or the log was reset (the topic deleted and created again)."""


class PartitionsChangedError(KafkaSourceError):
    """The topic's partitions changed in a way the source does not follow (fewer partitions)."""


def where(topic: str, partition: int, offset: int | None = None) -> str:
    """How messages are named in errors and logs: ``topic[partition]@offset``."""
    return f"{topic}[{partition}]" + ("" if offset is None else f"@{offset}")


def consumer_settings(bootstrap_servers: str, extra: Mapping[str, Any], *,
                      group_id: str | None = None,
                      on_error: Callable[[KafkaError], None] | None = None) -> dict[str, Any]:
    """A consumer's settings: offsets are this job's (assigned explicitly, never committed
    automatically, never reset silently: an offset out of range is an error the source
    names), partitions report their end (for idleness), topics are never created by reading.
    ``extra`` (the source's ``consumer_config``: security, timeouts) goes on top."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap_servers,
        "group.id": group_id or f"recsys-trainer-{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "error",
        "enable.partition.eof": True,
        "allow.auto.create.topics": False,
        "reconnect.backoff.max.ms": 1000,
        "topic.metadata.refresh.interval.ms": 5000,
        "logger": librdkafka_logger,
    }
    if on_error is not None:
        conf["error_cb"] = on_error
    conf.update(extra)
    return conf


def is_transport(err: KafkaError) -> bool:
    """Whether ``err`` says the broker cannot be reached (as opposed to a refused request)."""
    return err.code() in _TRANSPORT_ERRORS


def partitions_of(consumer: Consumer, topic: str, timeout_s: float,
                  bootstrap_servers: str) -> list[int] | None:
    """The topic's partitions, None when the broker did not answer in ``timeout_s``; a
    ``TopicMissingError`` naming ``bootstrap_servers`` (what ``consumer`` was made with) when
    it answered that the topic does not exist."""
    try:
        md = consumer.list_topics(topic, timeout=timeout_s)
    except KafkaException as exc:
        if is_transport(exc.args[0]):
            return None
        raise
    t = md.topics.get(topic)
    if t is None or (t.error is not None and t.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
        raise TopicMissingError(
            f"topic {topic!r} does not exist on {bootstrap_servers!r} (deleted, or "
            "never created): the job cannot read its windows. Recreate the topic and start a "
            "new run (its offsets are not this checkpoint's), or point the source at the "
            "right topic.")
    if t.error is not None:
        return None
    return sorted(t.partitions)


def watermarks(consumer: Consumer, topic: str, partition: int,
               timeout_s: float) -> tuple[int, int] | None:
    """The partition's (low, high) offsets, None when the broker did not answer."""
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                              timeout=timeout_s, cached=False)
    except KafkaException:
        return None


def out_of_range(topic: str, partition: int, offset: int, low_high: tuple[int, int] | None,
                 ) -> OffsetsOutOfRangeError:
    """The error for an offset the broker no longer has."""
    if low_high is None:
        now = "the broker did not say which offsets it holds"
    else:
        low, high = low_high
        now = f"the partition holds offsets [{low}, {high})"
        if offset < low:
            return OffsetsOutOfRangeError(
                f"{where(topic, partition, offset)}: the job must read from offset {offset}, but "
                f"{now}: {low - offset} messages were deleted by retention before the job read "
                "them. Raise the topic's retention (retention.ms / retention.bytes) above the "
                "longest stop the job may have, or set on_out_of_range='skip' to go on from the "
                "log's start, counting the lost messages.")
    return OffsetsOutOfRangeError(
        f"{where(topic, partition, offset)}: the job must read from offset {offset}, but {now}: "
        "the log was reset (the topic deleted and created again?). This checkpoint's offsets "
        "do not belong to this log: start a new run (another output_dir).")


def _namer(topic: str, partition: int, offsets: np.ndarray) -> Callable[[int], str]:
    return lambda i: where(topic, partition, int(offsets[i]))


class DeadLetters:
    """The dead-letter file of undecodable messages: one JSON line per message skipped
    (``on_corrupt="skip"``), in ``directory/<topic>.<partition>.jsonl``: topic, partition,
    offset, message timestamp, the error, and the first bytes of the value (base64). A
    partition's messages are written in offset order, and a message met again after a restart
    is not written twice."""

    PREVIEW_BYTES = 256

    def __init__(self, directory: str, topic: str) -> None:
        self.directory, self.topic = directory, topic
        self._last: dict[int, int] = {}
        os.makedirs(directory, exist_ok=True)

    def path(self, partition: int) -> str:
        return os.path.join(self.directory, f"{self.topic}.{partition}.jsonl")

    def _last_written(self, partition: int) -> int:
        if partition not in self._last:
            last = -1
            try:
                with open(self.path(partition), "rb") as f:
                    for line in f:
                        try:
                            last = max(last, int(json.loads(line)["offset"]))
                        except (ValueError, KeyError):
                            continue  # a line cut by a crash
            except FileNotFoundError:
                pass
            self._last[partition] = last
        return self._last[partition]

    def write(self, partition: int, offset: int, timestamp_ms: int, error: str,
              value: bytes | None) -> None:
        if offset <= self._last_written(partition):
            return
        import base64

        record = {"topic": self.topic, "partition": partition, "offset": offset,
                  "timestamp_ms": timestamp_ms, "error": error,
                  "value_base64": base64.b64encode((value or b"")[:self.PREVIEW_BYTES]).decode(),
                  "value_bytes": len(value or b""), "written_at": time.time()}
        with open(self.path(partition), "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._last[partition] = offset


def read(path: str) -> list[dict[str, Any]]:
    """The records of a dead-letter file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class SpanReader:
    """Reads spans of a window's rows from the broker (a rank's share that another rank read
    first, or any span after a restart): from an index point of the span, message by message,
    keeping the rows the window's assignment gives it (``windowing.in_window``)."""

    def __init__(self, topic: str, settings: dict[str, Any], fmt: MessageFormat, clock: Clock,
                 late: LatePolicy, start_window: int | None, broker_timeout_s: float,
                 stop: Callable[[], bool] | None = None) -> None:
        self.topic, self.fmt, self.clock, self.late = topic, fmt, clock, late
        self.start_window = start_window
        self.broker_timeout_s = broker_timeout_s
        self._settings = settings
        self._consumer: Consumer | None = None
        self._stop = stop

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def rows(self, window: int, partition: int, span: Span, a: int, b: int,
             chunk_rows: int = 16384) -> Iterator[tuple[pa.Table, np.ndarray]]:
        """The span's rows ``[a, b)`` (numbered in the span), in tables of about
        ``chunk_rows`` rows, each with its rows' offsets (what errors name)."""
        if a >= b:
            return
        if self._consumer is None:
            self._consumer = Consumer(self._settings)
        c = self._consumer
        offset, seen = span.seek(a)
        c.assign([TopicPartition(self.topic, partition, offset)])
        out: list[tuple[pa.Table, np.ndarray]] = []
        n_out = 0
        waited_since: float | None = None
        try:
            while seen < b:
                msgs = c.consume(num_messages=500, timeout=0.5)
                data, eof_at = [], None
                for m in msgs:
                    err = m.error()
                    if err is None:
                        data.append(m)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        eof_at = m.offset()
                    elif err.code() in (KafkaError._AUTO_OFFSET_RESET,
                                        KafkaError.OFFSET_OUT_OF_RANGE):
                        raise out_of_range(self.topic, partition, offset,
                                           watermarks(c, self.topic, partition, 5.0))
                    elif err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                        raise TopicMissingError(
                            f"{where(self.topic, partition)}: the partition no longer exists "
                            f"while the job reads window rows from it ({err.str()}).")
                if not data and eof_at is None:
                    waited_since = waited_since or time.monotonic()
                    if time.monotonic() - waited_since > self.broker_timeout_s:
                        raise BrokerUnavailableError(
                            f"{where(self.topic, partition, offset)}: no message for "
                            f"{self.broker_timeout_s:g} s while reading rows of a closed window "
                            "(the broker is unreachable?); raise broker_timeout_s or check the "
                            "brokers.")
                    if self._stop is not None and self._stop():
                        return
                    continue
                waited_since = None
                offsets = np.array([m.offset() for m in data], dtype=np.int64)
                batch = self.fmt.decode([m.value() for m in data],
                                        _namer(self.topic, partition, offsets))
                row_ms = np.repeat(np.array([m.timestamp()[1] for m in data], dtype=np.int64),
                                   batch.rows)
                v = self.clock.window_of(self.fmt.event_times(batch.table, row_ms))
                row_offsets = np.repeat(offsets, batch.rows)
                mask = in_window(window, span, row_offsets, v, self.late, self.start_window)
                k = int(mask.sum())
                rows = batch.table if k == batch.table.num_rows else batch.table.filter(
                    pa.array(mask))
                lo, hi = max(a - seen, 0), min(b - seen, k)
                seen += k
                if lo < hi:
                    out.append((rows.slice(lo, hi - lo), row_offsets[mask][lo:hi]))
                    n_out += hi - lo
                    if n_out >= chunk_rows:
                        yield from out
                        out, n_out = [], 0
                if seen < b and int(offsets[-1]) >= span.hi:
                    raise self._missing(partition, span, window, seen, b, int(offsets[-1]))
                if seen < b and eof_at is not None:
                    raise self._missing(partition, span, window, seen, b, eof_at)
            yield from out
        finally:
            c.unassign()

    def _missing(self, partition: int, span: Span, window: int, seen: int, want: int,
                 at: int) -> DataError:
        return DataError(
            f"window {self.clock.name(window)} has {span.rows} rows in this partition, but "
            f"reading it again found {seen} before offset {at} (its range ends at {span.hi}); "
            "the log changed after the job read it (compacted, or reset). Start a new run.",
            file=where(self.topic, partition))

