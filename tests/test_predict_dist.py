"""Offline scoring on 2 real gloo ranks: uneven windows, every row exactly once, resume."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import pytest
import torch
from dist_utils import run_cli, run_distributed

pytestmark = pytest.mark.distributed

TIMEOUT = 240


def _predict_twice(data: str, out: str) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers import make_trainer
    from predict_utils import scoring_spec

    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.predict import MARKER

    def ds() -> ParquetWindowDataset:
        return ParquetWindowDataset(data, scoring_spec(), batch_size=4)

    trainer = make_trainer(output_dir=os.path.join(out, "ckpt"), resume_from=None)
    first = trainer.predict(ds(), os.path.join(out, "scores"))
    # An interrupted window: its marker gone, as if a rank died before the commit.
    if trainer.rank == 0:
        os.remove(os.path.join(out, "scores", "hour=02", MARKER))
    dist.barrier()
    again = trainer.predict(ds(), os.path.join(out, "scores"))
    # Seconds are each rank's own; the rest must be the same on every rank.
    return {"first": replace(first, seconds=0.0), "again": replace(again, seconds=0.0)}


def test_two_ranks_write_every_row_of_uneven_windows_exactly_once_and_a_rerun_redoes_only_the_uncommitted_one(
        tmp_path) -> None:
    from predict_utils import write_scoring_windows

    from recsys_trainer.predict import MARKER, read_predictions

    # Rows split by rank: 13 -> 6/7 (uneven batches), 1 -> 0/1 (rank 0 has no row at all and
    # pads while rank 1 scores), 10 -> 5/5 in two files.
    ids = write_scoring_windows(str(tmp_path / "data"), [[13], [1], [4, 6]])
    r0, r1 = run_distributed(_predict_twice, 2, TIMEOUT, args=(str(tmp_path / "data"), str(tmp_path)))
    assert r0 == r1  # every rank returns the same summary
    assert r0["first"].windows_written == ["hour=00", "hour=01", "hour=02"]
    assert r0["first"].rows_written == len(ids)
    assert r0["again"].windows_skipped == ["hour=00", "hour=01"]
    assert r0["again"].windows_written == ["hour=02"] and r0["again"].rows_written == 10
    got = read_predictions(str(tmp_path / "scores"))
    assert sorted(got["request_id"].to_pylist()) == ids  # each row once: none lost, none twice
    assert got["user"].to_pylist() == [f"u{i % 11}" for i in got["request_id"].to_pylist()]
    assert all(0.0 < p < 1.0 for p in got["y"].to_pylist())
    markers = {w: json.loads((tmp_path / "scores" / w / MARKER).read_text()) for w in ("hour=00", "hour=01")}
    assert markers["hour=00"]["files"] == [{"name": "part-00000-of-00002.parquet", "rows": 6},
                                           {"name": "part-00001-of-00002.parquet", "rows": 7}]
    # Rank 0 had no row of window 1: it wrote no file, and the marker lists rank 1's only.
    assert markers["hour=01"]["files"] == [{"name": "part-00001-of-00002.parquet", "rows": 1}]
    assert sorted(os.listdir(tmp_path / "scores" / "hour=01")) == [MARKER, "part-00001-of-00002.parquet"]


class _ShortOutputsPastRequest(torch.nn.Module):
    """The tiny DLRM whose outputs lose a row on batches holding request ids >= ``bad_from``:
    a model bug that shows on one rank's rows only."""

    def __init__(self, bad_from: int) -> None:
        super().__init__()
        from helpers import tiny_model

        self.inner = tiny_model()
        self.bad_from = bad_from

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = self.inner(batch)
        if float(batch.dense[:, 0].max()) * 4096 >= self.bad_from:
            return loss, logits[:-1]
        return loss, logits


