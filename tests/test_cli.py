"""The ``recsys-train`` CLI: config validation, overrides, and real runs (1 process, 2 nodes)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from recsys_trainer.config import (
    ConfigError,
    ParquetDataConfig,
    RunConfig,
    apply_overrides,
    coerce_value,
    load_config,
)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

TINY = {
    "run": "train",
    "args": {"output_dir": "OUT", "train_steps": 6, "log_steps": 3, "resume_from": None},
    "model": {"sparse_features": 4, "num_dense": 4, "num_embeddings": 200, "embedding_dim": 8,
              "dense_arch": [16], "over_arch": [16, 1]},
    "data": {"kind": "synthetic", "batch_size": 32, "train_batches": 10, "eval_batches": 2},
    "dense_optimizer": {"name": "adam", "lr": 0.01},
    "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.05},
}


def tiny(**changes: Any) -> dict[str, Any]:
    """A deep copy of TINY with ``{"section.key": value}`` style changes."""
    return apply_overrides(TINY, [(k, str(v)) for k, v in changes.items()])


def write_config(tmp_path: Path, raw: dict[str, Any]) -> Path:
    import yaml

    raw = apply_overrides(raw, [("args.output_dir", str(tmp_path / "out"))])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# ------------------------------------------------------------------ config (no process group)


def test_the_example_config_loads_and_overrides_apply_with_yaml_typing() -> None:
    cfg = load_config(str(REPO / "examples/configs/dlrm_synthetic.yaml"),
                      [("args.train_steps", "100"), ("dense_optimizer.lr", "1e-3"),
                       ("args.max_grad_norm", "null"), ("hooks", "[metrics, {name: jsonl, every: 5}]")])
    assert cfg.args.train_steps == 100
    assert cfg.dense_optimizer.lr == pytest.approx(1e-3)
    assert cfg.args.max_grad_norm is None
    assert [h.name for h in cfg.hooks] == ["metrics", "jsonl"]
    assert cfg.hooks[1].kwargs == {"every": 5}
    assert cfg.model.sparse_features == [f"cat_{i}" for i in range(26)]


@pytest.mark.parametrize(("text", "value"), [
    ("100", 100), ("0.5", 0.5), ("1e-3", 1e-3), ("-2E4", -2e4), ("true", True), ("null", None),
    ("None", None), ("[1, 2]", [1, 2]), ("{a: 1}", {"a": 1}), ("bf16", "bf16"), ("'no'", "no"),
    ("out/dir", "out/dir"),
])
def test_override_values_are_typed_like_yaml(text: str, value: Any) -> None:
    assert coerce_value(text) == value


def test_an_unknown_top_level_key_is_named_with_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown top-level key `trainer`; allowed: run, args, model"):
        RunConfig.from_dict({**TINY, "trainer": {}})


def test_an_unknown_args_key_is_named_with_the_allowed_keys() -> None:
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(tiny(**{"args.train_stpes": 5}))
    msg = str(e.value)
    assert "`args.train_stpes`" in msg and "allowed keys in `args`:" in msg and "train_steps" in msg


def test_a_bad_args_value_raises_the_training_arguments_error() -> None:
    with pytest.raises(ConfigError, match=r"`train_steps` must be an int >= 1 or None, but is 0"):
        RunConfig.from_dict(tiny(**{"args.train_steps": 0}))


@pytest.mark.parametrize(("change", "pattern"), [
    ({"run": "fit"}, r"`run` must be one of train, evaluate, train_and_evaluate, predict, export, but is 'fit'"),
    ({"data.kind": "csv"}, r"`data.kind` must be one of synthetic, parquet, kafka, but is 'csv'"),
    ({"data.batch_sz": 3}, r"unknown key `data.batch_sz`; allowed keys in `data`: kind, batch_size"),
    ({"data.batch_size": 0}, r"`data.batch_size` must be an int >= 1, but is 0"),
    ({"model.over_arch": "[16, 2]"}, r"`model.over_arch` must end with 1"),
    ({"model.kind": "dcn"}, r"`model.kind` must be one of dlrm, but is 'dcn'"),
    ({"dense_optimizer.name": "lion"}, r"`dense_optimizer.name` must be one of adam, adamw, sgd"),
    ({"dense_optimizer.kwargs": "{momentum: 0.9}"},
     r"`dense_optimizer.kwargs.momentum` for torch.optim.Adam; allowed: betas, eps"),
    ({"sparse_optimizer.name": "adamw"}, r"`sparse_optimizer.name` must be one of sgd, adagrad, rowwise_adagrad"),
    ({"hooks": "[auc]"}, r"`hooks\[0\]` names hook 'auc'; allowed: logger, metrics, jsonl"),
    ({"hooks": "[{name: early_stopping, patients: 2}]"},
     r"unknown key\(s\) `hooks\[0\].patients` for hook 'early_stopping'; allowed: name, metric, mode, patience"),
    ({"hooks": "[{name: early_stopping, patience: 0}]"}, r"`hooks\[0\]` \(early_stopping\): `patience` must be"),
    ({"model.num_dense": "null"}, r"with `data.kind: synthetic` the model defines the schema: set `model.num_dense`"),
    ({"model.dynamic": "{num_slots: 1}"}, r"^`model.dynamic.num_slots` must be an int >= 2, but is 1\.$"),
    ({"model.dynamic": "{num_slot: 64}"},
     r"unknown key `model.dynamic.num_slot`; allowed keys in `model.dynamic`: num_slots, eviction_policy"),
    ({"model.dynamic": "{num_slots: 64, eviction_policy: lfru}"},
     r"`model.dynamic.eviction_policy` must be one of 'decayed_lfu', 'distance_lfu', 'lfu', 'lru'"),
    ({"model.dynamic": "{eviction_interval_rows: 64}"}, r"missing required key `model.dynamic.num_slots`"),
    ({"model.dynamic": "64"}, r"`model.dynamic` must be a mapping of keys to values, but is 64"),
    ({"model.dynamic": "{cat_0: {num_slots: 1}}"},
     r"^`model.dynamic.cat_0.num_slots` must be an int >= 2, but is 1\.$"),
    ({"model.dynamic": "{cat_0: {num_slots: 64}, num_slots: 64}"},
     r"`model.dynamic` takes either DynamicTable's fields .* not both: `model.dynamic.num_slots` is "
     r"a value, `model.dynamic.cat_0` a mapping"),
    ({"model.dynamic": "{cat_9: {num_slots: 64}}"},
     r"`model.dynamic` names features \['cat_9'\] that the model does not have; its sparse "
     r"features are \['cat_0', 'cat_1', 'cat_2', 'cat_3'\]"),
    ({"model.dynamic": "{}"}, r"`model.dynamic` is empty: give DynamicTable's fields .* or one "
                              r"such mapping per feature, or leave `model.dynamic` out"),
    ({"model.num_embeddings": "9223372036854775807", "model.dynamic": "{cat_0: {num_slots: 64}}"},
     r"feature 'cat_1' takes raw ids \(num_embeddings 9223372036854775807, the id space\) but "
     r"`model.dynamic` does not name it: add `model.dynamic.cat_1`"),
    ({"model.dynamic": "{cat_0: {num_slots: 64}, cat_1: {num_slots: 64, pooled_lookup: false}}"},
     r"`model.dynamic.<feature>.pooled_lookup` must be the same for every dynamic feature"),
])
def test_config_errors_name_the_key_and_the_allowed_values(change: dict[str, Any], pattern: str) -> None:
    raw = tiny(**change)
    with pytest.raises(ConfigError, match=pattern):
        cfg = RunConfig.from_dict(raw)
        for i, h in enumerate(cfg.hooks):  # hook arguments are checked when hooks are built
            h.build(i)


def test_parquet_options_are_the_datasets_own_fields_validated_by_it(tmp_path: Path) -> None:
    import dataclasses

    from recsys_trainer.data.parquet import ParquetReadOptions

    own = {f.name for f in dataclasses.fields(ParquetDataConfig)} - {
        f.name for f in dataclasses.fields(ParquetReadOptions)}
    assert own == {"kind", "train", "eval", "features"}  # the rest is not a copy: it is inherited
    raw = tiny()
    raw["data"] = {"kind": "parquet", "train": str(tmp_path), "sharding": "diagonal",
                   "features": {"labels": ["click"], "sparse": [{"name": "item", "num_embeddings": 5}]}}
    with pytest.raises(ConfigError, match=r"`data`: `sharding` must be one of 'rows', 'row_groups'"):
        RunConfig.from_dict(raw)
    with pytest.raises(ValueError, match=r"`sharding` must be one of 'rows', 'row_groups'"):
        ParquetReadOptions(sharding="diagonal")  # type: ignore[arg-type]


def test_an_override_of_an_unknown_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"override `--trainer.steps` names unknown section `trainer`"):
        apply_overrides(TINY, [("trainer.steps", "3")])


def test_parquet_data_takes_the_model_schema_from_its_feature_spec(tmp_path: Path) -> None:
    raw = tiny()
    raw["model"] = {"embedding_dim": 8}
    raw["data"] = {
        "kind": "parquet", "train": str(tmp_path), "batch_size": 16,
        "features": {"labels": ["click"], "dense": ["d0", {"column": "d1", "fill_value": 1.0}],
                     "sparse": [{"name": "item", "num_embeddings": 50},
                                {"name": "user", "num_embeddings": 70, "hash": True}]},
    }
    cfg = RunConfig.from_dict(raw)
    assert isinstance(cfg.data, ParquetDataConfig)
    assert cfg.model.sparse_features == ["item", "user"]
    assert cfg.model.num_dense == 2 and cfg.model.num_embeddings == [50, 70]
    raw["model"]["num_dense"] = 3
    with pytest.raises(ConfigError, match=r"`model.num_dense` is 3, but the data's feature spec gives 2"):
        RunConfig.from_dict(raw)
    raw["model"] = {}
    raw["data"]["features"]["sparse"][0]["num_embedings"] = 5
    with pytest.raises(ConfigError, match=r"unknown key `data.features.sparse\[0\].num_embedings`"):
        RunConfig.from_dict(raw)


# ------------------------------------------------------------------ real runs


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_the_cli_reports_a_config_error_with_exit_status_2(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, TINY)
    p = subprocess.run([PY, "-m", "recsys_trainer", str(cfg), "--args.log_stpes", "3"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert p.returncode == 2, p.stderr
    assert "config error: unknown key `args.log_stpes`" in p.stderr and "log_steps" in p.stderr


def test_the_cli_trains_a_yaml_config_in_one_process(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, TINY)
    p = subprocess.run(
        [PY, "-m", "recsys_trainer", str(cfg), "--args.train_steps", "4", "--run=train_and_evaluate",
         "--hooks", "[{name: jsonl, every: 2}]"],
        capture_output=True, text=True, timeout=150, env=_env(), cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0/1 done: global_step=4" in p.stdout
    assert "eval @ step 4" in p.stderr  # train_and_evaluate evaluated after training
    records = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert any('"type": "train"' in r and '"step": 4' in r for r in records)


def test_the_cli_trains_saves_and_resumes_a_dlrm_with_dynamic_and_hashed_tables_from_yaml(
        tmp_path: Path) -> None:
    raw = apply_overrides(TINY, [("model.dynamic", "{cat_0: {num_slots: 64, eviction_interval_rows: "
                                                   "64}, cat_2: {num_slots: 48}}")])
    p = subprocess.run([PY, "-m", "recsys_trainer", str(write_config(tmp_path, raw)), "--smoke"],
                       capture_output=True, text=True, timeout=150, env=_env(), cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "smoke test passed" in p.stdout  # train, evaluate, save, resume
    # The two tables named are dynamic (the Trainer's per-window report of each), the others not.
    reported = re.findall(r"dynamic table (t_cat_\d) after window all: \d+/(\d+) slots occupied",
                          p.stderr)
    assert sorted(set(reported)) == [("t_cat_0", "64"), ("t_cat_2", "48")], p.stderr[-2000:]


def test_yaml_makes_every_table_dynamic_or_only_the_features_it_names_each_with_its_settings(
        ) -> None:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recsys_trainer.dynamic import dynamic_table_names, mc_modules

    raw = tiny(**{"model.dynamic": "{num_slots: 64, buckets: 1}"})
    model = RunConfig.from_dict(raw).model.build()
    assert {t: m._zch_size for t, m in mc_modules(model).items()} == {f"t_cat_{i}": 64 for i in range(4)}
    raw = tiny(**{"model.dynamic": "{cat_0: {num_slots: 64}, cat_2: {num_slots: 32, buckets: 1}}"})
    model = RunConfig.from_dict(raw).model.build()
    assert dynamic_table_names(model) == {"t_cat_0", "t_cat_2"}
    assert {t: m._zch_size for t, m in mc_modules(model).items()} == {"t_cat_0": 64, "t_cat_2": 32}
    hashed = model.dlrm.sparse_arch.embedding_bag_collection.hashed
    assert isinstance(hashed, EmbeddingBagCollection)
    assert [(c.name, c.num_embeddings) for c in hashed.embedding_bag_configs()] == [
        ("t_cat_1", 200), ("t_cat_3", 200)]


def test_a_model_class_with_a_dynamic_table_argument_takes_its_fields_from_yaml() -> None:
    from recsys_trainer.dynamic import dynamic_table_names, mc_modules

    raw = apply_overrides(TINY, [("model", "{class: recsys_trainer.models.DINClassifier, "
                                           "sparse_features: [cat_0], num_dense: 4, num_embeddings: 200, "
                                           "num_items: 100, dynamic: {num_slots: 64, buckets: 1}}")])
    model = RunConfig.from_dict(raw).model.build()
    assert dynamic_table_names(model) == {"t_item"}
    assert mc_modules(model)["t_item"]._zch_size == 64  # type: ignore[attr-defined]
    raw["model"]["dynamic"] = {"num_slots": 64, "half_life": 2}
    with pytest.raises(ConfigError, match=r"unknown key `model.dynamic.half_life`; allowed keys"):
        RunConfig.from_dict(raw)


def test_a_bundled_model_named_by_its_short_name_is_built_with_its_arguments() -> None:
    from recsys_trainer.config import MODEL_CLASSES
    from recsys_trainer.dynamic import dynamic_table_names
    from recsys_trainer.models import DCNClassifier, HSTURetrievalModel

    raw = apply_overrides(TINY, [("model", "{class: dcn, sparse_features: [cat_0, cat_1], num_dense: 4, "
                                           "num_embeddings: 200, cross: full, num_cross_layers: 2, "
                                           "dynamic: {cat_0: {num_slots: 64, buckets: 1}}}")])
    model = RunConfig.from_dict(raw).model.build()
    assert isinstance(model, DCNClassifier) and len(model.cross.kernels) == 2
    assert dynamic_table_names(model) == {"t_cat_0"}  # per-feature dynamic tables, as the DLRM's
    raw["model"]["crosses"] = 3
    with pytest.raises(ConfigError, match=r"crosses"):
        RunConfig.from_dict(raw)
    # The example configs name theirs so, with the event times as value features.
    hstu = load_config(str(REPO / "examples/configs/hstu_sequences.yaml")).model.build()
    assert isinstance(hstu, HSTURetrievalModel)
    assert hstu.sequence_keys == ["item", "hist_item", "hist_ts", "ts"]
    assert isinstance(load_config(str(REPO / "examples/configs/dcn_crosses.yaml")).model.build(),
                      DCNClassifier)
    assert set(MODEL_CLASSES) == {"dcn", "din", "mmoe", "two_tower", "sasrec", "hstu_ranking",
                                  "hstu_retrieval"}


def test_two_cli_runs_of_one_seeded_config_save_bitwise_equal_models_and_run_evaluate_loads_the_newest(
        tmp_path: Path) -> None:
    """``args.seed`` seeds before the CLI builds the model (its dense layers are initialised in
    the constructor), so a YAML run is reproducible; fresh processes seed torch at random. Then
    ``--run evaluate`` on the first run's output_dir loads its newest checkpoint."""
    from recsys_trainer.checkpoint import export_model_state_dict

    cfg = write_config(tmp_path, tiny(**{"args.train_steps": 3, "args.save_end": "true",
                                         "args.seed": 7}))
    models = []
    for run in ("a", "b"):
        out = tmp_path / run
        p = subprocess.run([PY, "-m", "recsys_trainer", str(cfg), "--args.output_dir", str(out)],
                           capture_output=True, text=True, timeout=150, env=_env(), cwd=REPO)
        assert p.returncode == 0, p.stdout + p.stderr
        models.append(export_model_state_dict(str(out / "step_00000003")))
    a, b = models
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []

    ev = subprocess.run([PY, "-m", "recsys_trainer", str(cfg), "--run", "evaluate",
                         "--args.output_dir", str(tmp_path / "a"), "--args.resume_from", "auto"],
                        capture_output=True, text=True, timeout=150, env=_env(), cwd=REPO)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    # The restored step counter shows the checkpoint was loaded before evaluating.
    m = re.search(r"rank 0/1 done: global_step=3 .*eval=\{'loss': ([0-9.]+), 'num_samples': 64", ev.stdout)
    assert m, ev.stdout + ev.stderr[-3000:]
    assert "untrained model" not in ev.stderr


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            # Each agent leads its own process group: take its workers down with it.
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.mark.distributed
def test_the_console_script_is_callable_as_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recsys_trainer.cli import main

    cfg = write_config(tmp_path, TINY)
    assert main([str(cfg), "--print-config", "--args.train_steps", "9"]) == 0
    out = capsys.readouterr().out
    assert "train_steps: 9" in out and "kind: synthetic" in out
    assert main([str(cfg), "--model.embedding_dim", "0"]) == 2
    assert "`model.embedding_dim` must be an int >= 1, but is 0" in capsys.readouterr().err
