"""Retrieval (candidate generation) models: a two-tower model and a SASRec-style sequential one.

Both follow the model contract (README): ``forward(batch)`` returns ``(loss, outputs)`` with a
functional, padding-safe loss (``retrieval.losses``), and take their ids from
``batch.sequence`` (an ``EmbeddingCollection``) and ``batch.sparse`` (an
``EmbeddingBagCollection``). Each has **one item table** (``t_<item_feature>``) read by the
candidate item and by the history, so both towers embed items in one space; tables are on the
meta device and sharded by DMP.

``outputs`` is the dict a ``RetrievalModel`` gives its evaluation (``RetrievalMetricHook``):
``query [B, D]`` (the user embedding), ``target [B]`` (the item that followed), and
``history_lengths [B]`` / ``history_ids`` (the items already seen, for "exclude the history").
``item_embeddings(ids)`` embeds any items (the corpus, in evaluation and export); under DMP
every rank calls it together (the sharded table lookup is a collective).

Negatives (``loss=`` / ``num_uniform_negatives=``): ``"in_batch"`` uses the other rows'
items, plus ``num_uniform_negatives`` items drawn uniformly from the corpus (*mixed*
negatives), with the logQ correction from a streaming ``ItemFrequencyEstimator`` (a module of
the model, so checkpoints carry it); ``cross_rank_negatives=True`` adds the other ranks'
items (an all-gather whose backward returns every rank's gradient to each rank's items).
``"sampled"`` is a sampled softmax against the uniform negatives only. ``"full"`` is the full
softmax: every item of the corpus is a negative (no sampling, no logQ; for a corpus small
enough that a ``[queries, num_items]`` logit matrix fits); it refuses ``num_uniform_negatives
> 0`` (a ValueError) rather than ignore it. Uniformly sampled ids (and, with
``"full"``, the whole corpus) are looked up in the same call as the batch (one more row of the
sequence KJT), so the item table is read once per step.

The data-dependent parts (checks, collectives with per-rank sizes, the assembled lookup) are
``torch.fx`` leaves: TorchRec's ``pipeline="sparse_dist"`` traces the forward. The item table
is pipelined when it reads ``batch.sequence`` unchanged (in-batch negatives only); with
uniform negatives its input is assembled in the forward and TorchRec runs that lookup
unpipelined (same results, less overlap).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.models import make_tables
from recsys_trainer.ranking_models import mlp
from recsys_trainer.retrieval import collectives
from recsys_trainer.retrieval.frequency import ItemFrequencyEstimator
from recsys_trainer.retrieval.losses import (
    check_temperature,
    expected_candidate_log_q,
    in_batch_softmax_loss,
    sampled_softmax_loss,
)

LossKind = Literal["in_batch", "sampled", "full"]


@runtime_checkable
class RetrievalModel(Protocol):
    """What ``RetrievalMetricHook`` and ``export_item_embeddings`` need from a model: the
    corpus size (item ids ``[0, num_items)``) and the item tower. ``forward(batch)`` returns
    ``(loss, outputs)`` with at least ``outputs["query"]`` and ``outputs["target"]``."""

    num_items: int

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` embeddings of item ids ``[n]`` (a collective under DMP)."""
        ...


def find_retrieval_model(model: nn.Module) -> RetrievalModel:
    """The ``RetrievalModel`` inside ``model`` (a DMP's ``module``, a DDP's ``module``, or
    ``model`` itself); a ``TypeError`` naming what is missing otherwise."""
    seen: nn.Module | None = model
    for _ in range(4):
        if isinstance(seen, RetrievalModel):
            return seen
        seen = getattr(seen, "module", None)
        if not isinstance(seen, nn.Module):
            break
    raise TypeError(
        f"{type(model).__name__} is not a retrieval model: full-corpus evaluation and export need "
        "a model with `num_items` and `item_embeddings(ids) -> [n, D]` (TwoTowerModel, "
        "SASRecModel, or your own), reached directly or through DMP's `.module`.")


# ----------------------------------------------------------------------------- item catalog


def load_item_catalog(source: str | os.PathLike[str] | Mapping[str, Any], id_column: str,
                      columns: Sequence[str], num_items: int) -> dict[str, torch.Tensor]:
    """``{column: int64 [num_items]}``: each item's side-feature id, from a parquet file (or a
    mapping of arrays) with ``id_column`` and ``columns``. Every item id in ``[0, num_items)``
    must appear exactly once: an item without side features could not be embedded."""
    if isinstance(source, Mapping):
        table = {k: np.asarray(v) for k, v in source.items()}
        where = "the item catalog"
    else:
        import pyarrow.parquet as pq

        where = f"item catalog {os.fspath(source)!r}"
        # Check the schema first: reading a missing column raises an ArrowInvalid naming
        # neither the catalog nor the feature.
        have = pq.read_schema(source).names
        absent = [c for c in (id_column, *columns) if c not in have]
        if absent:
            raise ValueError(f"{where} lacks column(s) {absent}; it has {sorted(have)}.")
        read = pq.read_table(source, columns=[id_column, *columns])
        table = {c: read.column(c).to_numpy() for c in read.column_names}
    missing = [c for c in (id_column, *columns) if c not in table]
    if missing:
        raise ValueError(f"{where} lacks column(s) {missing}; it has {sorted(table)}.")
    ids = table[id_column].astype(np.int64)
    if len(ids) != num_items or not np.array_equal(np.sort(ids), np.arange(num_items)):
        raise ValueError(
            f"{where} must list every item id in [0, {num_items}) exactly once (column "
            f"{id_column!r}), but has {len(ids)} rows with {len(np.unique(ids))} distinct ids in "
            f"[{ids.min() if len(ids) else 0}, {ids.max() if len(ids) else 0}].")
    order = np.argsort(ids)
    return {c: torch.from_numpy(table[c].astype(np.int64)[order].copy()) for c in columns}


