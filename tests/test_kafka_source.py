"""The Kafka source (recsys_trainer.data.kafka) against a real broker process: librdkafka's mock
cluster, started by the test on 127.0.0.1 and stopped by its pid (``MockBroker``).

Windows of event time with their rows exactly once (through a stop and a resume from the
checkpoint's offsets), the message formats, late and early rows, idle partitions, and every
fault the source names: undecodable messages, schema drift, offsets deleted by retention, a
deleted topic, a broker outage (waited out, or named after ``broker_timeout_s``).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pytest
import torch
from kafka_utils import T0, all_row_ids, produce, rows_table, send, source_options

from recsys_trainer import Hook, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.kafka import (
    BrokerUnavailableError,
    KafkaWindowDataset,
    OffsetsOutOfRangeError,
    TopicMissingError,
)
from recsys_trainer.data.kafka.client import read as read_dead_letters
from recsys_trainer.data.kafka.mock_broker import MockBroker
from recsys_trainer.data.kafka.windowing import Clock
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.hooks.base import StepOutput
from recsys_trainer.models import DLRMClassifier

ROWS = 96  # per window


@pytest.fixture(scope="module")
def broker() -> Any:
    """One broker for the module's tests that do not break it (each uses its own topic)."""
    with MockBroker() as b:
        yield b


@pytest.fixture
def own_broker() -> Any:
    """A broker of the test's own (the test takes it down, or deletes from it)."""
    with MockBroker() as b:
        yield b


def _spec(**kw: Any) -> FeatureSpec:
    return FeatureSpec(labels=["label"], dense=["I1", "I2"],
                       sparse=[SparseFeature(name="C1", num_embeddings=50, hash=True),
                               SparseFeature(name="C2", num_embeddings=50, hash=True)],
                       passthrough=["row_id"], **kw)


def _json_row(row_id: int, ts: float, *, label: float = 1.0, i2: float = 0.0) -> bytes:
    """One row of ``_spec()`` as a JSON message."""
    return json.dumps({"label": label, "I1": 1.0, "I2": i2, "C1": "a", "C2": "b",
                       "row_id": row_id, "ts": ts}).encode()


def _read_all(ds: KafkaWindowDataset) -> dict[str, list[int]]:
    out = {}
    for wid in ds.window_ids():
        out[wid] = [r for b in ds.iter_window(wid) for r in b.passthrough["row_id"].to_pylist()]
    ds.close()
    return out


class Rows(Hook):
    def __init__(self) -> None:
        self.by_step: dict[int, list[int]] = {}
        self.windows: dict[int, str | None] = {}

    def after_step(self, trainer: Any, output: StepOutput) -> None:
        self.by_step[output.step] = [int(r) for m in output.micro_batches
                                     for r in m.batch.passthrough["row_id"]]
        self.windows[output.step] = trainer.state.window_id


def _trainer(ds: KafkaWindowDataset, out: str, hook: Hook, **args: Any) -> Trainer:
    torch.manual_seed(0)
    model = DLRMClassifier(["C1", "C2"], 2, 50, embedding_dim=4, dense_arch=(8,),
                           over_arch=(8, 1), dense_log1p=True)
    return Trainer(model=model, args=TrainingArguments(output_dir=out, log_steps=1000, seed=0,
                                                      **args),
                   train_dataset=ds, hooks=[hook],
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                   add_logger_hook=False)


