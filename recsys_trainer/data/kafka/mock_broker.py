"""A Kafka broker for tests, examples and benchmarks: librdkafka's mock cluster, in a process.

    python -m recsys_trainer.data.kafka.mock_broker --topic clicks --partitions 4 \\
        [--address-file FILE] [--control]

librdkafka (inside the ``confluent-kafka`` wheel) holds a mock cluster that speaks the Kafka
wire protocol: producers and consumers in other processes connect to it as to a broker. This
module starts one (through librdkafka's C API, ``rdkafka_mock.h``, with ``ctypes``), creates
the topics asked for, prints ``BOOTSTRAP host:port`` (and writes the address to
``--address-file``), and runs until it is stopped (SIGTERM, SIGINT; with ``--control``, also
when its stdin closes). The log lives in this process's memory: stopping it loses every
message.

With ``--control`` it reads commands on stdin, one a line, and answers ``ok ...`` or
``error ...`` on stdout: ``create TOPIC PARTITIONS``, ``down`` / ``up`` (the broker refuses
connections and drops the open ones / accepts them again: an outage),
``delete_records TOPIC PARTITION OFFSET`` (what retention does), ``delete_topic TOPIC``.

What the mock does and does not do is listed in docs/kafka.md. ``MockBroker`` starts and stops
such a process (stopped by its pid).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Any

import confluent_kafka


def _library() -> ctypes.CDLL:
    """librdkafka as the confluent-kafka wheel ships it (or the system's, for a source build)."""
    here = os.path.dirname(os.path.abspath(confluent_kafka.__file__))
    found = sorted(glob.glob(os.path.join(here, os.pardir, "confluent_kafka.libs",
                                          "librdkafka*.so*")))
    lib = ctypes.CDLL(found[0] if found else "librdkafka.so.1")
    vp, cp, i32, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int64
    sigs: dict[str, tuple[Any, list[Any]]] = {
        "rd_kafka_conf_new": (vp, []),
        "rd_kafka_conf_set": (ctypes.c_int, [vp, cp, cp, cp, ctypes.c_size_t]),
        "rd_kafka_new": (vp, [ctypes.c_int, vp, cp, ctypes.c_size_t]),
        "rd_kafka_mock_cluster_new": (vp, [vp, ctypes.c_int]),
        "rd_kafka_mock_cluster_bootstraps": (cp, [vp]),
        "rd_kafka_mock_topic_create": (ctypes.c_int, [vp, cp, ctypes.c_int, ctypes.c_int]),
        "rd_kafka_mock_topic_delete": (ctypes.c_int, [vp, cp]),
        "rd_kafka_mock_partition_delete_records": (ctypes.c_int, [vp, cp, i32, i64]),
        "rd_kafka_mock_broker_set_down": (ctypes.c_int, [vp, i32]),
        "rd_kafka_mock_broker_set_up": (ctypes.c_int, [vp, i32]),
        "rd_kafka_err2str": (cp, [ctypes.c_int]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class _Cluster:
    def __init__(self) -> None:
        self.lib = lib = _library()
        err = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        lib.rd_kafka_conf_set(conf, b"log_level", b"2", err, 512)  # no "no bootstrap" notice
        self.rk = lib.rd_kafka_new(0, conf, err, 512)  # a producer handle hosts the cluster
        if not self.rk:
            raise RuntimeError(f"librdkafka: {err.value.decode()}")
        self.mc = lib.rd_kafka_mock_cluster_new(self.rk, 1)
        if not self.mc:
            raise RuntimeError("librdkafka could not create a mock cluster")
        self.bootstrap = lib.rd_kafka_mock_cluster_bootstraps(self.mc).decode()

    def _check(self, code: int) -> str:
        if code:
            raise RuntimeError(self.lib.rd_kafka_err2str(code).decode())
        return "ok"

    def run(self, line: str) -> str:
        cmd, *args = line.split()
        lib, mc = self.lib, self.mc
        if cmd == "create":
            return self._check(lib.rd_kafka_mock_topic_create(mc, args[0].encode(),
                                                               int(args[1]), 1))
        if cmd == "delete_topic":
            return self._check(lib.rd_kafka_mock_topic_delete(mc, args[0].encode()))
        if cmd == "delete_records":
            return self._check(lib.rd_kafka_mock_partition_delete_records(
                mc, args[0].encode(), int(args[1]), int(args[2])))
        if cmd == "down":
            return self._check(lib.rd_kafka_mock_broker_set_down(mc, -1))
        if cmd == "up":
            return self._check(lib.rd_kafka_mock_broker_set_up(mc, -1))
        raise ValueError(f"unknown command {cmd!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topic", action="append", default=[],
                   help="a topic to create (repeat for more)")
    p.add_argument("--partitions", type=int, default=4, help="partitions of each --topic")
    p.add_argument("--address-file", help="also write the bootstrap address here")
    p.add_argument("--control", action="store_true",
                   help="read commands on stdin (and stop when it closes)")
    args = p.parse_args(argv)
    cluster = _Cluster()
    for t in args.topic:
        cluster.run(f"create {t} {args.partitions}")
    if args.address_file:
        tmp = args.address_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(cluster.bootstrap + "\n")
        os.replace(tmp, args.address_file)
    print(f"BOOTSTRAP {cluster.bootstrap}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.control:
        def serve() -> None:
            for line in sys.stdin:
                if not line.strip():
                    continue
                try:
                    answer = f"ok {line.strip()}" if cluster.run(line) == "ok" else ""
                except Exception as exc:  # noqa: BLE001 - answered to the caller
                    answer = f"error {type(exc).__name__}: {exc}"
                print(answer, flush=True)
            stop.set()

        threading.Thread(target=serve, daemon=True).start()
    while not stop.wait(0.5):
        pass


class MockBroker:
    """A mock broker process (``python -m recsys_trainer.data.kafka.mock_broker --control``):
    ``bootstrap`` is its address; ``command`` sends a control command and returns the answer;
    ``stop`` ends it by its pid."""

    def __init__(self, topics: dict[str, int] | None = None, *, log: IO[str] | None = None,
                 timeout_s: float = 30.0) -> None:
        cmd = [sys.executable, "-m", "recsys_trainer.data.kafka.mock_broker", "--control"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log if log is not None else subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        self._lock = threading.Lock()
        line = self._read(timeout_s)
        if not line.startswith("BOOTSTRAP "):
            self.stop()
            raise RuntimeError(f"the mock broker did not start: {line!r}")
        self.bootstrap = line.split()[1]
        for topic, partitions in (topics or {}).items():
            self.command(f"create {topic} {partitions}")

    def _read(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()),  # type: ignore[union-attr]
                             daemon=True)
        t.start()
        t.join(timeout_s)
        if not box:
            raise TimeoutError(f"the mock broker (pid {self.proc.pid}) did not answer in "
                               f"{timeout_s:g} s")
        return box[0].strip()

    def command(self, line: str, timeout_s: float = 10.0) -> str:
        """Run a control command (see the module docstring); raises on ``error ...``."""
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            answer = self._read(timeout_s)
        if not answer.startswith("ok"):
            raise RuntimeError(f"mock broker: {line!r}: {answer}")
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def __enter__(self) -> MockBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()
