"""Offline scoring on one process: what ``Trainer.predict`` writes, how it resumes, its errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from helpers import make_trainer
from predict_utils import PASSTHROUGH, request_ids_of, scoring_spec, write_scoring_windows

from recsys_trainer import Hook
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.predict import (
    MARKER,
    PredictOptions,
    committed_windows,
    output_columns,
    read_predictions,
    window_dir,
)


def _ds(root: Path, **kw: Any) -> ParquetWindowDataset:
    kw.setdefault("batch_size", 8)
    return ParquetWindowDataset(str(root), scoring_spec(**kw.pop("spec", {})), **kw)


class _Logits(Hook):
    """Evaluation's logits by request id: what predict must agree with."""

    def __init__(self) -> None:
        self.by_id: dict[int, float] = {}

    def after_eval_step(self, trainer: Any, output: Any) -> None:
        if not output.is_padding:
            for m in output.micro_batches:
                self.by_id.update(zip(request_ids_of(m.batch), m.outputs.tolist(), strict=True))


def test_predict_writes_every_row_once_with_the_probabilities_evaluate_computes(tmp_path: Path) -> None:
    ids = write_scoring_windows(str(tmp_path / "data"), [[9, 14], [0], [11]])
    logits = _Logits()
    trainer = make_trainer(train=_ds(tmp_path / "data"), eval_=_ds(tmp_path / "data"), hooks=[logits],
                           output_dir=str(tmp_path / "ckpt"), resume_from=None)
    trainer.train()  # a trained (not initial) model
    trainer.evaluate()
    summary = trainer.predict(_ds(tmp_path / "data", prefetch_batches=0), str(tmp_path / "scores"))
    assert summary.windows_written == ["hour=00", "hour=01", "hour=02"] and summary.windows_skipped == []
    assert summary.rows_written == len(ids)
    got = read_predictions(str(tmp_path / "scores"))
    assert got.column_names == ["window", *PASSTHROUGH, "y"]  # the score is named after the label
    assert sorted(got["request_id"].to_pylist()) == ids
    assert got["user"].to_pylist() == [f"u{i % 11}" for i in got["request_id"].to_pylist()]
    expected = torch.sigmoid(torch.tensor([logits.by_id[i] for i in got["request_id"].to_pylist()]))
    torch.testing.assert_close(torch.tensor(got["y"].to_pylist()), expected, rtol=0, atol=1e-6)
    marker = json.loads((tmp_path / "scores" / "hour=02" / MARKER).read_text())
    assert marker == {"window": "hour=02", "world_size": 1, "rows": 11,
                      "files": [{"name": "part-00000-of-00001.parquet", "rows": 11}]}
    # A window of 0 rows is committed too (no file): a re-run need not look at it again.
    assert json.loads((tmp_path / "scores" / "hour=01" / MARKER).read_text())["files"] == []
    # Raw outputs (activation="none"), under other names: the logits themselves.
    trainer.predict(_ds(tmp_path / "data"), str(tmp_path / "raw"), activation="none", output_names=["logit"])
    raw = read_predictions(str(tmp_path / "raw"))
    torch.testing.assert_close(torch.tensor(raw["logit"].to_pylist()),
                               torch.tensor([logits.by_id[i] for i in raw["request_id"].to_pylist()]),
                               rtol=0, atol=1e-6)


def test_a_rerun_skips_committed_windows_and_redoes_an_uncommitted_one_without_duplicates(tmp_path: Path) -> None:
    ids = write_scoring_windows(str(tmp_path / "data"), [[10], [13], [7]])
    out = tmp_path / "scores"
    trainer = make_trainer(output_dir=str(tmp_path / "ckpt"), resume_from=None)
    # Small row groups: several per file, so a file holds more than one flush.
    first = trainer.predict(_ds(tmp_path / "data", batch_size=4), str(out), rows_per_row_group=5)
    assert first.windows_written == ["hour=00", "hour=01", "hour=02"]
    assert pq.ParquetFile(out / "hour=01" / "part-00000-of-00001.parquet").metadata.num_row_groups == 2
    # An interrupted run: window 1 lost its marker and holds a stale file of another world size.
    (out / "hour=01" / MARKER).unlink()
    (out / "hour=01" / "part-00003-of-00004.parquet").write_bytes(b"half-written")
    kept = (out / "hour=00" / "part-00000-of-00001.parquet").stat().st_mtime_ns
    assert sorted(committed_windows(str(out))) == ["hour=00", "hour=02"]
    again = trainer.predict(_ds(tmp_path / "data", batch_size=4), str(out))
    assert again.windows_skipped == ["hour=00", "hour=02"] and again.windows_written == ["hour=01"]
    assert again.rows_written == 13
    assert sorted(os.listdir(out / "hour=01")) == [MARKER, "part-00000-of-00001.parquet"]
    assert (out / "hour=00" / "part-00000-of-00001.parquet").stat().st_mtime_ns == kept
    assert sorted(read_predictions(str(out))["request_id"].to_pylist()) == ids