@pytest.mark.timeout(90)
def test_a_run_stopped_mid_window_resumes_from_its_checkpoints_offsets_and_trains_every_row_once(
        broker: MockBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "recsys_trainer.data.kafka")
    broker.command("create resume 3")
    table = rows_table("dlrm", windows=4, rows=ROWS, window_s=10.0)
    produce(broker.bootstrap, "resume", table, partitions=3)
    out = str(tmp_path / "ckpt")
    first = Rows()
    # 4 windows of 96 rows (the last 99), batches of 16. Stop in window 1, after step 9 (saved).
    t = _trainer(KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "resume")),
                 out, first, train_steps=9, save_steps=3)
    t.train()
    assert t.state.window_index == 1 and t.state.batches_in_window == 3
    assert t.state.event_time_s == T0 + 10  # window 0 finished
    t.train_dataset.close()  # type: ignore[union-attr]
    second = Rows()
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "resume"))
    t2 = _trainer(ds, out, second, save_every_n_event_seconds=20)
    t2.train()
    assert t2.state.global_step == 25 and t2.state.event_time_s == T0 + 40  # 6+6+6+7 steps
    trained = Counter(r for s in (first.by_step, second.by_step) for rows in s.values()
                      for r in rows)
    assert sorted(trained) == all_row_ids(table) and set(trained.values()) == {1}
    # Each window's rows are the rows of its event time.
    by_window: dict[str | None, set[int]] = {}
    for s in (first.by_step, second.by_step):
        for step, rows in s.items():
            w = (first.windows | second.windows)[step]
            by_window.setdefault(w, set()).update(rows)
    ts = dict(zip(table.column("row_id").to_pylist(), table.column("ts").to_pylist(),
                  strict=True))
    for w, rows in by_window.items():
        assert w is not None and len({int((ts[r] - T0) // 10) for r in rows}) == 1
    # Saves every 20 s of event time: after windows 1 and 3 (event time T0+20, T0+40).
    steps = sorted(int(os.path.basename(p)[5:]) for p in glob.glob(out + "/step_*"))
    assert 12 in steps and 25 in steps, steps
    assert (ds.stats.windows, ds.stats.rows, ds.stats.late_trained) == (4, 387, 0)  # the run's
    assert "reads partitions [0, 1, 2]" in caplog.text


@pytest.mark.parametrize("fmt", ["arrow", "arrow_bare", "decoder"])
@pytest.mark.timeout(90)
def test_arrow_messages_and_a_user_decoder_give_the_rows_json_gives(
        broker: MockBroker, fmt: str) -> None:
    topic = f"formats-{fmt.replace('_', '-')}"
    broker.command(f"create {topic} 2")
    table = rows_table("dlrm", windows=2, rows=40, window_s=10.0, seed=3)
    spec = _spec()
    extra: dict[str, Any] = {}
    if fmt == "decoder":
        produce(broker.bootstrap, topic, table, partitions=2)  # JSON, read by a user decoder
        extra["decoder"] = lambda b: pa.RecordBatch.from_pylist([json.loads(b)])
    else:
        produce(broker.bootstrap, topic, table, partitions=2, fmt="arrow", rows_per_message=7,
                schema_in_message=fmt == "arrow")
        extra["format"] = "arrow"
        if fmt == "arrow_bare":
            extra["schema"] = {f.name: str(f.type) for f in table.schema}
    got = _read_all(KafkaWindowDataset(spec, **source_options(broker.bootstrap, topic), **extra))
    assert sorted(r for rows in got.values() for r in rows) == all_row_ids(table)
    assert [len(rows) for rows in got.values()] == [40, 43]  # the last window's 3 edge rows


@pytest.mark.timeout(90)
def test_late_rows_are_counted_and_trained_in_the_open_window_or_dropped_and_early_rows_wait(
        broker: MockBroker) -> None:
    def row(i: int, t: float) -> bytes:
        return _json_row(i, t, label=1, i2=2.0)

    for late in ("train", "drop"):
        topic = f"late-{late}"
        broker.command(f"create {topic} 1")
        # Window 0 = [T0, T0+10): row 2 (T0+12) arrives early, row 3 (T0+3) after window 0
        # closed (row 2 pushed the watermark past T0+10): late. Row 4 closes window 1.
        send(broker.bootstrap, topic, [(0, row(1, T0 + 1), T0 + 1), (0, row(2, T0 + 12), T0 + 12),
                                       (0, row(3, T0 + 3), T0 + 3), (0, row(4, T0 + 25), T0 + 25)])
        ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, topic,
                                                          late_rows=late))
        got = _read_all(ds)
        assert list(got.values())[:2] == [[1], [2, 3] if late == "train" else [2]]
        assert (ds.stats.late_trained, ds.stats.late_dropped) == (
            (1, 0) if late == "train" else (0, 1))


@pytest.mark.timeout(90)
def test_an_idle_partition_holds_a_window_open_only_for_idle_timeout_s_and_is_logged(
        broker: MockBroker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "recsys_trainer.data.kafka")
    broker.command("create idle 2")
    table = rows_table("dlrm", windows=3, rows=20, window_s=10.0)
    produce(broker.bootstrap, "idle", table, partitions=1)  # partition 1 gets nothing
    # No end: windows 0 and 1 close once partition 1 is idle; window 2 (whose end no row has
    # passed) stays open: the test stops there.
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "idle",
                                                      end_offsets=None, idle_timeout_s=1.5,
                                                      end_time=T0 + 20))
    started = time.monotonic()
    got = _read_all(ds)
    assert [len(r) for r in got.values()] == [20, 20]
    assert 1.5 <= time.monotonic() - started < 10
    assert "idle" in caplog.text and "idle_timeout_s=1.5" in caplog.text


