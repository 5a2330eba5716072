"""Sharding pooled dynamic tables on CPU: the sharders that let torchrec's
``ManagedCollisionEmbeddingBagCollection`` shard ``row_wise`` there (``sharders``), with the
pooled output dist for batches of different sizes on gloo (``PaddedPooledReduceScatter``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.comm_ops import reduce_scatter_base_pooled
from torchrec.distributed.dist_data import PooledEmbeddingsAwaitable
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import (
    Awaitable,
    ModuleSharder,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_trainer.dynamic.sharded_map import DynamicMapsSharder


class _RowWiseEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """torchrec's ``EmbeddingBagCollectionSharder`` that also offers ``row_wise`` on CPU.

    torchrec lists ``row_wise`` for CUDA only, so ``ManagedCollisionEmbeddingBagCollection``
    (whose id maps shard only ``row_wise``) had no sharding on CPU (torchrec issue 2958). The
    row-wise pooled sharding itself runs on CPU and gloo (bucketised input all-to-all, FBGEMM's
    CPU pooled lookup, a reduce-scatter of the pooled rows; tested against the unpooled path at
    1 and 2 ranks). Used only inside the managed-collision sharder (``sharders``): plain
    ``EmbeddingBagCollection``s keep torchrec's CPU choices."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if compute_device_type == "cpu" and ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types

    def shard(self, module: EmbeddingBagCollection, params: dict[str, ParameterSharding],
              env: ShardingEnv, device: torch.device | None = None,
              module_fqn: str | None = None) -> ShardedEmbeddingBagCollection:
        """torchrec's sharded collection, its row-wise pooled output dists on a gloo group
        given ``PaddedPooledReduceScatter`` (instance attributes): the row-wise sharding this
        sharder adds on CPU then also takes batches of different sizes. NCCL has the uneven
        reduce-scatter torchrec uses."""
        sharded = super().shard(module, params, env, device, module_fqn)
        for out_dist in sharded._output_dists:
            pg = getattr(out_dist, "_pg", None)
            if (isinstance(out_dist, RwPooledEmbeddingDist) and pg is not None
                    and dist.get_backend(pg) == "gloo"):
                out_dist._dist = PaddedPooledReduceScatter(  # type: ignore[assignment]
                    pg, out_dist._codecs)
        return sharded


def sharders() -> list[ModuleSharder[nn.Module]]:
    """torchrec's default sharders (what the planner and DMP take), the managed-collision ones
    sharding their id maps into ``DynamicShardedMaps`` (the short path per batch for dynamic
    tables), the ``ManagedCollisionEmbeddingBagCollection`` one also able to shard ``row_wise``
    on CPU; nothing else changes."""
    out: list[ModuleSharder[nn.Module]] = []
    for s in get_default_sharders():
        if isinstance(s, ManagedCollisionEmbeddingBagCollectionSharder):
            s = ManagedCollisionEmbeddingBagCollectionSharder(  # type: ignore[assignment]
                ebc_sharder=_RowWiseEmbeddingBagCollectionSharder(),
                mc_sharder=DynamicMapsSharder())
        elif isinstance(s, ManagedCollisionEmbeddingCollectionSharder):
            s = ManagedCollisionEmbeddingCollectionSharder(  # type: ignore[assignment]
                mc_sharder=DynamicMapsSharder())
        out.append(s)
    return out


class _Rows(Awaitable[torch.Tensor]):
    """The first ``rows`` rows of what ``inner`` gives."""

    def __init__(self, inner: Awaitable[torch.Tensor], rows: int) -> None:
        super().__init__()
        self._inner = inner
        self._rows = rows

    def _wait_impl(self) -> torch.Tensor:
        return self._inner.wait()[:self._rows]


class PaddedPooledReduceScatter(nn.Module):
    """torchrec's ``PooledEmbeddingsReduceScatter`` for gloo when the ranks' batches differ.

    Row-wise pooled sharding sums every rank's partial pooled rows of rank ``r``'s batch on
    rank ``r``: a reduce-scatter with one split per rank (its batch size). With unequal
    splits torchrec's backward is an ``all_gather`` of tensors of different sizes, which gloo
    refuses ("invalid tensor size"). Here each rank's chunk is padded with zero rows to the
    largest batch, reduced and scattered with torchrec's equal-split op (its backward an equal
    all-gather), and the padding cut off. Equal splits go to torchrec's op unchanged."""

    def __init__(self, pg: dist.ProcessGroup, codecs: QuantizedCommCodecs | None = None) -> None:
        super().__init__()
        self._pg = pg
        self._codecs = codecs

    def forward(self, local_embs: torch.Tensor, input_splits: list[int] | None = None,
                ) -> PooledEmbeddingsAwaitable:
        if not input_splits or len(set(input_splits)) == 1:
            return PooledEmbeddingsAwaitable(
                reduce_scatter_base_pooled(local_embs, self._pg, codecs=self._codecs))
        most = max(input_splits)
        chunks = torch.split(local_embs, input_splits)
        padded = torch.cat([F.pad(c, (0, 0, 0, most - c.shape[0])) for c in chunks])
        mine = input_splits[dist.get_rank(self._pg)]
        return PooledEmbeddingsAwaitable(
            _Rows(reduce_scatter_base_pooled(padded, self._pg, codecs=self._codecs), mine))
