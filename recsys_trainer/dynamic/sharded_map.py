"""The sharded id maps of a dynamic collection: torchrec's ``ShardedManagedCollisionCollection``
(the input dist of raw ids to the ranks owning them, each rank's maps, the remapped ids) with
a shorter path per batch when every map is a ``DynamicMCHModule``.

Why: at a few hundred rows per step the cost of torchrec's managed-collision glue is per call,
not per id. Its input dist splits the batch into one ``KeyedJaggedTensor`` per table, mixes
each table's ids, and concatenates them again before routing; its compute splits the routed
batch per table again and wraps each lookup in per-call work that a ``DynamicMCHModule`` never
reads (a tensor of lengths per key, a subtraction of the shard's offset that the map can skip).
``bench_dynamic_step.py`` measured the glue at +0.16x a hashed table's step at one rank. At
world size 1 the short path also skips the route itself (a bucketization into one bucket and
an all-to-all of the batch with itself: +0.08x).

The short path computes the same tensors (the same ``KeyedJaggedTensor``s into the all-to-all
and out of the maps, the same sharding contexts but for the identity permutations left out at
one rank; tested against torchrec's path, bit for bit, at 1 and 2 ranks). Anything it does not
cover goes to torchrec's path unchanged: index dedup, more than one sharding type, maps of
other classes or with per-feature lookups, a lookup tracker. Weighted features are routed by
torchrec's input dist and mapped on the short path (weights pass through); variable batch
sizes per feature the other way round (the same batches either way).
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.types import Awaitable, NoWait
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.dynamic.id_map import DynamicMCHModule

# torchrec.distributed.mc_modules changed between 1.6 and 1.9 (see torchrec_compat).
from recsys_trainer.torchrec_compat import (
    ManagedCollisionCollectionContext,
    ManagedCollisionCollectionSharder,
    ShardedManagedCollisionCollection,
    frees_features_storage_early,
    input_dist_permute,
    uses_2d_weights,
)


class DynamicShardedMaps(ShardedManagedCollisionCollection):
    """torchrec's ``ShardedManagedCollisionCollection``; when all its maps are
    ``DynamicMCHModule``s with one id mixing, one sharding type (row-wise) and no per-feature
    lookups, batches take the short path (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        maps = list(self._managed_collision_modules.values())
        first: Any = maps[0] if maps else None
        self._short = bool(
            maps and self.need_preprocess and len(self._sharding_tables) == 1
            and not self._use_index_dedup
            and all(isinstance(m, DynamicMCHModule) for m in maps)
            and first._input_hash_func is not None
            and all(m._input_hash_func is first._input_hash_func
                    and m._input_hash_size == first._input_hash_size for m in maps)
            and not any(getattr(m, "_enable_per_feature_lookups", False) for m in maps))
        """Whether batches may take the short path (decided once: the maps and sharding are
        fixed when the collection is sharded)."""
        self.short_path_batches = 0
        """Batches whose maps ran on the short path (a check that it is taken)."""

    def input_dist(self, ctx: ManagedCollisionCollectionContext, features: KeyedJaggedTensor,
                   skip_permute: bool = False) -> Awaitable[Awaitable[KJTList]]:
        """Mix all tables' ids in one op and route them; torchrec's input dist otherwise (and
        on the first batch, which creates the dists)."""
        if (not self._short or self._has_uninitialized_input_dists
                or features.weights_or_none() is not None):
            return super().input_dist(ctx, features, skip_permute)
        if uses_2d_weights(self):  # (nn.Module.__setattr__ costs µs a write)
            self._use_2d_weights = False
        with torch.no_grad():
            if not skip_permute and self._features_order:
                original = features
                features = input_dist_permute(features, self._features_order,
                                              self._features_order_tensor)
                if frees_features_storage_early(self):
                    ctx.early_releasable_inputs.append(original)
            first: Any = next(iter(self._managed_collision_modules.values()))
            # The tables' features are contiguous in sharding order after the permute: the
            # per-table split and concatenation of torchrec's preprocessing give these values.
            routed = KeyedJaggedTensor(
                keys=self._sharding_features[0],
                values=first._input_hash_func(features.values(), first._input_hash_size),
                lengths=features.lengths(),
                stride_per_key_per_rank=features.stride_per_key_per_rank() or None)
            input_dist = self._input_dists[0]
            if isinstance(input_dist, RwSparseFeaturesDist) and input_dist._world_size == 1 \
                    and not routed.variable_stride_per_key():
                return self._on_one_rank(ctx, routed, features)
            # First: the dist sets the unbucketize permutation of this batch, which the context
            # takes.
            routed_awaitable = input_dist(routed)
            ctx.sharding_contexts.append(SequenceShardingContext(
                unbucketize_permute_tensor=(input_dist.unbucketize_permute_tensor
                                            if isinstance(input_dist, RwSparseFeaturesDist)
                                            else None),
                batch_size_per_feature_pre_a2a=routed.stride_per_key(),
                variable_batch_per_feature=routed.variable_stride_per_key(),
                features_before_input_dist=features))
            return KJTListSplitsAwaitable([routed_awaitable], ctx)

    @staticmethod
    def _on_one_rank(ctx: ManagedCollisionCollectionContext, routed: KeyedJaggedTensor,
                     features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        """The input dist at world size 1: the rank owns every id, so routing would bucketize
        the batch into one bucket (the same ids, lengths and order) and send it to itself
        through the process group (~180 us a step at 512 rows, measured). The context gets
        what that all-to-all gives it, with the identity permutations left out (``None``: the
        output dists then permute by their own identity tensors, or not at all)."""
        n = routed.values().numel()
        stride = routed.stride()
        ctx.sharding_contexts.append(SequenceShardingContext(
            batch_size_per_rank=[stride], input_splits=[n], output_splits=[n],
            batch_size_per_feature_pre_a2a=[stride] * len(routed.keys()),
            variable_batch_per_feature=False, features_before_input_dist=features))
        return KJTListSplitsAwaitable([NoWait(NoWait(routed))], ctx)

    def compute(self, ctx: ManagedCollisionCollectionContext, dist_input: KJTList) -> KJTList:
        """Each table's ids through its map (``DynamicMCHModule.forward_rows``: ``profile``, then
        ``remap``), shard-local rows out; torchrec's compute for what the short path does not
        cover."""
        features = dist_input[0] if len(dist_input) == 1 else None
        if (not self._short or features is None or uses_2d_weights(self)
                or features.variable_stride_per_key() or self.post_lookup_tracker_fn is not None):
            return super().compute(ctx, dist_input)
        sharding_ctx = ctx.sharding_contexts[0]
        assert isinstance(sharding_ctx, SequenceShardingContext)
        self.short_path_batches += 1
        lengths = features.lengths()
        stride = features.stride()
        sharding_ctx.lengths_after_input_dist = lengths.view(-1, stride)
        tables = self._sharding_tables[0]
        values = features.values()
        if len(tables) == 1:
            parts, part_lengths = [values], [lengths]
        else:
            per_key = features.length_per_key()
            sizes, start = [], 0
            for n in self._sharding_per_table_feature_splits[0]:
                sizes.append(sum(per_key[start:start + n]))
                start += n
            parts = list(values.split(sizes))
            part_lengths = list(lengths.split(
                [n * stride for n in self._sharding_per_table_feature_splits[0]]))
        # Each table's rows written into one tensor, in the tables' order: no concatenation.
        remapped = torch.empty_like(values)
        start = 0
        for table, ids, ids_lengths, features_of_table in zip(
                tables, parts, part_lengths, self._sharding_per_table_feature_splits[0],
                strict=True):
            mc: Any = self._managed_collision_modules[table]
            rows = remapped[start:start + ids.numel()]
            start += ids.numel()
            # One length per feature and row of the whole (all ranks') batch.
            mc.forward_rows(ids, ids_lengths.numel() // max(1, features_of_table), out=rows)
            # Global rows: shard-local in place.
            offset = self._table_to_offset[table]
            if offset:
                rows.sub_(offset)
        return KJTList([KeyedJaggedTensor(
            keys=self._sharding_features[0],
            values=remapped,
            lengths=lengths, weights=features.weights_or_none(),
            stride_per_key_per_rank=features._stride_per_key_per_rank)])


class DynamicMapsSharder(ManagedCollisionCollectionSharder):
    """torchrec's ``ManagedCollisionCollectionSharder``, sharding into ``DynamicShardedMaps``."""

    def shard(self, module: Any, params: Any, env: Any, embedding_shardings: Any,
              device: torch.device | None = None, use_index_dedup: bool = False,
              ) -> DynamicShardedMaps:
        return DynamicShardedMaps(module, params, env=env, device=device or torch.device("cpu"),
                                  embedding_shardings=embedding_shardings,
                                  use_index_dedup=use_index_dedup)