@pytest.mark.timeout(90)
def test_rows_before_start_time_are_skipped_and_counted(broker: MockBroker) -> None:
    broker.command("create start 2")
    table = rows_table("dlrm", windows=3, rows=20, window_s=10.0)
    produce(broker.bootstrap, "start", table, partitions=2)
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "start",
                                                      start_time=T0 + 10))
    got = _read_all(ds)
    assert [len(r) for r in got.values()] == [20, 23] and ds.stats.before_start == 20


@pytest.mark.timeout(90)
def test_an_undecodable_message_stops_the_job_by_name_or_is_skipped_into_the_dead_letter_file(
        broker: MockBroker, tmp_path: Path) -> None:
    broker.command("create corrupt 2")
    table = rows_table("dlrm", windows=2, rows=20, window_s=10.0)
    produce(broker.bootstrap, "corrupt", table, partitions=2)
    send(broker.bootstrap, "corrupt", [(1, b"{not json", T0 + 5), (1, b"", T0 + 6)])
    at = table.num_rows // 2  # partition 1's first offset after the rows
    with pytest.raises(DataError, match=rf"corrupt\[1\]@{at}: the message cannot be decoded.*"
                                        r"on_corrupt='skip'"):
        _read_all(KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "corrupt")))
    dead = str(tmp_path / "dead")
    for _ in range(2):  # a rerun reads them again: the file does not grow
        ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "corrupt",
                                                          on_corrupt="skip",
                                                          dead_letter_dir=dead))
        got = _read_all(ds)
        assert sorted(r for rows in got.values() for r in rows) == all_row_ids(table)
        assert ds.stats.corrupt_skipped == 2
    records = read_dead_letters(os.path.join(dead, "corrupt.1.jsonl"))
    assert [(r["partition"], r["offset"]) for r in records] == [(1, at), (1, at + 1)]
    assert "JSONDecodeError" in records[0]["error"] and records[1]["value_bytes"] == 0


@pytest.mark.timeout(90)
def test_schema_drift_follows_the_file_rules(broker: MockBroker) -> None:
    broker.command("create drift 1")
    base = {"label": 1, "I1": 1.0, "I2": 2.0, "C1": "a", "C2": "b", "row_id": 1, "ts": T0 + 1}
    # Integers where strings were (written as str(int) writes them: read as the first kind),
    # then a declared column of the wrong type.
    send(broker.bootstrap, "drift", [
        (0, json.dumps(base).encode(), T0 + 1),
        (0, json.dumps({**base, "row_id": 2, "C1": 7}).encode(), T0 + 2),
        (0, json.dumps({**base, "row_id": 3, "I1": "x"}).encode(), T0 + 3)])
    with pytest.raises(DataError, match=r"drift\[0\]@2.*column 'I1'.*must be"):
        _read_all(KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "drift")))


