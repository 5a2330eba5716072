"""What a rank's dynamic tables hold: counters (``table_stats``), bytes (``table_memory``) and
which ids have a row (``is_resident``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recsys_trainer.dynamic.id_map import _COUNTERS, DynamicMCHModule
from recsys_trainer.dynamic.ids import mix_ids
from recsys_trainer.dynamic.tables import dynamic_collections, mc_modules


def table_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """This rank's ``{table: {"slots", "fallback_rows", "occupied", "admitted", "evicted",
    "expired", "passes", "dropped", "counters_epoch"}}``: rows in its shard (fallback rows
    included), those of them that ids without a row read, slots holding an id, and since the
    run started (across resumes at the same world size) new ids given a row, resident ids that
    lost theirs to another id, resident ids expired, passes, and ids dropped from a full history
    before a pass; ``counters_epoch`` counts the restarts of those counters (a resume at another
    world size restarts them; the same on every rank). Sum over ranks for the table's totals."""
    out: dict[str, dict[str, int]] = {}
    for table, mod in mc_modules(model).items():
        m: Any = mod
        epoch = 0
        if isinstance(mod, DynamicMCHModule):
            counters, fallback, occupied = mod.counters, mod.fallback_per_shard, mod.occupied()
            epoch = mod.counters_epoch
        else:
            counters = dict.fromkeys(_COUNTERS, 0)
            fallback, occupied = 1, int(m._zch_size) - 1 - int(mod.open_slots().item())
        out[table] = {"slots": int(m._zch_size), "fallback_rows": fallback,
                      "occupied": occupied, **{k: int(counters[k]) for k in _COUNTERS},
                      "counters_epoch": epoch}
    return out


MEMORY_PARTS = ("rows", "optimizer", "id_map", "policy", "history", "index", "fixed")
"""The parts of a dynamic table's bytes in ``table_memory`` (and ``bookkeeping`` those after
the optimizer state, but the fixed ones)."""
BOOKKEEPING = ("id_map", "policy", "history", "index")
"""What a dynamic table holds per slot beyond a hashed table's rows and optimizer state."""


def map_memory(mod: nn.Module) -> dict[str, int]:
    """The bytes of one shard's id map ``mod`` (a torchrec MCH module), from its tensors:
    ``id_map`` (the sorted ids and their slots), ``policy`` (the policy's per-slot metadata:
    ``decayed_lfu``'s count and last access), ``history`` (the ids held for the next pass,
    with their metadata, as allocated), ``index`` (the bucket index of large lookups, once
    built) and ``fixed`` (what does not grow with the slots: torchrec's 1,025-entry table of
    shard boundaries, the forward count)."""
    m: Any = mod
    parts = dict.fromkeys(MEMORY_PARTS[2:], 0)
    parts["id_map"] = m._mch_sorted_raw_ids.nbytes + m._mch_remapped_ids_mapping.nbytes
    parts["policy"] = sum(int(v.nbytes) for v in m._mch_metadata.values())
    if m._input_history_buffer_size > 0:
        parts["history"] = m._history_accumulator.nbytes + sum(
            int(v.nbytes) for v in m._history_metadata.values())
    counted = {id(m._mch_sorted_raw_ids), id(m._mch_remapped_ids_mapping),
               *(id(v) for v in m._mch_metadata.values()),
               *(id(v) for v in m._history_metadata.values())}
    for name, b in m.named_buffers(recurse=False):
        if id(b) in counted:
            continue
        parts["index" if name == "_lookup_index" else "fixed"] += int(b.nbytes)
    return parts


def bookkeeping_per_slot(mod: nn.Module) -> float:
    """Bytes per slot that one shard's id map ``mod`` holds beyond the rows and their optimizer
    state: its ``BOOKKEEPING`` parts (``map_memory``) over its slots."""
    parts = map_memory(mod)
    m: Any = mod
    return sum(parts[k] for k in BOOKKEEPING) / int(m._zch_size)


def table_memory(model: nn.Module) -> dict[str, dict[str, int]]:
    """This rank's bytes per dynamic table: ``rows`` (the weights, fallback rows included, in
    the table's precision), ``optimizer`` (the fused optimizer's per-row state), the id map's
    parts (``map_memory``: ``id_map``, ``policy``, ``history``, ``index``, ``fixed``), and
    ``total``: what a hashed table of equal memory is measured against."""
    out: dict[str, dict[str, int]] = {}
    for _, coll in dynamic_collections(model):
        tbes: dict[str, Any] = getattr(coll, "_table_to_tbe_and_index", {})
        for table, mod in mc_modules(coll).items():
            rows = optim = 0
            if table in tbes:
                tbe, idx = tbes[table]
                rows = tbe.split_embedding_weights()[int(idx)].nbytes
                optim = sum(s.nbytes for s in tbe.split_optimizer_states()[int(idx)])
            entry = {"rows": rows, "optimizer": optim, **map_memory(mod)}
            entry["total"] = sum(entry[k] for k in MEMORY_PARTS)
            out[table] = entry
    return out


def is_resident(model: nn.Module, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{table: mask}``: which raw ids have their own row in this rank's shard of ``table``
    (the others read the table's fallback rows)."""
    maps = mc_modules(model)
    out: dict[str, torch.Tensor] = {}
    for table, raw in ids.items():
        m: Any = maps[table]
        sorted_ids = m._mch_sorted_raw_ids
        mixed = mix_ids(raw.to(sorted_ids.device))
        pos = torch.searchsorted(sorted_ids[:-1], mixed)
        out[table] = (sorted_ids[pos] == mixed).to(raw.device)
    return out
