"""bench_freshness's log mode (``--source log``): freshness from an event to the served score when
the job trains from a Kafka topic.

    python benchmarks/bench_freshness.py --source log [--seconds 60] [--rows-per-s 1000]
        [--window-s 1] [--lateness-s 0.25] [--ranks 2] [--json OUT]

Real processes on 127.0.0.1:

* a **broker**: librdkafka's mock cluster (``recsys_trainer.data.kafka.mock_broker``), a topic
  of 4 partitions;
* a **producer** (``recsys_trainer.data.generators.kafka_producer``): ``--rows-per-s`` Criteo
  rows a second, one JSON message each, spread evenly over each second, each stamped with the
  time it is sent (its event time ``ts``, and the message timestamp);
* a **training job** under ``torchrun --nproc_per_node=--ranks``: ``KafkaWindowDataset``
  (windows of ``--window-s`` s of ``ts``, closing ``--lateness-s`` after their end), the example
  DLRM, ``PublishHook(every_n_event_seconds=--window-s)`` to a local directory (a base, then
  deltas);
* **recsys-serve** following that directory (``--poll-s``).

**F** (event to served) for a row produced at ``t``: the server's swap time (``loaded_at``,
from ``GET /model``, polled every 0.2 s) of the first served state whose window (the pointer's
``window_time``: the end of the newest trained window, in event time) reaches the end of the
row's window, minus ``t``. Rows are produced at a constant rate, so each second's rows are
taken at even times between its first and last send (the producer's ``--stats``). Reported:
the median and p95 of F over the rows produced after the first model was served (earlier ones
wait for the job's start-up), the loop's blocked time per publish (``PublishRecord.blocked_s``)
and the host's load.

**The reader** (first): the same rows (``--reader-rows``, their event times spread over the
last minute) as a topic of JSON messages (one row each), a topic of Arrow IPC messages (256 rows
each), both of 16 partitions, and a parquet file (one window); each of ``--ranks`` ranks reads
its share of every window through ``KafkaWindowDataset`` (windows of 5 s) and through
``ParquetWindowDataset`` (decoded batches, the same ``FeatureSpec``); rows per second per rank,
measured from the first ``window_ids()`` (for Kafka: listing the topic, reading, closing the
first window) to the last batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TOPIC = "clicks"


def worker(a: argparse.Namespace) -> None:
    """One rank of the training job (under torchrun)."""
    import logging
    import warnings

    import torch

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.data.generators.criteo_synthetic import SPARSE_COLUMNS
    from recsys_trainer.data.generators.stream_writer import stream_features
    from recsys_trainer.data.kafka import KafkaWindowDataset
    from recsys_trainer.hooks.lambda_hook import LambdaHook
    from recsys_trainer.hooks.publish import PublishHook
    from recsys_trainer.models import DLRMClassifier

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank %(process)d] %(name)s: "
                        "%(message)s")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    torch.manual_seed(0)
    spec = stream_features(a.num_embeddings)
    model = DLRMClassifier(SPARSE_COLUMNS, 13, a.num_embeddings, 16, dense_arch=(64, 16),
                           over_arch=(64, 32, 1))
    ds = KafkaWindowDataset(spec, bootstrap_servers=a.bootstrap, topic=TOPIC, time_column="ts",
                            window_s=a.window_s, allowed_lateness_s=a.lateness_s,
                            start="latest", end_time=a.end_time, batch_size=a.batch_size,
                            poll_interval_s=0.02, idle_timeout_s=5.0,
                            # The mock broker keeps about 4 MB a partition: a job that falls
                            # that far behind loses messages (counted) rather than stopping.
                            on_out_of_range="skip")
    hook = PublishHook(a.published, every_n_event_seconds=a.window_s, full_every=a.full_every,
                       keep_bases=2)
    ended: dict[str, float] = {}

    def ready(trainer: Trainer) -> None:
        if trainer.rank == 0:
            open(a.out + ".ready", "w").close()

    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=a.ckpt, log_steps=10**6, seed=0, max_to_keep=3),
        train_dataset=ds, add_logger_hook=False,
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        hooks=[hook, LambdaHook(before_train=ready,
                                after_window=lambda t, w: ended.setdefault(w, time.time()))])
    trainer.train()
    if trainer.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"records": [r.__dict__ for r in hook.records], "window_end": ended,
                       "steps": trainer.state.global_step, "stats": ds.stats.__dict__}, f)
    from recsys_trainer.distributed import shutdown

    shutdown()


def reader(a: argparse.Namespace) -> None:
    """One rank of the reader comparison (under torchrun): rows/s of its share, each source."""
    import torch.distributed as dist

    from recsys_trainer.data.generators.stream_writer import stream_features
    from recsys_trainer.data.kafka import KafkaWindowDataset
    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.distributed import ProcessGroupGang

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gang = ProcessGroupGang()
    spec = stream_features(a.num_embeddings)
    out: dict[str, Any] = {}
    for name in ("parquet", "kafka", "kafka_arrow"):
        if name.startswith("kafka"):
            arrow = name == "kafka_arrow"
            ds: Any = KafkaWindowDataset(spec, bootstrap_servers=a.bootstrap,
                                         topic="reader_arrow" if arrow else "reader",
                                         format="arrow" if arrow else "json",
                                         time_column="ts", window_s=5.0,
                                         end_offsets="log_end", batch_size=a.batch_size)
        else:
            ds = ParquetWindowDataset([a.parquet], spec, batch_size=a.batch_size)
        ds.setup(rank, world)
        ds.set_gang(gang)
        gang.barrier()
        t0 = time.perf_counter()
        rows = 0
        first: float | None = None
        for wid in ds.window_ids():
            for batch in ds.iter_window(wid):
                first = first or time.perf_counter()
                rows += batch.batch_size
        end = time.perf_counter()
        out[name] = {"rows": rows, "seconds": end - t0, "rows_per_s": rows / (end - t0),
                     "after_first_batch_rows_per_s": rows / (end - first) if first else None}
        if name.startswith("kafka"):
            ds.close()
    got = gang.all_gather_object(out)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()


def _served_for(states: list[dict[str, Any]], end: float) -> float | None:
    """When the first served state reflecting the window that ends at ``end`` was swapped in."""
    for s in states:
        if s.get("window_time") is not None and s["window_time"] >= end - 1e-6:
            return float(s["loaded_at"])
    return None


def run(a: argparse.Namespace, bench: Any) -> dict[str, Any]:
    """The log mode's run (``bench`` is bench_freshness: its Monitor and process helpers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recsys_trainer.data.kafka.mock_broker import MockBroker

    work = a.workdir or tempfile.mkdtemp(prefix="bench_freshness_log_")
    os.makedirs(work, exist_ok=True)
    print(f"work dir: {work}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": REPO}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[Any] = []
    monitor: Any = None
    broker = MockBroker({TOPIC: 4, "reader": 16, "reader_arrow": 16}, log=open(os.path.join(work, "broker.log"), "w"))  # noqa: SIM115
    try:
        def start(name: str, argv: list[str]) -> None:
            log = open(os.path.join(work, f"{name}.log"), "wb")  # noqa: SIM115
            logs.append(log)
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           cwd=REPO, start_new_session=True)

        def torchrun(name: str, mode: str, extra: list[str]) -> None:
            start(name, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc_per_node={a.ranks}", os.path.join(HERE, "bench_freshness.py"),
                         mode, "--source", "log", "--bootstrap", broker.bootstrap,
                         "--num-embeddings", str(a.num_embeddings),
                         "--batch-size", str(a.batch_size), *extra])

        # 1. The reader: the same rows from the topic and from a parquet file.
        from recsys_trainer.data.generators.stream_writer import StreamConfig, StreamWriter

        table, _ = StreamWriter(".", StreamConfig(rows_per_window=a.reader_rows)).generate(0)
        table = table.append_column("ts", pa.array(
            np.linspace(time.time() - 60, time.time() - 1, table.num_rows)))
        parquet = os.path.join(work, "reader.parquet")
        pq.write_table(table, parquet, row_group_size=16384)
        from confluent_kafka import Producer

        from recsys_trainer.data.generators.kafka_producer import encode

        p = Producer({"bootstrap.servers": broker.bootstrap, "linger.ms": 20,
                      "queue.buffering.max.messages": 2_000_000})
        for i, value in enumerate(encode(table, "json")):
            p.produce("reader", value, partition=i % 16)
            if i % 50_000 == 0:
                p.poll(0)
        for i, start_row in enumerate(range(0, table.num_rows, 256)):  # Arrow: 256 rows each
            for value in encode(table.slice(start_row, 256), "arrow"):
                p.produce("reader_arrow", value, partition=i % 16)
        p.flush(60)
        reader_out = os.path.join(work, "reader.json")
        torchrun("reader", "--reader", ["--parquet", parquet, "--out", reader_out])
        if procs["reader"].wait(timeout=600) != 0:
            raise RuntimeError(f"the reader run failed; see {work}/reader.log")
        with open(reader_out) as f:
            read = json.load(f)
        print(f"reader: {read}", flush=True)

        # 2. Freshness: produce continuously, train, publish, serve.
        port = bench._free_port()
        url = f"http://127.0.0.1:{port}"
        published = os.path.join(work, "published")
        train_out = os.path.join(work, "train.json")
        end_time = time.time() + a.warmup_s + a.seconds
        torchrun("train", "--worker", [
            "--published", published, "--ckpt", os.path.join(work, "ckpt"), "--out", train_out,
            "--full-every", str(a.full_every), "--window-s", str(a.window_s),
            "--lateness-s", str(a.lateness_s), "--end-time", str(end_time)])
        start("serve", [os.path.join(os.path.dirname(sys.executable), "recsys-serve"), published,
                        "--port", str(port), "--poll-s", str(a.poll_s), "--log-level", "info"])
        stats_file = os.path.join(work, "producer.json")
        start("producer", [sys.executable, "-m", "recsys_trainer.data.generators.kafka_producer",
                           "--bootstrap-servers", broker.bootstrap, "--topic", TOPIC,
                           "--rows-per-s", str(a.rows_per_s), "--stats", stats_file,
                           "--seconds", str(a.warmup_s + a.seconds + 3 * a.window_s + 5)])
        monitor = bench.Monitor(url)
        monitor.start()
        deadline = time.time() + a.warmup_s + a.seconds + a.drain_timeout_s
        while procs["train"].poll() is None and time.time() < deadline:
            for name in ("serve", "producer"):
                if procs[name].poll() not in (None, 0):
                    raise RuntimeError(f"{name} exited; see {work}/{name}.log")
            time.sleep(0.5)
        time.sleep(3 * a.poll_s + 1)
        monitor.stop.set()
        monitor.join(5)
        bench._stop(procs.get("producer"))
        procs["producer"].wait(60)
        if procs["train"].poll() != 0:
            raise RuntimeError(f"the training job failed ({procs['train'].poll()}); see "
                               f"{work}/train.log")
        with open(train_out) as f:
            train = json.load(f)
        with open(stats_file) as f:
            seconds = json.load(f)
        return summarize(a, monitor, train, seconds, read, end_time)
    finally:
        if monitor is not None:
            monitor.stop.set()
        for name in ("producer", "serve", "train", "reader"):
            bench._stop(procs.get(name))
        for log in logs:
            log.close()
        broker.stop()
        if a.workdir is None and not a.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def summarize(a: argparse.Namespace, monitor: Any, train: dict[str, Any],
              seconds: list[dict[str, Any]], read: list[dict[str, Any]],
              end_time: float) -> dict[str, Any]:
    states = sorted(monitor.states.values(), key=lambda s: s["loaded_at"])
    first_served = states[0]["loaded_at"] if states else None
    f_all: list[np.ndarray] = []
    for s in seconds:
        if s["first_ts"] is None or first_served is None:
            continue
        ts = np.linspace(s["first_ts"], s["last_ts"], s["rows"])
        ts = ts[(ts >= first_served) & (ts < end_time)]
        if not len(ts):
            continue
        ends = (np.floor(ts / a.window_s) + 1) * a.window_s
        for end in np.unique(ends):
            served = _served_for(states, float(end))
            if served is not None:
                f_all.append(served - ts[ends == end])
    f = np.concatenate(f_all) if f_all else np.array([])
    recs = [r for r in train.get("records", []) if r["kind"] in ("base", "delta")]
    blocked = [1e3 * r["blocked_s"] for r in recs]
    loads = [x for _, x in monitor.loads]
    per_rank = {name: [r[name]["rows_per_s"] for r in read]
                for name in ("kafka", "kafka_arrow", "parquet")}
    after_first = {name: [r[name]["after_first_batch_rows_per_s"] for r in read]
                   for name in ("kafka", "kafka_arrow", "parquet")}
    return {
        "config": {k: v for k, v in vars(a).items() if k != "json"},
        "host": {"cpus": os.cpu_count(), "load_mean": float(np.mean(loads)) if loads else None,
                 "load_max": max(loads) if loads else None},
        "freshness": {"rows": int(len(f)),
                      "median_s": float(np.median(f)) if len(f) else None,
                      "p95_s": float(np.percentile(f, 95)) if len(f) else None,
                      "max_s": float(f.max()) if len(f) else None},
        "served_states": len(states),
        "publishes": {"n": len(recs), "failed": sum(r["kind"] == "failed"
                                                     for r in train.get("records", [])),
                      "superseded": sum(r["kind"] == "superseded"
                                        for r in train.get("records", [])),
                      "blocked_ms_median": float(np.median(blocked)) if blocked else None,
                      "blocked_ms_max": max(blocked) if blocked else None,
                      "export_upload_s_median": float(np.median([r["seconds"] for r in recs]))
                      if recs else None},
        "source": train.get("stats", {}),
        "steps": train.get("steps"),
        "reader": {"per_rank_rows_per_s": per_rank,
                   "per_rank_rows_per_s_after_the_first_batch": after_first,
                   "kafka_vs_parquet": [k / p for k, p in zip(per_rank["kafka"],
                                                              per_rank["parquet"],
                                                              strict=True)],
                   "kafka_arrow_vs_parquet": [k / p for k, p in zip(
                       per_rank["kafka_arrow"], per_rank["parquet"], strict=True)],
                   "rows": a.reader_rows},
    }


