"""The modules a model builds dynamic tables with: ``dynamic_embedding_collection`` (sequence
features, torchrec's ``ManagedCollisionEmbeddingCollection``),
``DynamicEmbeddingBagCollection`` (pooled features: torchrec's
``ManagedCollisionEmbeddingBagCollection``, or the unpooled collection pooled here) and
``MixedEmbeddingBagCollection`` (pooled features of which only some tables are dynamic);
``pooled_collection`` picks one of those or a plain ``EmbeddingBagCollection``."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import ManagedCollisionCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsys_trainer.dynamic.config import DynamicTable
from recsys_trainer.dynamic.id_map import DynamicMCHModule, _Settings
from recsys_trainer.dynamic.ids import ID_SPACE, mix_ids
from recsys_trainer.dynamic.policy import make_eviction_policy


def _world_size() -> int:
    # Models are usually built before the Trainer starts the process group: torchrun's
    # WORLD_SIZE says how many ranks there will be.
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _mc_module(name: str, spec: DynamicTable, device: torch.device) -> DynamicMCHModule:
    return DynamicMCHModule(
        zch_size=spec.num_slots,
        device=device,
        eviction_policy=make_eviction_policy(spec),
        eviction_interval=spec.eviction_interval or 1,
        input_hash_size=ID_SPACE,
        input_hash_func=mix_ids,
        name=name,
        buckets=spec.buckets or _world_size(),
        settings=_Settings.of(spec),
    )


def dynamic_embedding_collection(
    tables: list[EmbeddingConfig], dynamic: DynamicTable | dict[str, DynamicTable],
    device: torch.device | None = None,
) -> ManagedCollisionEmbeddingCollection:
    """A torchrec ``ManagedCollisionEmbeddingCollection`` over ``tables`` (sequence features:
    its forward returns ``(Dict[feature, JaggedTensor], None)``). ``dynamic`` is one spec for
    every table or one per table name; each table's ``num_embeddings`` must equal its spec's
    ``num_slots``. A table may list several features (they share its ids and rows). The rows
    are built on ``device`` (default meta: DMP materialises shards); the id maps on CPU (the
    sharder moves them to the compute device)."""
    specs = _specs_for(tables, dynamic)
    ec = EmbeddingCollection(tables=tables, device=device or torch.device("meta"))
    mcc = ManagedCollisionCollection(
        {t.name: _mc_module(t.name, specs[t.name], torch.device("cpu")) for t in tables}, tables)
    # allow_in_place_embed_weight_update: re-initialising evicted rows through .data, so it
    # does not trip autograd's version check on the table views used by this step's graph.
    return ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False,
                                               allow_in_place_embed_weight_update=True)


def _specs_for(tables: list[EmbeddingConfig], dynamic: DynamicTable | dict[str, DynamicTable],
               ) -> dict[str, DynamicTable]:
    names = [t.name for t in tables]
    if isinstance(dynamic, DynamicTable):
        specs = {n: dynamic for n in names}
    else:
        missing = sorted(set(names) - set(dynamic))
        extra = sorted(set(dynamic) - set(names))
        if missing or extra:
            raise ValueError(f"`dynamic` must name exactly the tables {names}; missing "
                             f"{missing}, unknown {extra}.")
        specs = dict(dynamic)
    for t in tables:
        if t.num_embeddings != specs[t.name].num_slots:
            raise ValueError(f"table {t.name!r}: `num_embeddings` ({t.num_embeddings}) must equal "
                             f"its DynamicTable.num_slots ({specs[t.name].num_slots}).")
    return specs


class DynamicEmbeddingBagCollection(nn.Module):
    """Pooled dynamic features: an ``EmbeddingBagCollection`` look-alike (``forward(kjt) ->
    KeyedTensor``, ``embedding_bag_configs()``). A table may be read by several features (each
    pooled on its own).

    By default (``DynamicTable.pooled_lookup``) it holds torchrec's
    ``ManagedCollisionEmbeddingBagCollection`` (``mc_ebc``): the id maps in front of a pooled
    ``EmbeddingBagCollection``, FBGEMM's fused pooled lookup, sharded ``row_wise`` (also on CPU,
    through ``dynamic.sharders``). With ``pooled_lookup=False`` it holds the unpooled
    ``ManagedCollisionEmbeddingCollection`` (``mc_ec``) whose per-id rows are pooled here (sum
    or mean, one ``segment_reduce`` per feature after the sharded lookup): the former path,
    slower (docs/dynamic.md, "Step time"). Either way the collection is what DMP shards, so
    the KJT reaches it unchanged (TorchRec pipelines can trace).
    """

    def __init__(self, tables: list[EmbeddingBagConfig],
                 dynamic: DynamicTable | dict[str, DynamicTable],
                 device: torch.device | None = None) -> None:
        super().__init__()
        for t in tables:
            if t.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise ValueError(f"table {t.name!r}: `pooling` must be SUM or MEAN for a dynamic "
                                 f"table, but is {t.pooling}.")
        self._bag_configs = list(tables)
        self._mean = {f: t.pooling == PoolingType.MEAN for t in tables for f in t.feature_names}
        self._features = [f for t in tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        specs = _specs_for(tables, dynamic)
        lookups = {s.pooled_lookup for s in specs.values()}
        if len(lookups) > 1:
            raise ValueError("`DynamicTable.pooled_lookup` must be the same for the tables of one "
                             "DynamicEmbeddingBagCollection, but is "
                             f"{ {n: s.pooled_lookup for n, s in specs.items()} }.")
        self.pooled_lookup = lookups.pop() if lookups else True
        """Whether the lookup is torchrec's pooled one (``mc_ebc``) or the unpooled one
        pooled here (``mc_ec``)."""
        if self.pooled_lookup:
            ebc = EmbeddingBagCollection(tables=tables, device=device or torch.device("meta"))
            mcc = ManagedCollisionCollection(
                {t.name: _mc_module(t.name, specs[t.name], torch.device("cpu")) for t in tables},
                tables)
            # allow_in_place_embed_weight_update: as in dynamic_embedding_collection.
            self.mc_ebc = ManagedCollisionEmbeddingBagCollection(
                ebc, mcc, return_remapped_features=False,
                allow_in_place_embed_weight_update=True)
            return
        configs = [EmbeddingConfig(name=t.name, embedding_dim=t.embedding_dim,
                                   num_embeddings=t.num_embeddings, feature_names=t.feature_names,
                                   weight_init_max=t.weight_init_max,
                                   weight_init_min=t.weight_init_min, init_fn=t.init_fn,
                                   data_type=t.data_type)
                   for t in tables]
        self.mc_ec = dynamic_embedding_collection(configs, specs, device)

    @property
    def collection_name(self) -> str:
        """The attribute holding the managed-collision collection (``mc_ebc`` or ``mc_ec``)."""
        return "mc_ebc" if self.pooled_lookup else "mc_ec"

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The pooled tables (what torchrec's DLRM reads for dimensions)."""
        return self._bag_configs

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self.pooled_lookup:
            pooled_kt, _ = self.mc_ebc(features)
            return pooled_kt
        looked_up, _ = self.mc_ec(features)
        pooled = [_pool(looked_up[f], self._mean[f]) for f in self._features]
        return KeyedTensor(keys=self._features, length_per_key=self._dims,
                           values=torch.cat(pooled, dim=1))


