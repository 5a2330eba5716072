"""``DynamicMCHModule``: one dynamic table's id -> slot map on one shard (torchrec's
``MCHManagedCollisionModule``) with passes every so many rows, seconds or steps, the bounded
``decayed_lfu`` history, fallback rows and expiry."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_trainer.dynamic.config import DynamicTable
from recsys_trainer.dynamic.ids import EMPTY_SLOT, fallback_index
from recsys_trainer.dynamic.policy import COUNT_ONE, DecayedLFUEvictionPolicy
from recsys_trainer.validation import fail


@dataclass(frozen=True)
class _Settings:
    """What ``DynamicMCHModule`` takes from ``DynamicTable`` beyond torchrec's arguments."""

    interval_steps: int | None = None
    interval_rows: int | None = None
    interval_seconds: float | None = None
    fallback_rows: int = 1
    history_slots: int | None = None
    expire_windows: int | None = None
    expire_seconds: float | None = None

    @staticmethod
    def of(spec: DynamicTable) -> _Settings:
        return _Settings(interval_steps=spec.eviction_interval,
                         interval_rows=spec.eviction_interval_rows,
                         interval_seconds=spec.eviction_interval_seconds,
                         fallback_rows=spec.fallback_rows,
                         history_slots=spec.history_slots,
                         expire_windows=spec.expire_after_windows,
                         expire_seconds=spec.expire_after_seconds)


INDEX_BYTES_PER_SLOT = 1.5
"""The most the bucket index of large lookups may hold a slot: the compact map (20 bytes) and
the default history (2.5) leave 1.5 of a dynamic table's 24 (``index_bits``)."""


