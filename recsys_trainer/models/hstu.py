"""HSTU (hierarchical sequential transduction units; Zhai et al., "Actions Speak Louder than
Words", ICML 2024) for sequential retrieval (``HSTURetrievalModel``) and for ranking
(``HSTURankingModel``). The layer and its stack are ``models.hstu_layer``'s.

**Histories are jagged** (``models.jagged``): each batch is run bucket by bucket of rows of
similar length, so a step costs what its events cost, not rows x its longest row. The longest
history a model takes is its ``max_len``: longer rows are an error naming the fix (give the
``SequenceFeature`` ``max_len``, which keeps the most recent events); nothing is truncated
silently.

**Event times** are ``SequenceFeature``s of integers that no table reads (``num_embeddings=
ID_SPACE``: the raw values pass unchecked and unhashed): ``time_feature`` holds one time per
history item (aligned with the history, oldest first) and ``query_time_feature`` one per row,
the time of the event to predict (the target's time in training, the request's when serving).
Without them (``time_feature=None``) the bias is by position only. The serving program reads
them as integers (``serving_value_features``), so a served query sees the same times as in
training.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.models.blocks import TaskHeads, check_task_weights, check_tasks, make_tables
from recsys_trainer.models.checks import check_sequence_lengths, check_value_feature
from recsys_trainer.models.hstu_layer import HSTUEncoder
from recsys_trainer.models.jagged import BucketPolicy
from recsys_trainer.models.losses import (
    BinaryClassifier,
    multi_task_bce_with_logits,
    weighted_bce_with_logits,
)
from recsys_trainer.models.retrieval_base import (
    RetrievalBase,
    RetrievalOptions,
    takes_retrieval_options,
)
from recsys_trainer.retrieval.checks import (
    check_history_lengths,
    check_one_id_per_row,
    check_sequence_keys,
)
from recsys_trainer.retrieval.kjt import table_input

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions comes with torch
    from typing_extensions import Unpack

# ``torch.fx.wrap`` patches a function in the globals of the module that calls it: every leaf
# this module calls by name is registered here too, so that it stays one node of the traced graph.
for _leaf in ("check_one_id_per_row", "check_history_lengths", "check_sequence_keys",
              "check_sequence_lengths", "check_value_feature", "table_input"):
    torch.fx.wrap(_leaf)


def assert_served_times(lengths: dict[str, torch.Tensor], history: str, times: str,
                        query_time: str) -> None:
    """In the serving program: the times must be as training refuses otherwise (one per
    history item, one query time per row). Asserts kept in the exported program; the Scorer
    names the column and row of a query time missing from a row."""
    torch._assert_async((lengths[query_time] == 1).all(),
                        f"HSTU: the query time feature {query_time!r} must have exactly one id "
                        "per row (a null in its column gives none)")
    torch._assert_async((lengths[times] == lengths[history]).all(),
                        f"HSTU: {times!r} must hold one time per {history!r} item")


# ----------------------------------------------------------------------------- token layouts


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def _positions(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, position in its row)`` of every token of rows of ``counts`` tokens."""
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    pos = torch.arange(row.numel(), device=counts.device) - _offsets(counts)[row]
    return row, pos


