"""Kafka topics for the tests: rows of the examples' schema with an event time, produced to a
broker (librdkafka's mock cluster in its own process, ``recsys_trainer.data.kafka.mock_broker``)
as JSON or Arrow messages."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Producer

T0 = 1_790_000_000.0
"""Event time of the tests' first window (a multiple of every window length used)."""


def rows_table(kind: str, windows: int, rows: int, window_s: float, seed: int = 0) -> pa.Table:
    """``windows`` windows of ``rows`` rows of serving_utils' ``kind`` schema (``row_id``
    unique), each row with an event time ``ts`` inside its window (in order within a window)."""
    import tempfile

    import serving_utils as su

    with tempfile.TemporaryDirectory() as d:
        files = su.write_data(d, kind, hours=windows, rows=rows, seed=seed)
        tables = [pq.read_table(f) for f in files]
    out = []
    rng = np.random.default_rng(seed)
    for w, t in enumerate(tables):
        ts = T0 + w * window_s + np.sort(rng.uniform(0, window_s * 0.999, t.num_rows))
        out.append(t.append_column("ts", pa.array(ts)))
    return pa.concat_tables(out)


def produce(bootstrap: str, topic: str, table: pa.Table, *, partitions: int,
            fmt: str = "json", rows_per_message: int = 1, time_column: str = "ts",
            schema_in_message: bool = True) -> None:
    """Produce ``table``'s rows, in order, round-robin over ``partitions``: one JSON object per
    message, or Arrow IPC messages of ``rows_per_message`` rows (a stream with its schema, or a
    bare record batch); the message timestamp is the (first) row's event time."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "queue.buffering.max.messages": 1_000_000})
    n = 0
    for i in range(0, table.num_rows, rows_per_message):
        chunk = table.slice(i, rows_per_message)
        ts_ms = int(1000 * chunk.column(time_column)[0].as_py())
        p.produce(topic, encode(chunk, fmt, schema_in_message), partition=n % partitions,
                  timestamp=ts_ms)
        n += 1
        if n % 5000 == 0:
            p.flush(30)
    left = p.flush(30)
    assert left == 0, f"{left} messages not delivered"


def encode(chunk: pa.Table, fmt: str, schema_in_message: bool = True) -> bytes:
    if fmt == "json":
        (row,) = chunk.to_pylist()
        return json.dumps(row).encode()
    if schema_in_message:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, chunk.schema) as w:
            w.write_table(chunk)
        return bytes(sink.getvalue())
    (batch,) = chunk.combine_chunks().to_batches()
    return bytes(batch.serialize())


def send(bootstrap: str, topic: str, values: list[tuple[int, bytes, float]]) -> None:
    """Produce raw ``(partition, value, event time)`` messages."""
    p = Producer({"bootstrap.servers": bootstrap})
    for partition, value, t in values:
        p.produce(topic, value, partition=partition, timestamp=int(1000 * t))
    assert p.flush(30) == 0


def source_options(bootstrap: str, topic: str, **over: Any) -> dict[str, Any]:
    """The tests' usual source settings: windows of 10 s of the ``ts`` column, ended by the
    log's end, idle partitions after 1 s."""
    opts: dict[str, Any] = {"bootstrap_servers": bootstrap, "topic": topic, "time_column": "ts",
                            "window_s": 10.0, "batch_size": 16, "end_offsets": "log_end",
                            "idle_timeout_s": 1.0, "poll_interval_s": 0.05,
                            "broker_timeout_s": 30.0}
    opts.update(over)
    return opts


def all_row_ids(table: pa.Table) -> list[int]:
    return sorted(table.column("row_id").to_pylist())


def env_with_repo() -> dict[str, str]:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": repo}
