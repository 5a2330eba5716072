"""The dense program (``dense.pt2``): ``torch.export``'s export, save, load and AOTInductor
compile, one at a time in a process.

torch's export machinery keeps process-wide state (the deserializer being run, the proxy and
fake-tensor mode stacks), so two of these calls in threads at once fail, measured on torch 2.13:
``_CURRENT_DESERIALIZER is already set`` for two loads (two Scorers built at once), ``Trying to
pop empty mode stack`` or ``... is not tracked with proxy`` for an export beside a load (a
``Follower`` polling in its thread while the training loop publishes in-process). A failed export
can also leave the process unable to export again. Scoring with a loaded program runs beside a
load without failing (measured), so it takes no lock.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import torch

_LOCK = threading.RLock()


def export(module: torch.nn.Module, example: tuple[Any, ...], dynamic_shapes: Any) -> Any:
    """``torch.export.export(module, example, dynamic_shapes=...)`` under no_grad."""
    with _LOCK, torch.no_grad():
        return torch.export.export(module, example, dynamic_shapes=dynamic_shapes)


def save(ep: Any) -> bytes:
    """``ep`` as ``torch.export.save`` writes it."""
    buf = io.BytesIO()
    with _LOCK:
        torch.export.save(ep, buf)
    return buf.getvalue()


def load(data: bytes) -> Any:
    """The exported program in ``data`` (check it first: ``scorer.check_program_archive``)."""
    with _LOCK:
        return torch.export.load(io.BytesIO(data))


def aot_compile(ep: Any, package_path: str) -> None:
    """``ep`` compiled by AOTInductor into the package at ``package_path``."""
    with _LOCK:
        compile_package = torch._inductor.aoti_compile_and_package  # type: ignore[attr-defined]
        compile_package(ep, package_path=package_path)