@pytest.mark.timeout(90)
def test_offsets_deleted_by_retention_before_a_resume_read_them_are_named_or_skipped_and_counted(
        own_broker: MockBroker) -> None:
    b = own_broker
    b.command("create kept 1")
    table = rows_table("dlrm", windows=3, rows=20, window_s=10.0)
    produce(b.bootstrap, "kept", table.slice(0, 40), partitions=1)  # windows 0 and 1
    opts = source_options(b.bootstrap, "kept", end_offsets=None, end_time=T0 + 30)
    ds = KafkaWindowDataset(_spec(), **opts)
    first = next(ds.window_ids())  # window 1's rows closed window 0; window 1 stays open
    assert len([r for x in ds.iter_window(first) for r in x.passthrough["row_id"]]) == 20
    state = ds.state_dict()  # the position after window 0 (a checkpoint)
    ds.close()
    frontier = state["partitions"]["0"]["frontier"]
    assert 20 < frontier < 30
    produce(b.bootstrap, "kept", table.slice(40), partitions=1)
    send(b.bootstrap, "kept", [(0, json.dumps({"ts": T0 + 31}).encode(), T0 + 31)])  # closes 2
    b.command("delete_records kept 0 30")  # retention took offsets before 30, read or not

    def resume(**over: Any) -> tuple[KafkaWindowDataset, list[int]]:
        again = KafkaWindowDataset(_spec(), **{**opts, **over})
        again.load_state_dict(state)
        ids = again.window_ids()
        next(ids)  # window 0: trained before the checkpoint (the Trainer skips it)
        rows = [r for wid in ids for x in again.iter_window(wid)
                for r in x.passthrough["row_id"].to_pylist()]
        again.close()
        return again, rows

    with pytest.raises(OffsetsOutOfRangeError,
                       match=rf"kept\[0\]@{frontier}.*{30 - frontier} messages were deleted"):
        resume()
    skipped, rows = resume(on_out_of_range="skip")
    # Lost: the messages after the checkpoint's offset, and the row of window 1 read early
    # (before it) for window 1, still open then.
    early = sum(n for _, n in state["partitions"]["0"]["deferred"].values())
    assert (skipped.stats.lost_messages, skipped.stats.lost_rows) == (30 - frontier, early)
    assert len(rows) == table.num_rows - 20 - (30 - frontier) - early


@pytest.mark.timeout(90)
def test_a_deleted_topic_is_named_within_seconds(own_broker: MockBroker) -> None:
    own_broker.command("create gone 2")
    table = rows_table("dlrm", windows=2, rows=20, window_s=10.0)
    produce(own_broker.bootstrap, "gone", table, partitions=2)
    ds = KafkaWindowDataset(_spec(), **source_options(own_broker.bootstrap, "gone",
                                                      end_offsets=None))
    ids = ds.window_ids()
    next(ids)
    own_broker.command("delete_topic gone")
    started = time.monotonic()
    with pytest.raises(TopicMissingError,
                       match=rf"topic 'gone' does not exist on '{own_broker.bootstrap}'"):
        for _ in ids:
            pass
    assert time.monotonic() - started < 15
    ds.close()


@pytest.mark.timeout(120)
def test_a_broker_outage_is_waited_out_and_logged_and_one_longer_than_the_limit_is_named(
        own_broker: MockBroker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "recsys_trainer.data.kafka")
    b = own_broker
    b.command("create outage 2")
    table = rows_table("dlrm", windows=4, rows=20, window_s=10.0)
    produce(b.bootstrap, "outage", table.slice(0, 40), partitions=2)
    ds = KafkaWindowDataset(_spec(), **source_options(b.bootstrap, "outage", end_offsets=None,
                                                      end_time=T0 + 30, broker_timeout_s=20))
    ids = ds.window_ids()
    assert next(ids)  # window 0 closed (window 1's rows passed it)
    b.command("down")  # 15 s, in the middle of window 1 (its rows read, not closed)
    time.sleep(15)
    b.command("up")
    produce(b.bootstrap, "outage", table.slice(40), partitions=2)
    rest = list(ids)
    assert [len([r for x in ds.iter_window(w) for r in x.passthrough["row_id"]])
             for w in rest] == [20, 20]  # no partition taken for idle during the outage
    text = caplog.text
    assert "the broker cannot be reached" in text or "the broker does not answer" in text
    assert "the broker is reachable again after" in text
    ds.close()
    # Down for longer than broker_timeout_s: a named error, in about that time.
    short = KafkaWindowDataset(_spec(), **source_options(b.bootstrap, "outage",
                                                         end_offsets=None, broker_timeout_s=3))
    ids = short.window_ids()
    next(ids)
    b.command("down")
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match="broker_timeout_s=3"):
        for _ in ids:
            pass
    assert time.monotonic() - started < 12
    short.close()