def index_bits(slots: int) -> int:
    """The bucket index's bits for a map of ``slots``: the most buckets (a power of two, each
    an int32 position, and one past the last) within ``INDEX_BYTES_PER_SLOT`` bytes a slot: a
    bucket per 2.7-5.3 slots (1-1.5 bytes a slot; a finer index needs fewer rounds)."""
    return max(1, (int(slots * INDEX_BYTES_PER_SLOT) // 4 - 1).bit_length() - 1)


INDEXED_LOOKUP_MIN_IDS = 1024
"""Batches of at least this many ids (per table and shard) look up through the bucket index
(``DynamicMCHModule._indexed_positions``); smaller ones by binary search, which costs fewer
ops there (26 us against 48 for 512 ids in a 1,600-slot map)."""

_COUNTERS = ("admitted", "evicted", "expired", "passes", "dropped")


class DynamicMCHModule(MCHManagedCollisionModule):
    """torchrec's ``MCHManagedCollisionModule`` (one table's sorted id -> slot map on one
    shard) with passes every so many rows, seconds or steps, fallback rows, expiry, and, for
    ``DecayedLFUEvictionPolicy``, a bounded history that carries waiting ids' counts across
    passes (see the module docstring).

    Memory per shard, ``decayed_lfu`` (``compact_map``): 20 bytes a slot for the map (the
    sorted int64 ids, their slots as int32, the policy's float32 count and int32 last access),
    and the history: 20 bytes per ``history_slots / shards`` (a waiting id, its float32 count,
    and room for one new sighting, an int64 id, before they are coalesced). The legacy
    policies keep torchrec's int64 buffers (8 bytes per slot for the ids, the slots and each
    metadata buffer) and its history of 8 or 16 bytes per id *sighting* since the last pass,
    for the larger of torchrec's first size (the first batch's ids x ``eviction_interval`` x
    1.25) and twice the most one interval brought. ``table_memory`` counts all of it.

    torchrec's constructor plus ``settings``; ``rebuild_with_output_id_range`` (sharding) keeps
    them. Reads and writes torchrec 1.8's private attributes of the module; the tests of
    resume, expiry and fallback rows fail if they change.
    """

    def __init__(self, *args: Any, settings: _Settings | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        m: Any = self
        self._settings = settings or _Settings(interval_steps=m._eviction_interval)
        # From the arguments, as torchrec fills its buffer: not read back from the buffer, which
        # is on the module's device (a sync per table on a GPU, and no value on meta).
        given = inspect.signature(MCHManagedCollisionModule.__init__).bind(self, *args, **kwargs)
        given.apply_defaults()
        offset = int(given.arguments["output_global_offset"])
        segments = [int(s) for s in given.arguments["output_segments"]
                    or [offset, offset + int(given.arguments["zch_size"])]]
        self.segments = segments
        """This layout's shard boundaries (global rows). torchrec keeps its "init" segments as
        the very tensor of the buffer that a checkpoint loads into, so a load would overwrite
        them: ``validate_state`` writes these back."""
        self.shards = len(segments) - 1
        """Shards of this table (its world size when sharded row-wise)."""
        self.shard = segments.index(m._output_global_offset)
        self.fallback_per_shard = max(1, -(-self._settings.fallback_rows // self.shards))
        """The last rows of this shard that ids without a row read."""
        if self.fallback_per_shard >= m._zch_size:
            fail(f"DynamicTable.fallback_rows (table {m._name!r})", f"fewer than the "
                 f"{m._zch_size} rows of each of its {self.shards} shard(s)",
                 self._settings.fallback_rows)
        self.decayed = isinstance(m._eviction_policy, DecayedLFUEvictionPolicy)
        self._waiting = 0
        """``decayed_lfu``: the history's first entries that carry a count (ids that waited
        over a pass, or coalesced); those after them are sightings (one each)."""
        self._history_keep = 0
        """``decayed_lfu``: the ids (with counts) the history keeps over a pass."""
        if self.decayed:
            compact_map(m)
            _allocate_history(m, -(-(self._settings.history_slots or m._zch_size)
                                   // self.shards))
        self.closes_step = True
        """Whether the current training forward is the last micro-batch of its step."""
        self._steps = 0
        """Optimizer steps this module has taken part in (forwards that closed a step)."""
        self._last_pass_step = 0
        self._rows_since_pass = 0
        self._last_pass_time = 0.0
        self._windows = 0
        self._window_marks: list[int] = []
        """The forward count at the end of each of the last train windows (expiry in windows)."""
        self._time_marks: list[tuple[int, float]] = []
        """(forward count, wall time) every 1/16 of ``expire_seconds`` (expiry in seconds)."""
        self.counters = dict.fromkeys(_COUNTERS, 0)
        """Since the run started (restored on resume): ids given a row, residents that lost
        theirs to another id, residents expired, passes, and ids dropped from a full history."""
        self.counters_epoch = 0
        """Times the counters restarted (a resume at another world size); the same on every
        rank, so reporters know their baseline is gone."""
        self.loaded_segments: list[int] | None = None
        """The shard boundaries of the checkpoint last loaded (set by ``validate_state``)."""
        self._lookup_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | \
            None = None
        """(values, position in the map, found, not found) of the training forward's ids:
        ``profile`` computes it and ``remap`` reuses it (unless a pass changed the map)."""
        # The bucket index of large lookups (``_indexed_positions``): empty until one runs; a
        # buffer, so that ``table_memory`` counts it with the map.
        self.register_buffer("_lookup_index", torch.zeros(0, dtype=torch.int32, device=m.device),
                             persistent=False)
        self._index_key: tuple[int, int, int] | None = None
        self._occupied_key: tuple[int, int, int] | None = None
        self._occupied_count = 0
        # The forward count is a Python int; its buffer (torchrec's, in checkpoints) is written
        # whenever the state is read, not at every forward (an op per table).
        self.register_state_dict_pre_hook(_write_iteration)
        self._index_shift = 63
        self._index_rounds = 0

    def rebuild_with_output_id_range(self, output_id_range: tuple[int, int],
                                     output_segments: list[int],
                                     device: torch.device | None = None) -> DynamicMCHModule:
        m: Any = self
        return type(self)(
            name=m._name, zch_size=output_id_range[1] - output_id_range[0],
            device=device or self.device, eviction_policy=m._eviction_policy,
            eviction_interval=m._eviction_interval, input_hash_size=m._input_hash_size,
            input_hash_func=m._input_hash_func, output_global_offset=output_id_range[0],
            output_segments=output_segments, buckets=len(output_segments) - 1,
            settings=self._settings)

    # ---------------------------------------------------------------- lookups

    def fallback_slots(self, mixed: torch.Tensor) -> torch.Tensor:
        """The fallback slot (global row) each mixed id of this shard reads."""
        m: Any = self
        first = m._output_global_offset + m._zch_size - self.fallback_per_shard
        if self.fallback_per_shard == 1:
            return torch.full_like(mixed, first)
        g = fallback_index(mixed, self.fallback_per_shard * self.shards)
        local = (g - self.shard * self.fallback_per_shard).clamp_(0, self.fallback_per_shard - 1)
        return local + first

    def _lookup(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position in the sorted map, found) of mixed ids ``v``."""
        cached = self._lookup_cache
        if cached is not None and cached[0] is v:
            return cached[1], cached[2]
        sorted_ids: torch.Tensor = self._mch_sorted_raw_ids
        # (Inference tensors keep no version counter, which says when the index is stale.)
        if v.numel() >= INDEXED_LOOKUP_MIN_IDS and v.device.type == "cpu" and \
                not sorted_ids.is_inference():
            pos = self._indexed_positions(sorted_ids, v)
        else:
            # The last entry is always empty (int64 max, a protected fallback slot) and ids
            # are below it: every position is in range without searching a slice of the others.
            pos = torch.searchsorted(sorted_ids, v)
        return pos, sorted_ids.index_select(0, pos) == v

    def _indexed_positions(self, sorted_ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``torch.searchsorted(sorted_ids, v)``, the same positions, by the bucket index.

        A binary search's branches are unpredictable (random ids): ~50 ns per id in a
        1,600-slot map, ~150 in a million-slot one. Mixed ids are uniform over the id space, so
        the top bits of an id name a bucket of the sorted map holding ~1 id: the index gives
        each bucket's first position, and every id then steps past the few smaller ids of its
        bucket, all ids at once, as many rounds as the fullest bucket holds (31 ns per id at
        1,600 slots and 2,048 ids, 44 at a million slots; bit-identical positions, tested).
        Built on the first lookup after the map changed (the buffer's version counter says
        when), on CPU and for batches of ``INDEXED_LOOKUP_MIN_IDS`` ids or more, where it pays."""
        key = (id(sorted_ids), sorted_ids.data_ptr(), sorted_ids._version)
        if self._index_key != key:
            used = int(torch.searchsorted(sorted_ids, self._delimiter).item())
            # A bucket per 2.7-5.3 slots (1-1.5 bytes a slot): more rounds than a bucket per
            # slot, a quarter of the memory or less (docs/dynamic.md, "Memory").
            bits = index_bits(sorted_ids.numel())
            shift = 63 - bits
            per_bucket = torch.bincount(sorted_ids[:used] >> shift, minlength=1 << bits)
            starts = torch.zeros((1 << bits) + 1, dtype=torch.int64, device=sorted_ids.device)
            torch.cumsum(per_bucket, 0, out=starts[1:])
            # int32 positions (half the bytes) unless the shard has 2**31 slots or more.
            self._lookup_index = starts.to(torch.int32) if sorted_ids.numel() < 2**31 else starts
            self._index_shift = shift
            self._index_rounds = int(per_bucket.max().item()) if used else 0
            self._index_key = key
        pos = self._lookup_index.index_select(0, v >> self._index_shift)
        # Past the last id of a bucket is the next bucket's first id, or an empty slot (int64
        # max): both above every id of the bucket, so an id never steps past its position.
        for _ in range(self._index_rounds):
            pos += sorted_ids.index_select(0, pos) < v
        return pos.long()

    def preprocess(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Mix the ids (``input_hash_func``) before they are routed: torchrec's, without
        computing offsets that the lookup never reads (without an ``input_hash_func``, the ids
        unchanged, as torchrec)."""
        m: Any = self
        if m._input_hash_func is None:
            return features
        return {name: JaggedTensor(values=m._input_hash_func(f.values(), m._input_hash_size),
                                   lengths=f.lengths(), weights=f.weights_or_none())
                for name, f in features.items()}

    def remap(self, features: dict[str, JaggedTensor], mutate_miss_lengths: bool = True,
              write_weights: torch.Tensor | None = None) -> dict[str, JaggedTensor]:
        """Ids with a row read it; the others read their fallback row."""
        # Lengths only: torchrec reads no offsets of the remapped ids.
        out = {name: JaggedTensor(values=self._rows(f.values()), lengths=f.lengths(),
                                  weights=f.weights_or_none())
               for name, f in features.items()}
        _set_plain(self, "_lookup_cache", None)
        return out

    def forward_rows(self, ids: torch.Tensor, batch_rows: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """``remap(profile(...))`` of one table's (mixed) ids on this shard, from ``batch_rows``
        rows of the (all ranks') batch: the global row each id reads (written to ``out`` when
        given). Tensors in and out, for ``DynamicShardedMaps``: no dicts or JaggedTensors."""
        if self.training:
            self._start_forward()
            self._observe(ids, batch_rows)
            self._end_forward()
        rows = self._rows(ids, out)
        _set_plain(self, "_lookup_cache", None)
        return rows

    def _rows(self, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The global (int64) row each mixed id ``v`` reads (into ``out`` when given)."""
        m: Any = self
        cached = self._lookup_cache
        if cached is not None and cached[0] is v:
            _, pos, found, missing = cached
        else:
            pos, found = self._lookup(v)
            missing = found.logical_not()
        mapping: torch.Tensor = self._mch_remapped_ids_mapping
        if mapping.dtype != torch.int64:
            # The compact map's int32 slots: gathered, then widened into the int64 rows.
            rows = mapping.index_select(0, pos)
            if self.fallback_per_shard == 1:
                rows.masked_fill_(missing, m._output_global_offset + m._zch_size - 1)
            else:
                rows = torch.where(found, rows, self.fallback_slots(v))
            if out is None:
                return rows.long()
            return out.copy_(rows)
        if self.fallback_per_shard == 1:
            return torch.index_select(mapping, 0, pos, out=out).masked_fill_(
                missing, m._output_global_offset + m._zch_size - 1)
        return torch.where(found, mapping.index_select(0, pos), self.fallback_slots(v), out=out)

    def occupied(self) -> int:
        """Slots holding an id (counted once per change of the map: a pass asks before and
        after, torchrec's row reset then asks again)."""
        ids: torch.Tensor = self._mch_sorted_raw_ids
        # (Inference tensors keep no version counter, which says when the map changed.)
        key = None if ids.is_inference() else (id(ids), ids.data_ptr(), ids._version)
        if key is None or key != self._occupied_key:
            _set_plain(self, "_occupied_count",
                       int(torch.searchsorted(ids, self._delimiter).item()))
            _set_plain(self, "_occupied_key", key)
        return self._occupied_count

    def open_slots(self) -> torch.Tensor:
        """Slots free for ids, as torchrec's: a one-element tensor on the map's device."""
        m: Any = self
        return torch.tensor([m._zch_size - self.fallback_per_shard - self.occupied()],
                            device=self._mch_sorted_raw_ids.device)

    # ---------------------------------------------------------------- training

    @torch.no_grad()
    def profile(self, features: dict[str, JaggedTensor]) -> dict[str, JaggedTensor]:
        """Record this batch's ids in the history; run a pass when the interval is over."""
        if not self.training:
            return features
        self._start_forward()
        for f in features.values():
            # One length per feature and row of the whole (all ranks') batch; `weights` holds
            # one id count per feature of the table.
            w = f.weights_or_none()
            self._observe(f.values(), f.lengths().numel()
                          // max(1, w.numel() if w is not None else 1))
        self._end_forward()
        return features

    def _start_forward(self) -> None:
        m: Any = self  # torchrec's attributes are untyped
        if m._current_iter == -1:
            # As torchrec: the iteration restored with the buffers (a resume sets it itself).
            m._current_iter = int(m._current_iter_tensor.item())
            m._last_eviction_iter = m._current_iter
        _set_plain(self, "_current_iter", m._current_iter + 1)
        if m._current_iter >= ITER_REBASE and self.decayed:
            self._rebase_iterations()
        if self._last_pass_time == 0.0:
            self._last_pass_time = time.time()

    def _rebase_iterations(self) -> None:
        """Take a whole number of ``ITER_REBASE`` from the forward count and from everything
        that holds one (the int32 last accesses, expiry marks), so that the count stays within
        int32 for the life of a job: comparisons between them, all that expiry reads, keep
        their outcome. Last accesses more than 2**31 forwards back stay at int32's lowest."""
        m: Any = self
        shift = m._current_iter - m._current_iter % ITER_REBASE
        last: torch.Tensor = m._mch_last_access_iter
        last.copy_(last.long().sub_(shift).clamp_(min=ITER_MIN))
        for name, value in (("_current_iter", m._current_iter - shift),
                            ("_last_eviction_iter", m._last_eviction_iter - shift),
                            ("_window_marks", [it - shift for it in self._window_marks]),
                            ("_time_marks", [(it - shift, t) for it, t in self._time_marks])):
            _set_plain(self, name, value)

    def _observe(self, v: torch.Tensor, batch_rows: int) -> None:
        """Count this forward's ids ``v`` (from ``batch_rows`` rows of the batch)."""
        m: Any = self
        _set_plain(self, "_rows_since_pass", self._rows_since_pass + batch_rows)
        if not self.decayed:
            self._record_growing(v)
            return
        # Resident ids are counted in place; only the others wait in the history. Every op
        # here runs per table and forward: on small batches the cost is the number of ops,
        # not their size. Ids without a row are counted on the map's last entry instead of
        # their own: it is always empty (a protected fallback slot, which is never ranked,
        # expired, exported or re-routed), so the found positions need no compaction, and a
        # count and a last access take one op each.
        pos, found = self._lookup(v)
        missing = found.logical_not()
        _set_plain(self, "_lookup_cache", (v, pos, found, missing))
        seen = pos.masked_fill(missing, m._zch_size - 1)
        m._mch_counts.index_put_((seen,), self._count_one, accumulate=True)
        m._mch_last_access_iter.index_fill_(0, seen, m._current_iter)
        self._record(v.masked_select(missing))

    def _end_forward(self) -> None:
        if self.closes_step:
            _set_plain(self, "_steps", self._steps + 1)
            if self._pass_due():
                self.run_pass()

    def _pass_due(self) -> bool:
        s = self._settings
        if s.interval_rows is not None:
            return self._rows_since_pass >= s.interval_rows
        if s.interval_seconds is not None:
            return time.time() - self._last_pass_time >= s.interval_seconds
        m: Any = self
        return self._steps - self._last_pass_step >= (s.interval_steps or m._eviction_interval)

    def _record_growing(self, values: torch.Tensor) -> None:
        # torchrec sizes the history from the first batch and drops what does not fit; this
        # keeps that size as a floor and grows.
        m: Any = self
        start = m._current_history_buffer_offset
        end = start + values.numel()
        if end > m._input_history_buffer_size:
            grown = 2 * m._input_history_buffer_size if m._input_history_buffer_size > 0 else \
                int(end * m._eviction_interval * 1.25)  # torchrec's first size, now a floor
            _resize_history(m, max(end, grown))
        m._history_accumulator[start:end] = values
        m._eviction_policy.record_history_metadata(
            m._current_iter, values, {k: b[start:end] for k, b in m._history_metadata.items()})
        m._current_history_buffer_offset = end

    def _record(self, values: torch.Tensor) -> None:
        m: Any = self
        start = m._current_history_buffer_offset
        end = start + values.numel()
        if end <= m._input_history_buffer_size:
            # A sighting is an id alone (one sighting: ``_history_sightings``).
            m._history_accumulator[start:end] = values
            _set_plain(self, "_current_history_buffer_offset", end)
        else:
            self._coalesce(values)

    def _set_history(self, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Make ``ids`` with ``counts`` the ``decayed_lfu`` history (one entry per id), keeping
        the ``_history_keep`` most-seen if there are more (counted in ``dropped``)."""
        m: Any = self
        n = ids.numel()
        if n > self._history_keep:
            top = torch.topk(counts, self._history_keep, sorted=False).indices.sort().values
            self.counters["dropped"] += n - self._history_keep
            ids, counts, n = ids[top], counts[top], self._history_keep
        m._history_accumulator[:n] = ids
        m._history_counts[:n] = counts
        _set_plain(self, "_waiting", n)
        _set_plain(self, "_current_history_buffer_offset", n)

    def restore_history(self, ids: torch.Tensor | None, counts: torch.Tensor | None,
                        waiting: int | None) -> None:
        """Put a checkpoint's ``decayed_lfu`` history back: ``ids`` with ``counts`` (one per
        entry; None: empty), the first ``waiting`` of them with their own counts, the others
        sightings. The same entries when they fit this history (a resume); coalesced into one
        per id otherwise (a smaller ``history_slots``, or format 2's buffer, whose entries were
        all counted and twice as many), the most-seen kept."""
        m: Any = self
        if ids is None or counts is None or ids.numel() == 0:
            self._set_history(m._history_accumulator[:0], m._history_counts[:0])
            return
        counts = counts.to(COUNT_DTYPE)
        n = ids.numel()
        if waiting is not None and waiting <= self._history_keep and \
                n <= m._input_history_buffer_size:
            m._history_accumulator[:n] = ids
            m._history_counts[:waiting] = counts[:waiting]
            _set_plain(self, "_waiting", waiting)
            _set_plain(self, "_current_history_buffer_offset", n)
            return
        uniq, inverse = torch.unique(ids, return_inverse=True)
        self._set_history(uniq, counts.new_zeros(uniq.shape).scatter_add_(0, inverse, counts))

    def history_state(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``decayed_lfu``'s history as a checkpoint keeps it (copies): its ids, one count per
        entry (``COUNT_ONE`` for a sighting), and how many of the first entries are waiting ids
        with counts of their own (the others are sightings since). ``restore_history`` takes
        the three back."""
        ids, counts = self._history_sightings()
        return ids.clone(), counts.clone(), self._waiting

    def _history_sightings(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, counts) of the ``decayed_lfu`` history's entries: the waiting ids with their
        counts, then the sightings since, one ``COUNT_ONE`` each."""
        m: Any = self
        used, waiting = m._current_history_buffer_offset, self._waiting
        ids = m._history_accumulator[:used]
        counts = m._history_counts[:waiting]
        if used > waiting:
            counts = torch.cat([counts, counts.new_full((used - waiting,), COUNT_ONE)])
        return ids, counts

    def _coalesce(self, incoming: torch.Tensor | None = None, store: bool = True,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge the history (and ``incoming`` sightings) into one entry per id; returns the
        merged ids and counts, and with ``store`` makes them the history (the most-seen
        ``_history_keep`` of them)."""
        ids, counts = self._history_sightings()
        if incoming is not None:
            ids = torch.cat([ids, incoming])
            counts = torch.cat([counts, counts.new_full((incoming.numel(),), COUNT_ONE)])
        uniq, inverse = torch.unique(ids, return_inverse=True)
        # Counts are whole numbers of COUNT_ONE units below 2**24 (256 sightings): float32
        # sums them exactly, in any order.
        summed = counts.new_zeros(uniq.shape).scatter_add_(0, inverse, counts)
        if store:
            self._set_history(uniq, summed)
        return uniq, summed

    def _admit(self, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``decayed_lfu``'s admission: rank new ids ``ids`` (none of them resident: the
        history holds only ids that had no row when seen, and the map changes only at passes)
        with the residents by count, residents first on ties; the best ``num_slots`` keep or
        take a slot. Returns the positions in ``ids`` of those admitted; the slots they take are
        queued for torchrec's row reset.

        What torchrec's ``_update_and_evict`` with ``DecayedLFUEvictionPolicy`` does, the same
        tensors bit for bit (tested), without the steps that handle resident ids in the input
        (a search of the map, updates of no entries) or change nothing, and ranking with
        ``rank_new_ids`` rather than an argsort of every slot: on small batches the cost of a
        pass is its number of ops."""
        m: Any = self
        policy: Any = m._eviction_policy
        # The protected (fallback) slots score int64 max in torchrec's ranking: never evicted,
        # so ranking the other slots alone gives the same pairs. torchrec sorts the new ids by
        # count first; the stable ranking orders them by count, then by position, either way:
        # the same pairs of (evicted slot, new id).
        evicted, selected = policy.rank_new_ids(m._mch_counts[:m._zch_size - policy.protected],
                                                counts)
        if selected.numel() == 0:
            # No id beats the weakest resident: the map is unchanged and no row is queued for
            # reset (``evict()`` stays None, so torchrec's forward does no reset at all).
            return selected
        m._mch_counts.index_copy_(0, evicted, counts.index_select(0, selected))
        m._mch_last_access_iter.index_fill_(0, evicted, m._current_iter)
        policy.last_admitted = int(selected.numel())
        m._mch_sorted_raw_ids.index_copy_(0, evicted, ids.index_select(0, selected))
        slots = m._mch_remapped_ids_mapping.index_select(0, evicted).long()
        _set_plain(self, "_evicted_emb_indices",
                   torch.unique(torch.cat([m._evicted_emb_indices, slots]))
                   if m._evicted else slots)
        _set_plain(self, "_evicted", True)
        self._sort_mch_buffers()
        return selected

    @torch.no_grad()
    def _sort_mch_buffers(self) -> None:
        """torchrec's: the map sorted by id (a stable argsort), its slots and metadata permuted
        alongside; with ``index_select``, which is cheaper than indexing on small tensors."""
        m: Any = self
        ids: torch.Tensor = m._mch_sorted_raw_ids
        order = torch.argsort(ids, stable=True)
        for buf in (ids, m._mch_remapped_ids_mapping, *m._mch_metadata.values()):
            buf.copy_(buf.index_select(0, order))

    @torch.no_grad()
    def run_pass(self) -> None:
        """Admission and eviction now, over the ids seen since the last pass (then expiry in
        seconds, if set). The evicted slots are reset by torchrec in this forward."""
        m: Any = self
        before = self.occupied()
        policy: Any = m._eviction_policy
        policy.protected = self.fallback_per_shard
        if self.decayed:
            _set_plain(self, "_lookup_cache", None)  # the map changes
            uniq, counts = self._coalesce(store=False)
            policy.last_admitted = 0
            # Ids that did not get a row wait for the next pass with their decayed count,
            # rounded down to whole COUNT_ONE units (an id seen once reaches 0, and leaves).
            kept = counts.double().mul_(policy.factor).floor_().to(counts.dtype)
            keep = kept > 0
            # Only ids at the threshold can take a row; the ranking of the others with the
            # residents costs little more than sorting them (``rank_new_ids``).
            chosen = (counts >= policy.threshold).nonzero().squeeze(1)
            if chosen.numel():
                admitted = self._admit(uniq.index_select(0, chosen),
                                       counts.index_select(0, chosen))
                keep.index_fill_(0, chosen.index_select(0, admitted), False)
            # Resident ids' counts decay after the ranking, as the waiting ids' above: at the
            # next pass both hold their new sightings plus their past ones decayed.
            policy.decay(m._mch_metadata)
            idx = keep.nonzero().squeeze(1)
            cap = self._history_keep
            if idx.numel() > cap:
                top = torch.topk(kept.index_select(0, idx), cap, sorted=False).indices
                # In id order (a mask, cheaper than sorting the positions).
                idx = idx.index_select(0, torch.zeros_like(idx, dtype=torch.bool)
                                       .index_fill_(0, top, True).nonzero().squeeze(1))
            self._set_history(uniq.index_select(0, idx), kept.index_select(0, idx))
        else:
            m._coalesce_history()
        admitted_ids = int(policy.last_admitted)
        self.counters["admitted"] += admitted_ids
        self.counters["evicted"] += before + admitted_ids - self.occupied()
        self.counters["passes"] += 1
        for name, value in (("_last_pass_step", self._steps), ("_rows_since_pass", 0),
                            ("_last_pass_time", time.time()),
                            ("_last_eviction_iter", m._current_iter)):
            _set_plain(self, name, value)
        if self._settings.expire_seconds is not None:
            self._expire_by_time()

    # ---------------------------------------------------------------- expiry

    def _expire_by_time(self) -> None:
        m: Any = self
        span = float(self._settings.expire_seconds or 0.0)
        now = time.time()
        marks = self._time_marks
        if not marks or now - marks[-1][1] >= span / 16:
            marks.append((int(m._current_iter), now))
        old = [it for it, t in marks if t <= now - span]
        if old:
            # Keep the newest mark older than the span, and the ones after it.
            del marks[:len(old) - 1]
            self.expire(old[-1], keep_history=False)

    def end_window(self) -> None:
        """A train window ended: with ``expire_after_windows=N``, evict the ids unseen during
        the last N windows (those still in the history count as seen)."""
        m: Any = self
        self._windows += 1
        n = self._settings.expire_windows
        if n is None:
            return
        self._window_marks.append(max(0, int(m._current_iter)))
        del self._window_marks[:-(n + 1)]
        if len(self._window_marks) == n + 1:
            self.expire(self._window_marks[0], keep_history=True)

    @torch.no_grad()
    def expire(self, horizon_iter: int, keep_history: bool) -> int:
        """Evict the ids last seen at or before forward ``horizon_iter``; their slots are queued
        for torchrec's row reset. Returns how many."""
        m: Any = self
        ids: torch.Tensor = m._mch_sorted_raw_ids
        # A horizon below int32 (more than 2**31 forwards back, after rebases) reaches the
        # last accesses kept at int32's lowest.
        old = (ids != EMPTY_SLOT) & (m._mch_metadata["last_access_iter"]
                                     <= max(horizon_iter, ITER_MIN))
        used = m._current_history_buffer_offset
        if keep_history and used > 0:
            old &= ~torch.isin(ids, m._history_accumulator[:used])
        idx = old.nonzero().squeeze(1)
        n = int(idx.numel())
        if n == 0:
            return 0
        self._lookup_cache = None  # the map changes
        ids[idx] = EMPTY_SLOT
        for buf in m._mch_metadata.values():
            buf[idx] = 0
        slots = m._mch_remapped_ids_mapping[idx].long()
        if m._evicted:
            m._evicted_emb_indices = torch.unique(torch.cat([m._evicted_emb_indices, slots]))
        else:
            m._evicted_emb_indices = slots
        m._evicted = True
        m._sort_mch_buffers()
        self.counters["expired"] += n
        return n

    # ---------------------------------------------------------------- checkpoints

    def validate_state(self) -> None:
        """After ``load_state_dict``: remember the checkpoint's shard boundaries, take this
        module's own back and re-sort (torchrec asserts that the new boundaries are among the
        old; a checkpoint of another layout is re-routed instead, see ``_relayout``)."""
        m: Any = self
        buf = m._output_segments_tensor
        self.loaded_segments = [int(s) for s in buf.tolist() if s >= 0]
        own = torch.full_like(buf, -1)  # torchrec's padding
        own[:len(self.segments)] = torch.tensor(self.segments, dtype=buf.dtype, device=buf.device)
        buf.copy_(own)
        m._sort_mch_buffers()


def _set_plain(module: torch.nn.Module, name: str, value: Any) -> None:
    """Set a plain (not a parameter, buffer or submodule) attribute of ``module``: what
    ``nn.Module.__setattr__`` ends with, without its checks (~1.5 us a write, and the map
    writes several per table and forward)."""
    module.__dict__[name] = value


def _write_iteration(module: DynamicMCHModule, *_: Any) -> None:
    """Write the forward count into torchrec's ``_current_iter_tensor`` (a state-dict pre-hook).
    Before the first forward the count is -1: the buffer keeps its value."""
    m: Any = module
    if m._current_iter >= 0:
        m._current_iter_tensor.fill_(m._current_iter)


SLOT_DTYPE = torch.int32
"""The compact map's slots (global rows): int32 while a table has fewer than 2**31 rows."""
COUNT_DTYPE = torch.float32
"""``decayed_lfu``'s counts: float32, whole ``COUNT_ONE`` units (exact below 256 sightings,
and never overflowing above, where an int32 of ``COUNT_ONE`` units would at 32,768)."""
ITER_DTYPE = torch.int32
"""The last-access forward count: int32, kept in range by rebasing (``ITER_REBASE``)."""
ITER_MIN = torch.iinfo(ITER_DTYPE).min
ITER_REBASE = 1 << 30
"""A ``decayed_lfu`` map's forward count is rebased (``_rebase_iterations``) when it reaches
this: a whole number of it is taken from the count and from the last accesses, so the count
never passes 2**31 (an int32) in a job's life, however long it runs or resumes."""


def compact_map(m: Any) -> None:
    """Give an MCH module's map the compact layout (``decayed_lfu``: 20 bytes a slot instead
    of torchrec's 32): its slots int32 (int64 from 2**31 rows), the policy's counts float32
    and last access int32. The buffers keep their names and order (the checkpoint's keys); a
    checkpoint of torchrec's int64 layout loads into them (DCP casts, the values fit)."""
    end = int(m._output_global_offset) + int(m._zch_size)
    slots = m._mch_remapped_ids_mapping
    if end <= 2**31 - 1:
        m.register_buffer("_mch_remapped_ids_mapping", slots.to(SLOT_DTYPE))
    for name, dtype in (("counts", COUNT_DTYPE), ("last_access_iter", ITER_DTYPE)):
        buf = torch.zeros(m._zch_size, dtype=dtype, device=slots.device)
        m.register_buffer("_mch_" + name, buf)
        m._mch_metadata[name] = buf
    # One sighting, as the value ``_observe`` adds (a buffer: it moves with the map).
    m.register_buffer("_count_one", torch.tensor(COUNT_ONE, dtype=COUNT_DTYPE,
                                                 device=slots.device), persistent=False)


def _allocate_history(m: Any, keep: int) -> None:
    """``decayed_lfu``'s history on one shard: ``keep`` waiting ids with their float32 counts,
    and room for as many new sightings (ids alone) before they are coalesced."""
    # Zeros, not empty: the buffer is resident from the start, as table_memory counts it.
    m._history_accumulator = torch.zeros(2 * keep, dtype=torch.int64, device=m.device)
    counts = torch.zeros(keep, dtype=COUNT_DTYPE, device=m.device)
    m.register_buffer("_history_counts", counts, persistent=False)
    m._history_metadata = {"counts": counts}
    m._input_history_buffer_size = 2 * keep
    m._current_history_buffer_offset = 0
    m._history_keep = keep
    m._waiting = 0


def _resize_history(m: Any, size: int) -> None:
    """(Re)allocate a legacy policy's history buffers (the ids seen since the last pass, and
    the policy's per-id history metadata) at ``size`` ids, keeping the ids already recorded."""
    keep = min(m._current_history_buffer_offset, size) if m._input_history_buffer_size > 0 else 0
    acc = torch.empty(size, dtype=torch.int64, device=m.device)
    if keep:
        acc[:keep] = m._history_accumulator[:keep]
    m._history_accumulator = acc
    for name, _is_mch, is_history in m._eviction_policy.metadata_info:
        if is_history:
            buf = "_history_" + name
            new = torch.zeros(size, dtype=torch.int64, device=m.device)
            if keep:
                new[:keep] = m._history_metadata[name][:keep]
            m.register_buffer(buf, new, persistent=False)
            m._history_metadata[name] = new
    m._input_history_buffer_size = size
