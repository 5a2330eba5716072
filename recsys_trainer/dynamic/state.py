"""``DynamicTablesState``: the checkpoint component holding what torchrec keeps outside
``state_dict()`` (the history, the pass schedule, expiry marks, counters)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from recsys_trainer.dynamic.id_map import _COUNTERS, DynamicMCHModule, _resize_history
from recsys_trainer.dynamic.relayout import _relayout
from recsys_trainer.dynamic.tables import mc_modules

STATE_FORMAT = 3
"""``DynamicTablesState`` format: 3 adds ``waiting`` (the ``decayed_lfu`` history's entries
with a count; its counts float32); 2 the fallback layout, the pass schedule in rows and seconds,
expiry marks and the counters; 1 and 2 (before) load too."""


class DynamicTablesState:
    """The id maps' state that torchrec keeps outside ``state_dict()``: a checkpoint component
    (``Stateful``), saved per rank.

    The maps themselves (sorted ids, slots, the policy's per-slot metadata, the iteration) are
    module buffers: DCP saves them, sharded like the rows. What is not a buffer is the history
    since the last pass (ids seen, their counts or access iterations), the pass schedule, the
    expiry marks and the counters. Without them a resumed run would admit and evict
    differently from the uninterrupted one. This reads torchrec 1.8's private attributes of
    ``MCHManagedCollisionModule``; the bitwise-resume test fails if they change.

    A checkpoint of another layout (world size, or number of fallback rows per shard) is
    re-routed on load (``_relayout``, a collective over ``process_group``): every resident id
    moves, with its row, optimizer state and metadata, to the shard that owns it now, and the
    fallback rows keep their place in the id space. The ids seen since the checkpoint's last
    pass are not carried over then (they are counted again from the next batches).
    """

    needed_for_scoring = True
    """Restored with the model for evaluate/predict too (``checkpoint.contents``): the maps'
    buffers load into any layout, and one of another layout is re-routed here."""

    def __init__(self, model: nn.Module, world_size: int,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self._model = model
        self._world_size = world_size
        self._group = process_group

    def state_dict(self) -> dict[str, Any]:
        tables: dict[str, Any] = {}
        for table, mod in mc_modules(self._model).items():
            m: Any = mod
            used = int(m._current_history_buffer_offset)
            st: dict[str, Any] = {
                "buffer_size": int(m._input_history_buffer_size),
                "used": used,
                "current_iter": int(m._current_iter),
                "last_eviction_iter": int(m._last_eviction_iter),
            }
            if isinstance(m, DynamicMCHModule) and m.decayed:
                ids, counts, waiting = m.history_state()
                st.update(history=ids, history_metadata={"counts": counts}, waiting=waiting)
            else:  # torchrec's history (the legacy policies)
                st.update(history=(m._history_accumulator[:used].clone()
                                   if m._input_history_buffer_size > 0 else None),
                          history_metadata={k: v[:used].clone()
                                            for k, v in m._history_metadata.items()})
            if isinstance(m, DynamicMCHModule):
                st.update({
                    "steps": m._steps, "last_pass_step": m._last_pass_step,
                    "rows_since_pass": m._rows_since_pass, "last_pass_time": m._last_pass_time,
                    "windows": m._windows, "window_marks": list(m._window_marks),
                    "time_marks": list(m._time_marks), "counters": dict(m.counters),
                    "counters_epoch": m.counters_epoch,
                    "fallback_per_shard": m.fallback_per_shard, "shards": m.shards,
                    "decayed": m.decayed,
                })
            tables[table] = st
        return {"format": STATE_FORMAT, "world_size": self._world_size, "tables": tables}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mods = mc_modules(self._model)
        tables = state_dict["tables"]
        if set(tables) != set(mods):
            raise ValueError(f"the checkpoint has dynamic tables {sorted(tables)}, the model "
                             f"{sorted(mods)}; build the model with the same dynamic tables.")
        saved_world = int(state_dict["world_size"])
        for table, st in tables.items():
            m: Any = mods[table]
            if st.get("decayed", False) != getattr(m, "decayed", False):
                raise ValueError(
                    f"dynamic table {table!r} was checkpointed with "
                    f"{'decayed_lfu' if st.get('decayed') else 'a legacy eviction policy'} and is "
                    f"built with {'decayed_lfu' if getattr(m, 'decayed', False) else 'another'}"
                    f"; build it with the checkpoint's eviction_policy (before decayed_lfu the "
                    "default was 'distance_lfu').")
        relayout = any(
            saved_world != self._world_size
            or int(st.get("fallback_per_shard", 1)) != getattr(mods[t], "fallback_per_shard", 1)
            for t, st in tables.items())
        for table, st in tables.items():
            m = mods[table]
            _restore(m, st, history=not relayout)
        if relayout:
            group = self._group if self._group is not None else (
                dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
            for table, st in sorted(tables.items()):
                _relayout(self._model, table, saved_world, int(st.get("fallback_per_shard", 1)),
                          group)


def _restore(m: Any, st: dict[str, Any], history: bool) -> None:
    """Put one table's saved non-buffer state back (the history only with ``history``)."""
    m._current_iter = st["current_iter"]
    m._last_eviction_iter = st["last_eviction_iter"]
    size, used = st["buffer_size"], st["used"] if history else 0
    if size > 0 and (not isinstance(m, DynamicMCHModule) or not m.decayed):
        _resize_history(m, max(size, m._input_history_buffer_size))
    if isinstance(m, DynamicMCHModule) and m.decayed:
        m.restore_history(st["history"][:used] if used else None,
                          st["history_metadata"]["counts"][:used] if used else None,
                          st.get("waiting"))
    else:
        if used:
            m._history_accumulator[:used] = st["history"]
            for k, v in st["history_metadata"].items():
                m._history_metadata[k][:used] = v
        m._current_history_buffer_offset = used
    if not isinstance(m, DynamicMCHModule):
        return
    # Checkpoints from before passes counted steps (format 1, no step keys): forwards were
    # steps then (the count was only wrong with gradient accumulation).
    m._steps = int(st.get("steps", st["current_iter"]))
    m._last_pass_step = int(st.get("last_pass_step", st["last_eviction_iter"]))
    m._rows_since_pass = int(st.get("rows_since_pass", 0))
    m._last_pass_time = float(st.get("last_pass_time", 0.0))
    m._windows = int(st.get("windows", 0))
    m._window_marks = list(st.get("window_marks", []))
    m._time_marks = [tuple(x) for x in st.get("time_marks", [])]
    m.counters_epoch = int(st.get("counters_epoch", 0))
    if "counters" in st:
        m.counters = dict(st["counters"])
    else:  # format 1: the policy's counters; evictions were derived
        m.counters = dict.fromkeys(_COUNTERS, 0)
        m.counters.update(admitted=int(st["admitted"]), passes=int(st["passes"]),
                          evicted=int(st["admitted"]) - m.occupied())