def _fixed_draw(num_items: int, count: int) -> torch.Tensor:
    """``count`` ids in ``[0, num_items)`` from a generator seeded 0, on the host: the same ids
    on every device (a device generator would draw others per device type)."""
    return torch.randint(0, num_items, (count,), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- fx leaves


def check_one_id_per_row(lengths: torch.Tensor, feature: str) -> None:
    """Refuse a target feature without exactly one id per row (CPU: naming the row; any other
    device: an asynchronous device assert, no host sync)."""
    ok = (lengths == 1).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "the target item feature must have exactly one id per row")
        return
    if not bool(ok):
        row = int(torch.nonzero(lengths != 1)[0, 0])
        raise ValueError(
            f"the target item feature {feature!r} must have exactly one id per row, but row {row} "
            f"of the batch has {int(lengths[row])}. Read it from a scalar column with no nulls.")


def check_history_lengths(lengths: torch.Tensor, max_len: int, feature: str) -> None:
    """Refuse histories longer than the model's ``max_len`` (padding would keep the oldest)."""
    ok = (lengths <= max_len).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "a history is longer than the model's max_len")
        return
    if not bool(ok):
        row = int(torch.nonzero(lengths > max_len)[0, 0])
        raise ValueError(
            f"row {row} of the batch has a {feature!r} history of {int(lengths[row])} ids, more "
            f"than the model's max_len={max_len}. Give the SequenceFeature max_len={max_len} "
            "(the reader keeps the most recent ids) or build the model with a larger max_len.")


def check_aligned_history(side_lengths: torch.Tensor, lengths: torch.Tensor, feature: str,
                          history_feature: str) -> None:
    """A history side feature must hold one id per history item (its i-th id is the i-th
    item's): refuse a row where the two lengths differ."""
    ok = (side_lengths == lengths).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "a history side feature is not as long as the history")
        return
    if not bool(ok):
        row = int(torch.nonzero(side_lengths != lengths)[0, 0])
        raise ValueError(
            f"row {row} of the batch has {int(side_lengths[row])} {feature!r} ids but "
            f"{int(lengths[row])} {history_feature!r} items: a history side feature holds one id "
            f"per history item, in the same order. Write them together and give both "
            "SequenceFeatures the same max_len.")


def check_sequence_keys(sequence: KeyedJaggedTensor | None, expected: list[str]) -> None:
    """The batch's sequence keys must be the model's, in its order: a sharded table fixes its
    feature order at its first input, and the model's own lookups (negatives, the corpus) use
    this order."""
    if sequence is None:
        raise ValueError(
            f"this retrieval model reads batch.sequence (keys {expected}), but the batch has none: "
            "declare them as FeatureSpec(sequence=[SequenceFeature(...), ...]).")
    if list(sequence.keys()) != expected:
        raise ValueError(
            f"batch.sequence has keys {list(sequence.keys())}, but the model reads {expected} in "
            f"this order: declare FeatureSpec(sequence=[...]) in the order {expected}.")


def with_extra_row(sequence: KeyedJaggedTensor, extra: Mapping[str, torch.Tensor]) -> KeyedJaggedTensor:
    """``sequence`` with one more row holding ``extra[key]`` ids for the keys given (none for
    the others): ids the model looks up in the same call as the batch (uniform negatives)."""
    values, lengths = [], []
    for key, jt in zip(sequence.keys(), sequence.split([1] * len(sequence.keys())), strict=True):
        ids = extra.get(key)
        v = jt.values()
        ln = jt.lengths()
        if ids is None:
            values.append(v)
            lengths.append(torch.cat([ln, ln.new_zeros(1)]))
        else:
            values.append(torch.cat([v, ids.to(v.dtype)]))
            lengths.append(torch.cat([ln, ln.new_full((1,), ids.numel())]))
    return KeyedJaggedTensor.from_lengths_sync(keys=sequence.keys(), values=torch.cat(values),
                                               lengths=torch.cat(lengths))


def items_only_input(keys: list[str], item_ids: Mapping[str, torch.Tensor]) -> KeyedJaggedTensor:
    """A sequence KJT with the model's ``keys`` where each key in ``item_ids`` holds one id per
    row and the others none: the item tower's input for items outside a batch (the corpus)."""
    first = next(iter(item_ids.values()))
    n, device = first.numel(), first.device
    # Built where the ids are (the model's device): no round trip through the host.
    values, lengths = [], []
    for key in keys:
        ids = item_ids.get(key)
        if ids is None:
            lengths.append(torch.zeros(n, dtype=torch.int32, device=device))
        else:
            values.append(ids.to(device, torch.int64))
            lengths.append(torch.ones(n, dtype=torch.int32, device=device))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64, device=device),
        lengths=torch.cat(lengths))


def start_candidates(items: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                     cross_rank: bool) -> collectives.PendingRows | None:
    """Launch the gather of every rank's in-batch candidates (items, with their ids and
    validity in the same message) when ``cross_rank``; the model computes its user tower while
    it is in flight and ``gather_candidates`` waits for it. None without ``cross_rank``."""
    if not cross_rank:
        return None
    meta = torch.stack([ids.to(torch.int64), valid.to(torch.int64)], 1)
    return collectives.start_gather_with_grad(items, meta)


