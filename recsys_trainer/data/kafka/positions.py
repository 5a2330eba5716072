"""The Kafka source's position, the same on every rank (``KafkaWindowDataset.state_dict``):
per partition the offset up to which every row is assigned to a window (``PartitionPosition``),
the windows closed and not yet trained (their plans), and what a new run asks the broker for
(``first_state``: the partitions, start and end offsets) or a resumed one checks
(``lost_early_rows``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from recsys_trainer.data.kafka.client import (
    BrokerUnavailableError,
    OffsetsOutOfRangeError,
    TopicMissingError,
    partitions_of,
    watermarks,
    where,
)
from recsys_trainer.data.kafka.options import KafkaSourceOptions
from recsys_trainer.data.kafka.windowing import WindowPlan

logger = logging.getLogger("recsys_trainer.data.kafka")


@dataclass
class KafkaStats:
    """What the source met so far (every rank alike: sums over the partitions)."""

    windows: int = 0
    """Windows closed with rows."""
    rows: int = 0
    """Rows of those windows."""
    late_trained: int = 0
    late_dropped: int = 0
    before_start: int = 0
    """Rows earlier than ``start_time``, skipped."""
    corrupt_skipped: int = 0
    """Messages that could not be decoded, skipped (``on_corrupt="skip"``)."""
    lost_messages: int = 0
    """Messages deleted by retention before they were read (``on_out_of_range="skip"``)."""
    lost_rows: int = 0
    """Rows read before a restart for a window still open, then deleted by retention before
    the resumed job trained them (``on_out_of_range="skip"``)."""
    idle_closes: int = 0
    """Windows closed while a partition was idle."""
    ahead_of_message: int = 0
    """Rows whose event time was more than ``max_event_ahead_s`` past their message's
    timestamp, windowed by the message's timestamp."""



@dataclass
class PartitionPosition:
    """A partition's position in the checkpoint: every row before ``frontier`` is assigned to
    a window; ``watermark`` is the largest event time before it; ``deferred``: rows read
    early, per window still open (first offset, rows); ``end``: its end offset, if any."""

    frontier: int
    watermark: float = -math.inf
    deferred: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    end: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"frontier": self.frontier,
                "watermark": None if self.watermark == -math.inf else self.watermark,
                "deferred": {str(w): list(v) for w, v in self.deferred.items()},
                "end": self.end}

    @staticmethod
    def from_json(raw: dict[str, Any]) -> PartitionPosition:
        wm = raw.get("watermark")
        return PartitionPosition(int(raw["frontier"]), -math.inf if wm is None else float(wm),
                                 {int(w): (int(v[0]), int(v[1])) for w, v in raw["deferred"].items()},
                          None if raw.get("end") is None else int(raw["end"]))


@dataclass
class SourceState:
    """The source's position, the same on every rank (what ``state_dict`` saves)."""

    partitions: dict[int, PartitionPosition]
    closed: int | None
    next_index: int = 0
    plans: dict[int, WindowPlan] = dataclasses.field(default_factory=dict)
    id_kinds: dict[str, str] = dataclasses.field(default_factory=dict)


