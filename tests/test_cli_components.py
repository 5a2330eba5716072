"""Components by import path in CLI configs (``{class: pkg.module.Name, ...}``): a model, dense
optimizer, lr scheduler, hooks and dataset defined in a test module, trained from YAML through
the CLI on 1 process and under torchrun on 2; bad paths named with their key before any process
group starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from data_utils import write_windows

from recsys_trainer.config import ConfigError, RunConfig, config_to_dict, load_config

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
PY = sys.executable


def custom(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    """A config naming everything by import path: model, dataset factory, optimizer, scheduler
    (by alias), and a user hook."""
    data = tmp_path / "data"
    if not data.exists():
        write_windows(str(data), [[40, 24], [32]])  # 2 windows, 96 rows
    raw: dict[str, Any] = {
        "run": "train",
        "args": {"output_dir": str(tmp_path / "out"), "train_steps": 5, "log_steps": 1,
                 "resume_from": None},
        "model": {"class": "custom_components.ConcatMLP", "sparse_features": ["item", "tag"],
                  "num_embeddings": 100, "num_dense": 1, "embedding_dim": 4, "hidden": 8},
        "data": {"class": "custom_components.row_windows", "root": str(data),
                 "train_args": {"batch_size": 8, "shuffle": True}, "eval_args": {}},
        "dense_optimizer": {"class": "torch.optim.SGD", "lr": 0.1, "momentum": 0.5},
        "lr_scheduler": {"class": "step", "step_size": 2, "gamma": 0.5},
        "sparse_optimizer": {"name": "rowwise_adagrad", "lr": 0.05},
        "hooks": ["metrics", {"class": "custom_components.StepLog", "path": str(tmp_path / "log")}],
    }
    for key, value in changes.items():
        section, _, name = key.partition(".")
        if name:
            raw[section][name] = value
        else:
            raw[section] = value
    return raw


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def test_a_config_of_import_paths_loads_and_prints_back_as_written(tmp_path: Path) -> None:
    raw = custom(tmp_path)
    cfg = RunConfig.from_dict(raw)
    shown = config_to_dict(cfg)
    assert shown["model"] == raw["model"]
    assert shown["dense_optimizer"] == raw["dense_optimizer"]
    assert shown["lr_scheduler"] == raw["lr_scheduler"]
    assert shown["hooks"][1] == raw["hooks"][1]
    assert shown["data"]["class"] == "custom_components.row_windows"
    # The factories the Trainer gets build the named classes.
    import torch

    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = cfg.dense_optimizer.factory()(params)
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.5
    assert cfg.lr_scheduler is not None
    assert type(cfg.lr_scheduler.factory()(opt)) is torch.optim.lr_scheduler.StepLR


def test_the_builtin_short_names_are_aliases_of_the_class_form(tmp_path: Path) -> None:
    cfg = load_config(str(REPO / "examples/configs/dlrm_synthetic.yaml"), [
        ("model.class", "dlrm"), ("dense_optimizer", "{class: adam, lr: 0.002}"),
        ("hooks", "[{class: metrics}, {class: jsonl, every: 5}]")])
    old = load_config(str(REPO / "examples/configs/dlrm_synthetic.yaml"))
    assert cfg.model == old.model  # `class: dlrm` is the bundled model, schema rules included
    import torch

    opt = cfg.dense_optimizer.factory()([torch.nn.Parameter(torch.zeros(1))])
    assert type(opt) is torch.optim.Adam and opt.defaults["lr"] == 0.002
    assert [(h.name, h.kwargs) for h in cfg.hooks] == [("metrics", {}), ("jsonl", {"every": 5})]


@pytest.mark.parametrize(("key", "value", "pattern"), [
    ("model", {"class": "no_such_pkg.Model"},
     r"`model.class` is 'no_such_pkg.Model', but module 'no_such_pkg' cannot be imported"),
    ("model", {"class": "custom_components.ConcatMLPX", "num_dense": 1},
     r"`model.class` is 'custom_components.ConcatMLPX', but 'custom_components' has no attribute 'ConcatMLPX'"),
    ("model", {"class": "custom_components.NOT_CALLABLE"},
     r"`model.class` is 'custom_components.NOT_CALLABLE', which is a int, not a class or function"),
    ("model", {"class": "custom_components.ConcatMLP", "sparse_features": ["item"], "num_embeddings": 5,
               "num_dense": 1, "hiden": 3},
     r"unknown argument `model.hiden` for custom_components.ConcatMLP \(custom_components.ConcatMLP\); "
     r"its arguments: sparse_features, num_embeddings, num_dense, embedding_dim, hidden"),
    ("model", {"class": "custom_components.ConcatMLP", "num_dense": 1},
     r"`model` \(custom_components.ConcatMLP\): .*missing a required argument: 'sparse_features'"),
    ("model", {"class": "ConcatMLP"}, r"`model.class` is 'ConcatMLP', which is not an import path"),
    ("dense_optimizer", {"class": "torch.optim.SGD", "lr": 0.1, "momentun": 0.9},
     r"unknown argument `dense_optimizer.momentun` for torch.optim.sgd.SGD \(torch.optim.SGD\); its "
     r"arguments: lr, momentum"),
    ("dense_optimizer", {"class": "lion", "lr": 0.1},
     r"`dense_optimizer.class` is 'lion', which is not an import path: write 'my_pkg.module.Name' or one of adam"),
    ("lr_scheduler", {"class": "torch.optim.lr_scheduler.StepLRR", "step_size": 2},
     r"`lr_scheduler.class` is 'torch.optim.lr_scheduler.StepLRR', but 'torch.optim.lr_scheduler' has no attribute"),
    ("lr_scheduler", {"class": "step"}, r"`lr_scheduler` \(step\): .*missing a required argument: 'step_size'"),
    ("lr_scheduler", "step", r"`lr_scheduler` must be a mapping with `class`"),
    ("hooks", [{"class": "custom_components.StepLog", "paht": "x"}],
     r"unknown argument `hooks\[0\].paht` for custom_components.StepLog \(custom_components.StepLog\); "
     r"its arguments: path"),
    ("hooks", [{"class": "custom_components.Nope"}], r"`hooks\[0\].class` is 'custom_components.Nope'"),
    ("data", {"class": "custom_components.row_windows", "train_args": {"batch_sise": 3}},
     r"unknown argument `data.train_args.batch_sise` for custom_components.row_windows"),
])
def test_a_bad_import_path_or_argument_names_the_key_and_the_path(
        tmp_path: Path, key: str, value: Any, pattern: str) -> None:
    sys.path.insert(0, str(TESTS))  # as PYTHONPATH would (conftest does it too)
    with pytest.raises(ConfigError, match=pattern):
        RunConfig.from_dict(custom(tmp_path, **{key: value}))


def test_a_component_of_the_wrong_kind_is_named_when_built(tmp_path: Path) -> None:
    cfg = RunConfig.from_dict(custom(tmp_path, hooks=[{"class": "collections.OrderedDict"}]))
    with pytest.raises(ConfigError, match=r"`hooks\[0\]` \(collections.OrderedDict\) built a OrderedDict, "
                                          r"not a recsys_trainer.Hook"):
        cfg.hooks[0].build(0)
    cfg = RunConfig.from_dict(custom(tmp_path, model={"class": "collections.OrderedDict"}))
    with pytest.raises(ConfigError, match=r"`model` \(collections.OrderedDict\) built a OrderedDict, not a "
                                          r"torch.nn.Module"):
        cfg.model.build()


def test_synthetic_data_takes_its_schema_from_a_custom_models_arguments(tmp_path: Path) -> None:
    cfg = RunConfig.from_dict(custom(tmp_path, data={"kind": "synthetic"}))
    assert cfg.synthetic_schema() == (["item", "tag"], 1, 100)
    # The bundled model by its full path is a class like any other: its default table size is
    # not the schema's, so synthetic data asks for it.
    dlrm = {"class": "recsys_trainer.models.DLRMClassifier", "sparse_features": ["a", "b"], "num_dense": 2}
    with pytest.raises(ConfigError, match=r"`data.kind: synthetic` takes its schema from the model's "
                                          r"arguments .* but `model` gives \['a', 'b'\], 2, None"):
        RunConfig.from_dict(custom(tmp_path, data={"kind": "synthetic"}, model=dlrm))


def test_the_cli_exits_2_naming_a_bad_path_before_starting_the_process_group(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(custom(tmp_path)))
    p = subprocess.run([PY, "-m", "recsys_trainer", str(path), "--model.class", "custom_components.Nope"],
                       capture_output=True, text=True, timeout=120, env=env(), cwd=REPO)
    assert p.returncode == 2, p.stderr
    assert "config error: `model.class` is 'custom_components.Nope'" in p.stderr
    assert not (tmp_path / "out").exists()


def _check_run(tmp_path: Path, out: str, world: int) -> None:
    done = re.findall(r"rank (\d)/(\d) done: global_step=(\d+)", out)
    assert sorted(done) == [(str(r), str(world), "5") for r in range(world)], out[-3000:]
    for r in range(world):
        log = json.loads((tmp_path / f"log.rank{r}.json").read_text())
        assert log["model"] == "ConcatMLP"
        assert log["steps"] == [1, 2, 3, 4, 5]
        # SGD lr 0.1 halved every 2 steps by the `step` alias of StepLR.
        assert log["lrs"] == pytest.approx([0.1, 0.05, 0.05, 0.025, 0.025])
        assert log["rows_seen"] == 5 * 8 * world  # batch 8 on each rank


def test_a_model_class_from_a_test_module_trains_from_yaml_through_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(custom(tmp_path)))
    p = subprocess.run([PY, "-m", "recsys_trainer", str(path)], capture_output=True, text=True,
                       timeout=200, env=env(), cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    _check_run(tmp_path, p.stdout, 1)


@pytest.mark.distributed
def test_a_model_class_from_a_test_module_trains_under_torchrun_on_2_ranks(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(custom(tmp_path)))
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--max_restarts=0", "-m", "recsys_trainer", str(path)],
                       capture_output=True, text=True, timeout=240, env=env(), cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    _check_run(tmp_path, p.stdout, 2)


def test_the_custom_model_example_config_loads_and_builds_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # as PYTHONPATH=examples does
    cfg = load_config(str(REPO / "examples/configs/custom_model.yaml"))
    model = cfg.model.build()
    assert type(model).__name__ == "WideAndDeep"
    assert cfg.args.log_period.unit == "rows" and cfg.args.save_every_n_rows == 100_000
    # Its tables fit the data's feature spec (the check the Trainer makes when it is built).
    from recsys_trainer.sharding import check_data_fits_model

    class _Data:
        features = cfg.data.feature_spec()  # type: ignore[union-attr]

    check_data_fits_model(model, (_Data(), None))
