"""The project stands alone: nothing in it names a folder beside the repository, and
``scripts/setup`` takes a package index for torch (issue 19, item 13)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_nothing_in_the_repository_reads_or_names_a_folder_beside_it() -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    # The words are split so that this file does not name them either.
    beside = re.compile("|".join([r"\.\./" + "shared", "/work/" + "shared", r"\b" + "shared" + r"/(?:data|docs|hooks)\b",
                                  r"[\"']" + "shared" + r"[\"'],\s*[\"']data"]))
    hits = []
    for name in tracked.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        hits += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                 if beside.search(line)]
    assert hits == []


def _fake_torch_index(root: Path) -> str:
    """A PEP 503 index (file://) holding one tiny wheel that calls itself torch 2.13.0+cpu."""
    files = {"torch/__init__.py": b"__version__ = '2.13.0+cpu'\n",
             "torch-2.13.0+cpu.dist-info/METADATA": b"Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n",
             "torch-2.13.0+cpu.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}\n"
        for n, b in files.items()) + "torch-2.13.0+cpu.dist-info/RECORD,,\n"
    (root / "simple" / "torch").mkdir(parents=True)
    wheel = root / "torch-2.13.0+cpu-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr("torch-2.13.0+cpu.dist-info/RECORD", record)
    (root / "simple" / "torch" / "index.html").write_text(
        f'<a href="{wheel.as_uri().replace("+", "%2B")}">{wheel.name}</a>\n')
    return (root / "simple").as_uri()


def test_setup_installs_torch_from_the_index_it_is_given_and_refuses_what_is_not_an_index(tmp_path) -> None:
    repo = tmp_path / "repo"  # a copy: never this checkout's own .venv
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup", repo / "scripts" / "setup")
    shutil.copytree(ROOT / "requirements", repo / "requirements")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (tmp_path / "no-links").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    # No registry at all: pip's configuration is ignored and its default index refuses.
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0",
               PIP_NO_CACHE_DIR="1", PIP_FIND_LINKS=str(tmp_path / "no-links"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))

    def setup(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(repo / "scripts" / "setup")], env={**env, **extra}, capture_output=True,
                              text=True, timeout=300, check=False)

    bad = setup(RECSYS_TRAINER_TORCH_INDEX="download.pytorch.org/whl/cpu")
    assert bad.returncode == 2 and "RECSYS_TRAINER_TORCH_INDEX must be a package index URL" in bad.stderr
    assert not (repo / ".venv").exists()  # refused before anything was built
    clash = setup(RECSYS_TRAINER_TORCH_INDEX="https://download.pytorch.org/whl/cu126",
                  RECSYS_TRAINER_VARIANT="cuda", RECSYS_TRAINER_SYSTEM_TORCH="1")
    assert clash.returncode == 2 and "cannot go with RECSYS_TRAINER_SYSTEM_TORCH=1" in clash.stderr

    # torch comes from the given index; the next pin (fbgemm-gpu-cpu) finds no registry, so
    # setup stops there, with the index's torch in the venv.
    run = setup(RECSYS_TRAINER_TORCH_INDEX=_fake_torch_index(tmp_path / "index"))
    assert run.returncode != 0 and "fbgemm-gpu-cpu" in run.stderr
    got = subprocess.run([str(repo / ".venv" / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, check=False)
    assert got.stdout.strip() == "2.13.0+cpu", got.stderr