def gather_candidates(items: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, cross_rank: bool,
                      pending: collectives.PendingRows | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The in-batch candidates: this rank's, or every rank's (differentiable: every rank's loss
    reaches every rank's items; ``pending``: the gather ``start_candidates`` launched). Returns
    ``(items, ids, valid, offset of this rank's rows)``."""
    if not cross_rank:
        return items, ids, valid, 0
    if pending is None:
        pending = start_candidates(items, ids, valid, True)
    assert pending is not None
    all_items, meta, offset = pending.wait()
    assert meta is not None
    return all_items, meta[:, 0], meta[:, 1] > 0, offset


def count_items(estimator: ItemFrequencyEstimator, ids: torch.Tensor, valid: torch.Tensor,
                gathered: bool) -> None:
    """Count a training step's positive items of *every* rank (so all ranks' estimators stay
    identical): ``ids``/``valid`` are every rank's when ``gathered``, else this rank's."""
    mine = ids[valid]
    if not gathered:
        mine, _ = collectives.all_gather_rows(mine)
    estimator.update(mine)


def candidate_log_q(estimator: ItemFrequencyEstimator, ids: torch.Tensor, num_in_batch: torch.Tensor,
                    num_uniform: int, num_items: int) -> torch.Tensor:
    """logQ of ``ids`` as candidates: ``num_in_batch`` frequency-drawn plus ``num_uniform``
    uniform draws (``losses.expected_candidate_log_q``)."""
    return expected_candidate_log_q(estimator.probability(ids), num_in_batch, num_uniform, num_items)


def retrieval_step(model: Any, batch: Batch, seq: Any, pooled: Any,
                   neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Everything of a retrieval model's forward after its table lookups: towers, loss and
    outputs (``model._step``). One ``torch.fx`` leaf: the loss's collectives, frequency updates
    and masks depend on data."""
    return model._step(batch, seq, pooled, neg_ids)  # type: ignore[no-any-return]


for _leaf in ("retrieval_step", "check_one_id_per_row", "check_history_lengths", "check_aligned_history",
              "check_sequence_keys",
              "with_extra_row", "items_only_input", "start_candidates", "gather_candidates", "count_items",
              "candidate_log_q"):
    torch.fx.wrap(_leaf)


# ----------------------------------------------------------------------------- shared parts


def tower(sizes: Sequence[int]) -> nn.Sequential:
    """Linear + ReLU through ``sizes[:-1]``, then a final Linear without activation (the
    embedding)."""
    if len(sizes) < 2:
        raise ValueError(f"a tower needs an input and an output width, but has sizes {list(sizes)}.")
    return nn.Sequential(mlp(sizes[:-1]), nn.Linear(sizes[-2], sizes[-1]))


def user_tables(user_features: Sequence[str], num_embeddings: int | Sequence[int], embedding_dim: int,
                table_device: str) -> EmbeddingBagCollection | None:
    """One pooled table ``t_<feature>`` per user feature (``batch.sparse``), or None without."""
    features = list(user_features)
    if isinstance(user_features, str) or len(set(features)) != len(features):
        raise ValueError(f"`user_features` must be a list of distinct feature names, but is {user_features!r}.")
    if not features:
        return None
    sizes = ([int(num_embeddings)] * len(features) if isinstance(num_embeddings, int)
             else [int(n) for n in num_embeddings])
    if len(sizes) != len(features):
        raise ValueError(f"`user_num_embeddings` must be one int or one per user feature "
                         f"{features}, but is {num_embeddings!r}.")
    return EmbeddingBagCollection(tables=make_tables(features, sizes, embedding_dim),
                                  device=torch.device(table_device))


class _RetrievalBase(nn.Module):
    """What the two models share: the item (and side) tables, the user tables, the negatives,
    the loss and the item embeddings of the corpus."""

    def __init__(self, *, num_items: int, item_feature: str, history_feature: str | None,
                 user_features: Sequence[str], user_num_embeddings: int | Sequence[int],
                 max_len: int, embedding_dim: int, normalize: bool, side_tables: Mapping[str, int],
                 history_side_features: Mapping[str, str],
                 item_catalog: str | os.PathLike[str] | Mapping[str, Any] | None, item_id_column: str,
                 loss: LossKind, num_uniform_negatives: int, temperature: float,
                 log_q_correction: bool, cross_rank_negatives: bool,
                 frequency_buckets: int | None, frequency_hashes: int,
                 frequency_half_life_steps: float | None, item_init_max: float | None,
                 table_device: str) -> None:
        super().__init__()
        if not isinstance(num_items, int) or num_items < 2:
            raise ValueError(f"`num_items` must be an int >= 2, but is {num_items!r}.")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"`max_len` must be an int >= 1, but is {max_len!r}.")
        if loss not in ("in_batch", "sampled", "full"):
            raise ValueError(f"`loss` must be 'in_batch', 'sampled' or 'full', but is {loss!r}.")
        if loss == "full" and cross_rank_negatives:
            raise ValueError("loss='full' already scores every item of the corpus; "
                             "`cross_rank_negatives` has nothing to add.")
        if not isinstance(num_uniform_negatives, int) or num_uniform_negatives < 0:
            raise ValueError(f"`num_uniform_negatives` must be an int >= 0, but is {num_uniform_negatives!r}.")
        if loss == "full" and num_uniform_negatives > 0:
            # Refused rather than ignored: a caller who set a sample size would otherwise train
            # a different loss than the one configured, without a word.
            raise ValueError(f"loss='full' already scores every item of the corpus: "
                             f"`num_uniform_negatives` ({num_uniform_negatives}) would be ignored; "
                             "give num_uniform_negatives=0 or loss='in_batch'/'sampled'.")
        if loss == "sampled" and num_uniform_negatives < 1:
            raise ValueError("loss='sampled' draws its negatives uniformly from the corpus: give "
                             "`num_uniform_negatives` >= 1 (e.g. 1024).")
        if loss == "sampled" and cross_rank_negatives:
            raise ValueError("`cross_rank_negatives` extends the in-batch negatives; loss='sampled' "
                             "has none. Use loss='in_batch'.")
        check_temperature(temperature)
        self.num_items, self.item_feature, self.history_feature = num_items, item_feature, history_feature
        self.max_len, self.loss_kind = max_len, loss
        self.num_uniform_negatives, self.temperature = num_uniform_negatives, float(temperature)
        self.log_q_correction, self.cross_rank_negatives = log_q_correction, cross_rank_negatives
        item_features = [item_feature] + ([history_feature] if history_feature else [])
        unknown = [k for k in history_side_features if k not in side_tables]
        if unknown:
            raise ValueError(f"`history_side_features` names {unknown}, which are not item side "
                             f"features ({sorted(side_tables)}): give each side feature's history key.")
        self.history_side_features = {k: history_side_features[k] for k in side_tables
                                      if k in history_side_features}
        """Side feature -> the ``batch.sequence`` key holding it for each history item."""
        hist_side = list(self.history_side_features.values())
        names = [*item_features, *side_tables, *hist_side]
        self.row_id_features: tuple[str, ...] = tuple(names)
        """Features whose ids are table rows (the catalog, the metrics and the export map id i
        to row i): the Trainer makes the datasets refuse to hash them (``data.spec.apply_model_to_specs``)."""
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be distinct, but are {item_features}, "
                             f"{sorted(side_tables)} and {hist_side}.")
        init = {} if item_init_max is None else {
            "weight_init_min": -item_init_max, "weight_init_max": item_init_max}
        tables = [EmbeddingConfig(name=f"t_{item_feature}", embedding_dim=embedding_dim,
                                  num_embeddings=num_items, feature_names=item_features, **init)]
        # A side table is read by the candidate's side feature and, for a sequential model, by
        # the history's (as the item table by the item and the history).
        tables += [EmbeddingConfig(name=f"t_{name}", embedding_dim=embedding_dim, num_embeddings=rows,
                                   feature_names=[name, *([self.history_side_features[name]]
                                                          if name in self.history_side_features else [])])
                   for name, rows in side_tables.items()]
        self.sequence_keys = names
        """The keys of ``batch.sequence`` the model reads, in this order."""
        self.side_features = list(side_tables)
        catalog: dict[str, torch.Tensor] = {}
        if side_tables:
            if item_catalog is None:
                raise ValueError(f"item side features {self.side_features} need `item_catalog` "
                                 "(each item's side-feature ids) to embed items outside a batch.")
            catalog = load_item_catalog(item_catalog, item_id_column, self.side_features, num_items)
        for name, ids in catalog.items():
            if int(ids.min()) < 0 or int(ids.max()) >= side_tables[name]:
                raise ValueError(f"item catalog column {name!r} holds ids outside [0, {side_tables[name]}).")
            self.register_buffer(f"catalog_{name}", ids, persistent=False)
        self.items = EmbeddingCollection(tables=tables, device=torch.device(table_device))
        self.frequency = ItemFrequencyEstimator(
            frequency_buckets if frequency_buckets is not None else num_items,
            frequency_hashes, frequency_half_life_steps)
        """Streaming item frequencies for the logQ correction (saved with the model)."""
        self.register_buffer("positions", torch.arange(max_len + 1), persistent=False)
        self._eval_negatives: torch.Tensor | None = None
        """The evaluation's uniform negatives on the device they were last asked on."""
        self.users = user_tables(user_features, user_num_embeddings, embedding_dim, table_device)
        self.user_features = list(user_features)
        self.normalize = normalize

    positions: torch.Tensor

    def _uniform_negatives(self, device: torch.device) -> torch.Tensor | None:
        if self.loss_kind == "full":
            # Every item, in training and evaluation: the negatives are the whole corpus.
            return torch.arange(self.num_items, device=device)
        if self.num_uniform_negatives == 0:
            return None
        if self.training:
            # Drawn on the model's device (no host draw and copy per step), from that device's
            # global generator, which the Trainer seeds and checkpoints (bitwise resume).
            return torch.randint(0, self.num_items, (self.num_uniform_negatives,), device=device)
        # Evaluation: the same ids at every step, so evaluating never moves the training's
        # random stream; drawn once, kept on the device.
        cached = self._eval_negatives
        if cached is None or cached.device != device:
            cached = _fixed_draw(self.num_items, self.num_uniform_negatives).to(device)
            self._eval_negatives = cached
        return cached

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        """An output embedding: L2-normalised when ``normalize`` (scores are then cosines)."""
        return F.normalize(x, dim=-1) if self.normalize else x

    def _serving_user(self, pooled: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``[B, F * D]``: the scorer's pooled user features in ``user_features`` order (None
        without user features), as ``_pooled_user`` joins them in training."""
        return torch.cat([pooled[f] for f in self.user_features], dim=1) if self.user_features else None

    def _pooled_user(self, pooled: KeyedTensor | Any | None) -> torch.Tensor | None:
        """``[B, F * D]``: the user tables' output (a ``KeyedTensor``, or a sharded
        collection's awaitable of one) joined by name in ``user_features`` order, as torchrec's
        DLRM joins its features. A sharded collection returns its features grouped by sharding
        type and rank, not in the declared order (table-wise on 2 ranks: ``[segment,
        user_id]`` for a declared ``[user_id, segment]``): its ``values()`` would feed the
        tower a column order that changes with the world size and differs from serving's."""
        if pooled is None:
            return None
        if list(pooled.keys()) == self.user_features:
            return pooled.values()  # type: ignore[no-any-return]  # in order already: no copy
        by_name = pooled.to_dict()
        return torch.cat([by_name[f] for f in self.user_features], dim=1)

    def _catalog(self, name: str) -> torch.Tensor:
        return getattr(self, f"catalog_{name}")  # type: ignore[no-any-return]

    def _item_features(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ids an item adds to a lookup (a uniform negative, the corpus): its item id and
        its side features from the catalog."""
        feats = {self.item_feature: ids}
        feats.update({name: self._catalog(name)[ids.to(self._catalog(name).device)]
                      for name in self.side_features})
        return feats

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Only the table lookups happen here (TorchRec's pipeline traces this far); the rest
        # is one fx leaf, ``retrieval_step``.
        check_sequence_keys(batch.sequence, self.sequence_keys)
        neg_ids = self._uniform_negatives(batch.labels.device)
        kjt = batch.sequence if neg_ids is None else with_extra_row(
            batch.sequence, self._item_features(neg_ids))
        seq = self.items(kjt)
        pooled = self.users(batch.sparse) if self.users is not None else None
        return retrieval_step(self, batch, seq, pooled, neg_ids)

    def _step(self, batch: Batch, seq: dict[str, JaggedTensor], pooled: Any,
              neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def _item_vectors(self, seq: dict[str, JaggedTensor], rows: slice) -> torch.Tensor:
        """``[n, D]`` item-tower outputs of the lookup's one-id-per-row ``rows``."""
        raise NotImplementedError

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` embeddings of item ids ``[n]`` (side features from the catalog), as the
        loss scores them. Under DMP every rank calls this together."""
        seq = self.items(items_only_input(self.sequence_keys, self._item_features(ids)))
        return self._item_vectors(self._by_key(seq), slice(None))

    def _by_key(self, out: Any) -> dict[str, JaggedTensor]:
        # Index by key (a sharded collection's output is a lazy dict: no `in`, no iteration).
        return {k: out[k] for k in self.sequence_keys}

    def _history(self, seq: dict[str, JaggedTensor], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings [B, L, E], lengths [B])`` of the history, oldest first, left-aligned
        (the lookup's extra row of negatives, if any, has no history and is cut off)."""
        assert self.history_feature is not None
        jt = seq[self.history_feature]
        lengths = jt.lengths()[:batch_size]
        check_history_lengths(lengths, self.max_len, self.history_feature)
        emb = JaggedTensor(values=jt.values(), lengths=lengths).to_padded_dense(self.max_len)
        return emb, lengths

    def _cross_rank(self) -> bool:
        return self.cross_rank_negatives and self.loss_kind == "in_batch"

    @staticmethod
    def _valid(ids: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """Which of a step's rows are real (weight > 0; all without weights)."""
        return torch.ones_like(ids, dtype=torch.bool) if weights is None else weights > 0

    def _launch_candidates(self, items: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None,
                           ) -> collectives.PendingRows | None:
        """Launch the cross-rank gather of the in-batch candidates now (``start_candidates``),
        for ``_loss`` to wait on; None without cross-rank negatives (or to gather in ``_loss``)."""
        if not self._cross_rank():
            return None
        return start_candidates(items, ids, self._valid(ids, weights), True)

    def _candidates(self, items: torch.Tensor, item_ids: torch.Tensor, weights: torch.Tensor | None,
                    pending: collectives.PendingRows | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """The in-batch candidates of a step's positives ``items [B, D]`` (every rank's with
        cross-rank negatives; ``pending``: their gather, already launched), counted into the
        frequency estimate when training. Returns ``(items, ids, valid, offset of this rank's
        rows, how many are in-batch draws for logQ: the valid ones, 0 for loss='sampled')``."""
        cand, cand_ids, cand_valid, offset = gather_candidates(
            items, item_ids, self._valid(item_ids, weights), self._cross_rank(), pending)
        if self.training:
            count_items(self.frequency, cand_ids, cand_valid, self.cross_rank_negatives)
        num_in_batch = cand_valid.sum() if self.loss_kind == "in_batch" else cand_valid.new_zeros((), dtype=torch.int64)
        return cand, cand_ids, cand_valid, offset, num_in_batch

    def _loss(self, query: torch.Tensor, items: torch.Tensor, item_ids: torch.Tensor,
              weights: torch.Tensor | None, negatives: torch.Tensor | None,
              negative_ids: torch.Tensor | None, pending: collectives.PendingRows | None = None,
              ) -> torch.Tensor:
        """The configured loss of ``query [B, D]`` against ``items [B, D]`` (the positives);
        ``pending``: the cross-rank gather of ``items`` already launched (``start_candidates``)."""
        if self.loss_kind == "full":
            assert negatives is not None and negative_ids is not None
            # Each item once: a constant logQ, so none; the positive's own column is masked.
            return sampled_softmax_loss(query, items, item_ids, negatives, negative_ids, weights,
                                        temperature=self.temperature)
        cand, cand_ids, cand_valid, offset, num_in_batch = self._candidates(items, item_ids, weights, pending)
        s = self.num_uniform_negatives
        log_q = neg_log_q = None
        if self.log_q_correction:
            log_q = candidate_log_q(self.frequency, cand_ids, num_in_batch, s, self.num_items)
            if negative_ids is not None:
                neg_log_q = candidate_log_q(self.frequency, negative_ids, num_in_batch, s, self.num_items)
        if self.loss_kind == "sampled":
            assert negatives is not None and negative_ids is not None
            return sampled_softmax_loss(query, items, item_ids, negatives, negative_ids, weights,
                                        temperature=self.temperature, positive_log_q=log_q,
                                        negative_log_q=neg_log_q)
        item_weights = cand_valid.to(query.dtype)
        return in_batch_softmax_loss(
            query, cand, cand_ids, weights, temperature=self.temperature, positive_offset=offset,
            item_weights=item_weights, item_log_q=log_q, negatives=negatives,
            negative_ids=negative_ids, negative_log_q=neg_log_q)


# ----------------------------------------------------------------------------- two-tower


class TwoTowerModel(_RetrievalBase):
    """A two-tower retrieval model (DSSM / YouTube-DNN style) over sharded tables.

    * User tower: the pooled user features (``batch.sparse``, one table ``t_<name>`` each, in
      an ``EmbeddingBagCollection``), the mean of the history items (``history_feature``,
      looked up in the item table) and, with ``recent_items=r``, the last ``r`` history items
      one by one (zeros where the history is shorter; YouTube-DNN's "last watched"), through
      an MLP to ``tower_dims[-1]``.
    * Item tower: the item's embedding (``item_feature``, the item table) and its side
      features (``item_side_features``: ``{name: rows}``, one id per row, in
      ``batch.sequence``; for items outside a batch they come from ``item_catalog``), through
      an MLP to the same width.
    * Score: the dot product of the two, L2-normalised when ``normalize`` (then cosine), over
      ``temperature``; loss and negatives as in the module docstring.

    The ``FeatureSpec`` that feeds it: ``sparse=[SparseFeature(name=f) for f in
    user_features]``, ``sequence=[SequenceFeature(name=item_feature, num_embeddings=num_items),
    SequenceFeature(name=history_feature, num_embeddings=num_items, max_len=max_len), *one
    SequenceFeature per side feature]``, in the order of ``sequence_keys``.

    Args:
        user_features: pooled user features (``batch.sparse`` keys).
        num_items: rows of the item table; the corpus is item ids ``[0, num_items)``.
        user_num_embeddings: rows per user table (one int or one per feature).
        item_side_features: ``{feature: rows}`` of item side features.
        item_catalog: a parquet file (or mapping of arrays) with ``item_id_column`` and one
            column per side feature, listing every item once (``load_item_catalog``); needed
            with side features.
        history_feature: the history key, or None for a user tower without history.
        recent_items: how many of the most recent history items the user tower also sees
            individually (0: the mean only, an order-free user tower).
        tower_dims: hidden widths and the output width of both towers.
    """

    def __init__(
        self,
        user_features: Sequence[str],
        *,
        num_items: int,
        user_num_embeddings: int | Sequence[int] = 10_000,
        item_feature: str = "item",
        history_feature: str | None = "hist_item",
        item_side_features: Mapping[str, int] | None = None,
        item_catalog: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        item_id_column: str = "item_id",
        max_len: int = 50,
        recent_items: int = 0,
        embedding_dim: int = 32,
        tower_dims: Sequence[int] = (64, 32),
        normalize: bool = True,
        temperature: float = 0.05,
        loss: LossKind = "in_batch",
        num_uniform_negatives: int = 0,
        log_q_correction: bool = True,
        cross_rank_negatives: bool = False,
        frequency_buckets: int | None = None,
        frequency_hashes: int = 1,
        frequency_half_life_steps: float | None = 1000.0,
        item_init_max: float | None = None,
        table_device: str = "meta",
    ) -> None:
        side = dict(item_side_features or {})
        super().__init__(
            num_items=num_items, item_feature=item_feature, history_feature=history_feature,
            user_features=user_features, user_num_embeddings=user_num_embeddings,
            max_len=max_len, embedding_dim=embedding_dim, normalize=normalize, side_tables=side,
            history_side_features={}, item_catalog=item_catalog, item_id_column=item_id_column, loss=loss,
            num_uniform_negatives=num_uniform_negatives, temperature=temperature,
            log_q_correction=log_q_correction, cross_rank_negatives=cross_rank_negatives,
            frequency_buckets=frequency_buckets, frequency_hashes=frequency_hashes,
            frequency_half_life_steps=frequency_half_life_steps, item_init_max=item_init_max,
            table_device=table_device)
        if not self.user_features and history_feature is None:
            raise ValueError("the user tower needs user features, a history feature, or both.")
        if not isinstance(recent_items, int) or not 0 <= recent_items <= max_len or (
                recent_items and history_feature is None):
            raise ValueError(f"`recent_items` must be an int in [0, max_len={max_len}] (0 without a "
                             f"history feature), but is {recent_items!r}.")
        self.recent_items = recent_items
        dims = list(tower_dims)
        user_in = embedding_dim * (len(self.user_features) + (history_feature is not None) + recent_items)
        self.user_tower = tower([user_in, *dims])
        self.item_tower = tower([embedding_dim * (1 + len(side)), *dims])

    def _item_vectors(self, seq: dict[str, JaggedTensor], rows: slice) -> torch.Tensor:
        parts = [seq[self.item_feature].values()[rows]]
        parts += [seq[name].values()[rows] for name in self.side_features]
        return self._out(self.item_tower(torch.cat(parts, dim=1)))

    def _user_query(self, pooled: torch.Tensor | None, hist: torch.Tensor | None,
                    lengths: torch.Tensor | None) -> torch.Tensor:
        """``[B, D]`` user-tower output from the pooled user features ``[B, F * E]`` (in
        ``user_features`` order) and the left-aligned history ``[B, max_len, E]`` with its
        lengths ``[B]``: the code training and the serving export share."""
        user_parts = [] if pooled is None else [pooled]
        if hist is not None and lengths is not None:
            mask = (self.positions[: self.max_len].unsqueeze(0) < lengths.unsqueeze(1)).to(hist.dtype)
            mean = (hist * mask.unsqueeze(-1)).sum(1) / lengths.clamp_min(1).unsqueeze(1).to(hist.dtype)
            user_parts.append(mean)
            if self.recent_items:
                # The j-th most recent item sits at index length - 1 - j (left-aligned history).
                back = lengths.unsqueeze(1) - 1 - self.positions[: self.recent_items].unsqueeze(0)
                recent = torch.gather(hist, 1, back.clamp_min(0).unsqueeze(-1).expand(-1, -1, hist.shape[-1]))
                recent = recent * (back >= 0).unsqueeze(-1).to(hist.dtype)
                user_parts.append(recent.flatten(1))
        return self._out(self.user_tower(torch.cat(user_parts, dim=1)))

    def serving_sequence_lengths(self) -> dict[str, int]:
        """The serving contract (``recsys_trainer.serving``): the history's padded length."""
        return {self.history_feature: self.max_len} if self.history_feature is not None else {}

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        """The serving contract: the user tower's query embedding ``[B, D]`` (what the item
        export's vectors are scored against), from the scorer's lookups; export it with
        ``activation="none"``. The candidate item and its side features are not read."""
        hf = self.history_feature
        return self._user_query(self._serving_user(pooled), sequences[hf] if hf is not None else None,
                                lengths[hf] if hf is not None else None)

    def _step(self, batch: Batch, seq_out: Any, pooled: Any,
              neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.sequence is not None
        b = batch.labels.shape[0]
        seq = self._by_key(seq_out)
        cand = seq[self.item_feature]
        check_one_id_per_row(cand.lengths()[:b], self.item_feature)
        target_ids = batch.sequence[self.item_feature].values()
        # The item tower first (the batch's items and the uniform negatives in one call), so
        # that the cross-rank gather of the items is in flight while the user tower runs (and
        # in backward, the all-reduce of their gradient while the user tower's backward runs).
        vectors = self._item_vectors(seq, slice(None))
        items = vectors[:b]
        negatives = vectors[b:] if neg_ids is not None else None
        weights = batch.weights
        pending = self._launch_candidates(items, target_ids, weights)
        outputs: dict[str, torch.Tensor] = {}
        hist = lengths = None
        if self.history_feature is not None:
            hist, lengths = self._history(seq, b)
            outputs["history_lengths"] = lengths
            outputs["history_ids"] = batch.sequence[self.history_feature].values()
        query = self._user_query(self._pooled_user(pooled), hist, lengths)
        loss = self._loss(query, items, target_ids, weights, negatives, neg_ids, pending)
        outputs["query"] = query.detach()
        outputs["target"] = target_ids
        return loss, outputs


# ----------------------------------------------------------------------------- SASRec


class SASRecModel(_RetrievalBase):
    """A SASRec-style sequential retrieval model (Kang & McAuley, 2018): a causal transformer
    over the history, trained to predict the next item at every position.

    The input of a row is ``[BOS, h_1, ..., h_n]`` (the history, oldest first, embedded by the
    item table, plus learned positions); the output at position ``p`` is the query for the item
    that followed ``h_p``: ``h_{p+1}``, and the row's target item (``item_feature``) after the
    last. Every position is a training query (SASRec's objective), or with ``train_positions=t``
    the last ``t`` of each row (``1``: the target only; fewer queries, a cheaper loss). The loss
    scores each query against its positive and shared negatives: the batch's target items and
    ``num_uniform_negatives`` uniform items, with the logQ correction (``loss="in_batch"``;
    ``"sampled"``: the uniform items only; ``"full"``: every item of the corpus, no sampling).
    In evaluation the query is the output after the last history item, and the loss scores the
    positions ``eval_positions`` says (``1``: that query only, what the metrics rank).

    An item's vector is its row of the item table plus, with ``item_side_features``, the rows
    of its side features (one table ``t_<name>`` each): the same vector is the input at a
    history position and the candidate a query is scored against (L2-normalised when
    ``normalize``), shared as in SASRec. The candidate's side ids come from ``batch.sequence``
    (``name``, one per row), the history's from ``history_side_features[name]`` (one per
    history item, as long as the history: the data carries them so that serving, which sees
    embeddings and no ids, gets them too), and those of items outside a batch (uniform
    negatives, the corpus) from ``item_catalog``.

    With ``user_features`` (pooled tables ``t_<name>`` over ``batch.sparse``, e.g. the user id
    and segment), a linear projection of the concatenated user embeddings is added to the
    transformer's output at every position: each query is "this history, from this user".

    The ``FeatureSpec`` that feeds it: ``sparse=[SparseFeature(name=f) for f in
    user_features]``, ``sequence=[SequenceFeature(name=item_feature, num_embeddings=num_items),
    SequenceFeature(name=history_feature, num_embeddings=num_items, max_len=max_len), *one
    SequenceFeature per side feature (one id per row), *one per history side feature
    (max_len=max_len)]``, in the order of ``sequence_keys``.

    Args (besides the loss options, as ``TwoTowerModel``'s):
        num_uniform_negatives: uniform negatives per step; None: 256, or 0 with
            ``loss="full"`` (which refuses any other number: it scores every item already).
        eval_positions: the last positions of each row the evaluation's loss scores; None:
            ``train_positions``'s; ``1``: only the query the metrics rank (cheaper, and the
            loss of what is evaluated).
        user_features: pooled user features (``batch.sparse`` keys); none by default.
        user_num_embeddings: rows per user table (one int or one per feature).
        item_side_features: ``{feature: rows}`` of item side features; none by default.
        history_side_features: ``{feature: history key}``; default ``hist_<feature>`` for each
            side feature.
        item_catalog: a parquet file (or mapping of arrays) with ``item_id_column`` and one
            column per side feature, listing every item once; needed with side features.
    """

    def __init__(
        self,
        *,
        num_items: int,
        item_feature: str = "item",
        history_feature: str = "hist_item",
        user_features: Sequence[str] = (),
        user_num_embeddings: int | Sequence[int] = 10_000,
        item_side_features: Mapping[str, int] | None = None,
        history_side_features: Mapping[str, str] | None = None,
        item_catalog: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        item_id_column: str = "item_id",
        max_len: int = 50,
        embedding_dim: int = 32,
        num_layers: int = 2,
        num_heads: int = 2,
        dropout: float = 0.1,
        train_positions: int | None = None,
        eval_positions: int | None = None,
        normalize: bool = True,
        temperature: float = 0.05,
        loss: LossKind = "in_batch",
        num_uniform_negatives: int | None = None,
        log_q_correction: bool = True,
        cross_rank_negatives: bool = False,
        frequency_buckets: int | None = None,
        frequency_hashes: int = 1,
        frequency_half_life_steps: float | None = 1000.0,
        item_init_max: float | None = None,
        table_device: str = "meta",
    ) -> None:
        side = dict(item_side_features or {})
        hist_side = ({name: f"hist_{name}" for name in side} if history_side_features is None
                     else dict(history_side_features))
        missing = [name for name in side if name not in hist_side]
        if missing:
            raise ValueError(f"item side features {missing} have no history key in "
                             f"`history_side_features` ({hist_side}): a sequential model adds them "
                             "to every history item, so the data must carry them per history item.")
        if num_uniform_negatives is None:
            # The default sample, except with the full softmax, which takes none.
            num_uniform_negatives = 0 if loss == "full" else 256
        super().__init__(
            num_items=num_items, item_feature=item_feature, history_feature=history_feature,
            user_features=user_features, user_num_embeddings=user_num_embeddings,
            max_len=max_len, embedding_dim=embedding_dim, normalize=normalize, side_tables=side,
            history_side_features=hist_side, item_catalog=item_catalog,
            item_id_column=item_id_column, loss=loss,
            num_uniform_negatives=num_uniform_negatives, temperature=temperature,
            log_q_correction=log_q_correction, cross_rank_negatives=cross_rank_negatives,
            frequency_buckets=frequency_buckets, frequency_hashes=frequency_hashes,
            frequency_half_life_steps=frequency_half_life_steps, item_init_max=item_init_max,
            table_device=table_device)
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"`num_layers` must be an int >= 1, but is {num_layers!r}.")
        if not isinstance(num_heads, int) or num_heads < 1 or embedding_dim % num_heads:
            raise ValueError(f"`num_heads` must divide embedding_dim={embedding_dim}, but is {num_heads!r}.")
        for name, value in (("train_positions", train_positions), ("eval_positions", eval_positions)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be an int >= 1 or None, but is {value!r}.")
        self.train_positions = train_positions
        self.eval_positions = train_positions if eval_positions is None else eval_positions
        """The last positions of each row the evaluation's loss scores (None: every one)."""
        self.user_projection = (nn.Linear(embedding_dim * len(self.user_features), embedding_dim)
                                if self.user_features else None)
        """The user features' term of every query (None without user features)."""
        self.bos = nn.Parameter(torch.zeros(embedding_dim).normal_(0, 0.02))
        self.position_embedding = nn.Embedding(max_len + 1, embedding_dim)
        nn.init.normal_(self.position_embedding.weight, 0, 0.02)
        layer = nn.TransformerEncoderLayer(embedding_dim, num_heads, dim_feedforward=2 * embedding_dim,
                                           dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(embedding_dim)
        causal = torch.triu(torch.full((max_len + 1, max_len + 1), -math.inf), diagonal=1)
        self.register_buffer("causal_mask", causal, persistent=False)

    causal_mask: torch.Tensor

    def _item_vectors(self, seq: dict[str, JaggedTensor], rows: slice) -> torch.Tensor:
        """``[n, D]`` item vectors of the lookup's one-id-per-row ``rows``: the item's row plus
        its side features' rows."""
        out = seq[self.item_feature].values()[rows]
        for name in self.side_features:
            out = out + seq[name].values()[rows]
        return self._out(out)

    def encode(self, history: torch.Tensor, lengths: torch.Tensor,
               user: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, L + 1, D]`` outputs for ``[BOS, history]`` (``history [B, L, D]``: item vectors,
        left-aligned; positions after ``lengths`` are padding, which the causal mask keeps out
        of every real position's view), plus the projection of ``user [B, F * D]`` (the pooled
        user features, in ``user_features`` order) when the model has user features."""
        if (user is None) != (self.user_projection is None):
            raise ValueError(f"this model's user features are {self.user_features}: give `user` "
                             "(their pooled embeddings) exactly when it has some.")
        b = history.shape[0]
        x = torch.cat([self.bos.expand(b, 1, -1), history], dim=1)
        x = x + self.position_embedding(self.positions).unsqueeze(0)
        out = self.final_norm(self.encoder(x, mask=self.causal_mask, is_causal=True))
        if self.user_projection is not None and user is not None:
            out = out + self.user_projection(user).unsqueeze(1)
        return out

    def serving_sequence_lengths(self) -> dict[str, int]:
        """The serving contract (``recsys_trainer.serving``): the history's padded length (and
        its side features')."""
        assert self.history_feature is not None
        return {self.history_feature: self.max_len,
                **{key: self.max_len for key in self.history_side_features.values()}}

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        """The serving contract: the query embedding ``[B, D]`` after the last history item
        (the evaluation's query), from the scorer's lookups; export it with
        ``activation="none"``."""
        assert self.history_feature is not None
        hist, lens = sequences[self.history_feature], lengths[self.history_feature]
        for key in self.history_side_features.values():
            hist = hist + sequences[key]  # zero-padded as the history: padding stays zero
        out = self.encode(hist, lens, self._serving_user(pooled))
        last = out.gather(1, lens.long().view(-1, 1, 1).expand(-1, 1, out.shape[-1])).squeeze(1)
        return self._out(last)

    def _step(self, batch: Batch, seq_out: Any, pooled: Any,
              neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.sequence is not None and self.history_feature is not None
        b = batch.labels.shape[0]
        seq = self._by_key(seq_out)
        cand = seq[self.item_feature]
        check_one_id_per_row(cand.lengths()[:b], self.item_feature)
        for name in self.side_features:
            check_one_id_per_row(seq[name].lengths()[:b], name)
        target_ids = batch.sequence[self.item_feature].values()
        hist, lengths = self._history(seq, b)
        for key in self.history_side_features.values():
            side = seq[key]
            check_aligned_history(side.lengths()[:b], lengths, key, self.history_feature)
            hist = hist + JaggedTensor(values=side.values(), lengths=lengths).to_padded_dense(self.max_len)
        hist_ids_jt = batch.sequence[self.history_feature]
        out = self.encode(hist, lengths, self._pooled_user(pooled))  # [B, L+1, D]
        last = out[torch.arange(b, device=out.device), lengths.long()]  # after the last item
        query = self._out(last)
        target_emb = self._item_vectors(seq, slice(0, b))
        negatives = self._item_vectors(seq, slice(b, None)) if neg_ids is not None else None
        weights = batch.weights
        # Positions 0..n-1 predict h_1..h_n; position n (after the last item) the target.
        valid = self.positions[: self.max_len].unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]: p < n
        scored = self.train_positions if self.training else self.eval_positions
        if scored is not None:  # only the last t positions (the target's included)
            first = lengths.unsqueeze(1) + 1 - scored
            valid = valid & (self.positions[: self.max_len].unsqueeze(0) >= first)
        hist_ids = JaggedTensor(values=hist_ids_jt.values(), lengths=lengths).to_padded_dense(
            self.max_len, padding_value=0)
        row = torch.arange(b, device=out.device).unsqueeze(1).expand(b, self.max_len)[valid]
        loss = self._sequence_loss(
            torch.cat([self._out(out[:, :-1][valid]), query]),
            torch.cat([self._out(hist[valid]), target_emb]),
            torch.cat([hist_ids[valid], target_ids]),
            None if weights is None else torch.cat([weights[row], weights]),
            target_emb, target_ids, weights, negatives, neg_ids)
        outputs = {"query": query.detach(), "target": target_ids, "history_lengths": lengths,
                   "history_ids": hist_ids_jt.values()}
        return loss, outputs

    def _sequence_loss(self, queries: torch.Tensor, positives: torch.Tensor, positive_ids: torch.Tensor,
                       weights: torch.Tensor | None, row_items: torch.Tensor, row_ids: torch.Tensor,
                       row_weights: torch.Tensor | None, negatives: torch.Tensor | None,
                       negative_ids: torch.Tensor | None) -> torch.Tensor:
        """Every position's query against its positive and the shared negatives: the batch's
        target items (``loss="in_batch"``, all ranks' with ``cross_rank_negatives``) and the
        uniform ones; with ``loss="full"`` every item of the corpus."""
        if self.loss_kind == "full":
            assert negatives is not None and negative_ids is not None
            return sampled_softmax_loss(queries, positives, positive_ids, negatives, negative_ids,
                                        weights, temperature=self.temperature)
        cand, cand_ids, cand_valid, _, num_in_batch = self._candidates(row_items, row_ids, row_weights)
        s = self.num_uniform_negatives
        parts, ids, weights_n = [], [], []
        if self.loss_kind == "in_batch":
            parts, ids, weights_n = [cand], [cand_ids], [cand_valid.to(queries.dtype)]
        if negatives is not None and negative_ids is not None:
            parts.append(negatives)
            ids.append(negative_ids)
            weights_n.append(torch.ones_like(negative_ids, dtype=queries.dtype))
        neg, neg_ids = torch.cat(parts), torch.cat(ids)
        pos_log_q = neg_log_q = None
        if self.log_q_correction:
            pos_log_q = candidate_log_q(self.frequency, positive_ids, num_in_batch, s, self.num_items)
            neg_log_q = candidate_log_q(self.frequency, neg_ids, num_in_batch, s, self.num_items)
        return sampled_softmax_loss(
            queries, positives, positive_ids, neg, neg_ids, weights, temperature=self.temperature,
            positive_log_q=pos_log_q, negative_log_q=neg_log_q,
            negative_weights=torch.cat(weights_n))


__all__ = [
    "RetrievalModel",
    "SASRecModel",
    "TwoTowerModel",
    "find_retrieval_model",
    "load_item_catalog",
]
