"""Exactly once from a Kafka topic through the faults a job meets, in one elastic job: a node
lost in the middle of a window during a save, a node that joins (its agent's preemption signal),
and a worker SIGKILLed under torchrun, which restarts the workers (tests/elastic_driver.py with
a ``kafka`` source); and two ranks sharing one partition.

The broker is librdkafka's mock cluster in its own process (``MockBroker``), on 127.0.0.1,
stopped by its pid. Each step's rows are recorded and a resumed run deletes the records of the
steps its checkpoint does not hold (the driver's ``RowLog``), so the records are what the final
model trained on: every row of the topic exactly once.
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from dist_utils import run_distributed
from elastic_utils import Node, jsonl, progress, trained, wait_for
from kafka_utils import produce, rows_table, source_options

from recsys_trainer.data.kafka.mock_broker import MockBroker
from recsys_trainer.distributed import free_port


def _setup(root: Path, broker: MockBroker, topic: str, partitions: int, rows: int,
           cfg: dict[str, Any]) -> list[int]:
    broker.command(f"create {topic} {partitions}")
    table = rows_table("dlrm", windows=3, rows=rows, window_s=10.0)
    produce(broker.bootstrap, topic, table, partitions=partitions)
    (root / "config.json").write_text(json.dumps({
        "kind": "dlrm", "batch_size": 8, "kafka": {"bootstrap": broker.bootstrap, "topic": topic},
        **cfg}))
    return sorted(table.column("row_id").to_pylist())


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _assert_exactly_once(root: Path, expected: list[int]) -> dict[tuple[int, str], int]:
    rows, parts = trained(root)
    twice = sorted(i for i, n in rows.items() if n > 1)
    never = sorted(set(expected) - set(rows))
    assert not twice and not never, (f"{len(twice)} rows trained twice, e.g. {twice[:8]}; "
                                     f"{len(never)} never, e.g. {never[:8]}")
    assert sorted(rows) == expected
    return parts


def _two_ranks_one_partition(bootstrap: str) -> dict[str, Any]:
    import torch.distributed as dist

    from recsys_trainer.data.kafka import KafkaWindowDataset
    from recsys_trainer.data.spec import FeatureSpec
    from recsys_trainer.distributed import ProcessGroupGang

    dist.init_process_group("gloo")
    ds = KafkaWindowDataset(FeatureSpec(labels=["label"], dense=["I1"], passthrough=["row_id"]),
                            **source_options(bootstrap, "one", batch_size=8))
    ds.setup(dist.get_rank(), 2)
    ds.set_gang(ProcessGroupGang())
    rows, batches = {}, {}
    for wid in ds.window_ids():
        got = list(ds.iter_window(wid))
        batches[wid] = len(got)
        rows[wid] = [r for b in got for r in b.passthrough["row_id"].to_pylist()]
    state = ds.state_dict()
    ds.close()
    return {"rows": rows, "batches": batches, "state": json.dumps(state, sort_keys=True)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_share_every_window_of_a_single_partition_and_hold_the_same_position(
        tmp_path: Path) -> None:
    with MockBroker({"one": 1}) as broker:
        table = rows_table("dlrm", windows=3, rows=45, window_s=10.0)
        produce(broker.bootstrap, "one", table, partitions=1)
        r0, r1 = run_distributed(_two_ranks_one_partition, 2, timeout_s=100,
                                 args=(broker.bootstrap,))
    # More ranks than partitions: rank 1 owns none and reads its share by offset. Each window
    # is cut evenly, both ranks take as many batches, and every row is read once.
    assert list(r0["rows"]) == list(r1["rows"]) and r0["batches"] == r1["batches"]
    for wid in r0["rows"]:
        assert abs(len(r0["rows"][wid]) - len(r1["rows"][wid])) <= 1
    got = sorted(r for r_ in (r0, r1) for rows in r_["rows"].values() for r in rows)
    assert got == sorted(table.column("row_id").to_pylist())
    assert r0["state"] == r1["state"]  # the checkpoint is the same on every rank


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_node_lost_a_node_joined_and_a_worker_killed_leave_every_row_of_the_topic_trained_once(
        tmp_path: Path) -> None:
    root = tmp_path
    with MockBroker() as broker:
        # 4 partitions, windows of 320 rows: 20 steps at world size 2, 40 at world size 1. Node
        # b (rank 1) dies while writing step 28's checkpoint (window 1, 8 batches in); a goes on
        # alone from step 24 and holds 8 batches later for node c to join (its agent's SIGTERM:
        # a preemption save at step 32). At world size 2 again, c's worker is SIGKILLed after
        # step 54 (window 2): torchrun restarts both workers, which resume from step 52.
        expected = _setup(root, broker, "four", 4, 320, {
            "save_steps": 4, "pace_s": 0.03, "die": {"rank": 1, "at_save_of_step": 28},
            "hold": {"window_index": 1, "batches": 8}, "crash": {"rank": 1, "at_step": 54}})
        port = free_port()
        a = Node(root, "a", port)
        # a hosts the rendezvous store (b's death must not take it): b starts once it listens.
        wait_for("node a's rendezvous store", lambda: _listening(port), [a], 60)
        b = Node(root, "b", port)
        c = None
        try:
            wait_for("node b's death", lambda: (root / "died.json").exists(), [a], 120)
            assert b.wait(10) == -signal.SIGKILL
            wait_for("a held at world size 1 in window 1", lambda: (
                (p := progress(root)) is not None and p["world_size"] == 1
                and p["window_index"] == 1 and p["batches_in_window"] >= 8), [a], 120)
            c = Node(root, "c", port)
            assert a.wait(180) == 0, a.text()[-4000:]
            assert c.wait(60) == 0, c.text()[-4000:]
            text = a.text()
        finally:
            a.close()
            b.close()
            if c is not None:
                c.close()
    starts = jsonl(root / "starts.jsonl")
    alone = next(s for s in starts if s["world_size"] == 1)
    assert (alone["resumed_step"], alone["window_index"], alone["segments"]) == (24, 1, [[2, 4]])
    grown = [s for s in starts if s["world_size"] == 2 and s["segments"]]
    assert len(grown) == 2 and grown[0]["segments"][0] == [2, 4]
    assert grown[0]["segments"][1][0] == 1 and grown[0]["segments"][1][1] >= 8
    restarted = [s for s in starts if s["world_size"] == 2 and s["resumed_step"] >= 48]
    assert len(restarted) == 2 and {s["window_index"] for s in restarted} == {2}
    assert "SIGTERM: checkpoint of step" in text
    assert "resuming on the rows no old rank consumed" in text
    parts = _assert_exactly_once(root, expected)
    # Window 1 was trained at 2, then 1, then 2 ranks.
    w1 = sorted(w for w, name in parts if name == sorted({n for _, n in parts})[1])
    assert w1 == [1, 2], parts
