"""The production data paths together, against a real S3 server (SeaweedFS on 127.0.0.1, the
``s3_server`` fixture): scoring windows read from a bucket into a bucket on 2 ranks; passthrough
columns of windows in a bucket reaching hooks; the test mode with data and output_dir in a bucket
(2 ranks without a shared TMPDIR, the CLI, a missing bucket); ``run: predict`` with a model by
import path scoring into a bucket, and its test mode; save periods in rows with checkpoints in a
bucket."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pyarrow.fs as pafs
import pytest
from dist_utils import run_distributed
from s3_server import S3Server, upload_dir

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 240


def _keys(server: S3Server, prefix: str) -> list[str]:
    fs = server.filesystem()
    sel = pafs.FileSelector(f"{server.bucket}/{prefix}", recursive=True, allow_not_found=True)
    return sorted(i.path.split(f"{prefix}/", 1)[1] for i in fs.get_file_info(sel)
                  if i.type == pafs.FileType.File)


def _predict_bucket_to_bucket(data: str, out: str) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers import make_trainer
    from predict_utils import scoring_spec

    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.predict import MARKER
    from recsys_trainer.storage import resolve

    def ds() -> ParquetWindowDataset:
        return ParquetWindowDataset(data, scoring_spec(), batch_size=4)

    trainer = make_trainer(output_dir=f"{out}/ckpt", resume_from=None)
    first = trainer.predict(ds(), f"{out}/scores")
    # An interrupted window: its marker gone and a stray half-written part of another world
    # size left behind, as if a job of 4 ranks died before the commit.
    if trainer.rank == 0:
        loc = resolve(f"{out}/scores/hour=02")
        loc.filesystem.delete_file(loc.join(MARKER).path)
        with loc.filesystem.open_output_stream(loc.join("part-00003-of-00004.parquet").path) as f:
            f.write(b"half-written")
    dist.barrier()
    again = trainer.predict(ds(), f"{out}/scores")
    return {"first": replace(first, seconds=0.0), "again": replace(again, seconds=0.0)}


@pytest.mark.distributed
def test_two_ranks_score_windows_in_a_bucket_into_a_bucket_each_row_once_marker_last_and_resume(
        s3_server: S3Server, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from predict_utils import write_scoring_windows

    from recsys_trainer.predict import MARKER, committed_windows, read_predictions

    ids = write_scoring_windows(str(tmp_path / "data"), [[13], [1], [4, 6]])
    upload_dir(s3_server.filesystem(), str(tmp_path / "data"), f"{s3_server.bucket}/seam_predict/data")
    data, out = s3_server.url("seam_predict", "data"), s3_server.url("seam_predict", "run")
    r0, r1 = run_distributed(_predict_bucket_to_bucket, 2, TIMEOUT, args=(data, out), env=s3_server.env())
    assert r0 == r1
    assert r0["first"].windows_written == ["hour=00", "hour=01", "hour=02"]
    assert r0["first"].rows_written == len(ids)
    assert r0["again"].windows_skipped == ["hour=00", "hour=01"]
    assert r0["again"].windows_written == ["hour=02"] and r0["again"].rows_written == 10

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    got = read_predictions(f"{out}/scores")
    assert sorted(got["request_id"].to_pylist()) == ids  # each row once: none lost, none twice
    assert got["user"].to_pylist() == [f"u{i % 11}" for i in got["request_id"].to_pylist()]
    assert sorted(committed_windows(f"{out}/scores")) == ["hour=00", "hour=01", "hour=02"]
    # The re-run cleared the stray part of the interrupted attempt; only listed files remain.
    assert _keys(s3_server, "seam_predict/run/scores/hour=02") == [
        MARKER, "part-00000-of-00002.parquet", "part-00001-of-00002.parquet"]
    assert _keys(s3_server, "seam_predict/run/scores/hour=01") == [MARKER, "part-00001-of-00002.parquet"]


def test_passthrough_columns_of_windows_in_a_bucket_reach_the_hooks(
        s3_server: S3Server, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import make_trainer
    from predict_utils import request_ids_of, scoring_spec, write_scoring_windows

    from recsys_trainer import Hook
    from recsys_trainer.data.parquet import ParquetWindowDataset

    class Collect(Hook):
        def __init__(self) -> None:
            self.ids: list[int] = []

        def after_step(self, trainer: Any, output: Any) -> None:
            for m in output.micro_batches:
                ids = m.batch.passthrough["request_id"].to_pylist()
                assert ids == request_ids_of(m.batch)  # aligned with the rows it rides with
                assert m.batch.passthrough["user"].to_pylist() == [f"u{i % 11}" for i in ids]
                self.ids.extend(ids)

    all_ids = write_scoring_windows(str(tmp_path / "data"), [[9, 14], [11]])
    upload_dir(s3_server.filesystem(), str(tmp_path / "data"), f"{s3_server.bucket}/seam_passthrough")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    hook = Collect()
    ds = ParquetWindowDataset(s3_server.url("seam_passthrough"), scoring_spec(), batch_size=8,
                              prefetch_batches=2)
    trainer = make_trainer(train=ds, hooks=[hook], output_dir=str(tmp_path / "out"), resume_from=None)
    trainer.train()
    assert sorted(hook.ids) == all_ids


def _smoke_in_bucket(out: str, tmp_root: str) -> dict[str, Any]:
    import tempfile

    from helpers import batches, make_trainer

    # Each rank its own $TMPDIR, as on two nodes that share no disk.
    own = os.path.join(tmp_root, f"node{os.environ['RANK']}")
    os.makedirs(own)
    tempfile.tempdir = own
    trainer = make_trainer(train=batches(4), eval_=batches(2, seed=1), output_dir=out, smoke_test=True)
    smoke_dir = trainer.args.output_dir
    trainer.train()
    assert trainer.smoke is not None
    return {"dir": smoke_dir, "steps": trainer.smoke.report["steps"], "left": os.listdir(own)}


@pytest.mark.distributed
def test_smoke_mode_with_output_dir_in_a_bucket_saves_and_resumes_there_without_a_shared_tmpdir(
        s3_server: S3Server, tmp_path: Any) -> None:
    out = s3_server.url("seam_smoke", "job")
    r0, r1 = run_distributed(_smoke_in_bucket, 2, TIMEOUT, args=(out, str(tmp_path)), env=s3_server.env())
    # The save and resume went through the job's own bucket, in a prefix both ranks agree on...
    assert r0["dir"] == r1["dir"] and r0["dir"].startswith(f"{out}/_smoke-")
    assert r0["steps"] == r1["steps"] == 3
    # ...which is gone afterwards, as are the ranks' local log directories.
    assert _keys(s3_server, "seam_smoke") == []
    assert r0["left"] == r1["left"] == []


def test_the_cli_smoke_flag_on_a_config_whose_data_and_output_dir_are_in_a_bucket(
        s3_server: S3Server, tmp_path: Any) -> None:
    import subprocess
    import sys

    import yaml
    from data_utils import write_windows
    from test_cli_components import custom, env

    write_windows(str(tmp_path / "data"), [[40, 24], [32]])
    upload_dir(s3_server.filesystem(), str(tmp_path / "data"), f"{s3_server.bucket}/seam_cli_smoke/data")
    raw = custom(tmp_path, run="train_and_evaluate")
    raw["args"]["output_dir"] = s3_server.url("seam_cli_smoke", "out")
    raw["data"]["root"] = s3_server.url("seam_cli_smoke", "data")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    p = subprocess.run([sys.executable, "-m", "recsys_trainer", str(tmp_path / "c.yaml"), "--smoke"],
                       capture_output=True, text=True, timeout=200, cwd=tmp_path,
                       env={**env(), **s3_server.env(), "TMPDIR": str(tmp_path)}, check=False)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "rank 0/1 smoke test passed: {" in p.stdout and "'checkpoint_step': 2" in p.stdout
    assert _keys(s3_server, "seam_cli_smoke/out") == []  # nothing left in the job's output_dir
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "data", "log.rank0.json"]  # no ./logs, no temp dir

    # An output_dir the long job could not write to fails the smoke test, naming the bucket.
    raw["args"]["output_dir"] = "s3://no-such-bucket-smoke/out"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    p = subprocess.run([sys.executable, "-m", "recsys_trainer", str(tmp_path / "c.yaml"), "--smoke"],
                       capture_output=True, text=True, timeout=200, cwd=tmp_path,
                       env={**env(), **s3_server.env(), "TMPDIR": str(tmp_path)}, check=False)
    assert p.returncode == 1, p.stdout + p.stderr[-4000:]
    assert "smoke test FAILED in phase 'save'" in p.stderr and "'no-such-bucket-smoke'" in p.stderr, p.stderr[-3000:]


def test_run_predict_with_a_model_by_import_path_scores_into_a_bucket_and_its_smoke_test_does_not(
        s3_server: S3Server, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import re
    import subprocess
    import sys

    import yaml
    from test_cli_components import custom, env

    from recsys_trainer.predict import read_predictions

    raw = custom(tmp_path, run="train")  # 2 windows of 64 and 32 rows, ConcatMLP by import path
    raw["args"].update(save_end=True, resume_from="auto")
    raw["predict"] = {"output_dir": s3_server.url("seam_cli_predict", "scores")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))

    def cli(*extra: str) -> str:
        p = subprocess.run([sys.executable, "-m", "recsys_trainer", str(tmp_path / "c.yaml"), *extra],
                           capture_output=True, text=True, timeout=200, cwd=tmp_path,
                           env={**env(), **s3_server.env(), "TMPDIR": str(tmp_path)}, check=False)
        assert p.returncode == 0, p.stdout + p.stderr[-4000:]
        return p.stdout

    assert "global_step=5" in cli()
    # The test mode of the scoring job: its phases plus one scored batch, all in a temporary
    # directory; the job's scores directory stays empty.
    out = cli("--run", "predict", "--smoke")
    assert re.search(r"smoke test passed: \{.*'predicted_rows': 8\b", out), out
    assert _keys(s3_server, "seam_cli_predict") == []
    # The scoring job itself: the trained checkpoint, every row into the bucket.
    out = cli("--run", "predict")
    assert "global_step=5 " in out and "predicted_rows=96" in out
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    got = read_predictions(s3_server.url("seam_cli_predict", "scores"))
    assert got.num_rows == 96 and set(got["window"].to_pylist()) == {"hour=00", "hour=01"}
    assert all(0.0 < p < 1.0 for p in got["y"].to_pylist())


def test_save_periods_in_rows_with_checkpoints_in_a_bucket_resume_the_row_count(
        s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from helpers import batches, make_trainer

    from recsys_trainer.checkpoint import layout

    monkeypatch.chdir(tmp_path)  # hooks' local files go under ./logs/<bucket>/<prefix>
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    out = s3_server.url("seam_rows", "job")
    first = make_trainer(train=batches(10, batch_size=32), output_dir=out, save_every_n_rows=150,
                         max_to_keep=10, resume_from="auto")
    first.train()
    assert [c.step for c in layout.list_committed(out)] == [5, 10]  # 160 and 320 rows
    more = make_trainer(train=batches(10, batch_size=32), output_dir=out, save_every_n_rows=150,
                        max_to_keep=10, train_epoch=2, resume_from="auto")
    more.train()
    # rows_seen came back from the bucket: the next saves fall at 480 and 608 rows (450, 600).
    assert more.state.rows_seen == 640
    assert [c.step for c in layout.list_committed(out)] == [5, 10, 15, 19]