@pytest.mark.timeout(120)
def test_the_cli_trains_from_a_topic_a_yaml_config_names(broker: MockBroker, tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    from recsys_trainer.config import ConfigError, KafkaDataConfig, RunConfig

    broker.command("create cli 2")
    table = rows_table("dlrm", windows=2, rows=48, window_s=10.0)
    produce(broker.bootstrap, "cli", table, partitions=2)
    raw: dict[str, Any] = {
        "run": "train",
        "args": {"output_dir": str(tmp_path / "out"), "log_steps": 100,
                 "save_every_n_event_seconds": 10},
        "model": {"embedding_dim": 4, "dense_arch": [8], "over_arch": [8, 1]},
        "data": {"kind": "kafka", "bootstrap_servers": broker.bootstrap, "topic": "cli",
                 "time_column": "ts", "window_s": 10, "end_offsets": "log_end",
                 "batch_size": 16, "idle_timeout_s": 1,
                 "features": {"labels": ["label"], "dense": ["I1", "I2"],
                              "sparse": [{"name": "C1", "num_embeddings": 50, "hash": True}]}},
        "dense_optimizer": {"name": "adam", "lr": 0.01},
        "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.05},
    }
    cfg = RunConfig.from_dict(raw)
    assert isinstance(cfg.data, KafkaDataConfig) and cfg.model.sparse_features == ["C1"]
    bad = {**raw, "data": {**raw["data"], "window_s": 0}}
    with pytest.raises(ConfigError, match=r"`window_s` must be a number > 0, but is 0"):
        RunConfig.from_dict(bad)
    path = tmp_path / "kafka.yaml"
    path.write_text(yaml.safe_dump(raw))
    p = subprocess.run([sys.executable, "-m", "recsys_trainer", str(path)], capture_output=True,
                       text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "done: global_step=7" in p.stdout  # 3 + 4 steps (48 and 51 rows, batches of 16)
    steps = sorted(n for n in os.listdir(tmp_path / "out") if n.startswith("step_"))
    assert steps == ["step_00000003", "step_00000007"]  # a save every 10 s of event time


class Evals(Hook):
    def __init__(self) -> None:
        self.trained: list[str | None] = []
        self.evaluated: list[tuple[str | None, int]] = []
        self._rows = 0

    def after_window(self, trainer: Any, window_id: str) -> None:
        if trainer.state.mode == "train":
            self.trained.append(window_id)

    def after_eval_step(self, trainer: Any, output: StepOutput) -> None:
        if not output.is_padding:
            self._rows += output.micro_batches[0].batch.num_real_rows()

    def after_evaluate(self, trainer: Any, metrics: dict[str, float]) -> None:
        self.evaluated.append((trainer.state.window_id, self._rows))
        self._rows = 0


@pytest.mark.timeout(90)
def test_train_and_evaluate_evaluates_each_window_on_the_next_and_commits_offsets_for_lag(
        broker: MockBroker, tmp_path: Path) -> None:
    from confluent_kafka import Consumer, TopicPartition

    broker.command("create pairs 2")
    table = rows_table("dlrm", windows=3, rows=32, window_s=10.0)
    produce(broker.bootstrap, "pairs", table, partitions=2)
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "pairs",
                                                      commit_group="lag-pairs"))
    hook = Evals()
    t = _trainer(ds, str(tmp_path / "ckpt"), hook)
    t.eval_dataset = ds.following()
    t.train_and_evaluate()
    ids = [Clock(10.0, 0).name(int(T0 // 10) + w) for w in range(3)]
    assert hook.trained == ids
    # Window T evaluated on T + 1 (all its rows); the last train window has no next window.
    assert [(w, n) for w, n in hook.evaluated] == [(ids[1], 32), (ids[2], 35)]
    # Offsets for lag monitoring: committed when training moved to the last window (every row
    # before it trained), never read back by the job.
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "lag-pairs"})
    committed = c.committed([TopicPartition("pairs", p) for p in (0, 1)], timeout=10)
    c.close()
    assert [tp.offset for tp in committed] == [32, 32]  # windows 0 and 1: 64 rows, 32 each
    ds.close()


@pytest.mark.timeout(60)
def test_a_gap_in_the_traffic_closes_its_empty_windows_and_reading_goes_on(
        broker: MockBroker) -> None:
    def row(i: int, t: float) -> bytes:
        return _json_row(i, t, label=1, i2=2.0)

    broker.command("create gap 1")
    # Window 0, then nothing until window 20 (the producer stopped for 200 s of event time).
    send(broker.bootstrap, "gap", [(0, row(i, T0 + i), T0 + i) for i in range(5)]
         + [(0, row(5, T0 + 201), T0 + 201)])
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "gap",
                                                      end_offsets=None, end_time=T0 + 220))
    ids = ds.window_ids()
    first = next(ids)
    assert [r for b in ds.iter_window(first) for r in b.passthrough["row_id"].to_pylist()] == [
        0, 1, 2, 3, 4]
    # Windows 1-19 closed at once, empty: the partition, far past them, keeps reading.
    send(broker.bootstrap, "gap", [(0, row(6 + i, T0 + 205 + 5 * i), T0 + 205 + 5 * i)
                                   for i in range(4)])
    rest = {w: [r for b in ds.iter_window(w) for r in b.passthrough["row_id"].to_pylist()]
            for w in ids}
    assert list(rest.values()) == [[5, 6], [7, 8]]
    ds.close()


