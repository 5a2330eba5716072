"""Serving exports of dynamic tables: raw id -> vector, in full or as a delta.

A full export (``export_dynamic``) reads a committed checkpoint in one plain process (merged,
whatever world size wrote it) and gives, per dynamic table, the resident raw ids (sorted), their
vectors, and the fallback rows that every other id reads (``default``, in id-space order: an id
without a row reads ``default[fallback_index(mix_ids(id), len(default))]``, see
``TableExport.vectors_for``). Everything else in the model (dense towers, hashed tables) is
under ``other``.

A delta (``dynamic_delta``) holds only what changed since a previous export: ids that are new
or whose vector changed (bitwise), ids that left the table (evicted or expired), and any changed
fallback rows or other tensor, whole. ``apply_delta(base, delta)`` gives the newer full export exactly, so
a server can load one full export and then follow the stream of deltas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from recsys_trainer import storage
from recsys_trainer.checkpoint import contents
from recsys_trainer.checkpoint.export import export_model_state_dict, save_file
from recsys_trainer.dynamic import EMPTY_SLOT, fallback_index, mix_ids, rows_key, unmix_ids

_IDS = "._mch_sorted_raw_ids"
_SLOTS = "._mch_remapped_ids_mapping"
_SEGMENTS = "._output_segments_tensor"
_MC = "._managed_collision_collection._managed_collision_modules."


@dataclass
class TableExport:
    """One dynamic table: ``ids`` (sorted raw ids, int64 ``[n]``), ``vectors`` (``[n, dim]``),
    ``default`` (``[fallback rows, dim]``, the rows unknown ids read, in id-space order; one per
    shard for tables with one fallback row per shard)."""

    ids: torch.Tensor
    vectors: torch.Tensor
    default: torch.Tensor

    def lookup(self, raw_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Vectors of ``raw_ids`` and a mask of those found (others: zeros; use ``default``)."""
        pos = torch.searchsorted(self.ids, raw_ids).clamp_max(max(len(self.ids) - 1, 0))
        found = self.ids[pos] == raw_ids if len(self.ids) else torch.zeros_like(raw_ids, dtype=torch.bool)
        out = torch.zeros(len(raw_ids), self.vectors.shape[1], dtype=self.vectors.dtype,
                          device=self.vectors.device)
        out[found] = self.vectors[pos[found]]
        return out, found

    def vectors_for(self, raw_ids: torch.Tensor) -> torch.Tensor:
        """What the trained model reads for ``raw_ids``: an id's own row, else its fallback
        row (the one of its part of the id space; the trainer reads the same one, except for
        the ids within ``world size`` of a shard boundary, one in ~10**18)."""
        out, found = self.lookup(raw_ids)
        rows = fallback_index(mix_ids(raw_ids[~found]), len(self.default))
        out[~found] = self.default[rows]
        return out


@dataclass
class DynamicExport:
    """A full export: ``tables`` by table name, ``other`` model tensors by state-dict key."""

    tables: dict[str, TableExport]
    other: dict[str, torch.Tensor]
    step: int | None = None


@dataclass
class TableDelta:
    upsert_ids: torch.Tensor
    upsert_vectors: torch.Tensor
    deleted_ids: torch.Tensor
    default: torch.Tensor | None
    """The new default rows if they changed, else None."""


@dataclass
class DynamicDelta:
    """What changed from export ``base_step`` to export ``step``."""

    tables: dict[str, TableDelta]
    other: dict[str, torch.Tensor] = field(default_factory=dict)
    deleted_other: list[str] = field(default_factory=list)
    base_step: int | None = None
    step: int | None = None

    def num_rows(self) -> int:
        """Rows written (upserts), over all tables."""
        return sum(int(t.upsert_ids.numel()) for t in self.tables.values())


def export_dynamic(ckpt_dir: str, out_file: str | None = None, *, verify: bool = True,
                   ) -> DynamicExport:
    """The full serving export of a committed checkpoint (see the module docstring); with
    ``out_file`` also written with ``torch.save`` (plain tensors and dicts)."""
    state = export_model_state_dict(ckpt_dir, verify=verify)
    fallback = _fallback_per_shard(ckpt_dir)
    tables: dict[str, TableExport] = {}
    used: set[str] = set()
    for key in sorted(k for k in state if k.endswith(_IDS) and _MC in k):
        prefix = key[: -len(_IDS)]
        owner, table = prefix.split(_MC)
        weight_key = rows_key(state, f"{owner}.", table)
        if weight_key not in state:
            raise KeyError(f"checkpoint {ckpt_dir!r} has the id map of {table!r} but not its rows "
                           f"{weight_key!r} (left out by params_not_save?)")
        raw, slots, weight = state[key], state[prefix + _SLOTS], state[weight_key]
        keep = raw != EMPTY_SLOT
        ids = unmix_ids(raw[keep])
        order = torch.argsort(ids)
        segments = state[prefix + _SEGMENTS]
        ends = segments[segments >= 0][1:]
        per_shard = fallback.get(table, 1)
        rows = (ends.unsqueeze(1) - per_shard + torch.arange(per_shard, device=ends.device)).reshape(-1)
        tables[table] = TableExport(ids=ids[order], vectors=weight[slots[keep][order]].clone(),
                                    default=weight[rows].clone())
        used.update(k for k in state if k.startswith(prefix + "."))
        used.add(weight_key)
    other = {k: v for k, v in state.items() if k not in used}
    out = DynamicExport(tables=tables, other=other, step=_step_of(ckpt_dir))
    if out_file is not None:
        save_file(out, out_file)
    return out


