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


def table_memory(model: nn.Module) -> dict[str, dict[str, int]]:
    """This rank's bytes per dynamic table: ``rows`` (the weights, fallback rows included),
    ``optimizer`` (the fused optimizer's per-row state), ``id_map`` (the sorted ids, their slots
    and the policy's per-slot metadata), ``history`` (the ids held for the next pass, with their
    metadata, as allocated), and ``total``: what a hashed table of equal memory is measured
    against."""
    out: dict[str, dict[str, int]] = {}
    for _, coll in dynamic_collections(model):
        tbes: dict[str, Any] = getattr(coll, "_table_to_tbe_and_index", {})
        for table, mod in mc_modules(coll).items():
            m: Any = mod
            history = 0
            if m._input_history_buffer_size > 0:
                history = m._history_accumulator.nbytes + sum(
                    v.nbytes for v in m._history_metadata.values())
            id_map = sum(b.nbytes for n, b in m.named_buffers() if not n.startswith("_history_"))
            rows = optim = 0
            if table in tbes:
                tbe, idx = tbes[table]
                rows = tbe.split_embedding_weights()[int(idx)].nbytes
                optim = sum(s.nbytes for s in tbe.split_optimizer_states()[int(idx)])
            out[table] = {"rows": rows, "optimizer": optim, "id_map": id_map, "history": history,
                          "total": rows + optim + id_map + history}
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