@pytest.mark.parametrize("key,value", [("auto.offset.reset", "earliest"),
                                       ("enable.auto.commit", True),
                                       ("enable.partition.eof", False),
                                       ("group.id", "shared-group")])
def test_consumer_config_cannot_override_the_settings_exactly_once_relies_on(key: str,
                                                                              value: Any) -> None:
    # auto.offset.reset=earliest skipped offsets deleted by retention without a count.
    with pytest.raises(ValueError, match=f"consumer_config.*{key}"):
        KafkaWindowDataset(_spec(), **source_options("127.0.0.1:9", "t",
                                                     consumer_config={key: value}))


def _walk(ds: KafkaWindowDataset, skip: int, limit_s: float) -> list[Any]:
    """(window id, row ids) per window from window ``skip`` on (the Trainer skips the earlier
    ones by position), then 'ended' or the error; gives up after ``limit_s``."""
    got: list[Any] = []

    def run() -> None:
        try:
            for i, wid in enumerate(ds.window_ids()):
                if i >= skip:
                    got.append((wid, [r for b in ds.iter_window(wid)
                                      for r in b.passthrough["row_id"].to_pylist()]))
            got.append("ended")
        except Exception as exc:  # noqa: BLE001 - returned to the test
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    ds.close()
    return got


@pytest.mark.timeout(90)
def test_a_resumed_run_ends_where_its_own_end_offsets_say_not_where_the_first_run_ended(
        broker: MockBroker) -> None:
    # A bounded run (log_end) resumed as a stream reads what was produced after its end...
    broker.command("create endres 2")
    table = rows_table("dlrm", windows=6, rows=20, window_s=10.0)
    ts = pa.compute.less(table.column("ts"), T0 + 30)
    produce(broker.bootstrap, "endres", table.filter(ts), partitions=2)
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "endres"))
    list(ds.iter_window(next(ds.window_ids())))
    state = ds.state_dict()
    ds.close()
    produce(broker.bootstrap, "endres", table.filter(pa.compute.invert(ts)), partitions=2)
    again = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "endres",
                                                         end_offsets=None, end_time=T0 + 50))
    again.load_state_dict(state)
    got = _walk(again, skip=1, limit_s=30.0)
    assert got[-1] == "ended", got
    want = [r for r, t in zip(table.column("row_id").to_pylist(), table.column("ts").to_pylist(),
                              strict=True) if T0 + 10 <= t < T0 + 50]
    assert sorted(r for _, rows in got[:-1] for r in rows) == sorted(want)
    # ... and a stream resumed with log_end ends at the log's end (it waited for ever).
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "endres",
                                                      end_offsets=None, idle_timeout_s=30.0))
    list(ds.iter_window(next(ds.window_ids())))
    state = ds.state_dict()
    ds.close()
    again = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "endres",
                                                         idle_timeout_s=30.0))
    again.load_state_dict(state)
    got = _walk(again, skip=1, limit_s=15.0)
    assert got and got[-1] == "ended", f"still waiting after 15 s: {got}"
    assert sorted(r for _, rows in got[:-1] for r in rows) == sorted(
        r for r, t in zip(table.column("row_id").to_pylist(), table.column("ts").to_pylist(),
                          strict=True) if t >= T0 + 10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cache_mb", [512.0, 0.0])
def test_a_bad_value_found_in_a_window_is_named_by_its_topic_partition_and_offset(
        broker: MockBroker, cache_mb: float) -> None:
    # cache_mb=0: the rows are read again from the broker, not from the owner's memory.
    topic = f"badlabel{int(cache_mb)}"
    broker.command(f"create {topic} 2")
    rows = [{"label": 1.0, "I1": 1.0, "I2": 0.0, "C1": "a", "C2": "b", "row_id": i,
             "ts": T0 + i} for i in range(10)]
    rows[6]["label"] = None
    send(broker.bootstrap, topic, [(1, json.dumps(r).encode(), T0 + i)
                                   for i, r in enumerate(rows)])
    send(broker.bootstrap, topic, [(0, json.dumps({**rows[0], "row_id": 100}).encode(), T0 + 9)])
    got = _walk(KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, topic,
                                                             batch_size=4, cache_mb=cache_mb)),
                skip=0, limit_s=30.0)
    assert isinstance(got[-1], DataError), got
    assert f"{topic}[1]@6" in str(got[-1]) and "label" in str(got[-1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["json", "arrow"])
def test_a_time_column_the_messages_lack_is_named_not_replaced_by_message_timestamps(
        broker: MockBroker, fmt: str) -> None:
    # A typo in time_column windowed every row by the time the broker stamped, silently.
    topic = f"notime{fmt}"
    broker.command(f"create {topic} 2")
    produce(broker.bootstrap, topic, rows_table("dlrm", windows=2, rows=20, window_s=10.0),
            partitions=2, fmt=fmt)
    got = _walk(KafkaWindowDataset(_spec(), **source_options(
        broker.bootstrap, topic, format=fmt, time_column="event_ts")), skip=0, limit_s=30.0)
    assert isinstance(got[-1], DataError), got
    assert "event_ts" in str(got[-1]) and f"{topic}[" in str(got[-1])


@pytest.mark.timeout(60)
def test_event_times_in_another_unit_are_named_by_message_with_the_unit_they_look_like(
        broker: MockBroker) -> None:
    # Milliseconds read as seconds stopped the job with "ValueError: year 58692 is out of range".
    broker.command("create msunit 2")
    send(broker.bootstrap, "msunit", [
        (i % 2, _json_row(i, int((T0 + i) * 1000)), T0 + i)
        for i in range(20)])
    got = _walk(KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "msunit")),
                skip=0, limit_s=30.0)
    assert isinstance(got[-1], DataError), got
    assert "msunit[" in str(got[-1]) and "time_unit='ms'" in str(got[-1])