def test_an_output_named_like_a_passthrough_column_is_refused_naming_both(tmp_path: Path) -> None:
    write_scoring_windows(str(tmp_path / "data"), [[5]])
    trainer = make_trainer(output_dir=str(tmp_path / "ckpt"), resume_from=None)
    ds = _ds(tmp_path / "data", spec={"passthrough": ["request_id", "y"]})
    with pytest.raises(OSError, match=r"rank 0 could not write its rows of window 'hour=00' to .*scores/hour=00: "
                                      r"ValueError: output column\(s\) \['y'\] clash with passthrough"):
        trainer.predict(ds, str(tmp_path / "scores"))
    assert committed_windows(str(tmp_path / "scores")) == {}
    # Named otherwise, the raw label and the score sit side by side.
    trainer.predict(ds, str(tmp_path / "scores"), output_names=["p_y"])
    got = read_predictions(str(tmp_path / "scores"))
    assert got.column_names == ["window", "request_id", "y", "p_y"] and got.num_rows == 5


def test_an_output_dir_that_cannot_be_created_is_named(tmp_path: Path) -> None:
    write_scoring_windows(str(tmp_path / "data"), [[5]])
    (tmp_path / "file").write_text("not a directory")
    trainer = make_trainer(output_dir=str(tmp_path / "ckpt"), resume_from=None)
    with pytest.raises(OSError, match=r"predict: rank 0 cannot prepare the output directory .*file/hour=00: "):
        trainer.predict(_ds(tmp_path / "data"), str(tmp_path / "file"))


def test_output_columns_are_named_after_the_tasks_or_score() -> None:
    two = torch.tensor([[0.0, 2.0], [1.0, -1.0]])
    cols = output_columns(two, ["click", "like"], "sigmoid", 2)
    assert list(cols) == ["click", "like"]
    torch.testing.assert_close(torch.from_numpy(cols["like"]), torch.sigmoid(two[:, 1]))
    assert list(output_columns(two, None, "none", 2)) == ["score_0", "score_1"]
    assert list(output_columns(two[:, :1], ["click", "like"], "none", 2)) == ["score"]
    assert output_columns(torch.tensor([3.0]), ["click"], "none", 1)["click"].tolist() == [3.0]
    named = output_columns({"ctr": torch.zeros(2), "cvr": torch.ones(2, 1)}, ["y"], "none", 2)
    assert {k: v.tolist() for k, v in named.items()} == {"ctr": [0.0, 0.0], "cvr": [1.0, 1.0]}
    with pytest.raises(ValueError, match=r"returned only the loss; to predict it must return \(loss, outputs\)"):
        output_columns(None, None, "sigmoid", 2)
    with pytest.raises(ValueError, match=r"outputs\['ctr'\] must be a tensor of one value per row \(2\), but is \(3,\)"):
        output_columns({"ctr": torch.zeros(3)}, None, "none", 2)
    with pytest.raises(ValueError, match=r"must be \[B\] or \[B, T\] per batch, but have shape \(2, 1, 1\)"):
        output_columns(torch.zeros(2, 1, 1), None, "none", 2)


def test_window_ids_become_partition_directories_and_odd_ids_are_encoded() -> None:
    assert window_dir("dt=2019-11-24/hour=05") == ["dt=2019-11-24", "hour=05"]
    assert window_dir("/data/2019-11-24/*.parquet") == ["data", "2019-11-24", "%2A.parquet"]
    assert window_dir("_tmp/.x/..") == ["%5Ftmp", "%2Ex", "%2E."]


@pytest.mark.parametrize("change, pattern", [
    ({"activation": "softmax"}, r"`activation` must be one of 'sigmoid', 'none', but is 'softmax'"),
    ({"output_names": "click"}, r"`output_names` must be None or a list of column names"),
    ({"output_names": ["a", "a"]}, r"`output_names` must be unique"),
    ({"output_dir": ""}, r"`output_dir` must be a path or URL"),
])
def test_predict_options_name_the_bad_field(change: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        PredictOptions(**{"output_dir": "x", **change})


def _cli(config: Path, *extra: str) -> str:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "recsys_trainer", str(config), *extra],
                       capture_output=True, text=True, timeout=180,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return p.stdout