@torch.fx.wrap
def _pool(jt: JaggedTensor, mean: bool) -> torch.Tensor:
    lengths, values = jt.lengths(), jt.values()
    # One id per row (as many ids as rows, none more than one): nothing to pool. Checked on CPU
    # only, where reading the maximum costs no device synchronisation.
    if values.device.type == "cpu" and values.shape[0] == lengths.numel() and (
            not values.shape[0] or int(lengths.max()) == 1):
        return values
    out = torch.segment_reduce(values, "sum", lengths=lengths, axis=0, unsafe=True)
    if mean:
        out = out / lengths.clamp_min(1).unsqueeze(1).to(out.dtype)
    return out


def rows_key(state: Mapping[str, Any], collection: str, table: str) -> str:
    """The state-dict key of dynamic table ``table``'s rows in the managed-collision collection
    whose keys start with ``collection`` ('' or ending in '.'): the pooled lookup's rows are
    ``embedding_bags``, the unpooled one's ``embeddings``. The ``embeddings`` key when ``state``
    has neither (so a missing table is reported under the name it would have)."""
    pooled = f"{collection}_embedding_module.embedding_bags.{table}.weight"
    return pooled if pooled in state else f"{collection}_embedding_module.embeddings.{table}.weight"


def lookup_path_hint(missing: Iterable[str], saved: Iterable[str]) -> str:
    """What to do when a checkpoint's pooled dynamic tables were saved by the other lookup path
    (``DynamicTable.pooled_lookup``: the rows are under ``mc_ec`` or ``mc_ebc``), given the
    state keys the model lacks in the checkpoint and those the checkpoint has; '' otherwise."""
    wants_pooled = any(".mc_ebc." in k for k in missing)
    wants_unpooled = any(".mc_ec." in k for k in missing)
    saved = list(saved)
    if wants_pooled and any(".mc_ec." in k for k in saved):
        return (" Its dynamic tables were saved by the unpooled lookup (the default before "
                "pooled lookups): build the model with DynamicTable(..., pooled_lookup=False) "
                "(YAML: `model.dynamic.pooled_lookup: false`) to load it.")
    if wants_unpooled and any(".mc_ebc." in k for k in saved):
        return (" Its dynamic tables were saved by the pooled lookup: build the model with "
                "DynamicTable(..., pooled_lookup=True) (the default; YAML: "
                "`model.dynamic.pooled_lookup: true`) to load it.")
    return ""