@pytest.mark.timeout(60)
def test_a_row_stamped_far_ahead_of_its_message_does_not_hold_back_its_partitions_later_rows(
        broker: MockBroker) -> None:
    # One row from a clock 11 days ahead took its partition's watermark there: the partition's
    # later rows waited (unassigned) until event time caught up, then trained 11 days late.
    broker.command("create ahead 2")

    def msg(p: int, row_id: int, ts: float, sent: float) -> tuple[int, bytes, float]:
        return (p, _json_row(row_id, ts), sent)

    msgs = [msg(0, i, T0 + i, T0 + i) for i in range(5)] + [msg(0, 999, T0 + 1e6, T0 + 5)]
    msgs += [msg(0, i, T0 + i, T0 + i) for i in range(5, 40)]
    msgs += [msg(1, 1000 + i, T0 + i, T0 + i) for i in range(40)]
    send(broker.bootstrap, "ahead", msgs)
    ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "ahead"))
    got = _walk(ds, skip=0, limit_s=30.0)
    assert got[-1] == "ended", got
    window_of = {wid: i for i, wid in enumerate(Clock(10.0, 0.0).name(int(T0 // 10) + k)
                                                 for k in range(4))}
    for wid, rows in got[:-1]:
        for r in rows:  # every row in the window of its event time; the far one, its message's
            assert window_of.get(wid) == (0 if r == 999 else (r % 1000) // 10), (wid, r)
    assert sum(len(rows) for _, rows in got[:-1]) == 81
    assert ds.stats.ahead_of_message == 1


@pytest.mark.timeout(90)
def test_a_quiet_partition_is_idle_again_after_a_broker_outage_and_holds_no_window_open(
        own_broker: MockBroker) -> None:
    # After any outage a quiet partition never counted as idle again (its end is reported once,
    # and no new message came): every window waited for it, without a word.
    b = own_broker
    b.command("create quiet 2")

    def msg(p: int, i: int, t: float) -> tuple[int, bytes, float]:
        return (p, _json_row(i, t), t)

    send(b.bootstrap, "quiet", [msg(1, 1000 + i, T0 + i) for i in range(5)]
         + [msg(0, i, T0 + i) for i in range(25)])
    ds = KafkaWindowDataset(_spec(), **source_options(b.bootstrap, "quiet", end_offsets=None,
                                                      end_time=T0 + 50))
    ids = ds.window_ids()
    assert next(ids) == Clock(10.0, 0.0).name(int(T0 // 10))  # partition 1 idle after 1 s
    b.command("down")
    time.sleep(3)
    b.command("up")
    send(b.bootstrap, "quiet", [msg(0, i, T0 + i) for i in range(25, 60)])
    got = _walk(ds, skip=1, limit_s=30.0)
    assert got[-1] == "ended", f"windows held open by the quiet partition: {got}"
    assert [len(rows) for _, rows in got[:-1]] == [10, 10, 10, 10]


@pytest.mark.timeout(60)
def test_start_or_end_offsets_naming_a_partition_the_source_does_not_read_is_refused_by_name(
        broker: MockBroker) -> None:
    broker.command("create startkeys 2")
    for name, value in (("start", {0: 0, 7: 3}), ("end_offsets", {5: 10})):
        ds = KafkaWindowDataset(_spec(), **source_options(broker.bootstrap, "startkeys",
                                                          **{name: value}))
        with pytest.raises(TopicMissingError, match=rf"`{name}` names partitions \[\d\]"):
            next(ds.window_ids())
        ds.close()


@pytest.mark.timeout(90)
def test_the_click_producer_counts_what_it_delivered_and_what_the_broker_never_acknowledged(
        own_broker: MockBroker) -> None:
    from confluent_kafka import Consumer, TopicPartition

    from recsys_trainer.data.generators.kafka_producer import ClickProducer

    own_broker.command("create clicks 2")
    p = ClickProducer(own_broker.bootstrap, "clicks", rows_per_s=200, fmt="arrow",
                      rows_per_message=4, producer_config={"message.timeout.ms": 1500})
    p.run(seconds=1)
    assert p.sent == 50 and p.failed == 0
    c = Consumer({"bootstrap.servers": own_broker.bootstrap, "group.id": "count"})
    ends = [c.get_watermark_offsets(TopicPartition("clicks", q), timeout=10)[1] for q in (0, 1)]
    c.close()
    assert ends == [25, 25]  # every message it counted sent is on the topic
    # The broker gone: what it sends is counted as not delivered, not as produced.
    own_broker.stop()
    p.run(seconds=1)
    assert p.sent == 100 and p.failed == 50
