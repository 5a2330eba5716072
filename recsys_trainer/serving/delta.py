"""Incremental updates: a delta export holds only what changed since a full export.

A delta is a directory in the artifact's format (``manifest.json`` with ``"kind": "delta"``,
``delta.safetensors``, ``dense.pt2`` when the dense part changed, ``COMMITTED`` last):

* plain tables: ``<table>.rows`` (int64 row numbers) and ``<table>.values`` (those rows, as
  stored: float32 or quantized bytes), for every row whose stored bytes differ from the base;
* dynamic tables: ``<table>.upsert_ids`` / ``<table>.upsert_vectors`` (ids that are new or whose
  vector changed), ``<table>.deleted_ids`` (evicted since), and ``<table>.default_rows`` when a
  default row changed;
* ``base`` / ``target``: the content hashes (and steps) of the full export it applies to and of
  the full export it reproduces. ``Scorer.apply_delta`` refuses a delta whose base is not what
  it holds, so deltas apply in order.

Changed rows are found by comparing the new tables with the base export's stored bytes, not by
tracking the ids the fused optimizer touched: the comparison catches every change whatever
made it (the optimizer, an eviction's reset, a restored or warm-started checkpoint, another
rank's shard), needs no state in the training loop or its checkpoints, and survives restarts;
its cost is reading the base export once per delta (a sequential read of the tables' size).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from recsys_trainer import storage
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving.routing import Routing
from recsys_trainer.serving.runtime.tables import DynamicRows, Table

DELTA_TABLES = "delta.safetensors"


@dataclass
class Delta:
    """A read delta: its manifest, its tensors, and ``read(name) -> bytes`` for its files."""

    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    read: Callable[[str], bytes]


def read_delta(root: storage.Location, verify: bool = True) -> Delta:
    manifest = mf.read_manifest(root, verify=False)
    if manifest.get("kind") != "delta":
        raise mf.ArtifactError(f"{root.url!r} is a full export, not a delta; load it with "
                               "Scorer(path) instead of apply_delta.")
    files = manifest["files"]

    def read(name: str) -> bytes:
        data = mf.read_file(root, name)
        meta = files.get(name)
        if verify and (meta is None or len(data) != meta["size"]
                       or mf.sha256_bytes(data) != meta["sha256"]):
            raise mf.ArtifactError(f"file {name!r} of the delta {root.url!r} is corrupt or not "
                                   "listed in its manifest.")
        return data

    return Delta(manifest=manifest, tensors=load_safetensors(read(DELTA_TABLES)), read=read)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as integers of its width (bitwise comparison: -0.0 != 0.0, and a
    NaN equals itself)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()])


def _changed_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    diff = _bits(old) != _bits(new)
    return torch.nonzero(diff.reshape(len(diff), -1).any(dim=1)).flatten()


def compute_delta(base: Mapping[str, Any], base_tensors: Mapping[str, torch.Tensor],
                  new: Mapping[str, Any], new_tensors: Mapping[str, torch.Tensor],
                  ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The delta's tensors and per-table summary from the base export (manifest, tensors) to
    the new one. Both must be exports of one model with one spec and quantization."""
    old_tables = {t["name"]: t for t in base["tables"]}
    new_tables = {t["name"]: t for t in new["tables"]}
    if set(old_tables) != set(new_tables):
        raise mf.ArtifactError(f"exports of different models: tables {sorted(old_tables)} vs "
                               f"{sorted(new_tables)}; export a full artifact instead.")
    out: dict[str, torch.Tensor] = {}
    summary: list[dict[str, Any]] = []
    for name, t in sorted(new_tables.items()):
        o = old_tables[name]
        if (o.get("quantization"), o.get("dtype", "fp32"), o["dim"], bool(o.get("dynamic"))) != (
                t.get("quantization"), t.get("dtype", "fp32"), t["dim"], bool(t.get("dynamic"))):
            raise mf.ArtifactError(f"table {name!r} changed its dim, precision, quantization or "
                                   "kind between the exports; a delta cannot carry that: export "
                                   "in full.")
        dyn = t.get("dynamic")
        if dyn is None:
            old_w, new_w = base_tensors[o["tensor"]], new_tensors[t["tensor"]]
            if old_w.shape != new_w.shape:
                raise mf.ArtifactError(f"table {name!r} has {old_w.shape[0]} rows in the base "
                                       f"export and {new_w.shape[0]} now; export in full.")
            rows = _changed_rows(old_w, new_w)
            out[f"{name}.rows"], out[f"{name}.values"] = rows, new_w[rows].contiguous()
            summary.append({"name": name, "rows": int(rows.numel())})
            continue
        od = o["dynamic"]
        old_ids, old_vec = base_tensors[od["ids"]], base_tensors[od["vectors"]]
        new_ids, new_vec = new_tensors[dyn["ids"]], new_tensors[dyn["vectors"]]
        pos = torch.searchsorted(old_ids, new_ids).clamp_max(max(len(old_ids) - 1, 0))
        found = (old_ids[pos] == new_ids) if len(old_ids) else torch.zeros_like(new_ids, dtype=torch.bool)
        same = found.clone()
        if bool(found.any()):
            diff = (_bits(old_vec[pos[found]]) != _bits(new_vec[found])).reshape(int(found.sum()), -1)
            same[found] = ~diff.any(dim=1)
        deleted = old_ids[~torch.isin(old_ids, new_ids)]
        out[f"{name}.upsert_ids"] = new_ids[~same].contiguous()
        out[f"{name}.upsert_vectors"] = new_vec[~same].contiguous()
        out[f"{name}.deleted_ids"] = deleted.contiguous()
        old_def, new_def = base_tensors[od["default_rows"]], new_tensors[dyn["default_rows"]]
        default_changed = old_def.shape != new_def.shape or bool(
            (_bits(old_def) != _bits(new_def)).any())
        if default_changed:
            out[f"{name}.default_rows"] = new_def.contiguous()
        summary.append({"name": name, "upserts": int((~same).sum()), "deleted": int(deleted.numel()),
                        "default_rows_changed": default_changed,
                        "routing": dyn["routing"]})
    return out, summary