def test_run_predict_scores_the_eval_data_with_the_newest_checkpoint_of_a_cli_training_run(tmp_path: Path) -> None:
    import yaml
    from helpers import FEATURES, NUM_DENSE, ROWS

    ids = write_scoring_windows(str(tmp_path / "data"), [[20], [12]])
    features = {"labels": ["y"], "dense": [f"d{i}" for i in range(NUM_DENSE)],
                "sparse": [{"name": f, "num_embeddings": ROWS} for f in FEATURES],
                "passthrough": ["request_id"]}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "run": "train",
        "args": {"output_dir": str(tmp_path / "ckpt"), "save_end": True, "resume_from": "auto"},
        "model": {"embedding_dim": 8, "dense_arch": [16], "over_arch": [16, 1]},
        "data": {"kind": "parquet", "train": str(tmp_path / "data"), "eval": str(tmp_path / "data"),
                 "batch_size": 8, "features": features},
        "dense_optimizer": {"name": "adam", "lr": 0.05},
        "predict": {"output_dir": str(tmp_path / "scores")},
    }))
    assert "global_step=5" in _cli(config)  # 20 + 12 rows in batches of 8
    out = _cli(config, "--run", "predict")
    assert "rank 0/1 done: global_step=5 " in out and "predicted_rows=32" in out  # checkpoint loaded
    trained = read_predictions(str(tmp_path / "scores"))
    assert sorted(trained["request_id"].to_pylist()) == ids
    # The same data scored by the untrained model: other scores, so the checkpoint was used.
    _cli(config, "--run", "predict", "--args.resume_from", "null", "--args.output_dir", str(tmp_path / "none"),
         "--predict.output_dir", str(tmp_path / "untrained"))
    untrained = read_predictions(str(tmp_path / "untrained"))
    assert trained["request_id"].to_pylist() == untrained["request_id"].to_pylist()
    assert trained["y"].to_pylist() != untrained["y"].to_pylist()


def test_scoring_restores_the_trained_model_whatever_the_data_section_of_training_was(
        tmp_path: Path) -> None:
    """A ``train_and_evaluate`` checkpoint holds both datasets' positions, tied to their
    configuration; ``resume(mode="scoring")`` restores the model (and the step) only, so
    scoring data with another batch size, seed and passthrough columns is fine."""
    data = tmp_path / "data"
    write_scoring_windows(str(data), [[20], [12]])
    trained = make_trainer(_ds(data, spec={"passthrough": []}), _ds(data, spec={"passthrough": []}),
                           output_dir=str(tmp_path / "ckpt"), save_end=True, resume_from=None)
    trained.train_and_evaluate()
    expected = trained.evaluate()
    scorer = make_trainer(None, _ds(data, batch_size=16, seed=5), output_dir=str(tmp_path / "ckpt"))
    scorer.resume(mode="scoring")
    assert scorer.state.global_step == trained.state.global_step > 0
    got = scorer.evaluate()
    assert got["num_samples"] == expected["num_samples"] == 32
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)


def test_a_scoring_restore_brings_back_the_dynamic_tables_id_maps_with_the_model(
        tmp_path: Path) -> None:
    """Dynamic tables' id maps are model buffers: a scoring restore (no train data, no
    optimizer state) maps raw ids to the trained rows; their component comes along too."""
    from test_checkpoint_trainer import snapshot
    from test_dynamic import FEATS, build, resident_ids

    from recsys_trainer.checkpoint.contents import scoring_components
    from recsys_trainer.data.generators.id_stream import IdStream
    from recsys_trainer.dynamic import DynamicTable

    spec = DynamicTable(num_slots=64, eviction_interval=2)
    trained = build(str(tmp_path), spec, IdStream(FEATS, 40).batches(6, 32, seed=0),
                    train_steps=6, save_end=True)
    trained.train()
    scorer = build(str(tmp_path), spec, None)
    assert scoring_components(scorer.state_components()) == ["model", "vocabularies", "dynamic_tables"]
    scorer.resume(mode="scoring")
    ids, slots = resident_ids(scorer, "t_u")
    want_ids, want_slots = resident_ids(trained, "t_u")
    assert len(ids) > 0 and ids.tolist() == want_ids.tolist() and slots.tolist() == want_slots.tolist()
    model = {k: v for k, v in snapshot(scorer).items() if k.startswith("model.")}
    want = {k: v for k, v in snapshot(trained).items() if k.startswith("model.")}
    assert model.keys() == want.keys() and all(torch.equal(model[k], want[k]) for k in model)


def test_run_predict_without_a_predict_section_is_a_config_error_naming_it() -> None:
    from recsys_trainer.config import ConfigError, RunConfig

    raw = {"run": "predict", "model": {"sparse_features": 2, "num_dense": 1, "num_embeddings": 10},
           "data": {"kind": "synthetic"}}
    with pytest.raises(ConfigError, match=r"`run: predict` needs a `predict` section with `output_dir`"):
        RunConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"`predict`: `activation` must be one of 'sigmoid', 'none'"):
        RunConfig.from_dict({**raw, "predict": {"output_dir": "s", "activation": "relu"}})
    cfg = RunConfig.from_dict({**raw, "predict": {"output_dir": "s3://bucket/scores"}})
    assert cfg.predict == PredictOptions(output_dir="s3://bucket/scores")
