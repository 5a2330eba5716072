"""What the retrieval models (``models.two_tower``, ``models.sasrec``, ``models.hstu``) share:
``RetrievalBase`` (the item and side tables, the user tables, the uniform negatives, the
in-batch candidates, the loss and the item embeddings of the corpus), their keyword options and
``retrieval_step``, the ``torch.fx`` leaf that runs everything of a forward after its table
lookups. The losses, candidates, checks and lookups' KJTs they call are the retrieval package's
(``recsys_trainer.retrieval``).

The retrieval models (``TwoTowerModel``, ``SASRecModel``, ``HSTURetrievalModel``) follow the
model contract (docs/models.md): ``forward(batch)`` returns ``(loss, outputs)`` with a
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

``torch.fx.wrap`` patches a function in the globals of the module that calls it, so the leaves
this module calls by name (checks, KJT builders, candidates) are registered here as well as
where they are defined.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.models.blocks import make_tables
from recsys_trainer.retrieval import collectives
from recsys_trainer.retrieval.candidates import (
    candidate_log_q,
    count_items,
    gather_candidates,
    start_candidates,
)
from recsys_trainer.retrieval.catalog import load_item_catalog
from recsys_trainer.retrieval.checks import check_history_lengths, check_sequence_keys
from recsys_trainer.retrieval.frequency import ItemFrequencyEstimator
from recsys_trainer.retrieval.kjt import items_only_input, table_input, with_extra_row
from recsys_trainer.retrieval.losses import (
    check_temperature,
    in_batch_softmax_loss,
    sampled_softmax_loss,
)

LossKind = Literal["in_batch", "sampled", "full"]


def _fixed_draw(num_items: int, count: int) -> torch.Tensor:
    """``count`` ids in ``[0, num_items)`` from a generator seeded 0, on the host: the same ids
    on every device (a device generator would draw others per device type)."""
    return torch.randint(0, num_items, (count,), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- fx leaves


def retrieval_step(model: Any, batch: Batch, seq: Any, pooled: Any,
                   neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Everything of a retrieval model's forward after its table lookups: towers, loss and
    outputs (``model._step``). One ``torch.fx`` leaf: the loss's collectives, frequency updates
    and masks depend on data."""
    return model._step(batch, seq, pooled, neg_ids)  # type: ignore[no-any-return]


for _leaf in ("retrieval_step", "check_history_lengths", "check_sequence_keys", "with_extra_row",
              "items_only_input", "table_input", "start_candidates", "gather_candidates", "count_items",
              "candidate_log_q"):
    torch.fx.wrap(_leaf)


# ----------------------------------------------------------------------------- shared parts


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


class RetrievalOptions(TypedDict, total=False):
    """The keywords both retrieval models take as they are and hand on to ``RetrievalBase``
    unchanged: a model's ``__init__`` takes them as ``**options: Unpack[RetrievalOptions]``, so
    that each is written once here for type checkers (its default, and its check, are
    ``RetrievalBase.__init__``'s; ``takes_retrieval_options`` lists them in the models'
    runtime signatures). What they mean: ``TwoTowerModel``'s docstring and the module's."""

    user_num_embeddings: int | Sequence[int]
    item_feature: str
    item_catalog: str | os.PathLike[str] | Mapping[str, Any] | None
    item_id_column: str
    max_len: int
    embedding_dim: int
    normalize: bool
    temperature: float
    loss: LossKind
    log_q_correction: bool
    cross_rank_negatives: bool
    frequency_buckets: int | None
    frequency_hashes: int
    frequency_half_life_steps: float | None
    item_init_max: float | None
    table_device: str


class RetrievalBase(nn.Module):
    """What the retrieval models share: the item (and side) tables, the user tables, the
    negatives, the loss and the item embeddings of the corpus. ``value_features``: keys of
    ``batch.sequence`` after the tables' that carry values no table reads (event times). The
    keywords after ``value_features`` are ``RetrievalOptions``, with their defaults."""

    def __init__(self, *, num_items: int, history_feature: str | None, user_features: Sequence[str],
                 side_tables: Mapping[str, int], history_side_features: Mapping[str, str],
                 num_uniform_negatives: int, value_features: Sequence[str] = (),
                 user_num_embeddings: int | Sequence[int] = 10_000, item_feature: str = "item",
                 item_catalog: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                 item_id_column: str = "item_id", max_len: int = 50, embedding_dim: int = 32,
                 normalize: bool = True, temperature: float = 0.05, loss: LossKind = "in_batch",
                 log_q_correction: bool = True, cross_rank_negatives: bool = False,
                 frequency_buckets: int | None = None, frequency_hashes: int = 1,
                 frequency_half_life_steps: float | None = 1000.0,
                 item_init_max: float | None = None, table_device: str = "meta") -> None:
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
        values = list(value_features)
        if len(set(names + values)) != len(names) + len(values):
            raise ValueError(f"feature names must be distinct, but are {item_features}, "
                             f"{sorted(side_tables)}, {hist_side} and {values}.")
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
        self.table_keys = names
        """The keys of ``batch.sequence`` the tables read, in this order."""
        self.sequence_keys = names + values
        """The keys of ``batch.sequence`` the model reads, in this order: the tables', then the
        value features."""
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
        self.embedding_dim = embedding_dim
        """The width of every table (the models' towers and transformer are built from it)."""

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
        check_sequence_keys(batch.sequence, self.sequence_keys, type(self).__name__)
        neg_ids = self._uniform_negatives(batch.labels.device)
        kjt = table_input(batch.sequence, len(self.table_keys))
        if neg_ids is not None:
            kjt = with_extra_row(kjt, self._item_features(neg_ids))
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
        seq = self.items(items_only_input(self.table_keys, self._item_features(ids)))
        return self._item_vectors(self._by_key(seq), slice(None))

    def _by_key(self, out: Any) -> dict[str, JaggedTensor]:
        # Index by key (a sharded collection's output is a lazy dict: no `in`, no iteration).
        return {k: out[k] for k in self.table_keys}

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

_Init = TypeVar("_Init", bound=Callable[..., None])


def takes_retrieval_options(init: _Init) -> _Init:
    """Decorate a retrieval model's ``__init__`` (its own parameters, then ``**options:
    Unpack[RetrievalOptions]``) so that at run time it reads as if it listed every option:

    * its signature names each with ``RetrievalBase.__init__``'s default and annotation instead
      of ``**options``: what ``inspect.signature``, ``help()`` and the config loader (which
      checks a ``model:`` section's keys against it, and lists the allowed ones) see;
    * a keyword it does not take is refused as Python refuses it, naming the model's
      ``__init__`` (not ``RetrievalBase``'s, where ``**options`` would otherwise land).

    Type checkers read ``Unpack[RetrievalOptions]``."""
    base = inspect.signature(RetrievalBase.__init__).parameters
    unknown = [name for name in RetrievalOptions.__annotations__ if name not in base]
    if unknown:
        raise TypeError(f"RetrievalOptions names {unknown}, which RetrievalBase.__init__ does not take.")
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    signature = inspect.Signature(own + [base[name] for name in RetrievalOptions.__annotations__])
    accepted = {p.name for p in signature.parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @functools.wraps(init)
    def checked(*args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in accepted:
                raise TypeError(f"{init.__qualname__}() got an unexpected keyword argument {name!r}")
        init(*args, **kwargs)

    checked.__signature__ = signature  # type: ignore[attr-defined]
    return cast(_Init, checked)


__all__ = ["LossKind", "RetrievalBase", "RetrievalOptions", "retrieval_step",
           "takes_retrieval_options", "user_tables"]
