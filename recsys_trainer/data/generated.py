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

log = logging.getLogger(__name__)

SIGNAL_FILE = "_signal.json"
"""A generated dataset's metadata (its oracle figures), written last: its presence says the
dataset is complete."""


def write_whole(path: Path, table: pa.Table, row_group_size: int | None = None) -> None:
    """Write ``table`` to the parquet file ``path`` through a temporary file renamed into place:
    a reader never sees a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    tmp.replace(path)


def written_once(root: str | os.PathLike[str], write: Callable[[], Any], what: str) -> dict[str, Any]:
    """Rank 0 calls ``write`` (which writes the dataset, ``SIGNAL_FILE`` last) if
    ``root/SIGNAL_FILE`` is missing while the other ranks wait at a barrier (join the job
    first); returns ``SIGNAL_FILE``'s content. An existing dataset is reused as it is: delete it
    to change it. ``what`` describes the dataset in the log line."""
    meta_file = Path(root) / SIGNAL_FILE
    if int(os.environ.get("RANK", "0")) == 0 and not meta_file.exists():
        log.info("writing %s to %s", what, root)
        write()
    if dist.is_initialized():
        dist.barrier()
    meta: dict[str, Any] = json.loads(meta_file.read_text())
    return meta
