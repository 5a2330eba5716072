"""Re-routing a dynamic table loaded from a checkpoint of another layout (world size, or fallback
rows per shard): every resident id moves, with its row, optimizer state and metadata, to the
shard that owns it now (``_relayout``, a collective)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recsys_trainer.dynamic.id_map import _COUNTERS, DynamicMCHModule
from recsys_trainer.dynamic.ids import EMPTY_SLOT, shard_of
from recsys_trainer.dynamic.tables import dynamic_collections

logger = logging.getLogger("recsys_trainer")


def _table_owner(model: nn.Module, table: str) -> tuple[Any, Any]:
    """(the collection, this rank's map) of ``table``."""
    for _, coll in dynamic_collections(model):
        c: Any = coll
        mods = c._managed_collision_collection._managed_collision_modules
        if table in mods:
            return coll, mods[table]
    raise KeyError(table)


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors must be for collectives on ``group`` (NCCL: the GPU)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_rows(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``[n_r, c]`` int64 rows, concatenated in rank order (on the CPU)."""
    _, world = _group_rank_size(group)
    if world == 1:
        return local
    dev = _comm_device(group)
    n = torch.tensor([local.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    most = max(int(s) for s in sizes)
    padded = torch.zeros(most, local.shape[1], dtype=torch.int64, device=dev)
    padded[:local.shape[0]] = local.to(dev)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:int(s)].cpu() for p, s in zip(parts, sizes, strict=True)])


def _keep_best(rows: torch.Tensor, names: list[str], cap: int) -> torch.Tensor:
    """Indices of the ``cap`` rows (id, slot, metadata by ``names``) a policy keeps: by count,
    then by last access (torchrec's own policies rank by those)."""
    order = torch.arange(rows.shape[0])
    for key in ("last_access_iter", "counts"):  # least significant first (stable sorts)
        if key in names:
            col = rows[order, 2 + names.index(key)]
            order = order[torch.argsort(col, descending=True, stable=True)]
    return order[:cap]


@torch.no_grad()
def _relayout(model: nn.Module, table: str, saved_world: int, saved_fallback: int,
              group: dist.ProcessGroup | None) -> None:
    """Re-route a dynamic table loaded from a checkpoint of another layout (a collective).

    DCP has loaded the saved global row space into this run's shards: rank ``r`` holds the rows
    and map entries at its new row range, entries that still name slots of the old layout.
    Every rank gathers all resident entries (id, old slot, metadata), and all compute the same
    plan: each id goes to the shard that owns it now (``shard_of``), into the first free slots
    of that shard in id order (if more ids land on a shard than it has slots for ids, its
    best by count / last access stay); fallback row ``g`` of the new layout takes the old
    fallback row covering the same part of the id space (the same row when their number is
    unchanged). Rows and optimizer state move with one ``all_to_all``."""
    coll, m = _table_owner(model, table)
    if not isinstance(m, DynamicMCHModule) or m.loaded_segments is None:
        raise RuntimeError(f"dynamic table {table!r}: its id map was not loaded from the "
                           "checkpoint, so it cannot be re-routed.")
    rank, world = _group_rank_size(group)
    mm: Any = m
    old_seg, fb_old = m.loaded_segments, saved_fallback
    new_seg = list(m.segments)
    shards_new, fb_new = len(new_seg) - 1, m.fallback_per_shard
    names = sorted(mm._mch_metadata)
    ids = mm._mch_sorted_raw_ids
    real = ids != EMPTY_SLOT
    # One int64 row per resident id (the compact map's int32 slots and float32 counts, whole
    # numbers of COUNT_ONE units, widen exactly): 8 bytes a column on the wire.
    local = torch.stack([ids[real], mm._mch_remapped_ids_mapping[real].long()]
                        + [mm._mch_metadata[k][real].long() for k in names], dim=1).cpu()
    everything = _all_gather_rows(local, group)
    owner = shard_of(everything[:, 0], shards_new)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    mine = everything[:0]
    dropped = 0
    for k in range(shards_new):
        rows = everything[owner == k]
        cap = new_seg[k + 1] - new_seg[k] - fb_new
        if rows.shape[0] > cap:
            dropped += rows.shape[0] - cap
            rows = rows[_keep_best(rows, names, cap)]
        rows = rows[torch.argsort(rows[:, 0])]
        src.append(rows[:, 1])
        dst.append(new_seg[k] + torch.arange(rows.shape[0]))
        if k == rank:
            mine = rows
    # Fallback rows: new row g reads the part of the id space whose middle old row g_old covered.
    total_new, total_old = fb_new * shards_new, fb_old * (len(old_seg) - 1)
    g_new = torch.arange(total_new)
    g_old = torch.div((2 * g_new + 1) * total_old, 2 * total_new, rounding_mode="floor")
    old_ends = torch.tensor(old_seg[1:])
    new_ends = torch.tensor(new_seg[1:])
    src.append(old_ends[g_old // fb_old] - fb_old + g_old % fb_old)
    dst.append(new_ends[g_new // fb_new] - fb_new + g_new % fb_new)
    _move_rows(coll, table, torch.cat(src), torch.cat(dst), new_seg, rank, world, group)
    # This shard's map: its ids in the first slots (sorted), every other slot empty, in slot
    # order, so the fallback slots are the last entries (never assigned, see the policies).
    n, z = mine.shape[0], mm._zch_size
    new_ids = torch.full((z,), EMPTY_SLOT, dtype=torch.int64)
    new_ids[:n] = mine[:, 0]
    ids.copy_(new_ids.to(ids.device))
    mm._mch_remapped_ids_mapping.copy_(torch.arange(
        mm._output_global_offset, mm._output_global_offset + z, device=ids.device))
    for j, key in enumerate(names):
        meta = torch.zeros(z, dtype=torch.int64)
        meta[:n] = mine[:, 2 + j]
        mm._mch_metadata[key].copy_(meta.to(ids.device))  # cast to the buffer's dtype
    mm._evicted = False
    m.loaded_segments = None
    if world != saved_world:
        # Each rank's counters were its own shard's; rank 0's alone came back. Start afresh.
        m.counters = dict.fromkeys(_COUNTERS, 0)
        m.counters_epoch += 1
    if rank == 0:
        logger.warning(
            "dynamic table %s: re-routed %d ids from a checkpoint of %d shard(s) with %d "
            "fallback row(s) each to %d shard(s) with %d each%s; the ids seen since its last "
            "pass are counted again from the next batches", table, everything.shape[0],
            len(old_seg) - 1, fb_old, shards_new, fb_new,
            f"; {dropped} ids with the fewest sightings did not fit their new shard"
            if dropped else "")


def _move_rows(coll: Any, table: str, src: torch.Tensor, dst: torch.Tensor,
               new_seg: list[int], rank: int, world: int,
               group: dist.ProcessGroup | None) -> None:
    """Copy global rows ``src`` (weights and per-row optimizer state) to global rows ``dst``,
    where each rank holds the rows of its range in ``new_seg``."""
    if not hasattr(coll, "_table_to_tbe_and_index"):
        raise RuntimeError(f"dynamic table {table!r} is not sharded; a checkpoint of another "
                           "layout can only be re-routed into a sharded model (the Trainer's).")
    tbe, idx = coll._table_to_tbe_and_index[table]
    if getattr(tbe, "lxu_cache_weights", torch.empty(0)).numel():
        tbe.flush()  # a UVM-cached table: write the cache back first
    weights = tbe.split_embedding_weights()[int(idx)]
    states = [s.view(s.shape[0], -1) for s in tbe.split_optimizer_states()[int(idx)]]
    lo = new_seg[rank]
    ends = torch.tensor(new_seg[1:])
    src_rank = torch.searchsorted(ends, src, right=True)
    dst_rank = torch.searchsorted(ends, dst, right=True)

    def payload(local_rows: torch.Tensor) -> torch.Tensor:
        # One float32 tensor for rows and optimizer state, so one all_to_all moves both: fp16
        # and bf16 rows widen to float32 exactly and narrow back unchanged on arrival, so a
        # re-routed half-precision row is bit for bit the saved one.
        parts = [weights[local_rows].float()] + [s[local_rows].float() for s in states]
        return torch.cat(parts, dim=1)

    sending = (src_rank == rank).nonzero().squeeze(1)
    sending = sending[torch.argsort(dst_rank[sending], stable=True)]
    dev = _comm_device(group)
    send = payload((src[sending] - lo).to(weights.device)).to(dev)
    receiving = (dst_rank == rank).nonzero().squeeze(1)
    receiving = receiving[torch.argsort(src_rank[receiving], stable=True)]
    if world > 1:
        send_splits = torch.bincount(dst_rank[sending], minlength=world).tolist()
        recv_splits = torch.bincount(src_rank[receiving], minlength=world).tolist()
        recv = torch.empty(len(receiving), send.shape[1], dtype=send.dtype, device=dev)
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    else:
        recv = send
    rows = (dst[receiving] - lo).to(weights.device)
    recv = recv.to(weights.device)
    dim = weights.shape[1]
    weights[rows] = recv[:, :dim].to(weights.dtype)
    at = dim
    for s in states:
        s[rows] = recv[:, at:at + s.shape[1]].to(s.dtype)
        at += s.shape[1]
    if hasattr(tbe, "reset_cache_states") and getattr(
            tbe, "lxu_cache_weights", torch.empty(0)).numel():
        tbe.reset_cache_states()  # the cache held rows of the old layout
