"""Read checkpoints without ``torch.distributed``: merged, rank-independent model state dicts.

DCP stores each table's shards with their global offsets; reading with an empty-state-dict
planner in "no_dist" mode assembles every tensor whole in one process, whatever world size or
sharding plan wrote it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from recsys_trainer.checkpoint import layout
from recsys_trainer.checkpoint.errors import CheckpointError


def saved_keys(ckpt_dir: str) -> dict[str, Any]:
    """The checkpoint's flattened keys (``model.<param>``, ``optim.state.<param>.<state>``)
    with their DCP metadata (global ``size`` for tensors)."""
    try:
        return dict(dcp.FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - unreadable metadata: name the file
        path = os.path.join(ckpt_dir, ".metadata")
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


def read_full(ckpt_dir: str, keys: set[str]) -> dict[str, Any]:
    """Load the given flattened keys whole, in this process only (no collectives, no process
    group needed). Returns ``{flattened key: tensor or object}``."""
    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=dcp.FileSystemReader(ckpt_dir),
                         planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    except Exception as e:  # noqa: BLE001 - name the checkpoint
        raise CheckpointError(f"reading {sorted(keys)[:3]}... from checkpoint {ckpt_dir!r} "
                              f"failed: {e}", path=ckpt_dir, kind="load_failed") from e
    flat = _flatten(sd)
    return {k: flat[k] for k in keys if k in flat}


def export_model_state_dict(ckpt_dir: str, out_file: str | None = None, *,
                            verify: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict from a committed checkpoint, merged into whole tensors.

    Keys are the model's own parameter names (as in ``dmp.state_dict()``: for a model wrapped by
    the Trainer, ``<submodule path>.<param>``). Loads in a plain process, no
    ``torch.distributed`` needed; with ``out_file`` it is also written with ``torch.save``
    (``torch.load(out_file, weights_only=True)`` reads it back), for serving and inspection.
    """
    manifest = layout.read_manifest(ckpt_dir)
    if manifest is None:
        layout.info_of(ckpt_dir)  # raises the precise error (missing / not committed)
    assert manifest is not None
    if verify:
        layout.verify_files(ckpt_dir, manifest, checksums=True)
    keys = {k for k in saved_keys(ckpt_dir) if k.startswith("model.")}
    full = read_full(ckpt_dir, keys)
    out = {k[len("model."):]: v for k, v in sorted(full.items()) if isinstance(v, torch.Tensor)}
    if out_file is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
        tmp = out_file + ".tmp"
        torch.save(out, tmp)
        os.replace(tmp, out_file)
    return out