def _one_rank_cannot_write(data: str, out: str, bad_from: int) -> dict[str, Any]:
    import time

    from predict_utils import scoring_spec

    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.data.parquet import ParquetWindowDataset

    trainer = Trainer(_ShortOutputsPastRequest(bad_from), TrainingArguments(
        output_dir=os.path.join(out, "ckpt"), resume_from=None, collective_timeout_s=120),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad"), add_logger_hook=False)
    t0 = time.monotonic()
    try:
        trainer.predict(ParquetWindowDataset(data, scoring_spec(), batch_size=4), os.path.join(out, "scores"))
    except OSError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def test_a_write_that_fails_on_one_rank_stops_both_with_its_error_and_commits_nothing(tmp_path) -> None:
    from predict_utils import write_scoring_windows

    from recsys_trainer.predict import committed_windows

    ids = write_scoring_windows(str(tmp_path / "data"), [[40]])
    # Rank 1 holds the second half of the window: its outputs cannot be written from its first
    # batch on, while rank 0 would go on scoring.
    results = run_distributed(_one_rank_cannot_write, 2, TIMEOUT,
                              args=(str(tmp_path / "data"), str(tmp_path), ids[20]))
    for r in results:
        assert r["error"] is not None and r["error"].startswith(
            "predict: rank 1 could not write its rows of window 'hour=00' to ")
        assert "y must be a tensor of one value per row (4), but is (3,)" in r["error"]
        assert r["seconds"] < 60  # agreed at the next fetch, not after the collective timeout
    assert committed_windows(str(tmp_path / "scores")) == {}


def _torchrun(config: str) -> str:
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "--max_restarts=0", "-m", "recsys_trainer", config],
                       capture_output=True, text=True, timeout=TIMEOUT, cwd=repo,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    return p.stdout


def test_run_predict_and_evaluate_score_with_a_train_runs_checkpoint_under_another_data_section(
        tmp_path) -> None:
    """``run: train`` saves no eval-data state and a position in its own batches; scoring must
    restore the model only, so the data section may differ: eval data, another batch size and
    seed, passthrough columns. Through the CLI on 2 ranks: the scoring runs under torchrun, the
    training run (the checkpoint they need) on ``run_distributed``'s ranks."""
    import math
    import re

    import yaml
    from helpers import FEATURES, NUM_DENSE, ROWS
    from predict_utils import write_scoring_windows

    from recsys_trainer.predict import read_predictions

    data = str(tmp_path / "data")
    ids = write_scoring_windows(data, [[20], [12]])
    features = {"labels": ["y"], "dense": [f"d{i}" for i in range(NUM_DENSE)],
                "sparse": [{"name": f, "num_embeddings": ROWS} for f in FEATURES]}
    base = {"args": {"output_dir": str(tmp_path / "ckpt"), "save_end": True, "log_steps": 100},
            "model": {"embedding_dim": 8, "dense_arch": [16], "over_arch": [16, 1]},
            "dense_optimizer": {"name": "adam", "lr": 0.05},
            "predict": {"output_dir": str(tmp_path / "scores")}}
    configs = {
        "train": {**base, "run": "train", "data": {
            "kind": "parquet", "train": data, "batch_size": 4, "features": features}},
        **{run: {**base, "run": run, "data": {
            "kind": "parquet", "eval": data, "batch_size": 16, "seed": 3,
            "features": {**features, "passthrough": ["request_id", "user"]}}}
           for run in ("predict", "evaluate")},
    }
    out = {}
    for run, cfg in configs.items():
        path = tmp_path / f"{run}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        if run == "train":
            ranks = run_distributed(run_cli, 2, TIMEOUT, args=([str(path)],))
            assert [code for code, _ in ranks] == [0, 0], ranks
            out[run] = "".join(text for _, text in ranks)
        else:
            out[run] = _torchrun(str(path))
    steps = {run: sorted(re.findall(r"rank (\d)/2 done: global_step=(\d+) ", o))
             for run, o in out.items()}
    trained = steps["train"][0][1]
    assert int(trained) > 0 and steps["train"] == [("0", trained), ("1", trained)]
    # Both scoring runs loaded that checkpoint's model (its step), on both ranks.
    assert steps["predict"] == steps["evaluate"] == steps["train"], out
    written = re.findall(r"predicted_rows=(\d+)", out["predict"])  # all ranks' rows, per rank
    scores = read_predictions(str(tmp_path / "scores"))
    assert written == [str(len(ids))] * 2 and sorted(scores["request_id"].to_pylist()) == ids
    assert scores["user"].to_pylist() == [f"u{i % 11}" for i in scores["request_id"].to_pylist()]
    # evaluate's loss over every row is the log loss of predict's probabilities: one model.
    losses = set(re.findall(r"eval=\{'loss': ([0-9.e-]+), 'num_samples': 32", out["evaluate"]))
    assert len(losses) == 1, out["evaluate"]
    logloss = -sum(math.log(p if i % 3 == 0 else 1.0 - p) for i, p in
                   zip(scores["request_id"].to_pylist(), scores["y"].to_pylist(), strict=True))
    assert abs(float(losses.pop()) - logloss / len(ids)) < 1e-4