def report(out: dict[str, Any]) -> None:
    c, f, p, r, h = (out["config"], out["freshness"], out["publishes"], out["reader"],
                     out["host"])

    def fmt(x: Any, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    print(f"## Freshness from a Kafka log: event to served score ({c['seconds']:g} s measured, "
          f"{c['rows_per_s']} rows/s, windows of {c['window_s']:g} s + {c['lateness_s']:g} s "
          f"lateness, a publish every {c['window_s']:g} s of event time, {c['ranks']} ranks)")
    print(f"F over {f['rows']} rows: median {fmt(f['median_s'])} s, p95 {fmt(f['p95_s'])} s, "
          f"max {fmt(f['max_s'])} s; {out['served_states']} states served, {p['n']} publishes "
          f"({p['superseded']} superseded, {p['failed']} failed), export+write median "
          f"{fmt(p['export_upload_s_median'])} s; the loop blocked per publish: median "
          f"{fmt(p['blocked_ms_median'], '.1f')} ms, max {fmt(p['blocked_ms_max'], '.1f')} ms")
    kr, pr = r["per_rank_rows_per_s"]["kafka"], r["per_rank_rows_per_s"]["parquet"]
    ka = r["per_rank_rows_per_s"]["kafka_arrow"]
    print(f"reader, {r['rows']} rows on {len(kr)} ranks, rows/s per rank: Kafka, JSON messages "
          f"{', '.join(f'{x:,.0f}' for x in kr)} ({', '.join(f'{x:.2f}x' for x in r['kafka_vs_parquet'])} "
          f"parquet); Kafka, Arrow messages of 256 rows {', '.join(f'{x:,.0f}' for x in ka)} "
          f"({', '.join(f'{x:.2f}x' for x in r['kafka_arrow_vs_parquet'])}); parquet "
          f"{', '.join(f'{x:,.0f}' for x in pr)}")
    print(f"host load mean {fmt(h['load_mean'], '.1f')}, max {fmt(h['load_max'], '.1f')} on "
          f"{h['cpus']} CPUs; source: {out['source']}", flush=True)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--source log")
    g.add_argument("--source", choices=("files", "log"), default="files",
                   help="windows of parquet files on S3 (default), or a Kafka topic")
    g.add_argument("--seconds", type=float, default=60.0, help="log: seconds measured")
    g.add_argument("--warmup-s", type=float, default=40.0,
                   help="log: seconds of production before the measured ones (start-up)")
    g.add_argument("--rows-per-s", type=int, default=1000, help="log: rows produced a second")
    g.add_argument("--window-s", type=float, default=1.0, help="log: window length")
    g.add_argument("--lateness-s", type=float, default=0.25, help="log: allowed lateness")
    g.add_argument("--reader-rows", type=int, default=80_000,
                   help="log: rows of the reader comparison (the mock broker keeps ~4 MB, "
                        "about 6,000 of these rows, a partition; the topics have 16)")
    g.add_argument("--bootstrap", help=argparse.SUPPRESS)
    g.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--parquet", help=argparse.SUPPRESS)
    g.add_argument("--end-time", type=float, help=argparse.SUPPRESS)

