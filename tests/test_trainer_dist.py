"""Real 2-process gloo runs of the Trainer (each with a hard timeout via run_distributed)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed, train_recording_failure
from helpers import Recorder, batches, make_trainer

from recsys_trainer import LambdaHook, SparseOptimizer
from recsys_trainer.batch import Batch

TIMEOUT = 180
pytestmark = pytest.mark.distributed


def _rank() -> int:
    return int(os.environ["RANK"])


def _split_rows(b: Batch, parts: int) -> list[Batch]:
    """Split one batch into ``parts`` equal micro-batches (rows in order)."""
    n = b.batch_size // parts
    out = []
    kjt = b.sparse
    keys = kjt.keys()
    for i in range(parts):
        rows = slice(i * n, (i + 1) * n)
        vals = torch.stack([kjt[k].values().view(b.batch_size)[rows] for k in keys])
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        out.append(Batch(
            dense=b.dense[rows], labels=b.labels[rows],
            sparse=KeyedJaggedTensor(keys=keys, values=vals.reshape(-1),
                                     lengths=torch.ones(len(keys) * n, dtype=torch.int32), stride=n),
        ))
    return out


def _train_and_report(steps: int) -> dict[str, Any]:
    rank = _rank()
    trainer = make_trainer(train=batches(steps, seed=rank), train_steps=steps)
    tables_before = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()
                     if "embedding_bags" in n}
    trainer.train()
    dense = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
             if not hasattr(p, "_in_backward_optimizers")}
    local_shards = {}
    for n, t in trainer.model.state_dict().items():
        if "embedding_bags" not in n:
            continue
        shards = t.local_shards()
        local_shards[n] = [(s.metadata.shard_offsets, tuple(s.tensor.shape)) for s in shards]
        if shards:
            before = tables_before[n].local_shards()[0].tensor
            local_shards[n + ":changed"] = not torch.equal(before, shards[0].tensor)
    return {"dense": dense, "shards": local_shards, "steps": trainer.state.global_step}


def test_dense_params_are_identical_on_both_ranks_and_each_rank_holds_only_its_own_table_shards() -> None:
    r0, r1 = run_distributed(_train_and_report, 2, TIMEOUT, args=(6,))
    assert r0["steps"] == r1["steps"] == 6
    assert r0["dense"].keys() == r1["dense"].keys() and r0["dense"]
    for name in r0["dense"]:
        assert torch.equal(r0["dense"][name], r1["dense"][name]), name
    tables = [n for n in r0["shards"] if not n.endswith(":changed")]
    assert len(tables) == 4
    owners = {n: [r for r, res in enumerate((r0, r1)) if res["shards"][n]] for n in tables}
    # table-wise on 2 ranks: every table lives on exactly one rank, and both ranks own some.
    assert all(len(o) == 1 for o in owners.values()), owners
    assert {o[0] for o in owners.values()} == {0, 1}
    for n, (rank,) in owners.items():
        assert (r0, r1)[rank]["shards"][n + ":changed"], f"sparse optimizer did not update {n}"


def _loss_curve() -> list[float]:
    rank = _rank()
    losses: list[float] = []
    trainer = make_trainer(
        train=batches(60, batch_size=64, seed=rank), dense_lr=3e-3,
        hooks=[LambdaHook(after_step=lambda t, out: losses.append(float(out.loss)))],
    )
    trainer.train()
    return losses


def test_loss_falls_on_a_planted_signal_with_two_ranks() -> None:
    for losses in run_distributed(_loss_curve, 2, TIMEOUT):
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < first - 0.08, (first, last)


def _events(n_batches_by_rank: tuple[int, int]) -> dict[str, Any]:
    rank = _rank()
    rec = Recorder()
    trainer = make_trainer(train=batches(n_batches_by_rank[rank], batch_size=16, seed=rank),
                           eval_=batches(n_batches_by_rank[rank], batch_size=16, seed=10 + rank),
                           hooks=[rec])
    trainer.train_and_evaluate()
    after_train = list(rec.events)
    rec.events.clear()
    metrics = trainer.evaluate()
    return {"train_and_eval": after_train, "evaluate": rec.events, "metrics": metrics,
            "steps": trainer.state.global_step, "unread": trainer.state.rows_unread}


def test_recorded_events_follow_the_documented_sequence_on_both_ranks_with_uneven_data() -> None:
    # rank 0 has 3 batches, rank 1 has 2: training stops both after 2 steps (rank 0 counts the
    # 16 rows it fetched but did not train); evaluation pads rank 1 so all 5 batches count.
    r0, r1 = run_distributed(_events, 2, TIMEOUT, args=((3, 2),))
    assert r0["steps"] == r1["steps"] == 2
    assert (r0["unread"], r1["unread"]) == (16, 0)
    step = lambda s: ["before_step", "after_data", f"after_step({s})"]  # noqa: E731
    evals = lambda n: [e for i in range(1, n + 1) for e in ("after_data", "before_eval_step", f"after_eval_step({i})")]  # noqa: E731
    for res, unread in ((r0, 16), (r1, 0)):
        assert res["train_and_eval"] == [
            "before_train", "before_epoch(0)", "before_window(all)", *step(1), *step(2),
            f"out_of_data(all,{unread})", "after_window(all)", "after_epoch(0)",
            "before_evaluate", "before_window(all)", *evals(3), "out_of_data(all,0)",
            "after_window(all)", "after_evaluate", "after_train", "end",
        ]
        assert res["evaluate"] == ["before_evaluate", "before_window(all)", *evals(3),
                                   "out_of_data(all,0)", "after_window(all)", "after_evaluate", "end"]
        assert res["metrics"]["num_samples"] == 5 * 16  # every real row, padding excluded
    assert r0["metrics"]["loss"] == r1["metrics"]["loss"]


def _stop_on_rank_one() -> int:
    rank = _rank()

    def stop(trainer, out):  # noqa: ANN001
        if rank == 1 and out.step == 4:
            trainer.request_stop("rank 1 wants out")

    trainer = make_trainer(train=batches(10, seed=rank), hooks=[LambdaHook(after_step=stop)],
                           train_steps=8)
    trainer.train()
    assert dist.get_world_size() == 2
    return trainer.state.global_step


def test_a_stop_requested_on_one_rank_stops_both_at_the_same_step() -> None:
    assert run_distributed(_stop_on_rank_one, 2, TIMEOUT) == [4, 4]


def _accumulation(k: int) -> dict[str, torch.Tensor]:
    """One optimizer step: k micro-batches of 16 rows, or (k=1) one batch of the same 16*K rows."""
    rank = _rank()
    big = batches(1, batch_size=64, seed=rank)[0]
    data = _split_rows(big, k) if k > 1 else [big]
    # Sparse SGD with a negligible lr: embeddings stay put between micro-batches, so the
    # dense update is comparable across the two schedules.
    trainer = make_trainer(train=data, dense_sgd=True, dense_lr=0.5, gradient_accumulation_steps=k,
                           sparse=SparseOptimizer("sgd", lr=1e-30), train_steps=1)
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()
            if not hasattr(p, "_in_backward_optimizers")}


def test_k_micro_batches_with_accumulation_match_one_batch_of_k_times_the_rows() -> None:
    accum = run_distributed(_accumulation, 2, TIMEOUT, args=(4,))
    single = run_distributed(_accumulation, 2, TIMEOUT, args=(1,))
    for name in single[0]:
        assert torch.equal(accum[0][name], accum[1][name])  # ranks agree under no_sync too
        # tolerance: float32 summation order differs (4 partial means vs one mean)
        torch.testing.assert_close(accum[0][name], single[0][name], rtol=1e-5, atol=1e-6)


def _pipeline_vs_plain(pipeline: str, n_by_rank: tuple[int, int]) -> dict[str, Any]:
    rank = _rank()
    rec = Recorder()
    trainer = make_trainer(train=batches(n_by_rank[rank], seed=rank), pipeline=pipeline,
                           eval_=batches(2, seed=50 + rank), hooks=[rec])
    trainer.train_and_evaluate()
    dense = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
             if not hasattr(p, "_in_backward_optimizers")}
    tables = {n: [s.tensor.clone() for s in t.local_shards()]
              for n, t in trainer.model.state_dict().items() if "embedding_bags" in n}
    return {"dense": dense, "tables": tables, "events": rec.events,
            "steps": trainer.state.global_step, "pos": trainer.state.batches_in_window}


def test_train_pipeline_sparse_dist_gives_the_same_model_and_events_as_the_plain_loop_on_uneven_data() -> None:
    plain = run_distributed(_pipeline_vs_plain, 2, TIMEOUT, args=("none", (7, 5)))
    piped = run_distributed(_pipeline_vs_plain, 2, TIMEOUT, args=("sparse_dist", (7, 5)))
    for a, b in zip(plain, piped, strict=True):
        assert a["steps"] == b["steps"] == 5
        assert a["events"] == b["events"]
        for name in a["dense"]:
            torch.testing.assert_close(a["dense"][name], b["dense"][name], rtol=0, atol=1e-6)
        for name in a["tables"]:
            for x, y in zip(a["tables"][name], b["tables"][name], strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def _too_big_for_the_host() -> dict[str, Any]:
    import time

    import recsys_trainer.sharding as sharding
    from recsys_trainer import Trainer, TrainingArguments
    from recsys_trainer.models import DLRMClassifier

    # A container limit of 512 MiB for the host's 2 ranks; a 0.72 GiB table fits neither rank.
    sharding.usable_memory_bytes = lambda: (512 << 20, "cgroup v2 memory.max (/fake)")  # type: ignore[assignment]
    model = DLRMClassifier(["a", "b"], 2, [6_000_000, 100], embedding_dim=32, dense_arch=(32,),
                           over_arch=(4, 1))
    t0 = time.monotonic()
    try:
        Trainer(model, TrainingArguments(), train_dataset=batches(1), add_logger_hook=False)
    except ValueError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def test_tables_too_big_for_the_host_are_refused_on_every_rank_before_allocating() -> None:
    r0, r1 = run_distributed(_too_big_for_the_host, 2, 120)
    expected = ("the embedding tables do not fit in host memory: 2 table(s) hold 0.72 GiB of weights "
                "before optimizer state, the largest 't_a' (6,000,000 x 32 = 0.72 GiB of weights)")
    assert r0["error"] is not None and r0["error"].startswith(expected)
    assert "each of the 2 rank(s) on this host may use 0.25 GiB of host memory (cgroup v2 memory.max " \
           "(/fake): 0.50 GiB / 2 local ranks)" in r0["error"]
    # Rank 0 plans for everyone; the others get its error instead of waiting for its plan.
    assert r1["error"] == f"sharding planner (rank 0): {r0['error']}"


def _stalled_peer(out: str, how: str) -> None:
    import signal
    import time

    rank = _rank()
    stopped_at: list[float] = []

    def after_step(trainer: Any, output: Any) -> None:
        if output.step == 2:
            stopped_at.append(time.monotonic())
            if rank == 1:  # SIGSTOP stands in for a stuck read or a frozen host
                os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    trainer = make_trainer(train=batches(10, seed=rank), hooks=[LambdaHook(after_step=after_step)],
                           collective_timeout_s=3)
    train_recording_failure(trainer, out, rank, stopped_at)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_stalled_or_killed_rank_fails_the_others_with_a_named_error(tmp_path, how) -> None:
    import json

    with pytest.raises((AssertionError, RuntimeError), match="rank 0 failed|exited with code"):
        run_distributed(_stalled_peer, 2, 90, args=(str(tmp_path), how))
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["type"] == "PeerLostError"
    if how == "stop":
        assert r0["message"].startswith(
            "rank 0: a peer rank stopped answering: a collective waited collective_timeout_s=3 s for "
            "it, after step 2 (train, window 'all'). Check the other ranks:")
        assert "Timed out waiting 3000ms" in r0["message"]
    else:
        assert r0["message"].startswith(
            "rank 0: a peer rank went away (its connection closed), after step 2 (train, window 'all')")
    assert r0["seconds"] < 60  # hang guard: the default timeout was 1800 s


def test_2_rank_jobs_exit_cleanly_with_no_gloo_thread_left_for_interpreter_finalization(
        tmp_path) -> None:
    # Each job leaves through a real interpreter exit (tests/exit_driver.py forks the ranks from a
    # process that imported the stack once). A gloo thread still alive when finalization starts
    # can abort a finished job with "terminate called without an active exception" (SIGABRT).
    # The thread count is deterministic (every process of every job left one before the fix),
    # so a few jobs catch it; the abort itself is the rare symptom, not what is counted.
    import json
    import subprocess
    import sys

    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_driver.py")
    proc = subprocess.run([sys.executable, driver, "5", str(tmp_path)], capture_output=True,
                          text=True, timeout=420, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 10
    bad = [r for r in results if r["exit"] != 0 or r["terminate"] or r["gloo_threads_at_exit"] != 0]
    assert bad == [], bad[:3]


def _one_rank_has_an_id_outside_its_table() -> dict[str, Any]:
    import time

    from recsys_trainer.data.errors import DataError

    rank = _rank()
    # Uneven data: rank 1's last batch, never trained (rank 0 runs out first), is only counted.
    data = batches(2 if rank == 0 else 4, seed=rank)
    if rank == 1:
        data[3].sparse.values()[3] = 999
    uneven = make_trainer(train=data)
    uneven.train()
    data = batches(4, seed=rank)
    if rank == 1:
        data[2].sparse.values()[3] = 999  # feature f0 (200 rows), row 3
    trainer = make_trainer(train=data)
    t0 = time.monotonic()
    try:
        trainer.train()
    except DataError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0, "step": trainer.state.global_step,
                "uneven_steps": uneven.state.global_step}
    return {"error": None}


def test_an_id_outside_its_table_in_one_ranks_hand_built_batch_stops_both_ranks_naming_it() -> None:
    r0, r1 = run_distributed(_one_rank_has_an_id_outside_its_table, 2, TIMEOUT)
    mine = ("window 'all', batch 2: feature 'f0' (batch.sparse) has id 999 at row 3: outside "
            "table 't_f0', which has rows [0, 200)")
    assert r1["error"].startswith(mine)
    assert r0["error"] == (f"rank 1 failed to read its next batch: DataError: {r1['error']} "
                           "(rank 0 stops too instead of waiting for it).")
    assert r0["step"] == r1["step"] == 2  # neither rank trained the batch
    assert r0["uneven_steps"] == r1["uneven_steps"] == 2
    assert r0["seconds"] < 60 and r1["seconds"] < 60
