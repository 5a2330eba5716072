"""The item corpus as ``item id -> embedding`` files, for an ANN index (faiss, ScaNN, a vector
database) that serves a retrieval model's candidates.

``export_item_embeddings(model, output_dir)`` embeds every item ``[0, model.num_items)`` with
the model's item tower, each rank its contiguous share (``metrics.corpus_share``), and writes::

    output_dir/part-00000-of-00002.parquet    rank 0's items: item_id int64, embedding list<float32>[D]
    output_dir/part-00001-of-00002.parquet
    output_dir/_SUCCESS                       JSON, written last by rank 0: files, rows, dim

An export counts only once ``_SUCCESS`` exists (``read_item_embeddings`` refuses a directory
without it), and rank 0 removes an old marker before any rank writes, so an interrupted
re-export is never mistaken for a complete one. Writes go through ``storage.resolve`` and
``pyarrow.fs``: ``output_dir`` may be a path or any URL the reader takes (``s3://``, ...).
Scoring with the exported vectors: the dot product with the user tower's output (the model's
``outputs["query"]``), the score the model was trained and evaluated with.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from recsys_trainer.distributed import FakeGang, Gang, ProcessGroupGang
from recsys_trainer.retrieval import collectives
from recsys_trainer.retrieval.metrics import embed_corpus
from recsys_trainer.retrieval.protocol import find_retrieval_model
from recsys_trainer.storage import resolve, storage_error, write_bytes

MARKER = "_SUCCESS"
"""The commit marker of an export (written last, by rank 0)."""


@dataclass(frozen=True)
class ItemExport:
    """What an export wrote: ``num_items`` rows of ``dim`` floats in ``files`` under
    ``output_dir``."""

    output_dir: str
    num_items: int
    dim: int
    files: list[str]


def _part_name(rank: int, world_size: int) -> str:
    return f"part-{rank:05d}-of-{world_size:05d}.parquet"


@torch.no_grad()
def export_item_embeddings(model: torch.nn.Module, output_dir: str | os.PathLike[str], *,
                           gang: Gang | None = None, group: dist.ProcessGroup | None = None,
                           chunk_size: int = 65_536, filesystem: pafs.FileSystem | None = None,
                           ) -> ItemExport:
    """Write every item's embedding under ``output_dir`` (see the module docstring); all ranks
    call this. ``model``: a ``RetrievalModel`` or a DMP around one (``trainer.model``);
    ``gang``: the control collectives (``trainer.gang``; default: the default group's);
    ``group``: the model's process group (``trainer.process_group``). Returns what was written;
    a write failing on any rank raises on every rank, naming that rank."""
    retrieval = find_retrieval_model(model)
    rank, world = collectives.world(group)
    if gang is None:
        gang = ProcessGroupGang(group) if world > 1 else FakeGang()
    root = resolve(output_dir, filesystem)
    error = None
    if gang.rank == 0:
        try:
            root.filesystem.create_dir(root.path, recursive=True)
            marker = root.join(MARKER)
            if root.filesystem.get_file_info(marker.path).type != pafs.FileType.NotFound:
                root.filesystem.delete_file(marker.path)  # the old export stops counting first
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = str(storage_error(exc, root.url, "prepare the export directory"))
    _raise_any(gang, error)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    start, emb = embed_corpus(retrieval, retrieval.num_items, device, chunk_size=chunk_size, group=group)
    emb_np = emb.float().cpu().numpy()
    name = _part_name(rank, world)
    try:
        table = pa.table({
            "item_id": pa.array(np.arange(start, start + len(emb_np), dtype=np.int64)),
            "embedding": pa.FixedSizeListArray.from_arrays(
                pa.array(emb_np.reshape(-1), pa.float32()), emb_np.shape[1]),
        })
        with root.filesystem.open_output_stream(root.join(name).path) as f:
            pq.write_table(table, f)
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error = str(storage_error(exc, root.join(name).url, "write")) if isinstance(exc, OSError) \
            else f"{type(exc).__name__}: {exc}"
    _raise_any(gang, error)
    rows = gang.all_gather_object((name, len(emb_np)))
    dim = int(emb_np.shape[1])
    if gang.rank == 0:
        try:
            info = {"num_items": retrieval.num_items, "dim": dim,
                    "files": [{"name": n, "rows": r} for n, r in rows]}
            # Whole or not at all: the marker says the export is complete.
            write_bytes(root.join(MARKER), json.dumps(info, indent=1).encode())
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = str(storage_error(exc, root.join(MARKER).url, "write"))
    _raise_any(gang, error)
    return ItemExport(root.url, retrieval.num_items, dim, [n for n, _ in rows])


def _raise_any(gang: Gang, error: str | None) -> None:
    """Every rank raises when any rank failed (naming the rank and its error)."""
    errors = gang.all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise RuntimeError("item-embedding export failed on " + "; ".join(
            f"rank {r}: {e}" for r, e in failed))


def read_item_embeddings(output_dir: str | os.PathLike[str], filesystem: pafs.FileSystem | None = None,
                         ) -> tuple[np.ndarray, np.ndarray]:
    """``(item ids int64 [N], embeddings float32 [N, D])`` of a committed export, sorted by id.
    A directory without ``_SUCCESS`` (an export never finished) is refused."""
    root = resolve(output_dir, filesystem)
    marker = root.join(MARKER)
    try:
        with root.filesystem.open_input_stream(marker.path) as f:
            info = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{root.url} holds no committed item-embedding export (no {MARKER}): the export did "
            "not finish; run export_item_embeddings again.") from None
    ids, embs = [], []
    for part in info["files"]:
        t = pq.read_table(root.join(part["name"]).path, filesystem=root.filesystem)
        if t.num_rows != part["rows"]:
            raise ValueError(f"{root.join(part['name']).url} has {t.num_rows} rows, but {MARKER} "
                             f"lists {part['rows']}: the export is damaged; export again.")
        ids.append(t.column("item_id").to_numpy())
        flat = t.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        embs.append(flat.reshape(t.num_rows, info["dim"]))
    all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    all_emb = np.concatenate(embs) if embs else np.zeros((0, info["dim"]), np.float32)
    order = np.argsort(all_ids, kind="stable")
    return all_ids[order], all_emb[order].astype(np.float32)


__all__ = ["MARKER", "ItemExport", "export_item_embeddings", "read_item_embeddings"]
