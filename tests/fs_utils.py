"""Filesystems for fault tests: a small tmpfs (a disk that fills up) and a read-only bind mount.

Both need ``mount`` (root); without it the test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here (needs root): mount {' '.join(args)}: {r.stderr.strip()}")


@contextlib.contextmanager
def small_tmpfs(path: str, size_kib: int) -> Iterator[str]:
    """``path`` as a tmpfs of ``size_kib`` KiB (removed on exit)."""
    os.makedirs(path, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", path)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


@contextlib.contextmanager
def read_only(path: str) -> Iterator[str]:
    """``path`` (a directory) read-only, through a read-only bind mount onto itself."""
    os.makedirs(path, exist_ok=True)
    _mount("--bind", path, path)
    try:
        _mount("-o", "remount,ro,bind", path)
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def fill(directory: str) -> str:
    """Write a file into ``directory`` until its filesystem is full; returns the file's path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb") as f:
        block = b"\0" * (64 << 10)
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
                f.flush()
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
    return path
