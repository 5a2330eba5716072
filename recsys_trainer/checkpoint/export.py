"""Read checkpoints without ``torch.distributed``: merged, rank-independent model state dicts.

DCP stores each table's shards with their global offsets; reading with an empty-state-dict
planner in "no_dist" mode assembles every tensor whole in one process, whatever world size or
sharding plan wrote it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from recsys_trainer import storage
from recsys_trainer.checkpoint import contents, layout, writer
from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.data.vocab import Vocabulary, saved_vocabulary


def saved_keys(ckpt_dir: storage.Where) -> dict[str, Any]:
    """The checkpoint's flattened keys (``model.<param>``, ``optim.state.<param>.<state>``)
    with their DCP metadata (global ``size`` for tensors)."""
    loc = storage.locate(ckpt_dir)
    try:
        return dict(writer.storage_reader(loc).read_metadata().state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - unreadable metadata: name the file
        path = loc.join(".metadata").url
        raise CheckpointError(f"cannot read DCP metadata {path!r}: {e}", path=path,
                              kind="corrupt") from e


def _flatten(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_full(ckpt_dir: storage.Where, keys: set[str]) -> dict[str, Any]:
    """Load the given flattened keys whole, in this process only (no collectives, no process
    group needed). Returns ``{flattened key: tensor or object}``."""
    loc = storage.locate(ckpt_dir)
    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=writer.storage_reader(loc),
                         planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    except Exception as e:  # noqa: BLE001 - name the checkpoint
        raise CheckpointError(f"reading {sorted(keys)[:3]}... from checkpoint {loc.url!r} "
                              f"failed: {e}", path=loc.url, kind="load_failed") from e
    flat = _flatten(sd)
    return {k: flat[k] for k in keys if k in flat}


def export_model_state_dict(ckpt_dir: storage.Where, out_file: str | None = None, *,
                            verify: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict from a committed checkpoint, merged into whole tensors.

    ``ckpt_dir`` is a checkpoint directory: a local path, a URL (``s3://...``) or a
    ``storage.Location``. It is marked as being read meanwhile (rotation skips it).

    Keys are the model's own parameter names (as in ``dmp.state_dict()``: for a model wrapped by
    the Trainer, ``<submodule path>.<param>``). Loads in a plain process, no
    ``torch.distributed`` needed; with ``out_file`` it is also written with ``torch.save``
    (``torch.load(out_file, weights_only=True)`` reads it back), for serving and inspection.
    """
    loc = storage.locate(ckpt_dir)
    manifest = layout.read_manifest(loc)
    if manifest is None:
        layout.info_of(loc)  # raises the precise error (missing / not committed)
    assert manifest is not None
    with layout.reading(loc):
        if verify:
            layout.verify_files(loc, manifest, checksums=True)
        keys = {k for k in saved_keys(loc) if k.startswith("model.")}
        full = read_full(loc, keys)
    out = {k[len("model."):]: v for k, v in sorted(full.items()) if isinstance(v, torch.Tensor)}
    if out_file is not None:
        save_file(out, out_file)
    return out


def save_file(obj: Any, out_file: str) -> None:
    """``torch.save`` ``obj`` to the local file ``out_file``, whole or not at all
    (``storage.atomic_write``: a temporary file, fsynced, renamed into place; the directory
    fsynced). A failed write (full or read-only disk) is a ``StorageError`` naming ``out_file``
    and leaves no temporary file: torch's own error names neither."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
        # Streamed to the file (an export may be large): not serialised into memory first.
        # The fsync matters: without it a power loss after the rename may leave an empty file
        # in place of the previous one (which a delta may name as its base). One temporary
        # name per file: an export that died leaves at most one, which the next overwrites.
        with storage.atomic_write(out_file, tmp=out_file + ".tmp") as f:
            torch.save(obj, f)
    except (OSError, RuntimeError) as exc:
        raise storage.storage_error(exc, out_file, "write") from exc


def export_vocabularies(checkpoint: str | os.PathLike[str], out_dir: str | None = None
                        ) -> dict[str, Vocabulary]:
    """The vocabularies a committed checkpoint (a ``step_<N>`` directory, or an output directory:
    its newest) decodes with, ``{feature: Vocabulary}``, for serving its exported tables (see
    ``export_model_state_dict``). With ``out_dir``, each is also written to
    ``out_dir/<feature>.txt``, one value per line: ``vocab="out_dir/<feature>.txt"`` maps ids to
    the same rows in a new run. Reads rank 0's state file; no process group needed."""
    info = layout.resolve_checkpoint(os.fspath(checkpoint), "`checkpoint`")
    with layout.reading(info.where):
        extra = contents.load_extra(info.where.join(contents.extra_file_name(0)), info.step)
    state = extra.get("vocabularies") or {"version": 1, "features": {}}
    out: dict[str, Vocabulary] = {}
    for name, saved in sorted(state["features"].items()):
        vocab = saved_vocabulary(saved)
        if vocab is not None:
            out[name] = vocab
    if out_dir is not None:
        root = storage.resolve(out_dir)
        with storage.errors_named(root.url, "write"):
            root.filesystem.create_dir(root.path, recursive=True)
        for name, vocab in out.items():
            vocab.write(root.join(f"{name}.txt").url)
    return out