def first_state(o: KafkaSourceOptions, settings: dict[str, Any],
            start_window: int | None) -> SourceState:
    """A new run's partitions, start and end offsets, from the broker (rank 0 asks, every rank
    gets the answer; waits up to ``broker_timeout_s`` for the broker)."""
    c = Consumer(settings)
    try:
        deadline = time.monotonic() + o.broker_timeout_s
        parts = partitions_of(c, o.topic, 5.0, o.bootstrap_servers)
        while parts is None:
            if time.monotonic() > deadline:
                raise BrokerUnavailableError(
                    f"no broker of {o.bootstrap_servers!r} answered for "
                    f"{o.broker_timeout_s:g} s (broker_timeout_s): the job cannot list "
                    f"topic {o.topic!r}. Check the address and that the brokers run.")
            logger.warning("%s: no answer from %s yet; retrying", o.topic,
                           o.bootstrap_servers)
            time.sleep(1.0)
            parts = partitions_of(c, o.topic, 5.0, o.bootstrap_servers)
        if o.partitions is not None:
            missing = sorted(set(o.partitions) - set(parts))
            if missing:
                raise TopicMissingError(
                    f"topic {o.topic!r} has partitions {parts}, not {missing}: fix "
                    "`partitions`.")
            parts = sorted(o.partitions)
        for name, given in (("start", o.start), ("end_offsets", o.end_offsets)):
            unknown = sorted(set(given) - set(parts)) if isinstance(given, dict) else []
            if unknown:
                raise TopicMissingError(
                    f"`{name}` names partitions {unknown} of topic {o.topic!r}, which the "
                    f"source does not read (it reads {parts}): fix `{name}`.")
        start: dict[int, int] = {}
        times: dict[int, int] = {}
        if o.start_time is not None:
            ask = [TopicPartition(o.topic, p, int(1000 * (o.start_time
                                                           - o.allowed_lateness_s)))
                   for p in parts]
            with contextlib.suppress(Exception):
                times = {tp.partition: tp.offset
                         for tp in c.offsets_for_times(ask, timeout=10.0) if tp.offset >= 0}
            if len(times) < len(parts):
                logger.info("%s: the broker's time index has no offset for start_time in "
                            "partitions %s; they are read from `start` (earlier rows are "
                            "skipped and counted)", o.topic, sorted(set(parts) - set(times)))
        out: dict[int, PartitionPosition] = {}
        for p in parts:
            marks = watermarks(c, o.topic, p, 10.0)
            if marks is None:
                raise BrokerUnavailableError(
                    f"{where(o.topic, p)}: the broker did not give its offsets.")
            low, high = marks
            if p in times:
                first = times[p]
            elif isinstance(o.start, dict):
                first = o.start.get(p, low)
                if not low <= first <= high:
                    raise OffsetsOutOfRangeError(
                        f"{where(o.topic, p, first)}: `start` asks for offset "
                        f"{first}, but the partition holds [{low}, {high}).")
            else:
                first = low if o.start == "earliest" else high
            start[p] = first
            out[p] = PartitionPosition(first, end=end_of(o, p, high))
        closed = None if start_window is None else start_window - 1
        logger.info("%s: a new run reads partitions %s from %s%s", o.topic, parts, start,
                    "" if o.end_offsets is None else
                    f" to {({p: v.end for p, v in out.items()})}")
        return SourceState(out, closed)
    finally:
        c.close()


def end_of(o: KafkaSourceOptions, partition: int, high: int) -> int | None:
    """Where the source's ``end_offsets`` ends ``partition`` (``high``: its log end now)."""
    if o.end_offsets == "log_end":
        return high
    if isinstance(o.end_offsets, dict):
        return o.end_offsets.get(partition)
    return None


def saved_end_offsets(o: KafkaSourceOptions) -> Any:
    """``end_offsets`` as a checkpoint keeps it (JSON: partitions as strings)."""
    ends = o.end_offsets
    return {str(p): v for p, v in sorted(ends.items())} if isinstance(ends, dict) else ends


def ends_now(o: KafkaSourceOptions, partitions: list[int],
             settings: dict[str, Any]) -> dict[int, int | None]:
    """A resumed run's end offsets when its ``end_offsets`` differs from the checkpoint's run
    (rank 0 asks the broker for ``"log_end"``): the run's own setting applies, not the
    first run's."""
    if o.end_offsets != "log_end":
        return {p: end_of(o, p, 0) for p in partitions}
    c = Consumer(settings)
    try:
        out: dict[int, int | None] = {}
        for p in partitions:
            marks = watermarks(c, o.topic, p, 10.0)
            if marks is None:
                raise BrokerUnavailableError(
                    f"{where(o.topic, p)}: the broker did not give its offsets (for "
                    "end_offsets='log_end').")
            out[p] = marks[1]
        return out
    finally:
        c.close()


def lost_early_rows(st: SourceState, topic: str,
                settings: dict[str, Any]) -> dict[int, list[int]] | None:
    """At a resume with ``on_out_of_range="skip"`` (rank 0 asks the broker): per partition,
    the windows whose rows read early (kept by offset in the checkpoint, before ``frontier``)
    retention has (partly) deleted since. None when the broker does not say."""
    c = Consumer(settings)
    try:
        out = {}
        for p, v in st.partitions.items():
            if not v.deferred:
                continue
            marks = watermarks(c, topic, p, 10.0)
            if marks is None:
                return None
            gone = [w for w, (first, _) in v.deferred.items() if first < marks[0]]
            if gone:
                out[p] = gone
        return out
    finally:
        c.close()
