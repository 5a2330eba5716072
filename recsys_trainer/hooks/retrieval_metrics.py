"""``RetrievalMetricHook``: full-corpus Recall@K, NDCG@K and HitRate@K of a retrieval model,
exact across ranks (``recsys_trainer.retrieval.metrics`` has the math and the sharded top-K).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from recsys_trainer.hooks.base import Hook, MetricReport, StepOutput, TrainerView
from recsys_trainer.retrieval.metrics import (
    METRICS,
    Jagged,
    check_k_fits_corpus,
    full_corpus_metrics,
    seen_exclusions,
)
from recsys_trainer.retrieval.protocol import find_retrieval_model

if TYPE_CHECKING:
    from recsys_trainer.batch import Batch

logger = logging.getLogger("recsys_trainer")

Exclude = Literal["none", "history", "seen"]
EXCLUDE: tuple[str, ...] = ("none", "history", "seen")


class RetrievalMetricHook(Hook):
    """Recall@K, NDCG@K and HitRate@K of every evaluation, over the whole item corpus.

    During evaluation it keeps, for every real row (weight > 0; padding batches are skipped),
    the model's query embedding and target item (``outputs["query"]``, ``outputs["target"]``)
    and, with ``exclude_history``, the row's history (``outputs["history_lengths"]``,
    ``outputs["history_ids"]``). After the evaluation the corpus (item ids ``[0,
    model.num_items)``) is embedded once by the model's item tower, sharded over the ranks, and
    every query is scored against all of it (``retrieval.metrics.full_corpus_metrics``).

    Queries:

    * by default every eval row is a query with one target, the item that followed
      (next-item evaluation; recall and hit rate coincide);
    * with ``user_fn`` (``Batch -> int64 [B]`` user ids) and ``time_fn`` (``Batch -> [B]`` an
      order, e.g. a timestamp), the rows of one user are one query: the embedding and history
      of the user's earliest row, and the set of all the user's target items in the evaluation
      (the items of the eval period, predicted from the state before it).

    What a query may not return (``exclude``):

    * ``"none"`` (the default): nothing; the full-corpus ranking as it is;
    * ``"history"`` (``exclude_history=True``): the row's history as the model saw it (the
      last ``max_len`` items);
    * ``"seen"``, the *filtered* full-corpus protocol of most papers: every item the user
      interacted with before the query, among the rows this hook saw (training rows since the
      process started, then the evaluation's rows) and their histories
      (``retrieval.metrics.seen_exclusions``); needs ``user_fn`` and ``time_fn``. With
      ``exclude_same_time`` also the user's other items of the query's own time (the rest of a
      basket). ``per_user=False`` keeps one query per row with these exclusions.

    The values (``recall@10``, ``ndcg@10``, ``hitrate@10``, ... and ``num_queries``) are added
    to ``evaluate()``'s metrics (with ``prefix``) and sent to every hook's ``on_metrics`` as a
    ``MetricReport("eval", "eval", ...)`` (so ``JsonlMetricsHook`` and ``TensorBoardHook``
    record them and ``EarlyStoppingHook`` can watch ``recall@50``).

    Args:
        k: cut-offs (each >= 1).
        exclude_history: ``exclude="history"`` (kept for existing callers).
        exclude: ``"none"``, ``"history"`` or ``"seen"`` (above); None: from ``exclude_history``.
        exclude_same_time: with ``exclude="seen"``, also the user's other items at the query's time.
        per_user: with ``user_fn``, one query per user (True) or per row (False).
        metrics: which of ``recall``, ``ndcg``, ``hitrate`` to report.
        query_chunk_size / corpus_chunk_size: queries scored per step (bounds memory together
            with ``retrieval.metrics.sharded_top_k``'s block size) and corpus items per
            item-tower call.

    Cost per evaluation: the item tower over the corpus (split over the ranks) and
    ``num_queries x num_items`` dot products (split over the ranks); see docs/retrieval.md.
    With ``exclude`` other than ``"seen"`` training steps cost nothing (the hook does not
    handle ``after_step``). ``exclude="seen"`` copies each training row's user, time, target
    and history to the host every step (device-to-host copies, no other device work) and keeps
    a compact seen-record: one entry per distinct (user, item) with the earliest time it was
    an interaction and the earliest time it was in a row's history (``_merge_seen``), so it
    grows with the distinct pairs, not with the stream. Evaluation gathers that record (not raw
    rows) to every rank. It is the hook's checkpoint state (per rank), so a resumed run keeps
    it; a resume from a checkpoint without it logs a warning at the first evaluation.
    """

    def __init__(
        self,
        k: Sequence[int] = (10, 50, 100),
        *,
        exclude_history: bool = False,
        user_fn: Callable[[Batch], torch.Tensor] | None = None,
        time_fn: Callable[[Batch], torch.Tensor] | None = None,
        exclude: Exclude | None = None,
        exclude_same_time: bool = False,
        per_user: bool = True,
        metrics: Sequence[str] = METRICS,
        prefix: str = "",
        log: bool = True,
        query_chunk_size: int = 1024,
        corpus_chunk_size: int = 65_536,
    ) -> None:
        ks = [k] if isinstance(k, int) else list(k)
        if not ks or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in ks):
            raise ValueError(f"`k` must be a list of ints >= 1, but is {k!r}.")
        unknown = sorted(set(metrics) - set(METRICS))
        if unknown or not metrics:
            raise ValueError(f"unknown metrics {unknown or list(metrics)}; choose from {', '.join(METRICS)}.")
        if (user_fn is None) != (time_fn is None):
            raise ValueError("`user_fn` and `time_fn` go together: a user's query is its earliest "
                             "row, by time_fn.")
        if exclude is None:
            exclude = "history" if exclude_history else "none"
        elif exclude not in EXCLUDE or (exclude_history and exclude != "history"):
            raise ValueError(f"`exclude` must be one of {', '.join(EXCLUDE)} (and 'history' with "
                             f"exclude_history=True), but is {exclude!r}.")
        if exclude == "seen" and user_fn is None:
            raise ValueError("exclude='seen' removes each user's earlier interactions: give "
                             "`user_fn` and `time_fn` (per_user=False for one query per row).")
        if exclude_same_time and exclude != "seen":
            raise ValueError("`exclude_same_time` refines exclude='seen'; give exclude='seen'.")
        for name, v in (("query_chunk_size", query_chunk_size), ("corpus_chunk_size", corpus_chunk_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be an int >= 1, but is {v!r}.")
        self.ks = sorted(set(ks))
        self.exclude: Exclude = exclude
        self.exclude_history = exclude != "none"
        """Whether the rows' histories are kept (both exclusions read them)."""
        self.exclude_same_time, self.per_user = exclude_same_time, per_user
        self._seen_record: dict[str, np.ndarray] = _merge_seen([])
        """``exclude="seen"``: this rank's compact seen-record (``_merge_seen``'s form)."""
        self._seen_pending: list[dict[str, np.ndarray]] = []
        """Training steps' events not yet merged into ``_seen_record`` (merged in batches:
        merging every step would re-sort the whole record each step)."""
        self._seen_pending_rows = 0
        self._seen_from_step: int | None = None
        """The global step before the first training step this process recorded: above 0
        without a restored record, the record misses the steps before it (the warning)."""
        self._seen_restored = False
        self._seen_warned = False
        self._user_fn, self._time_fn = user_fn, time_fn
        self._metrics = tuple(metrics)
        self._prefix, self._log = prefix, log
        self._query_chunk, self._corpus_chunk = query_chunk_size, corpus_chunk_size
        self.reports: list[MetricReport] = []
        self._rows: list[dict[str, Any]] = []

    def handled_events(self) -> set[str] | None:
        # Training steps matter only to the filtered protocol: no per-step call otherwise.
        events = {"before_evaluate", "after_eval_step", "after_evaluate"}
        return events | {"after_step"} if self.exclude == "seen" else events

    def after_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if self.exclude != "seen":
            return
        if self._seen_from_step is None:
            self._seen_from_step = output.step - 1
        for mb in output.micro_batches:
            ev = self._take(mb.batch, mb.outputs, train=True)["seen"]
            self._seen_pending.append(ev)
            self._seen_pending_rows += len(ev["user"])
        # Merge once the pending events outgrow the record (and a floor): amortised linear
        # work, and memory at most about twice the record plus the floor.
        if self._seen_pending_rows > max(len(self._seen_record["user"]), _SEEN_MERGE_FLOOR):
            self._compact_seen()

    def _compact_seen(self) -> dict[str, np.ndarray]:
        """Merge the pending training events into the record; returns the record."""
        if self._seen_pending:
            self._seen_record = _merge_seen([self._seen_record, *self._seen_pending])
            self._seen_pending, self._seen_pending_rows = [], 0
        return self._seen_record

    def state_dict(self) -> dict[str, Any]:
        # Only the filtered protocol has state; the default adds nothing to a checkpoint.
        if self.exclude != "seen":
            return {}
        return {"seen_record": dict(self._compact_seen())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rec = state.get("seen_record")
        if rec is None:
            return
        if set(rec) != set(_SEEN_KEYS):
            raise ValueError(f"RetrievalMetricHook: a seen-record with keys {sorted(rec)}, "
                             f"expected {sorted(_SEEN_KEYS)}.")
        self._seen_record = _merge_seen([{k: np.asarray(rec[k]) for k in _SEEN_KEYS}])
        self._seen_pending, self._seen_pending_rows = [], 0
        self._seen_restored = True

    def seen_record_size(self) -> int:
        """Entries in the seen-record (distinct (user, item) pairs of this rank's training
        rows), after merging what is pending."""
        return len(self._compact_seen()["user"])

    def before_evaluate(self, trainer: TrainerView) -> None:
        # A model without an item tower, or a K the corpus cannot fill: say so before the pass.
        check_k_fits_corpus(self.ks, find_retrieval_model(trainer.model).num_items)
        self._rows = []
        start = self._seen_from_step if self._seen_from_step is not None else trainer.state.global_step
        if self.exclude == "seen" and not self._seen_warned and not self._seen_restored and start > 0:
            # Resumed (the record starts after step 0) with no record restored: the filtered
            # protocol would silently exclude less than a run that never stopped.
            self._seen_warned = True
            logger.warning(
                "RetrievalMetricHook(exclude='seen'): the training rows' seen-record starts at "
                "step %d (a resume from a checkpoint that held none): it restarts there, so "
                "items seen in the steps before are not excluded.", start)

    def after_eval_step(self, trainer: TrainerView, output: StepOutput) -> None:
        if output.is_padding:
            return
        for mb in output.micro_batches:
            self._rows.append(self._take(mb.batch, mb.outputs))

    def _take(self, batch: Batch, outputs: Any, *, train: bool = False) -> dict[str, Any]:
        """The rows of one batch that count (weight > 0): query, target, history, user, time.

        ``train``: only the seen-record's events (``{"seen": ...}``), copied to the host first
        and selected there: a training row's query is never used."""
        if not isinstance(outputs, dict) or "query" not in outputs or "target" not in outputs:
            raise TypeError(
                "RetrievalMetricHook needs the model's forward to return (loss, outputs) with "
                "outputs['query'] [B, D] and outputs['target'] [B] (TwoTowerModel, SASRecModel), "
                f"but the outputs are {type(outputs).__name__}"
                f"{' with keys ' + str(sorted(outputs)) if isinstance(outputs, dict) else ''}.")
        if train:
            # The seen-record's events, in ``_merge_seen``'s form: one copy to the host of each
            # input, the real rows selected there (no device work, no query).
            assert self._user_fn is not None and self._time_fn is not None
            target = np.asarray(outputs["target"].reshape(-1).cpu()).astype(np.int64)
            keep_h = (np.ones(len(target), dtype=bool) if batch.weights is None
                      else np.asarray(batch.weights.reshape(-1).cpu()) > 0)
            user = np.asarray(self._user_fn(batch).reshape(-1).cpu()).astype(np.int64)[keep_h]
            time = np.asarray(self._time_fn(batch).reshape(-1).cpu()).astype(np.float64)[keep_h]
            if "history_lengths" in outputs and "history_ids" in outputs:
                lengths = np.asarray(outputs["history_lengths"].reshape(-1).cpu()).astype(np.int64)
                values = np.asarray(outputs["history_ids"].reshape(-1).cpu()).astype(np.int64)
                values, lengths = values[np.repeat(keep_h, lengths)], lengths[keep_h]
            else:  # a model without a history feature: the seen items are the earlier targets
                lengths, values = np.zeros(int(keep_h.sum()), np.int64), np.zeros(0, np.int64)
            return {"seen": _events(user, time, target[keep_h], lengths, values)}
        query, target = outputs["query"], outputs["target"].reshape(-1)
        keep = torch.ones(query.shape[0], dtype=torch.bool, device=query.device) \
            if batch.weights is None else batch.weights.to(query.device) > 0
        row: dict[str, Any] = {"query": query[keep].float(), "target": target[keep].to(torch.int64)}
        if self.exclude_history and self.exclude == "seen" and "history_lengths" not in outputs:
            # A model without a history feature: the seen items are the earlier rows' targets.
            row["history"] = Jagged.empty(int(keep.sum()), query.device)
        elif self.exclude_history:
            if "history_lengths" not in outputs or "history_ids" not in outputs:
                raise TypeError("exclude_history=True needs outputs['history_lengths'] and "
                                "outputs['history_ids'] from the model's forward.")
            hist = Jagged(outputs["history_lengths"].to(torch.int64), outputs["history_ids"].to(torch.int64))
            kept = keep[hist.row_index()] if hist.values.numel() else keep[:0]
            row["history"] = Jagged(hist.lengths[keep], hist.values[kept])
        if self._user_fn is not None and self._time_fn is not None:
            # To the host: users are grouped there (numpy) after the gang's object gather.
            row["user"] = self._user_fn(batch).reshape(-1)[keep.cpu()].cpu().to(torch.int64)
            row["time"] = self._time_fn(batch).reshape(-1)[keep.cpu()].cpu().to(torch.float64)
        if self.exclude == "seen":
            # To the host with the users: the seen items are matched there (numpy) after the
            # gang's object gather. Each row's target at its time, its history items before it.
            hist = row["history"]
            tgt = np.asarray(row["target"].cpu())
            row["target_host"] = tgt
            row["seen"] = _events(np.asarray(row["user"]), np.asarray(row["time"]), tgt,
                                  np.asarray(hist.lengths.cpu()), np.asarray(hist.values.cpu()))
        return row

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        model = find_retrieval_model(trainer.model)
        dim = None
        if self._rows:
            dim = self._rows[0]["query"].shape[1]
        # A rank without rows still takes part in every collective (with empty tensors).
        dims = [d for d in trainer.gang.all_gather_object(dim) if d is not None]
        if not dims:
            raise ValueError("RetrievalMetricHook: the evaluation had no rows on any rank.")
        device = trainer.device
        rows = self._rows
        users = times = None
        if self._user_fn is not None:
            # Host tensors already (``_take``): numpy views of them, no copy from the device.
            users = np.concatenate([np.asarray(r["user"]) for r in rows]) if rows else np.zeros(0, np.int64)
            times = np.concatenate([np.asarray(r["time"]) for r in rows]) if rows else np.zeros(0, np.float64)
        sets: list[np.ndarray] = []
        if self.exclude == "seen":  # one target per row (host copies from ``_take``)
            sets = [t.reshape(1) for r in rows for t in r["target_host"]]
        query = torch.cat([r["query"] for r in rows]) if rows else torch.zeros(0, dims[0], device=device)
        target = Jagged.one_per_row(torch.cat([r["target"] for r in rows]) if rows
                                    else torch.zeros(0, dtype=torch.int64, device=device))
        history = None
        if self.exclude_history:
            history = Jagged.cat([r["history"] for r in rows], device)
        if self._user_fn is not None and self.per_user:
            query, target, history, users, times, sets = self._per_user(trainer, rows, query, target, history)
        if self.exclude == "seen":
            assert users is not None and times is not None
            history = self._seen(trainer, rows, users, times, sets, query.device)
        values = full_corpus_metrics(
            model, query.to(device), target, self.ks, exclude=history, device=device,
            query_chunk_size=self._query_chunk, corpus_chunk_size=self._corpus_chunk,
            group=trainer.process_group)
        kept = {name: v for name, v in values.items()
                if name == "num_queries" or name.split("@")[0] in self._metrics}
        self._rows = []
        for name, v in kept.items():
            metrics[self._prefix + name] = v
        report = MetricReport("eval", "eval", trainer.state.global_step, kept)
        self.reports.append(report)
        if self._log and trainer.is_rank_zero:
            shown = " | ".join(f"{k} {v:.5g}" for k, v in kept.items())
            logger.info("eval retrieval metrics [full corpus of %d items] @ step %d | %s",
                        model.num_items, report.step, shown)
        trainer.hooks.fire("on_metrics", trainer, report)

    def _seen(self, trainer: TrainerView, rows: list[dict[str, Any]], users: np.ndarray,
              times: np.ndarray, sets: list[np.ndarray], device: torch.device) -> Jagged:
        """This rank's queries' exclusions under ``exclude="seen"``: from every rank's training
        seen-record and evaluation rows (one object gather of the compact records), per query
        (``users``, ``times``, target ``sets``)."""
        # The evaluation's rows join only this evaluation's record, not the training record.
        mine = _merge_seen([self._compact_seen(), *(r["seen"] for r in rows)])
        rec = _merge_seen(list(trainer.gang.all_gather_object(mine)))
        ev = _seen_events(rec)
        excl = seen_exclusions(ev["user"], ev["item"], ev["time"], ev["before"], users, times, sets,
                               same_time=self.exclude_same_time)
        return Jagged(torch.as_tensor([len(x) for x in excl], dtype=torch.int64, device=device),
                      torch.as_tensor(np.concatenate(excl) if excl else np.zeros(0, np.int64),
                                      dtype=torch.int64, device=device))

    def _per_user(self, trainer: TrainerView, rows: list[dict[str, Any]], query: torch.Tensor,
                  target: Jagged, history: Jagged | None,
                  ) -> tuple[torch.Tensor, Jagged, Jagged | None, np.ndarray, np.ndarray, list[np.ndarray]]:
        """One query per user: its earliest row's embedding, history, user and time; all its
        targets (also as host arrays). The
        grouping runs on the host (numpy, over the gang's object gather); what it selects goes
        back to the queries' device."""
        user = torch.cat([r["user"] for r in rows]).numpy() if rows else np.zeros(0, np.int64)
        time = torch.cat([r["time"] for r in rows]).numpy() if rows else np.zeros(0, np.float64)
        tgt = target.values.cpu().numpy()
        gathered = trainer.gang.all_gather_object((user, time, tgt))
        rank = trainer.rank
        all_user = np.concatenate([g[0] for g in gathered])
        all_time = np.concatenate([g[1] for g in gathered])
        all_tgt = np.concatenate([g[2] for g in gathered])
        owner = np.concatenate([np.full(len(g[0]), r) for r, g in enumerate(gathered)])
        local = np.concatenate([np.arange(len(g[0])) for g in gathered])
        # The earliest row of each user (ties: the first in rank order) is its query.
        order = np.lexsort((np.arange(len(all_user)), all_time, all_user))
        first = order[np.r_[True, all_user[order][1:] != all_user[order][:-1]]] if len(order) else order
        mine = first[owner[first] == rank]
        by_user = {}
        if len(all_user):
            srt = np.argsort(all_user, kind="stable")
            uniq, starts = np.unique(all_user[srt], return_index=True)
            ends = np.r_[starts[1:], len(srt)]
            by_user = {int(u): all_tgt[srt[s:e]] for u, s, e in zip(uniq, starts, ends, strict=True)}
        sel = local[mine]
        sets = [np.unique(by_user[int(all_user[i])]) for i in mine]
        dev = target.values.device
        new_target = Jagged(torch.as_tensor([len(s) for s in sets], dtype=torch.int64, device=dev),
                            torch.as_tensor(np.concatenate(sets) if sets else np.zeros(0, np.int64),
                                            dtype=torch.int64, device=dev))
        new_history = None
        if history is not None:
            parts = [history.rows(int(i), int(i) + 1) for i in sel]
            new_history = Jagged.cat(parts, dev)
        return (query[torch.as_tensor(sel, dtype=torch.int64, device=query.device)], new_target,
                new_history, all_user[mine], all_time[mine], sets)


_SEEN_KEYS: tuple[str, ...] = ("user", "item", "at", "before")
_SEEN_MERGE_FLOOR = 1 << 16
"""Pending training events merged into the seen-record at the latest after this many."""


def _events(user: np.ndarray, time: np.ndarray, target: np.ndarray, lengths: np.ndarray,
            values: np.ndarray) -> dict[str, np.ndarray]:
    """Rows (user, time, target, history) as ``_merge_seen`` input: the target an interaction
    at the row's time, each history item known to precede it (not merged yet)."""
    n_hist = int(lengths.sum())
    inf = np.full(len(user), np.inf)
    return {"user": np.concatenate([user, np.repeat(user, lengths)]).astype(np.int64),
            "item": np.concatenate([target, values]).astype(np.int64),
            "at": np.concatenate([time, np.full(n_hist, np.inf)]).astype(np.float64),
            "before": np.concatenate([inf, np.repeat(time, lengths)]).astype(np.float64)}


def _merge_seen(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One entry per distinct (user, item) of ``parts``: ``at``, the earliest time it was a
    row's target (an interaction at that time), and ``before``, the earliest time of a row
    whose history held it (inf: never). These two minima decide ``seen_exclusions`` exactly:
    an interaction at ``t`` counts when ``t < time`` (or ``t == time`` with ``same_time``),
    a history item when ``t <= time``, so only the earliest of each kind matters."""
    if not parts:
        return {"user": np.zeros(0, np.int64), "item": np.zeros(0, np.int64),
                "at": np.zeros(0, np.float64), "before": np.zeros(0, np.float64)}
    u, i, at, bf = (np.concatenate([np.asarray(p[k]) for p in parts]) for k in _SEEN_KEYS)
    if not len(u):
        return _merge_seen([])
    order = np.lexsort((i, u))
    u, i, at, bf = u[order], i[order], at[order], bf[order]
    start = np.flatnonzero(np.r_[True, (u[1:] != u[:-1]) | (i[1:] != i[:-1])])
    return {"user": u[start].astype(np.int64), "item": i[start].astype(np.int64),
            "at": np.minimum.reduceat(at, start).astype(np.float64),
            "before": np.minimum.reduceat(bf, start).astype(np.float64)}


def _seen_events(rec: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The record as ``seen_exclusions``' events: an interaction per finite ``at``, a history
    item per finite ``before``."""
    has_at, has_bf = np.isfinite(rec["at"]), np.isfinite(rec["before"])
    return {"user": np.concatenate([rec["user"][has_at], rec["user"][has_bf]]),
            "item": np.concatenate([rec["item"][has_at], rec["item"][has_bf]]),
            "time": np.concatenate([rec["at"][has_at], rec["before"][has_bf]]),
            "before": np.r_[np.zeros(int(has_at.sum()), bool), np.ones(int(has_bf.sum()), bool)]}


__all__ = ["RetrievalMetricHook"]
