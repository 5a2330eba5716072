"""Produce a Criteo-schema click stream to a Kafka topic, continuously, each row stamped with the
time it is produced (its event time): the log-side twin of ``stream_writer``.

    python -m recsys_trainer.data.generators.kafka_producer --bootstrap-servers HOST:PORT \\
        --topic clicks [--rows-per-s 2000] [--seconds 0] [--format json] [--shift-at-s 60]

Rows come from ``stream_writer``'s generator (the ``criteo_synthetic`` schema and signal, with
its planted change: from ``--shift-at-s`` seconds on, one value of ``C10`` becomes strongly
clicked), a block of ``--rows-per-s`` rows per second, spread evenly over the second and sent as
their time comes, round-robin over the topic's partitions. Each row carries ``ts``, its event
time (unix seconds), which is also the message's timestamp; ``row_id`` numbers the rows.
``--format json`` sends one JSON object per message; ``arrow`` sends Arrow IPC messages of
``--rows-per-message`` rows. ``--seconds 0`` produces until stopped (SIGTERM, SIGINT).

``--stats FILE``: at the end, write each second's row count and first and last event time (for
freshness measurements: benchmarks/bench_freshness.py --source log).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from recsys_trainer.data.generators.stream_writer import StreamConfig, StreamWriter

log = logging.getLogger(__name__)


def encode(rows: pa.Table, fmt: str) -> list[bytes]:
    """``rows`` as messages: one JSON object each, or one Arrow IPC stream message."""
    if fmt == "json":
        return [json.dumps(r).encode() for r in rows.to_pylist()]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as w:
        w.write_table(rows)
    return [bytes(sink.getvalue())]


class ClickProducer:
    """Produces the stream (see the module docstring); ``run()`` until ``stop`` is set."""

    def __init__(self, bootstrap_servers: str, topic: str, *, rows_per_s: int = 2000,
                 fmt: str = "json", rows_per_message: int = 1, shift_at_s: float = 60.0,
                 seed: int = 0, producer_config: dict[str, Any] | None = None) -> None:
        from confluent_kafka import Producer

        if rows_per_s < 1:
            raise ValueError(f"`rows_per_s` must be >= 1, but is {rows_per_s}.")
        if fmt not in ("json", "arrow"):
            raise ValueError(f"`format` must be 'json' or 'arrow', but is {fmt!r}.")
        self.topic, self.rows_per_s, self.fmt = topic, rows_per_s, fmt
        self.rows_per_message = max(1, rows_per_message) if fmt == "arrow" else 1
        # The stream writer's generator: "window" w is second w of this stream.
        self.windows = StreamWriter(".", StreamConfig(rows_per_window=rows_per_s, seed=seed,
                                                      shift_at=int(shift_at_s)))
        self.producer = Producer({"bootstrap.servers": bootstrap_servers, "linger.ms": 5,
                                  "queue.buffering.max.messages": 2_000_000,
                                  **(producer_config or {})})
        md = self.producer.list_topics(topic, timeout=30)
        self.partitions = sorted(md.topics[topic].partitions) if topic in md.topics else []
        if not self.partitions:
            raise RuntimeError(f"topic {topic!r} has no partitions on {bootstrap_servers}")
        self.stop = threading.Event()
        self.stats: list[dict[str, Any]] = []
        self.sent = 0
        self.failed = 0
        """Messages the broker never acknowledged (delivery errors, or still queued when
        ``run`` gave up flushing): produced is ``sent - failed``."""

    def run(self, seconds: float = 0.0) -> None:
        t0 = time.time()
        second = 0
        while not self.stop.is_set() and (seconds <= 0 or second < seconds):
            table, _ = self.windows.generate(second)
            n = table.num_rows
            start = t0 + second
            # Rows spread evenly over the second, stamped when they are sent.
            first, last = None, None
            for i in range(0, n, max(self.rows_per_message, n // 50)):
                chunk = table.slice(i, max(self.rows_per_message, n // 50))
                due = start + i / n
                wait = due - time.time()
                if wait > 0 and self.stop.wait(wait):
                    break
                # JSON rows go to Python once per chunk, not once per message: a 1-row
                # slice, append_column and to_pylist cost ~85 us a row, against ~12 us batched.
                objs = chunk.to_pylist() if self.fmt == "json" else []
                for j in range(0, chunk.num_rows, self.rows_per_message):
                    now = time.time()
                    if self.fmt == "json":
                        objs[j]["ts"] = now
                        values = [json.dumps(objs[j]).encode()]
                    else:
                        rows = chunk.slice(j, self.rows_per_message)
                        values = encode(rows.append_column(
                            "ts", pa.array(np.full(rows.num_rows, now))), self.fmt)
                    for value in values:
                        self.producer.produce(self.topic, value,
                                              partition=self.partitions[
                                                  self.sent % len(self.partitions)],
                                              timestamp=int(now * 1000),
                                              on_delivery=self._delivered)
                        self.sent += 1
                    first = now if first is None else first
                    last = now
                self.producer.poll(0)
            self.stats.append({"second": second, "rows": n, "first_ts": first, "last_ts": last})
            second += 1
        left = self.producer.flush(30)  # runs the delivery callbacks of what was acknowledged
        self.failed += left

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failed += 1
            if self.failed == 1:
                log.warning("a message was not delivered: %s (counted; the summary says how "
                            "many)", err)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--rows-per-s", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=0.0, help="0: until stopped")
    ap.add_argument("--format", choices=("json", "arrow"), default="json")
    ap.add_argument("--rows-per-message", type=int, default=1, help="arrow messages only")
    ap.add_argument("--shift-at-s", type=float, default=60.0,
                    help="seconds until the planted value becomes strongly clicked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stats", help="write each second's rows and event times here (JSON)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kafka_producer %(message)s")
    p = ClickProducer(a.bootstrap_servers, a.topic, rows_per_s=a.rows_per_s, fmt=a.format,
                      rows_per_message=a.rows_per_message, shift_at_s=a.shift_at_s, seed=a.seed)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: p.stop.set())
    log.info("producing %d rows/s to %s (%d partitions) as %s", a.rows_per_s, a.topic,
             len(p.partitions), a.format)
    p.run(a.seconds)
    if a.stats:
        with open(a.stats, "w") as f:
            json.dump(p.stats, f)
    if p.failed:
        log.error("%d of %d messages were not delivered to %s", p.failed, p.sent, a.topic)
        raise SystemExit(1)
    log.info("produced %d messages", p.sent)


__all__ = ["ClickProducer", "encode", "main"]


if __name__ == "__main__":
    main()