class MixedEmbeddingBagCollection(nn.Module):
    """Pooled features of which some tables are dynamic and the others hashed: an
    ``EmbeddingBagCollection`` look-alike holding torchrec's ``EmbeddingBagCollection``
    (``hashed``: ids already below each table's ``num_embeddings``) and a
    ``DynamicEmbeddingBagCollection`` (``dynamic``: raw ids; ``{table name: DynamicTable}``,
    one per dynamic table). Both read the whole ``KeyedJaggedTensor`` and look up only their
    own features, so DMP shards each as it would alone (the dynamic tables ``row_wise``, the
    hashed ones as the planner chooses) and TorchRec pipelines still see the batch reach them
    unchanged. ``forward`` returns one ``KeyedTensor`` of every feature in the order of
    ``tables`` (as an ``EmbeddingBagCollection`` does), which ``embedding_bag_configs()``
    lists."""

    def __init__(self, tables: list[EmbeddingBagConfig], dynamic: Mapping[str, DynamicTable],
                 device: torch.device | None = None) -> None:
        super().__init__()
        unknown = sorted(set(dynamic) - {t.name for t in tables})
        if unknown:
            raise ValueError(f"`dynamic` names tables {unknown} that do not exist; the tables "
                             f"are {[t.name for t in tables]}.")
        hashed = [t for t in tables if t.name not in dynamic]
        dyn = [t for t in tables if t.name in dynamic]
        if not hashed or not dyn:
            raise ValueError("a MixedEmbeddingBagCollection needs hashed and dynamic tables; "
                             "pooled_collection() builds the plain collection when all tables "
                             "are one kind.")
        self._bag_configs = list(tables)
        self._features = [f for t in tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self.hashed = EmbeddingBagCollection(tables=hashed, device=device or torch.device("meta"))
        self.dynamic = DynamicEmbeddingBagCollection(dyn, dict(dynamic), device)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """Every table, hashed and dynamic, in the order given (what torchrec's DLRM reads)."""
        return self._bag_configs

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return _merge_keyed(self.hashed(features), self.dynamic(features), self._features,
                            self._dims)


@torch.fx.wrap
def _merge_keyed(a: KeyedTensor, b: KeyedTensor, keys: list[str], dims: list[int]) -> KeyedTensor:
    """``a`` and ``b`` as one ``KeyedTensor`` of ``keys`` (widths ``dims``) in that order. A
    leaf for fx: TorchRec's pipeline traces the model, and a KeyedTensor built from proxies
    would not record the merge."""
    pieces_a, pieces_b, order = _merge_plan(tuple(a.keys()), tuple(a.length_per_key()),
                                            tuple(b.keys()), tuple(b.length_per_key()),
                                            tuple(keys), tuple(dims))
    # Each source split once, into its runs of columns that stay consecutive in the output
    # (the backward of one split is one concatenation; a slice per run would build a
    # source-wide gradient per run).
    pieces = [*a.values().split(pieces_a, dim=1), *b.values().split(pieces_b, dim=1)]
    values = pieces[order[0]] if len(order) == 1 else torch.cat([pieces[i] for i in order], dim=1)
    return KeyedTensor(keys=keys, length_per_key=dims, values=values)


@functools.lru_cache(maxsize=64)
def _merge_plan(a_keys: tuple[str, ...], a_dims: tuple[int, ...], b_keys: tuple[str, ...],
                b_dims: tuple[int, ...], keys: tuple[str, ...], dims: tuple[int, ...],
                ) -> tuple[list[int], list[int], list[int]]:
    """How ``_merge_keyed`` cuts ``a`` and ``b``: the widths of each one's pieces (runs of its
    columns that are consecutive in the output, in its own column order) and the pieces'
    order in the output (indices into ``a``'s pieces, then ``b``'s)."""
    source = {k: (0, i) for i, k in enumerate(a_keys)} | {k: (1, i) for i, k in enumerate(b_keys)}
    widths = (a_dims, b_dims)
    missing = [k for k in keys if k not in source]
    if missing or len(keys) != len(source):
        raise ValueError(f"cannot merge pooled features {list(a_keys)} and {list(b_keys)} into "
                         f"{list(keys)}: {missing or 'a feature twice'}.")
    runs: list[tuple[int, int, int]] = []  # (source, first key, last key + 1), output order
    for k, d in zip(keys, dims, strict=True):
        src, i = source[k]
        if widths[src][i] != d:
            raise ValueError(f"pooled feature {k!r} is {widths[src][i]} wide, but {d} was "
                             "expected (its table's embedding_dim).")
        if runs and runs[-1][0] == src and runs[-1][2] == i:
            runs[-1] = (src, runs[-1][1], i + 1)
        else:
            runs.append((src, i, i + 1))
    by_source = [sorted(r for r in runs if r[0] == src) for src in (0, 1)]
    pieces = [[sum(widths[src][lo:hi]) for _, lo, hi in by_source[src]] for src in (0, 1)]
    index = {r: j for j, r in enumerate(by_source[0])} | \
        {r: len(by_source[0]) + j for j, r in enumerate(by_source[1])}
    return pieces[0], pieces[1], [index[r] for r in runs]


def pooled_collection(
    tables: list[EmbeddingBagConfig], dynamic: Mapping[str, DynamicTable],
    device: torch.device | None = None,
) -> EmbeddingBagCollection | DynamicEmbeddingBagCollection | MixedEmbeddingBagCollection:
    """The pooled collection of ``tables`` given ``{table name: DynamicTable}`` for its dynamic
    tables: torchrec's ``EmbeddingBagCollection`` when there are none, a
    ``DynamicEmbeddingBagCollection`` when all are, a ``MixedEmbeddingBagCollection``
    otherwise. A dynamic table's ``num_embeddings`` must be its spec's ``num_slots`` (torchrec's
    default initialiser is sized from it)."""
    device = device or torch.device("meta")
    if not dynamic:
        return EmbeddingBagCollection(tables=tables, device=device)
    if set(dynamic) == {t.name for t in tables}:
        return DynamicEmbeddingBagCollection(tables, dict(dynamic), device)
    return MixedEmbeddingBagCollection(tables, dynamic, device)
