"""The import paths users have today keep working after modules moved into folders by concern
(``data/generators/``, ``data/vocab/``, ``serving/exporting/``, ``serving/runtime/``): every old
module path names the very objects of the module's new home, the packages' ``__all__`` names
resolve, the component paths of the example configs resolve, and every ``python -m`` command
that the docs, examples and scripts give, and the old path of every moved command, still runs.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

MOVED: dict[str, str] = {
    f"recsys_trainer.data.{m}": f"recsys_trainer.data.generators.{m}"
    for m in ("criteo_synthetic", "interactions_synthetic", "churn_dataset", "id_stream",
              "open_bandit", "synthetic", "stream_writer")
} | {
    f"recsys_trainer.serving.{m}": f"recsys_trainer.serving.runtime.{m}"
    for m in ("scorer", "follow", "server")
} | {
    f"recsys_trainer.serving.{m}": f"recsys_trainer.serving.exporting.{m}"
    for m in ("export", "publisher")
} | {
    "recsys_trainer.hooks.publisher": "recsys_trainer.serving.exporting.publisher",
}
"""Old module path -> where the module lives now (the old path is a module that re-exports)."""

OLD_COMMANDS = ("recsys_trainer.data.criteo_synthetic", "recsys_trainer.data.interactions_synthetic",
                "recsys_trainer.data.churn_dataset", "recsys_trainer.data.open_bandit",
                "recsys_trainer.data.stream_writer", "recsys_trainer.serving.server")
"""``python -m`` commands the docs gave before the moves."""

PACKAGES = ("recsys_trainer", "recsys_trainer.data", "recsys_trainer.data.features",
            "recsys_trainer.data.vocab", "recsys_trainer.serving", "recsys_trainer.checkpoint")


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_names_the_objects_of_the_new_module(old: str) -> None:
    new = MOVED[old]
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    assert old_module.__all__, old
    for name in old_module.__all__:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name}"
    # Every class and function the module defines is reachable at the old path.
    defined = {k for k, v in vars(new_module).items()
               if not k.startswith("_") and getattr(v, "__module__", None) == new}
    assert defined <= set(old_module.__all__), sorted(defined - set(old_module.__all__))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_a_package_all_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, missing


def _config_class_paths() -> set[str]:
    """Every ``class:`` value naming a recsys_trainer object in the example configs."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            value = node.get("class")
            if isinstance(value, str) and value.startswith("recsys_trainer."):
                found.add(value)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for path in sorted((REPO / "examples" / "configs").glob("*.yaml")):
        walk(yaml.safe_load(path.read_text()))
    return found


def test_component_paths_of_the_configs_resolve_at_their_old_and_new_paths() -> None:
    from recsys_trainer.component import import_path

    paths = _config_class_paths()
    assert "recsys_trainer.data.generators.stream_writer.stream_dataset" in paths
    for path in paths:
        import_path("class", path)
    assert import_path("class", "recsys_trainer.data.stream_writer.stream_dataset") is \
        import_path("class", "recsys_trainer.data.generators.stream_writer.stream_dataset")


def _documented_commands() -> set[str]:
    """The modules of every ``python -m recsys_trainer...`` in README.md, docs/, examples/ and
    scripts/ (not a placeholder such as ``recsys_trainer.data.<name>``)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted(p for p in (REPO / "examples").rglob("*") if p.suffix in (".py", ".yaml")),
             *sorted(p for p in (REPO / "scripts").iterdir() if p.is_file())]
    found: set[str] = set()
    for path in files:
        text = path.read_text()
        found.update(re.findall(r"python3? -m (recsys_trainer(?:[\w.]*\w)?)(?![\w.<])", text))
    return found


@pytest.mark.timeout(300)
def test_documented_and_old_python_m_commands_still_run() -> None:
    modules = sorted(_documented_commands() | set(OLD_COMMANDS))
    assert "recsys_trainer.data.generators.criteo_synthetic" in modules
    # Started together: each one imports torch, which is most of its time.
    procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for m in modules}
    failed = []
    for m, p in procs.items():
        out, err = p.communicate(timeout=240)
        if p.returncode != 0 or "usage:" not in out:
            failed.append(f"python -m {m} --help: exit {p.returncode}: {err[-800:]}")
    assert not failed, "\n".join(failed)
