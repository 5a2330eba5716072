"""``KafkaSourceOptions``: how ``KafkaWindowDataset`` reads a topic, windows it and batches it
(its keyword arguments; also the fields of the CLI's ``data: kind: kafka`` section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

from recsys_trainer.validation import check_choice, check_int, check_number, check_type, fail


@dataclass(kw_only=True)
class KafkaSourceOptions:
    """How a Kafka topic becomes windows of batches (see docs/kafka.md)."""

    bootstrap_servers: str
    """The brokers (``host:port,host:port``)."""
    topic: str
    """The topic to train from."""
    partitions: list[int] | None = None
    """The partitions to read (None: all of the topic's, and partitions added later too)."""
    format: Literal["json", "arrow"] = "json"
    """``"json"`` (one object per message) or ``"arrow"`` (Arrow IPC); a ``decoder`` callable
    (Python API) replaces it."""
    schema: dict[str, str] | None = None
    """Column types (``{column: type}``, pyarrow's names: ``int64``, ``double``, ``string``,
    ``list<item: int64>``...): for ``"arrow"``, the schema of bare record batch messages (given
    once instead of in every message); for ``"json"``, the types to parse as."""
    time_column: str | None = None
    """The column of each row's event time (timestamps, or numbers in ``time_unit``s since the
    epoch); None: the message's timestamp."""
    time_unit: Literal["s", "ms", "us", "ns"] = "s"
    window_s: float = 60.0
    """Window length in seconds of event time (windows are aligned to the epoch)."""
    allowed_lateness_s: float = 0.0
    """A window closes once every partition's watermark (its largest event time read) is this
    far past its end."""
    max_event_ahead_s: float | None = 3600.0
    """A row whose event time is more than this past its message's timestamp (a clock far
    ahead) takes the message's timestamp instead (counted: ``KafkaStats.ahead_of_message``;
    logged): one such row would hold its partition's later rows back until event time caught
    up with it. None: event times as they are."""
    late_rows: Literal["train", "drop"] = "train"
    """A row whose window had closed when it was read: trained in the window open then, or
    dropped; counted either way."""
    idle_timeout_s: float = 30.0
    """A partition read to its end that has had no message for this long holds no window open
    (logged); 0 < it."""
    start: Literal["earliest", "latest"] | dict[int, int] = "earliest"
    """Where a new run starts reading: each partition's first or next offset, or
    ``{partition: offset}``. A resumed run reads from its checkpoint's offsets."""
    start_time: float | None = None
    """A new run's first window is the one holding this event time (unix seconds); earlier rows
    are skipped and counted. The read starts at the offset the broker's time index gives for it
    (less ``allowed_lateness_s``), else at ``start``."""
    end_time: float | None = None
    """The stream ends after the last window starting before this event time (unix s)."""
    end_offsets: Literal["log_end"] | dict[int, int] | None = None
    """The stream ends at these offsets (``"log_end"``: each partition's end when the run
    starts); None: no end. A resumed run keeps its checkpoint's ends when this is what that
    run had (one job through its restarts), else its own apply from the resume."""
    batch_size: int = 512
    """Rows per batch (per rank)."""
    prefetch_batches: int = 4
    """Decoded batches read ahead on a background thread (0: no thread)."""
    on_corrupt: Literal["error", "skip"] = "error"
    """A message that cannot be decoded: stop with a ``DataError`` naming it, or skip it
    (counted; its offset and first bytes go to ``dead_letter_dir``)."""
    dead_letter_dir: str | None = None
    """Where skipped messages are recorded (``<topic>.<partition>.jsonl``); needed with
    ``on_corrupt="skip"``."""
    on_out_of_range: Literal["error", "skip"] = "error"
    """Offsets the job must read that retention deleted first: stop with
    ``OffsetsOutOfRangeError``, or go on from the log's start counting the lost messages."""
    broker_timeout_s: float = 300.0
    """How long the job waits for an unreachable broker before ``BrokerUnavailableError``."""
    poll_interval_s: float = 0.1
    """While waiting for a window to close, how often the ranks agree on the partitions'
    progress (one small all-gather)."""
    commit_group: str | None = None
    """Also commit the offsets of trained windows to this consumer group (for lag monitoring;
    the checkpoint's offsets stay the truth)."""
    consumer_config: dict[str, Any] = field(default_factory=dict)
    """More librdkafka settings for every consumer (security, SASL, timeouts); the settings
    the source owns (``OWNED_CONSUMER_SETTINGS``: its offsets, its group, the ends of
    partitions) are refused by name."""
    cache_mb: float = 512.0
    """Decoded rows a rank keeps from its own partitions for training (beyond: read again)."""
    max_windows_ahead: int = 2
    """A partition pauses once its watermark is this many windows past the last window
    closed (windows close when training asks for the next one): memory stays bounded when
    training falls behind the log."""

    def __post_init__(self) -> None:
        check_type("bootstrap_servers", self.bootstrap_servers, (str,), "a host:port list")
        if not self.bootstrap_servers:
            fail("bootstrap_servers", "a host:port list", self.bootstrap_servers)
        check_type("topic", self.topic, (str,), "a topic name")
        if not self.topic:
            fail("topic", "a topic name", self.topic)
        if self.partitions is not None and (
                not isinstance(self.partitions, list) or not self.partitions
                or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0
                           for p in self.partitions)
                or len(set(self.partitions)) != len(self.partitions)):
            fail("partitions", "a list of distinct partition numbers or None", self.partitions)
        check_choice("format", self.format, ("json", "arrow"))
        self.arrow_schema()
        check_choice("time_unit", self.time_unit, ("s", "ms", "us", "ns"))
        check_number("window_s", self.window_s, above=0)
        check_number("allowed_lateness_s", self.allowed_lateness_s, at_least=0)
        check_number("max_event_ahead_s", self.max_event_ahead_s, at_least=0, allow_none=True)
        check_choice("late_rows", self.late_rows, ("train", "drop"))
        check_number("idle_timeout_s", self.idle_timeout_s, above=0)
        if not (self.start in ("earliest", "latest") or (
                isinstance(self.start, dict) and all(
                    isinstance(k, int) and isinstance(v, int) and v >= 0
                    for k, v in self.start.items()))):
            fail("start", "'earliest', 'latest' or {partition: offset}", self.start)
        check_number("start_time", self.start_time, at_least=0, allow_none=True)
        check_number("end_time", self.end_time, above=0, allow_none=True)
        if self.start_time is not None and self.end_time is not None \
                and self.end_time <= self.start_time:
            fail("end_time", f"after start_time ({self.start_time})", self.end_time)
        if not (self.end_offsets is None or self.end_offsets == "log_end" or (
                isinstance(self.end_offsets, dict) and all(
                    isinstance(k, int) and isinstance(v, int) and v >= 0
                    for k, v in self.end_offsets.items()))):
            fail("end_offsets", "None, 'log_end' or {partition: offset}", self.end_offsets)
        check_int("batch_size", self.batch_size)
        check_int("prefetch_batches", self.prefetch_batches, minimum=0)
        check_choice("on_corrupt", self.on_corrupt, ("error", "skip"))
        if self.on_corrupt == "skip" and not self.dead_letter_dir:
            fail("dead_letter_dir", "a directory with on_corrupt='skip' (skipped messages are "
                 "recorded there)", self.dead_letter_dir)
        check_choice("on_out_of_range", self.on_out_of_range, ("error", "skip"))
        check_number("broker_timeout_s", self.broker_timeout_s, above=0)
        check_number("poll_interval_s", self.poll_interval_s, above=0)
        check_type("consumer_config", self.consumer_config, (dict,), "a mapping of settings")
        owned = sorted(set(self.consumer_config) & set(OWNED_CONSUMER_SETTINGS))
        if owned:
            key = owned[0]
            raise ValueError(
                f"`consumer_config` sets {key!r}={self.consumer_config[key]!r}, a setting the "
                f"Kafka source owns: {OWNED_CONSUMER_SETTINGS[key]} Remove it.")
        check_number("cache_mb", self.cache_mb, at_least=0)
        check_int("max_windows_ahead", self.max_windows_ahead)

    def arrow_schema(self) -> pa.Schema | None:
        """``schema`` as a ``pyarrow.Schema`` (None when not given)."""
        if self.schema is None:
            return None
        if not isinstance(self.schema, dict) or not self.schema:
            fail("schema", "a mapping {column: type name}", self.schema)
        fields = []
        for name, type_name in self.schema.items():
            try:
                fields.append(pa.field(name, _type(type_name)))
            except (ValueError, TypeError, KeyError):
                fail(f"schema.{name}", "a pyarrow type name (int64, double, string, "
                     "list<item: int64>, timestamp[ms], ...)", type_name)
        return pa.schema(fields)

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint's offsets and windows depend on: a resume with other values fails
        naming the field instead of reading other rows."""
        return {"topic": self.topic, "partitions": self.partitions, "window_s": self.window_s,
                "allowed_lateness_s": self.allowed_lateness_s, "late_rows": self.late_rows,
                "time_column": self.time_column, "time_unit": self.time_unit,
                "max_event_ahead_s": self.max_event_ahead_s,
                "start_time": self.start_time, "batch_size": self.batch_size}


OWNED_CONSUMER_SETTINGS: dict[str, str] = {
    "bootstrap.servers": "it is `bootstrap_servers`.",
    "metadata.broker.list": "it is `bootstrap_servers`.",
    "group.id": "every consumer reads by assignment in a group of its own (the checkpoint "
                "holds the offsets); `commit_group` commits the trained offsets to a group.",
    "enable.auto.commit": "offsets are committed only by `commit_group`, once their rows are "
                          "trained (the checkpoint stays the truth).",
    "auto.commit.enable": "offsets are committed only by `commit_group`, once their rows are "
                          "trained (the checkpoint stays the truth).",
    "enable.auto.offset.store": "offsets are committed only by `commit_group`.",
    "auto.offset.reset": "an offset out of range is never skipped silently: "
                         "`on_out_of_range` names it or skips and counts the lost messages.",
    "enable.partition.eof": "the end of a partition is how it is found idle.",
    "allow.auto.create.topics": "reading never creates a topic (a missing one is named).",
}
"""librdkafka settings ``consumer_config`` may not change, and why: with them changed, rows
could be skipped or committed without a trace in the checkpoint."""


def _type(name: Any) -> pa.DataType:
    if isinstance(name, pa.DataType):
        return name
    if not isinstance(name, str):
        raise TypeError(name)
    name = name.strip()
    if name.startswith("list<") and name.endswith(">"):
        inner = name[5:-1].split(":", 1)[-1]
        return pa.list_(_type(inner))
    if name.startswith("timestamp[") and name.endswith("]"):
        return pa.timestamp(name[10:-1])
    return pa.type_for_alias(name)
