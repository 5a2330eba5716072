"""ParquetWindowDataset with the Trainer on 2 real gloo ranks: uneven windows, exact resume,
and the Open Bandit hourly windows end to end."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from data_utils import row_id_spec, row_ids, train_interrupted_then_resumed, write_windows
from dist_utils import run_distributed

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.generators.open_bandit import convert, open_bandit_features
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.hooks.lambda_hook import LambdaHook
from recsys_trainer.models import DLRMClassifier

pytestmark = pytest.mark.distributed


def _trainer(spec: FeatureSpec, train: Any, eval_: Any = None, hooks: Any = (), **args: Any) -> Trainer:
    torch.manual_seed(0)
    model = DLRMClassifier(spec.sparse_names, spec.num_dense, [s.num_embeddings for s in spec.sparse],
                           embedding_dim=8, dense_arch=(16,), over_arch=(16, 1))
    return Trainer(model, TrainingArguments(output_dir="/tmp/recsys_data_test", log_steps=1000, **args),
                   train_dataset=train, eval_dataset=eval_, hooks=list(hooks),
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-3), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
                   add_logger_hook=False)


def _uneven_worker(root: str) -> dict[str, Any]:
    steps: dict[str, int] = {}
    unread: dict[str, int] = {}
    current: list[str] = []
    hook = LambdaHook(
        before_window=lambda t, w: (current.append(w), steps.__setitem__(w, 0)) if t.state.mode == "train" else None,
        after_step=lambda t, out: steps.__setitem__(current[-1], steps[current[-1]] + 1),
        out_of_data=lambda t, w, n: unread.__setitem__(w, n) if t.state.mode == "train" else None,
    )
    ds = ParquetWindowDataset(root, row_id_spec(), batch_size=4, sharding="row_groups")
    trainer = _trainer(row_id_spec(), ds, ds, hooks=[hook])
    trainer.train()
    metrics = trainer.evaluate()
    return {"steps": steps, "unread": unread, "eval_rows": metrics["num_samples"],
            "rows_unread": trainer.state.rows_unread}


def test_ranks_with_0_3_and_5_batches_end_each_window_at_the_same_step_without_hanging(tmp_path) -> None:
    # sharding="row_groups" with one row group per file: file i of a window goes to rank i % 2.
    # Batches per rank (batch_size 4): w0 3|5, w1 5|0 (empty on rank 1), w2 5|3, w3 2|2 where the
    # last window is shorter on rank 1 (5 rows: a full batch and a 1-row batch).
    total = write_windows(str(tmp_path), [[12, 20], [20], [20, 12], [8, 5]], row_group_size=100)
    r0, r1 = run_distributed(_uneven_worker, 2, timeout_s=180, args=(str(tmp_path),))
    expected_steps = {"hour=00": 3, "hour=01": 0, "hour=02": 3, "hour=03": 2}
    assert r0["steps"] == r1["steps"] == expected_steps
    # Training stops the window on all ranks when one runs dry; the rest is counted, not lost silently.
    assert r0["unread"] == {"hour=00": 0, "hour=01": 20, "hour=02": 8, "hour=03": 0}
    assert r1["unread"] == {"hour=00": 8, "hour=01": 0, "hour=02": 0, "hour=03": 0}
    # Evaluation pads exhausted ranks with zero-weight batches: every row is evaluated once.
    assert r0["eval_rows"] == r1["eval_rows"] == total


def _resume_worker(root: str, stop_after: int) -> dict[str, Any]:
    seen: list[int] = []
    interrupted: list[int] = []  # rows seen when each train() ended
    second, saved_trainer = train_interrupted_then_resumed(
        lambda: ParquetWindowDataset(root, row_id_spec(), batch_size=4, shuffle=True, seed=11),
        lambda ds, **kw: _trainer(row_id_spec(), ds, **kw), stop_after,
        LambdaHook(after_data=lambda t, b: seen.extend(row_ids(b)),
                   after_train=lambda t: interrupted.append(len(seen))))
    return {"seen": seen, "interrupted_at": interrupted[0], "unread": second.state.rows_unread,
            "position": saved_trainer["window_index"], "in_window": saved_trainer["batches_in_window"]}


def test_an_interrupted_and_resumed_run_trains_every_row_exactly_once_across_ranks(tmp_path) -> None:
    total = write_windows(str(tmp_path), [[16, 16], [24], [16]], row_group_size=5)
    r0, r1 = run_distributed(_resume_worker, 2, timeout_s=180, args=(str(tmp_path), 6))
    # Interrupted inside the second window (4 batches per rank in window 0, then 2 of 3).
    assert (r0["position"], r0["in_window"]) == (1, 2)
    assert r0["interrupted_at"] == r1["interrupted_at"] == 6 * 4
    everything = r0["seen"] + r1["seen"]
    assert r0["unread"] == r1["unread"] == 0
    assert len(everything) == len(set(everything)) == total
    assert sorted(everything) == list(range(total))


def _open_bandit_worker(root: str, num_windows: int) -> dict[str, Any]:
    windows = partitioned_windows(root)
    spec = open_bandit_features(num_embeddings=200)
    train = ParquetWindowDataset(windows[:num_windows], spec, batch_size=32, shuffle=True)
    # The streaming protocol: train on hour t, evaluate on hour t + 1.
    evals = ParquetWindowDataset(windows[1:num_windows + 1], spec, batch_size=64)
    losses: list[float] = []
    eval_rows: list[float] = []
    hook = LambdaHook(after_step=lambda t, out: losses.append(float(out.loss)),
                      after_evaluate=lambda t, m: eval_rows.append(m["num_samples"]))
    trainer = _trainer(spec, train, evals, hooks=[hook])
    trainer.train_and_evaluate()
    return {"steps": trainer.state.global_step, "losses": losses, "eval_rows": eval_rows}


def test_open_bandit_hourly_windows_train_and_evaluate_end_to_end_on_two_ranks(tmp_path) -> None:
    root = str(tmp_path / "obd")
    assert convert(root) == 168
    n = 6
    r0, r1 = run_distributed(_open_bandit_worker, 2, timeout_s=180, args=(root, n))
    assert r0["steps"] == r1["steps"] > n
    assert all(torch.isfinite(torch.tensor(r0["losses"])))
    hours = partitioned_windows(root)[1:n + 1]
    rows_per_eval_window = [sum(pq.ParquetFile(f).metadata.num_rows for f in w.files) for w in hours]
    assert r0["eval_rows"] == r1["eval_rows"] == rows_per_eval_window


def _bad_data_worker(root: str) -> dict[str, Any]:
    from recsys_trainer.data.sync import SyncedIterator
    from recsys_trainer.distributed import ProcessGroupGang, init_distributed

    init_distributed("cpu", timeout_s=600)  # a hang would outlive the test's own timeout
    import torch.distributed as dist

    ds = ParquetWindowDataset(root, row_id_spec(), batch_size=4)
    ds.setup(dist.get_rank(), dist.get_world_size())
    it = SyncedIterator(ds.iter_window("hour=00"), ProcessGroupGang(), pad=False)
    fetched = 0
    try:
        for _ in it:
            fetched += 1
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"fetched": fetched, "error": type(exc).__name__, "message": str(exc)}
    return {"fetched": fetched, "error": None, "message": ""}


def test_a_rank_whose_data_raises_makes_every_rank_raise_its_error_instead_of_hanging(tmp_path) -> None:
    write_windows(str(tmp_path), [[40]], row_group_size=40)
    f = str(tmp_path / "hour=00" / "part-0.parquet")
    t = pq.read_table(f)
    y = t["y"].to_pylist()
    y[9] = float("nan")  # rank 0's third batch (rows 8-11); rank 1 holds rows 20-39
    pq.write_table(t.set_column(t.schema.get_field_index("y"), "y", pa.array(y, pa.float32())), f)
    r0, r1 = run_distributed(_bad_data_worker, 2, timeout_s=90, args=(str(tmp_path),))
    assert r0["error"] == "DataError" and "row 9, column 'y'" in r0["message"]
    # Rank 1's data was fine: it raises the same kind of error, naming rank 0's file and row.
    assert r1["error"] == "DataError" and "rank 0 failed to read its next batch" in r1["message"]
    assert "part-0.parquet, row group 0, row 9, column 'y'" in r1["message"]
    # The chunk holding row 9 is decoded before rank 0's first batch is handed out.
    assert r0["fetched"] == r1["fetched"] == 0


# ---------------------------------------------------------------------------- listings that differ

def _lagging_listing_worker(root: str) -> dict[str, Any]:
    import os

    from recsys_trainer.data.windows import Window

    rank = int(os.environ["RANK"])

    def listing() -> list[Window]:
        # Rank 1's view of the shared directory lags: hour=01 looks empty (so it is skipped)
        # and hour=00's second file is not there yet.
        out = []
        for w in partitioned_windows(root):
            if rank == 1 and w.id == "hour=01":
                continue
            files = w.files[:1] if rank == 1 and w.id == "hour=00" else w.files
            out.append(Window(w.id, files))
        return out

    seen: list[int] = []
    steps: dict[str, int] = {}
    hook = LambdaHook(after_data=lambda t, b: seen.extend(row_ids(b)),
                      after_step=lambda t, out: steps.__setitem__(
                          t.state.window_id, steps.get(t.state.window_id, 0) + 1))
    ds = ParquetWindowDataset(listing, row_id_spec(), batch_size=4)
    _trainer(row_id_spec(), ds, hooks=[hook]).train()
    return {"seen": seen, "steps": steps}


def test_ranks_whose_listings_differ_train_rank_0s_listing_and_read_every_row_exactly_once(
        tmp_path) -> None:
    total = write_windows(str(tmp_path), [[16, 16], [24], [8]], row_group_size=4)
    r0, r1 = run_distributed(_lagging_listing_worker, 2, timeout_s=120, args=(str(tmp_path),))
    # Both ranks trained the same windows for the same steps (without the agreement, rank 1
    # skips hour=01 and the ranks' collectives fall out of step).
    assert r0["steps"] == r1["steps"] == {"hour=00": 4, "hour=01": 3, "hour=02": 1}
    everything = r0["seen"] + r1["seen"]
    assert sorted(everything) == list(range(total))


def _unreadable_on_rank_1_worker(root: str) -> dict[str, Any]:
    import os
    import time

    if int(os.environ["RANK"]) == 1:
        from recsys_trainer import storage

        real = storage.open_input_file  # every parquet file is opened through it

        def lagging(loc: Any) -> Any:
            if loc.url.endswith("hour=01/part-1.parquet"):
                raise FileNotFoundError(f"[Errno 2] No such file or directory: {loc.url!r}")
            return real(loc)

        storage.open_input_file = lagging  # type: ignore[assignment]
    ds = ParquetWindowDataset(root, row_id_spec(), batch_size=4)
    trainer = _trainer(row_id_spec(), ds)
    t0 = time.monotonic()
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"error": type(exc).__name__, "message": str(exc), "step": trainer.state.global_step,
                "seconds": time.monotonic() - t0}
    return {"error": None, "message": "", "step": trainer.state.global_step, "seconds": 0.0}


def test_a_listed_file_that_one_rank_cannot_open_is_a_data_error_naming_it_on_every_rank(
        tmp_path) -> None:
    write_windows(str(tmp_path), [[16], [16, 16]], row_group_size=4)
    r0, r1 = run_distributed(_unreadable_on_rank_1_worker, 2, timeout_s=120, args=(str(tmp_path),))
    missing = str(tmp_path / "hour=01" / "part-1.parquet")
    assert r1["error"] == "DataError" and f"file {missing}: cannot read the file" in r1["message"]
    assert r0["error"] == "DataError" and "rank 1 failed to read its next batch" in r0["message"]
    assert missing in r0["message"]
    assert r0["step"] == r1["step"] == 2  # hour=00 trained; both stopped at hour=01's first fetch
