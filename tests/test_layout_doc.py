"""docs/layout.md's table has a row for every folder (sub-package) of the package, and names no
folder that is gone: a reader maps the table onto the tree."""

from __future__ import annotations

import re
from pathlib import Path

import recsys_trainer

PKG_DIR = Path(recsys_trainer.__file__).parent
LAYOUT = PKG_DIR.parent / "docs" / "layout.md"


def test_the_layout_table_has_a_row_for_every_folder_of_the_package() -> None:
    folders = {p.parent.relative_to(PKG_DIR).as_posix() + "/"
               for p in PKG_DIR.rglob("__init__.py") if p.parent != PKG_DIR}
    rows = set(re.findall(r"^\| `([a-z_/]+/)`", LAYOUT.read_text(), flags=re.MULTILINE))
    assert folders == rows, (f"folders without a row: {sorted(folders - rows)}; rows without "
                             f"a folder: {sorted(rows - folders)}")