def apply_table_delta(tables: Mapping[str, Table], delta: Delta) -> dict[str, Table]:
    """The tables after ``delta``. Checks every table's entries first (a failure changes
    nothing), then writes plain tables' rows in place (their tensors are the scorer's own) and
    builds new id maps for dynamic tables."""
    summary = {t["name"]: t for t in delta.manifest["tables"]}
    if set(summary) != set(tables):
        raise mf.ArtifactError(f"the delta holds tables {sorted(summary)}, the scorer "
                               f"{sorted(tables)}; it belongs to another model.")
    d = delta.tensors
    for name, t in tables.items():
        keys = (("rows", "values") if t.dynamic is None
                else ("upsert_ids", "upsert_vectors", "deleted_ids"))
        missing = [f"{name}.{k}" for k in keys if f"{name}.{k}" not in d]
        if missing:
            raise mf.ArtifactError(f"the delta lacks the tensors {missing} of table {name!r}; "
                                   "export it again.")
        if t.dynamic is None:
            assert t.weight is not None
            rows, values = d[f"{name}.rows"], d[f"{name}.values"]
            if values.dtype != t.weight.dtype or tuple(values.shape[1:]) != tuple(t.weight.shape[1:]) \
                    or (rows.numel() and int(rows.max()) >= t.weight.shape[0]):
                raise mf.ArtifactError(f"the delta's rows of table {name!r} do not fit the table "
                                       f"({tuple(values.shape)} {values.dtype} into "
                                       f"{tuple(t.weight.shape)} {t.weight.dtype}).")
        else:
            vec = d[f"{name}.upsert_vectors"]
            if vec.dtype != t.dynamic.vectors.dtype or tuple(vec.shape[1:]) != tuple(
                    t.dynamic.vectors.shape[1:]) or len(vec) != len(d[f"{name}.upsert_ids"]):
                raise mf.ArtifactError(f"the delta's rows of dynamic table {name!r} do not fit "
                                       f"it ({tuple(vec.shape)} {vec.dtype} into "
                                       f"{tuple(t.dynamic.vectors.shape)} "
                                       f"{t.dynamic.vectors.dtype}).")
    out: dict[str, Table] = {}
    for name, t in tables.items():
        if t.dynamic is None:
            assert t.weight is not None
            t.weight[d[f"{name}.rows"]] = d[f"{name}.values"]
            out[name] = t
            continue
        dyn = t.dynamic
        up_ids, up_vec, deleted = (d[f"{name}.upsert_ids"], d[f"{name}.upsert_vectors"],
                                   d[f"{name}.deleted_ids"])
        keep = ~torch.isin(dyn.ids, deleted) & ~torch.isin(dyn.ids, up_ids)
        ids = torch.cat([dyn.ids[keep], up_ids])
        vectors = torch.cat([dyn.vectors[keep], up_vec])
        order = torch.argsort(ids)
        default_rows = d.get(f"{name}.default_rows", dyn.default_rows)
        routing = Routing.from_json(summary[name]["routing"])
        out[name] = replace(t, dynamic=DynamicRows(ids=ids[order].contiguous(),
                                                   vectors=vectors[order].contiguous(),
                                                   default_rows=default_rows, routing=routing))
    return out


def delta_manifest(base: Mapping[str, Any], new: Mapping[str, Any],
                   summary: list[dict[str, Any]], program_file: str | None) -> dict[str, Any]:
    """The delta's manifest (without ``files``, which the writer adds)."""
    return {
        "schema_version": mf.schema_version_of(new["tables"], new["program"]["inputs"]["sequences"]),
        "kind": "delta",
        "versions": new["versions"],
        "base": {"content_hash": base["content_hash"], "step": base.get("step")},
        "target": {"content_hash": new["content_hash"], "step": new.get("step")},
        "features_sha256": new["features_sha256"],
        "tables": summary,
        "program": None if program_file is None else {"file": program_file},
    }


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()
