"""Writing the generated datasets (the synthetic logs): each file whole, the dataset once per job."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist

from recsys_trainer import storage

log = logging.getLogger(__name__)

SIGNAL_FILE = "_signal.json"
"""A generated dataset's metadata (its oracle figures), written last: its presence says the
dataset is complete."""


def write_whole(path: Path, table: pa.Table, row_group_size: int | None = None) -> None:
    """Write ``table`` to the parquet file ``path`` through a temporary file renamed into place
    (``storage.atomic_write``): a reader never sees a half-written file, and a failed write (a
    full or read-only disk) leaves no temporary file behind."""
    with storage.atomic_write(os.fspath(path), durable=False) as f:
        pq.write_table(table, f, row_group_size=row_group_size)


def write_signal(root: Path, meta: dict[str, Any]) -> None:
    """Write ``root/SIGNAL_FILE``, whole or not at all: its presence says the dataset is
    complete, so a reader must never find half of it."""
    storage.write_bytes(os.fspath(root / SIGNAL_FILE), json.dumps(meta, indent=1).encode(),
                        durable=False)


def written_once(root: str | os.PathLike[str], write: Callable[[], Any], what: str) -> dict[str, Any]:
    """Rank 0 calls ``write`` (which writes the dataset, ``SIGNAL_FILE`` last) if
    ``root/SIGNAL_FILE`` is missing, then hands its content to every rank (join the job first);
    returns it. If rank 0 cannot write or read it (a full or read-only disk), every rank raises,
    naming rank 0's error, instead of the others waiting for it or reading a listing that lags.
    An existing dataset is reused as it is: delete it to change it. ``what`` describes the
    dataset in the log line."""
    meta_file = Path(root) / SIGNAL_FILE
    outcome: list[Any] = [None]
    failure: BaseException | None = None
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            if not meta_file.exists():
                log.info("writing %s to %s", what, root)
                write()
            outcome[0] = ("ok", json.loads(meta_file.read_text()))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            failure = exc
            outcome[0] = ("error", f"{type(exc).__name__}: {exc}")
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0] is None:  # a rank other than 0 with no process group: the file is all it has
        outcome[0] = ("ok", json.loads(meta_file.read_text()))
    kind, value = outcome[0]
    if kind == "error":
        raise RuntimeError(f"rank 0 could not write the generated dataset ({what}) at {root}: "
                           f"{value}")
    meta: dict[str, Any] = value
    return meta