def _fallback_per_shard(ckpt_dir: str) -> dict[str, int]:
    """``{table: fallback rows per shard}`` from the checkpoint's dynamic-tables state (rank 0's
    file; every rank has the same layout). Checkpoints from before fallback rows had one."""
    loc = storage.locate(ckpt_dir)
    extra = contents.load_extra(loc.join(contents.extra_file_name(0)))
    tables = (extra.get("dynamic_tables") or {}).get("tables", {})
    return {t: int(st.get("fallback_per_shard", 1)) for t, st in tables.items()}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers of the same width (for bitwise comparison)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()])


def dynamic_delta(base: DynamicExport, new: DynamicExport) -> DynamicDelta:
    """Only what changed from ``base`` to ``new`` (both full exports)."""
    if set(base.tables) != set(new.tables):
        raise ValueError(f"exports of different models: dynamic tables {sorted(base.tables)} "
                         f"vs {sorted(new.tables)}")
    tables: dict[str, TableDelta] = {}
    for name, t in new.tables.items():
        old = base.tables[name]
        old_vec, found = old.lookup(t.ids)
        # Bitwise, not ==: -0.0 == 0.0 would drop a real change and NaN != NaN resend a row.
        same = found & (_bits(old_vec) == _bits(t.vectors)).all(dim=1)
        deleted = old.ids[~torch.isin(old.ids, t.ids)]
        default_same = old.default.shape == t.default.shape and torch.equal(old.default, t.default)
        tables[name] = TableDelta(upsert_ids=t.ids[~same], upsert_vectors=t.vectors[~same].clone(),
                                  deleted_ids=deleted, default=None if default_same else t.default)
    other = {k: v for k, v in new.other.items()
             if k not in base.other or not torch.equal(base.other[k], v)}
    return DynamicDelta(tables=tables, other=other,
                        deleted_other=sorted(set(base.other) - set(new.other)),
                        base_step=base.step, step=new.step)


def apply_delta(base: DynamicExport, delta: DynamicDelta) -> DynamicExport:
    """``base`` updated by ``delta``: equal to the full export ``delta`` was taken against."""
    if delta.base_step is not None and base.step is not None and delta.base_step != base.step:
        raise ValueError(f"this delta goes from step {delta.base_step} to {delta.step}, but the "
                         f"base export is of step {base.step}; apply deltas in order.")
    tables: dict[str, TableExport] = {}
    for name, t in base.tables.items():
        d = delta.tables[name]
        keep = ~torch.isin(t.ids, d.deleted_ids) & ~torch.isin(t.ids, d.upsert_ids)
        ids = torch.cat([t.ids[keep], d.upsert_ids])
        vectors = torch.cat([t.vectors[keep], d.upsert_vectors])
        order = torch.argsort(ids)
        tables[name] = TableExport(ids=ids[order], vectors=vectors[order],
                                   default=t.default if d.default is None else d.default)
    other = {k: v for k, v in base.other.items() if k not in delta.deleted_other}
    other.update(delta.other)
    return DynamicExport(tables=tables, other=other, step=delta.step)


def write_delta(ckpt_dir: str, previous_export: str, out_file: str,
                full_out_file: str | None = None) -> DynamicDelta:
    """Export ``ckpt_dir``, diff it against the full export saved at ``previous_export``, and
    write only the delta to ``out_file`` (and the new full export to ``full_out_file``, the
    base for the next delta)."""
    new = export_dynamic(ckpt_dir, full_out_file)
    delta = dynamic_delta(load_export(previous_export), new)
    save_file(delta, out_file)
    return delta


def load_export(path: str) -> Any:
    """A ``DynamicExport`` or ``DynamicDelta`` written by this module."""
    data = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(data, DynamicExport | DynamicDelta):
        raise ValueError(f"{path!r} is not a dynamic-table export or delta")
    return data


def _step_of(ckpt_dir: str) -> int | None:
    tail = os.path.basename(os.path.normpath(ckpt_dir))
    return int(tail.split("_")[-1]) if tail.startswith("step_") and tail[5:].isdigit() else None