def _gather(parts: Sequence[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    return torch.cat(list(parts))[index]


# ----------------------------------------------------------------------------- retrieval


class HSTURetrievalModel(RetrievalBase):
    """HSTU for sequential retrieval (next item), as ``SASRecModel`` with HSTU layers.

    A row's tokens are ``[BOS, h_1, ..., h_n]`` (the history, oldest first, embedded by the
    item table); the output at position ``p`` is the query for the item that followed ``h_p``:
    ``h_{p+1}``, and the row's target (``item_feature``) after the last. Every position is a
    training query, or the last ``train_positions`` of each row; in evaluation and serving the
    query is the output after the last history item. Losses, negatives and metrics are the
    retrieval models' (``models.retrieval_base``): ``"in_batch"`` with uniform negatives and
    the logQ correction, ``"sampled"``, ``"full"``.

    Times (module docstring): ``tau`` of ``BOS`` is the time of what it predicts, of ``h_p``
    its event time; ``theta`` of position ``p`` is the time of ``h_{p+1}`` (the query time
    after the last). ``user_features``: a projection of the pooled user embeddings is added to
    every position's output, as in ``SASRecModel``.

    The ``FeatureSpec`` that feeds it: ``sparse=[SparseFeature(name=f) for f in
    user_features]``, ``sequence=[SequenceFeature(name=item_feature, num_embeddings=
    num_items), SequenceFeature(name=history_feature, num_embeddings=num_items,
    max_len=max_len), SequenceFeature(name=time_feature, num_embeddings=ID_SPACE,
    max_len=max_len), SequenceFeature(name=query_time_feature, num_embeddings=ID_SPACE)]``
    (``sequence_keys``' order; the time features last).

    Args (besides the loss options, ``RetrievalOptions``, as ``SASRecModel``'s):
        time_feature, query_time_feature: the event times' keys (None: no time bias).
        num_layers, num_heads: HSTU layers and heads per layer.
        attention_dim, linear_dim: per head, the width of ``Q``/``K`` and of ``U``/``V``
            (default ``embedding_dim // num_heads``).
        dropout: on each layer's gated output.
        train_positions, eval_positions, num_uniform_negatives: as ``SASRecModel``'s.
        bucket_policy: ``"length"`` (the jagged step) or ``"padded"`` (every row at the
            batch's longest: the baseline of ``benchmarks/bench_hstu.py``).
    """

    @takes_retrieval_options
    def __init__(
        self,
        *,
        num_items: int,
        history_feature: str = "hist_item",
        time_feature: str | None = "hist_ts",
        query_time_feature: str | None = "ts",
        user_features: Sequence[str] = (),
        num_layers: int = 2,
        num_heads: int = 1,
        attention_dim: int | None = None,
        linear_dim: int | None = None,
        dropout: float = 0.1,
        train_positions: int | None = None,
        eval_positions: int | None = None,
        num_uniform_negatives: int | None = None,
        bucket_policy: BucketPolicy = "length",
        **options: Unpack[RetrievalOptions],
    ) -> None:
        if (time_feature is None) != (query_time_feature is None):
            raise ValueError("give both `time_feature` (the history's times) and "
                             "`query_time_feature` (the time of the event to predict), or neither "
                             f"(no time bias); they are {time_feature!r} and {query_time_feature!r}.")
        if num_uniform_negatives is None:
            num_uniform_negatives = 0 if options.get("loss") == "full" else 256
        values = [] if time_feature is None or query_time_feature is None else [time_feature,
                                                                                 query_time_feature]
        super().__init__(num_items=num_items, history_feature=history_feature,
                         user_features=user_features, side_tables={}, history_side_features={},
                         num_uniform_negatives=num_uniform_negatives, value_features=values,
                         **options)
        for name, value in (("train_positions", train_positions), ("eval_positions", eval_positions)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be an int >= 1 or None, but is {value!r}.")
        if bucket_policy not in ("length", "padded"):
            raise ValueError(f"`bucket_policy` must be 'length' or 'padded', but is {bucket_policy!r}.")
        self.time_feature, self.query_time_feature = time_feature, query_time_feature
        self.train_positions = train_positions
        self.eval_positions = train_positions if eval_positions is None else eval_positions
        self.bucket_policy: BucketPolicy = bucket_policy
        d = self.embedding_dim
        self.bos = nn.Parameter(torch.zeros(d).normal_(0, 0.02))
        self.encoder = HSTUEncoder(d, num_layers=num_layers, num_heads=num_heads,
                                   attention_dim=attention_dim, linear_dim=linear_dim,
                                   max_tokens=self.max_len + 1, time_bias=bool(values),
                                   dropout=dropout)
        self.user_projection = (nn.Linear(d * len(self.user_features), d)
                                if self.user_features else None)

    def _item_vectors(self, seq: dict[str, JaggedTensor], rows: slice) -> torch.Tensor:
        return self._out(seq[self.item_feature].values()[rows])

    def _times(self, batch: Batch, lengths: torch.Tensor, counts: torch.Tensor,
               row: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every token's ``tau`` and ``theta`` (the class docstring), flat like the tokens."""
        if self.time_feature is None or self.query_time_feature is None:
            return None, None
        assert batch.sequence is not None
        times, query = batch.sequence[self.time_feature], batch.sequence[self.query_time_feature]
        model = type(self).__name__
        check_value_feature(times.lengths(), lengths, self.time_feature,
                            "one time per history item", model=model)
        check_value_feature(query.lengths(), torch.ones_like(lengths), self.query_time_feature,
                            "one query time per row", model=model)
        n = times.values().numel()
        hist_at = _offsets(lengths)[row] + pos  # the history index of h_{pos+1}
        # theta: h_{p+1}'s time, the query time after the last item.
        theta_at = torch.where(pos < lengths[row], hist_at, n + row)
        # tau: BOS takes theta's (what it predicts), h_p its own time. Indexed into the same
        # two parts as theta: a batch of empty histories has no history time to index.
        tau_at = torch.where(pos == 0, theta_at, hist_at - 1)
        both = torch.cat([times.values(), query.values()])
        return both[tau_at], both[theta_at]

    def _step(self, batch: Batch, seq_out: Any, pooled: Any,
              neg_ids: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert batch.sequence is not None and self.history_feature is not None
        b = batch.labels.shape[0]
        seq = self._by_key(seq_out)
        check_one_id_per_row(seq[self.item_feature].lengths()[:b], self.item_feature)
        target_ids = batch.sequence[self.item_feature].values()
        hist_jt = seq[self.history_feature]
        lengths = hist_jt.lengths()[:b]
        check_history_lengths(lengths, self.max_len, self.history_feature)
        hist = hist_jt.values()  # the negatives' extra row has no history: the batch's only
        counts = lengths + 1
        row, pos = _positions(counts)
        n = hist.shape[0]
        hist_at = _offsets(lengths)[row] + pos
        tokens = _gather([hist, self.bos.unsqueeze(0)], torch.where(pos == 0, n, hist_at - 1))
        tau, theta = self._times(batch, lengths, counts, row, pos)
        out = self.encoder.run(tokens, counts, tau, theta, self.bucket_policy)
        user = self._pooled_user(pooled)
        if self.user_projection is not None and user is not None:
            out = out + self.user_projection(user)[row]
        last = _offsets(counts)[1:] - 1  # the token after the last history item
        query = self._out(out[last])
        target_emb = self._item_vectors(seq, slice(0, b))
        negatives = self._item_vectors(seq, slice(b, None)) if neg_ids is not None else None
        # Position p predicts h_{p+1} (p < n), the target after the last item.
        is_target = pos == lengths[row]
        scored = self.train_positions if self.training else self.eval_positions
        valid = torch.ones_like(is_target) if scored is None else pos >= lengths[row] + 1 - scored
        hist_ids = batch.sequence[self.history_feature].values()
        next_at = torch.where(is_target, n + row, hist_at)
        positives = _gather([self._out(hist), target_emb], next_at)
        positive_ids = _gather([hist_ids, target_ids], next_at)
        weights = batch.weights
        loss = self._sequence_loss(
            self._out(out[valid]), positives[valid], positive_ids[valid],
            None if weights is None else weights[row[valid]],
            target_emb, target_ids, weights, negatives, neg_ids)
        outputs = {"query": query.detach(), "target": target_ids, "history_lengths": lengths,
                   "history_ids": hist_ids}
        return loss, outputs

    def serving_sequence_lengths(self) -> dict[str, int]:
        """The serving contract (``recsys_trainer.serving``): the history's padded length, and
        the times' (read as values: ``serving_value_features``)."""
        assert self.history_feature is not None
        out = {self.history_feature: self.max_len}
        if self.time_feature is not None and self.query_time_feature is not None:
            out.update({self.time_feature: self.max_len, self.query_time_feature: 1})
        return out

    def serving_value_features(self) -> set[str]:
        """The event times: the program reads their integers, not embeddings."""
        return {f for f in (self.time_feature, self.query_time_feature) if f is not None}

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        """The serving contract: the query embedding ``[B, D]`` after the last history item,
        computed as in training (each row at its own bucket's length); export it with
        ``activation="none"``."""
        assert self.history_feature is not None
        hist, lens = sequences[self.history_feature], lengths[self.history_feature]
        b = hist.shape[0]
        x = torch.cat([self.bos.view(1, 1, -1).expand(b, 1, -1), hist], dim=1)
        tau = theta = None
        if self.time_feature is not None and self.query_time_feature is not None:
            assert_served_times(lengths, self.history_feature, self.time_feature,
                                self.query_time_feature)
            times = sequences[self.time_feature]
            at = lens.long().view(-1, 1)
            theta = torch.cat([times, times.new_zeros(b, 1)], dim=1).scatter(
                1, at, sequences[self.query_time_feature][:, :1])
            tau = torch.cat([theta[:, :1], times], dim=1)
        out = self.encoder.run_padded(x, lens + 1, tau, theta, lens.long())
        user = self._serving_user(pooled)
        if self.user_projection is not None and user is not None:
            out = out + self.user_projection(user)
        return self._out(out)


# ----------------------------------------------------------------------------- ranking


def hstu_ranking_step(model: Any, batch: Batch, seq: Any, pooled: Any) -> torch.Tensor:
    """Everything of ``HSTURankingModel``'s forward after its table lookups: the logits. One
    ``torch.fx`` leaf (buckets and checks depend on data)."""
    return model._step(batch, seq, pooled)  # type: ignore[no-any-return]


torch.fx.wrap("hstu_ranking_step")


class HSTURankingModel(BinaryClassifier):
    """HSTU for ranking, target-aware: the candidate item follows the user's history.

    A row's tokens are ``[h_1, ..., h_n, c]`` (the history, oldest first, then the candidate
    ``item_feature``, one table ``t_<item_feature>`` for both). The causal HSTU layers let the
    candidate attend to the whole history and itself (and each history item to its past); the
    candidate's output, with the dense arch's output and the pooled ``sparse_features`` (user
    and context features; optional), feeds one tower per task (``TaskHeads``). Output: logits
    ``[B]`` for one task, ``[B, T]`` for several (``tasks``: the ``FeatureSpec``'s labels, in
    order); loss: the weighted BCE, per task summed with ``task_weights``.

    Times as in the module docstring: ``tau`` of ``h_p`` its event time, of ``c`` the query
    time; ``theta`` of each position the time of the next token (the candidate's for the
    last history item and itself).

    The ``FeatureSpec`` that feeds it: ``sparse=[SparseFeature(...) per sparse_features]``,
    ``dense`` (``num_dense`` columns), ``sequence=[SequenceFeature(name=item_feature,
    num_embeddings=num_items), SequenceFeature(name=history_feature, num_embeddings=num_items,
    max_len=max_len), SequenceFeature(name=time_feature, num_embeddings=ID_SPACE,
    max_len=max_len), SequenceFeature(name=query_time_feature, num_embeddings=ID_SPACE)]``
    (the time features last).
    """

    def __init__(
        self,
        sparse_features: Sequence[str] = (),
        num_dense: int = 0,
        tasks: Sequence[str] = ("label",),
        *,
        num_items: int,
        item_feature: str = "item",
        history_feature: str = "hist_item",
        time_feature: str | None = "hist_ts",
        query_time_feature: str | None = "ts",
        max_len: int = 50,
        num_embeddings: int | list[int] = 10_000,
        embedding_dim: int = 16,
        num_layers: int = 2,
        num_heads: int = 1,
        attention_dim: int | None = None,
        linear_dim: int | None = None,
        dropout: float = 0.1,
        dense_arch: tuple[int, ...] = (64,),
        tower_arch: tuple[int, ...] = (32,),
        task_weights: Sequence[float] | None = None,
        prior_rates: Sequence[float] | None = None,
        item_init_max: float | None = 0.5,
        dense_log1p: bool = False,
        table_device: str = "meta",
        bucket_policy: BucketPolicy = "length",
    ) -> None:
        super().__init__()
        if not isinstance(max_len, int) or max_len < 1 or not isinstance(num_items, int) or num_items < 1:
            raise ValueError(f"`max_len` and `num_items` must be ints >= 1, but are {max_len!r} and "
                             f"{num_items!r}.")
        if (time_feature is None) != (query_time_feature is None):
            raise ValueError("give both `time_feature` and `query_time_feature`, or neither; they "
                             f"are {time_feature!r} and {query_time_feature!r}.")
        if bucket_policy not in ("length", "padded"):
            raise ValueError(f"`bucket_policy` must be 'length' or 'padded', but is {bucket_policy!r}.")
        self.tasks = check_tasks(tasks)
        self.task_weights = check_task_weights(task_weights, self.tasks)
        self.item_feature, self.history_feature, self.max_len = item_feature, history_feature, max_len
        self.time_feature, self.query_time_feature = time_feature, query_time_feature
        self.sparse_features, self.num_dense = list(sparse_features), num_dense
        self.dense_log1p, self.bucket_policy = dense_log1p, bucket_policy
        self.table_keys = [item_feature, history_feature]
        self.value_keys = [] if time_feature is None or query_time_feature is None else [
            time_feature, query_time_feature]
        names = [*self.table_keys, *self.value_keys, *self.sparse_features]
        if len(set(names)) != len(names):
            raise ValueError(f"feature names must be distinct, but are {names}.")
        device = torch.device(table_device)
        init = {} if item_init_max is None else {"weight_init_min": -item_init_max,
                                                 "weight_init_max": item_init_max}
        self.items = EmbeddingCollection(tables=[EmbeddingConfig(
            name=f"t_{item_feature}", embedding_dim=embedding_dim, num_embeddings=num_items,
            feature_names=self.table_keys, **init)], device=device)
        self.pooled = (EmbeddingBagCollection(
            tables=make_tables(self.sparse_features, num_embeddings, embedding_dim), device=device)
            if self.sparse_features else None)
        if dense_arch and num_dense > 0:
            self.dense_arch: nn.Module | None = DenseArch(num_dense, list(dense_arch))
            dense_width = dense_arch[-1]
        else:
            self.dense_arch, dense_width = None, num_dense
        self.encoder = HSTUEncoder(embedding_dim, num_layers=num_layers, num_heads=num_heads,
                                   attention_dim=attention_dim, linear_dim=linear_dim,
                                   max_tokens=max_len + 1, time_bias=bool(self.value_keys),
                                   dropout=dropout)
        width = embedding_dim * (1 + len(self.sparse_features)) + dense_width
        self.heads = TaskHeads(width, self.tasks, tower_arch, prior_rates)

    @property
    def sequence_keys(self) -> list[str]:
        """The keys of ``batch.sequence`` the model reads, in this order."""
        return [*self.table_keys, *self.value_keys]

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        # The keys checked before the lookup: a missing or misplaced key (a time feature) would
        # otherwise be a bare KeyError inside torchrec.
        check_sequence_keys(batch.sequence, self.sequence_keys, type(self).__name__)
        assert batch.sequence is not None
        seq = self.items(table_input(batch.sequence, len(self.table_keys)))
        pooled = self.pooled(batch.sparse) if self.pooled is not None else None
        logits = hstu_ranking_step(self, batch, seq, pooled)
        if len(self.tasks) == 1:  # (a static test: TorchRec's pipelines trace this forward)
            loss = weighted_bce_with_logits(logits, batch.labels, batch.weights)
        else:
            loss = multi_task_bce_with_logits(logits, batch.labels, batch.weights, self.task_weights)
        return loss, logits.detach()

    def _context(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> list[torch.Tensor]:
        dense = torch.log1p(dense.clamp_min(0)) if self.dense_log1p else dense
        out = [self.dense_arch(dense)] if self.dense_arch is not None else (
            [dense] if self.num_dense else [])
        return [*out, *pooled]

    def _head(self, candidate: torch.Tensor, context: list[torch.Tensor]) -> torch.Tensor:
        logits = self.heads(torch.cat([candidate, *context], dim=1))
        return logits.squeeze(1) if len(self.tasks) == 1 else logits

    def _step(self, batch: Batch, seq_out: Any, pooled: Any) -> torch.Tensor:
        assert batch.sequence is not None
        cand_jt, hist_jt = seq_out[self.item_feature], seq_out[self.history_feature]
        lengths = hist_jt.lengths()
        model = type(self).__name__
        check_sequence_lengths(cand_jt.lengths(), lengths, self.max_len, self.item_feature,
                               self.history_feature, model=model)
        counts = lengths + 1
        row, pos = _positions(counts)
        hist, cand = hist_jt.values(), cand_jt.values()
        n = hist.shape[0]
        hist_at = _offsets(lengths)[row] + pos
        is_cand = pos == lengths[row]
        tokens = _gather([hist, cand], torch.where(is_cand, n + row, hist_at))
        tau = theta = None
        if self.time_feature is not None and self.query_time_feature is not None:
            times, query = batch.sequence[self.time_feature], batch.sequence[self.query_time_feature]
            check_value_feature(times.lengths(), lengths, self.time_feature,
                                "one time per history item", model=model)
            check_value_feature(query.lengths(), torch.ones_like(lengths), self.query_time_feature,
                                "one query time per row", model=model)
            t = times.values()
            tau = _gather([t, query.values()], torch.where(is_cand, n + row, hist_at))
            # theta: the next token's time; the candidate's for the last item and itself.
            theta = _gather([t, query.values()],
                            torch.where(pos + 1 < lengths[row], hist_at + 1, n + row))
        out = self.encoder.run(tokens, counts, tau, theta, self.bucket_policy)
        candidate = out[_offsets(counts)[1:] - 1]
        ctx = self._context(batch.dense, [] if pooled is None else [self._pooled_by_name(pooled)])
        return self._head(candidate, ctx)

    def _pooled_by_name(self, pooled: Any) -> torch.Tensor:
        """The pooled features in ``sparse_features`` order (a sharded collection groups them
        by sharding type and rank)."""
        if list(pooled.keys()) == self.sparse_features:
            return pooled.values()  # type: ignore[no-any-return]
        by_name = pooled.to_dict()
        return torch.cat([by_name[f] for f in self.sparse_features], dim=1)

    def serving_sequence_lengths(self) -> dict[str, int]:
        """The serving contract: the candidate (1), the history and its times' padded lengths."""
        out = {self.item_feature: 1, self.history_feature: self.max_len}
        if self.time_feature is not None and self.query_time_feature is not None:
            out.update({self.time_feature: self.max_len, self.query_time_feature: 1})
        return out

    def serving_value_features(self) -> set[str]:
        """The event times: the program reads their integers, not embeddings."""
        return set(self.value_keys)

    def serving_logits(self, dense: torch.Tensor, pooled: dict[str, torch.Tensor],
                       sequences: dict[str, torch.Tensor], lengths: dict[str, torch.Tensor]) -> torch.Tensor:
        """The logits of ``forward`` from looked-up embeddings: the serving contract
        (``recsys_trainer.serving.exporting.export``). Rows without exactly one candidate id
        fail as in training (an assert kept in the exported program)."""
        torch._assert_async((lengths[self.item_feature] == 1).all(),
                            f"HSTU: the candidate feature {self.item_feature!r} must have exactly "
                            "one id per row (a null in its column gives none)")
        hist, lens = sequences[self.history_feature], lengths[self.history_feature]
        b, d = hist.shape[0], hist.shape[2]
        at = lens.long().view(-1, 1)
        x = torch.cat([hist, hist.new_zeros(b, 1, d)], dim=1).scatter(
            1, at.unsqueeze(-1).expand(-1, 1, d), sequences[self.item_feature][:, :1])
        tau = theta = None
        if self.time_feature is not None and self.query_time_feature is not None:
            assert_served_times(lengths, self.history_feature, self.time_feature,
                                self.query_time_feature)
            times, query = sequences[self.time_feature], sequences[self.query_time_feature][:, :1]
            tau = torch.cat([times, times.new_zeros(b, 1)], dim=1).scatter(1, at, query)
            theta = torch.cat([tau[:, 1:], tau.new_zeros(b, 1)], dim=1).scatter(1, at, query)
        candidate = self.encoder.run_padded(x, lens + 1, tau, theta, lens.long())
        ctx = self._context(dense, [torch.cat([pooled[f] for f in self.sparse_features], dim=1)]
                            if self.sparse_features else [])
        return self._head(candidate, ctx)


__all__ = ["HSTURankingModel", "HSTURetrievalModel", "assert_served_times", "hstu_ranking_step"]
