"""The public paths resolve: the packages' ``__all__`` names, the console scripts, the component
paths of the example configs, and every ``python -m`` command that the docs, examples and
scripts give (docs/migrating-from-recis.md lists the module paths that moved).
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

PACKAGES = sorted(
    ".".join(path.parent.relative_to(REPO).parts)
    for path in (REPO / "recsys_trainer").rglob("__init__.py")
    if "__all__" in path.read_text()
)
"""The package and its subpackages that list public names (``__all__``)."""


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_a_package_all_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, missing


def test_every_console_script_names_a_function_of_the_package() -> None:
    section = (REPO / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    entries = dict(re.findall(r'^([\w-]+) = "([\w.]+:\w+)"$', section, re.M))
    assert set(entries) == {"recsys-train", "recsys-serve"}, entries
    for target in entries.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


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


def test_component_paths_of_the_configs_resolve() -> None:
    from recsys_trainer.component import import_path

    paths = _config_class_paths()
    assert "recsys_trainer.data.generators.stream_writer.stream_dataset" in paths
    for path in paths:
        import_path("class", path)


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
def test_every_documented_python_m_command_runs() -> None:
    modules = sorted(_documented_commands())
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
