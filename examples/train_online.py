"""Online learning: train a DLRM on a stream of windows as they land, publishing the model as it
trains, for ``recsys-serve`` to follow.

    # one command: land a generated stream (a window every 10 s) and train on it, 2 ranks
    torchrun --standalone --nproc_per_node=2 examples/train_online.py --land \\
        --stream /tmp/online/stream --publish /tmp/online/published --output /tmp/online/ckpt
    # the other: serve what is published (docs/online.md)
    recsys-serve /tmp/online/published --port 8080

The source is ``StreamingWindows`` over ``--stream`` (a directory or ``s3://bucket/prefix``):
a window is trained once its ``_SUCCESS`` exists; the job ends at ``STREAM/_END`` (or after
``--timeout-s`` without a new window: an error). ``PublishHook`` publishes to ``--publish`` (a
directory or URL) after every window (``--publish-every``): a base, then deltas, and the
``LATEST`` pointer; checkpoints go to ``--output`` (the same command resumes from the newest
one, e.g. under ``torchrun --max-restarts``).

``--land`` starts the stream writer (``python -m recsys_trainer.data.generators.stream_writer``)
in a background process from rank 0, writing into ``--stream``: ``--windows`` windows (0: until
the job is stopped), one every ``--every-s`` seconds, of ``--rows-per-window`` rows, with the
planted change from window ``--shift-at`` on (one item becomes strongly clicked; the value is in
``STREAM/_signal.json``). The writer dies with the job; a restarted job's writer continues the
stream where it stopped (the windows are deterministic).

**From a Kafka topic** (``--kafka HOST:PORT``): the windows are ``--window-s`` seconds of the
rows' event time (``ts``) on ``--topic`` (``KafkaWindowDataset``, docs/kafka.md), published
after every ``--window-s`` seconds of event time; ``--produce`` starts the click producer
(``python -m recsys_trainer.data.generators.kafka_producer``: ``--rows-per-s`` rows a second,
stamped as they are sent, the planted change after ``--shift-at-s`` seconds) from rank 0::

    # a broker: librdkafka's mock cluster (or give your brokers' address to --kafka)
    python -m recsys_trainer.data.kafka.mock_broker --topic clicks --partitions 4 \
        --address-file /tmp/online_log/broker
    torchrun --standalone --nproc_per_node=2 examples/train_online.py \
        --kafka "$(cat /tmp/online_log/broker)" --topic clicks --produce \
        --publish /tmp/online_log/published --output /tmp/online_log/ckpt
    recsys-serve /tmp/online_log/published --port 8080

``--seconds N`` ends the run once the event time passes ``N`` seconds after its start (the
producer runs a little longer, to close the last window); 0 runs until stopped.

At the end rank 0 prints the train AUC per window (each batch scored before it is trained on:
progressive validation) and ``train_online: final step S, LATEST sequence Q step S2``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from recsys_trainer import (
    SparseOptimizer,
    Trainer,
    TrainingArguments,
    seed_everything,
    setup_logging,
    shutdown,
)
from recsys_trainer.data.generators.criteo_synthetic import NUM_DENSE, SPARSE_COLUMNS
from recsys_trainer.data.generators.stream_writer import stream_dataset, stream_features
from recsys_trainer.distributed import init_distributed
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.hooks.publish import PublishHook
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.serving import published as pub

log = logging.getLogger("recsys_trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default="output/online/stream",
                   help="the stream's root: a directory or s3://bucket/prefix")
    p.add_argument("--publish", default="output/online/published",
                   help="where to publish the model: a directory or s3://bucket/prefix")
    p.add_argument("--output", default="output/online/ckpt", help="checkpoint directory")
    p.add_argument("--publish-every", type=int, default=1, help="publish every N windows")
    p.add_argument("--full-every", type=int, default=10, help="a new base after N deltas")
    p.add_argument("--keep-bases", type=int, default=3)
    p.add_argument("--poll-s", type=float, default=1.0, help="seconds between stream listings")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="fail after this long without a new window and without STREAM/_END")
    p.add_argument("--batch-size", type=int, default=512, help="rows per rank per step")
    p.add_argument("--num-embeddings", type=int, default=20_000, help="rows per table")
    p.add_argument("--embedding-dim", type=int, default=8)
    p.add_argument("--log-steps", type=int, default=20)
    w = p.add_argument_group("--land: the stream writer started by this job")
    w.add_argument("--land", action="store_true",
                   help="start the stream writer in the background (rank 0), into --stream")
    w.add_argument("--windows", type=int, default=0, help="windows to land (0: until stopped)")
    w.add_argument("--every-s", type=float, default=10.0, help="seconds between windows")
    w.add_argument("--rows-per-window", type=int, default=10_000)
    w.add_argument("--shift-at", type=int, default=3,
                   help="first window where the planted item becomes strongly clicked")
    w.add_argument("--seed", type=int, default=0, help="the stream's seed")
    k = p.add_argument_group("--kafka: train from a Kafka topic instead of --stream")
    k.add_argument("--kafka", metavar="HOST:PORT", help="the brokers (bootstrap servers)")
    k.add_argument("--topic", default="clicks")
    k.add_argument("--window-s", type=float, default=5.0, help="window length (event time)")
    k.add_argument("--lateness-s", type=float, default=1.0,
                   help="a window closes this long (event time) after its end")
    k.add_argument("--seconds", type=float, default=0.0,
                   help="end after this many seconds of event time (0: until stopped)")
    k.add_argument("--produce", action="store_true",
                   help="start the click producer in the background (rank 0)")
    k.add_argument("--rows-per-s", type=int, default=2000, help="the producer's rate")
    k.add_argument("--shift-at-s", type=float, default=30.0,
                   help="the producer's planted change, after this many seconds")
    return p.parse_args(argv)


def _writer_preexec() -> None:
    """In the writer before exec: ignore SIGINT, and get SIGTERM when this process dies (Linux).

    torchrun and a terminal's Ctrl-C signal the whole process group, the writer included. The
    Trainer acts on a preemption signal at its next batch, and a job waiting for the next
    window has none: the writer keeps landing windows, so that the job reaches that batch,
    saves and exits (130); then ``stop_writer`` ends the writer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_writer(a: argparse.Namespace) -> subprocess.Popen[bytes]:
    """The stream writer, in a background process writing into ``--stream``."""
    cmd = [sys.executable, "-m", "recsys_trainer.data.generators.stream_writer", "--out", a.stream,
           "--windows", str(a.windows), "--every-s", str(a.every_s),
           "--rows-per-window", str(a.rows_per_window), "--shift-at", str(a.shift_at),
           "--seed", str(a.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    log.info("starting the stream writer: %s", " ".join(cmd))
    return subprocess.Popen(cmd, env=env, preexec_fn=_writer_preexec)


def start_producer(a: argparse.Namespace) -> subprocess.Popen[bytes]:
    """The click producer, in a background process writing to ``--topic``."""
    cmd = [sys.executable, "-m", "recsys_trainer.data.generators.kafka_producer",
           "--bootstrap-servers", a.kafka, "--topic", a.topic, "--rows-per-s", str(a.rows_per_s),
           "--shift-at-s", str(a.shift_at_s), "--seed", str(a.seed)]
    if a.seconds:  # past the end: the last window closes
        cmd += ["--seconds", str(a.seconds + 2 * a.window_s + a.lateness_s + 5)]
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID")}
    log.info("starting the click producer: %s", " ".join(cmd))
    return subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"},
                            preexec_fn=_writer_preexec)


def stop_writer(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    setup_logging()
    init_distributed()
    rank = int(os.environ.get("RANK", "0"))
    writer = start_writer(a) if a.land and rank == 0 else None
    if a.kafka and a.produce and rank == 0:
        writer = start_producer(a)
    try:
        train(a)
    finally:
        stop_writer(writer)
        shutdown()


def kafka_dataset(a: argparse.Namespace) -> Any:
    """Windows of ``--window-s`` seconds of the rows' event time on ``--topic``: the offsets are
    in this job's checkpoints; a rerun resumes from them."""
    from recsys_trainer.data.kafka import KafkaWindowDataset

    end = [time.time() + a.seconds if a.seconds else None]
    if dist.is_initialized():  # every rank ends at the same window: rank 0's clock decides
        dist.broadcast_object_list(end, src=0)
    return KafkaWindowDataset(stream_features(a.num_embeddings), bootstrap_servers=a.kafka,
                              topic=a.topic, time_column="ts", window_s=a.window_s,
                              allowed_lateness_s=a.lateness_s, start="latest", end_time=end[0],
                              batch_size=a.batch_size, poll_interval_s=0.05,
                              idle_timeout_s=10.0)


def train(a: argparse.Namespace) -> None:
    # Checkpoints after every window (the PublishHook's saves are these) and at a preemption
    # (SIGTERM / Ctrl-C: the step every rank stopped after); a rerun resumes the newest.
    args = TrainingArguments(output_dir=a.output, log_steps=a.log_steps, resume_from="auto",
                             save_every_n_windows=a.publish_every, max_to_keep=3)
    seed_everything(args.seed)
    model = DLRMClassifier(SPARSE_COLUMNS, NUM_DENSE, a.num_embeddings, a.embedding_dim,
                           dense_arch=(64, a.embedding_dim), over_arch=(64, 32, 1))
    metrics = MetricReportHook(metrics=["auc", "logloss", "ctr"], per_window=True)
    if a.kafka:
        # After every --window-s seconds of event time (each window, agreed by the ranks).
        publish = PublishHook(a.publish, every_n_event_seconds=a.window_s,
                              full_every=a.full_every, keep_bases=a.keep_bases)
    else:
        publish = PublishHook(a.publish, every_n_windows=a.publish_every,
                              full_every=a.full_every, keep_bases=a.keep_bases)
    trainer = Trainer(
        model=model,
        args=args,
        # StreamingWindows over --stream (a window once its _SUCCESS exists, the end at _END),
        # or windows of event time on a Kafka topic; the Criteo columns with log1p of the counts.
        train_dataset=kafka_dataset(a) if a.kafka else
        stream_dataset(a.stream, batch_size=a.batch_size, num_embeddings=a.num_embeddings,
                       poll_interval_s=a.poll_s, timeout_s=a.timeout_s),
        dense_optimizers=(lambda params: torch.optim.Adam(params, lr=2e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        hooks=[metrics, publish],
    )
    t0 = time.monotonic()
    trainer.train()
    if not trainer.is_rank_zero:
        return
    windows = [r for r in metrics.reports if r.mode == "train" and r.scope == "window"]
    for r in windows:
        print(f"window {r.window_id}: train AUC {r.values['auc']:.4f} (scored before training "
              f"on it), ctr {r.values['ctr']:.3f}, step {r.step}")
    kinds: dict[str, int] = {}
    for rec in publish.records:
        kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
    blocked = max((rec.blocked_s for rec in publish.records), default=0.0)
    print(f"published: {kinds}; the loop blocked at most {1e3 * blocked:.0f} ms per publish")
    pointer = pub.read_pointer(a.publish)
    where: Any = (f"LATEST sequence {pointer.sequence} step {pointer.step}" if pointer
                  else "no LATEST")
    print(f"train_online: final step {trainer.state.global_step}, {where} "
          f"({len(windows)} windows in {time.monotonic() - t0:.0f} s on {trainer.world_size} "
          f"rank(s))", flush=True)


if __name__ == "__main__":
    main()
