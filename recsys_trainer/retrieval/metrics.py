"""Full-corpus retrieval metrics, exact across ranks: Recall@K, NDCG@K, HitRate@K.

Every query (an eval user) is scored against **every** item of the corpus; no sampled-negative
metric (those rank the target among a few hundred random items and overstate quality by far).
The work is split as in a sharded ANN service:

1. ``embed_corpus``: the corpus ``[0, num_items)`` is cut into one contiguous share per rank;
   each rank embeds its share with the model's item tower (in chunks; every rank makes the same
   number of calls, since a sharded table lookup is a collective), once per evaluation.
2. ``sharded_top_k``: the queries of all ranks are gathered; each rank scores them against its
   share (dot product), removes excluded items (e.g. the user's history), keeps its top K, and
   the per-rank top-Ks are all-gathered and merged. The merged top K is the exact top K over
   the whole corpus (each item lives in exactly one share); ties at the K-th score are broken
   arbitrarily.
3. ``ranking_metrics``: per query, with ``T`` its set of target items and ``hits`` the top-K
   positions holding one: ``recall@K = |hits| / |T|``, ``hitrate@K = [|hits| > 0]``,
   ``ndcg@K = sum over hits of 1/log2(position + 1)`` (positions from 1) over the same sum for
   ``min(|T|, K)`` hits at the top. Queries without targets are skipped. With one target per
   query (next-item evaluation) recall and hit rate coincide.

Every rank ends with the same values (the same gathered inputs, the same order of operations).
Costs per evaluation: ``num_items`` item-tower rows split over the ranks; one gather of the
queries (``Q x D`` floats) and of their targets and exclusions; ``Q x num_items / W`` dot
products per rank; one gather of ``W x Q x K`` (score, id) pairs, in chunks of queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from recsys_trainer.retrieval import collectives
from recsys_trainer.retrieval.protocol import RetrievalModel

METRICS = ("recall", "ndcg", "hitrate")


@dataclass
class Jagged:
    """Ids per row: ``values`` (int64) cut by ``lengths [n]`` (row ``i`` owns
    ``values[offsets[i]:offsets[i+1]]``)."""

    lengths: torch.Tensor
    values: torch.Tensor

    @staticmethod
    def one_per_row(ids: torch.Tensor) -> Jagged:
        return Jagged(torch.ones(ids.numel(), dtype=torch.int64, device=ids.device), ids.reshape(-1).to(torch.int64))

    @staticmethod
    def empty(n: int, device: torch.device | None = None) -> Jagged:
        return Jagged(torch.zeros(n, dtype=torch.int64, device=device),
                      torch.zeros(0, dtype=torch.int64, device=device))

    @staticmethod
    def cat(parts: Sequence[Jagged], device: torch.device | None = None) -> Jagged:
        """The rows of ``parts`` in order; with no parts, no rows on ``device`` (the parts'
        device when there are some)."""
        if not parts:
            return Jagged.empty(0, device)
        return Jagged(torch.cat([p.lengths.to(torch.int64) for p in parts]),
                      torch.cat([p.values.to(torch.int64) for p in parts]))

    def offsets(self) -> torch.Tensor:
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def rows(self, lo: int, hi: int) -> Jagged:
        off = self.offsets()
        return Jagged(self.lengths[lo:hi], self.values[int(off[lo]):int(off[hi])])

    def row_index(self) -> torch.Tensor:
        """The row of each value."""
        return torch.repeat_interleave(torch.arange(self.lengths.numel(), device=self.lengths.device),
                                       self.lengths)

    def padded(self, fill: int = -1) -> torch.Tensor:
        """``[n, max length]`` with ``fill`` after each row's ids."""
        n = self.lengths.numel()
        width = int(self.lengths.max()) if n else 0
        out = torch.full((n, max(width, 1)), fill, dtype=torch.int64, device=self.values.device)
        if self.values.numel():
            rows = self.row_index()
            cols = torch.arange(self.values.numel(), device=rows.device) - self.offsets()[rows]
            out[rows, cols] = self.values
        return out


def corpus_share(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[start, stop)`` of item ids ``[0, num_items)``
    (sizes differ by at most one)."""
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@torch.no_grad()
def embed_corpus(model: RetrievalModel, num_items: int, device: torch.device, *,
                 chunk_size: int = 65_536, group: dist.ProcessGroup | None = None,
                 ) -> tuple[int, torch.Tensor]:
    """This rank's share of the corpus, embedded: ``(start, [stop - start, D])``. A
    collective: every rank calls ``model.item_embeddings`` the same number of times (a rank
    whose share is used up embeds one padding id, dropped)."""
    rank, world = collectives.world(group)
    start, stop = corpus_share(num_items, rank, world)
    longest = -(-num_items // world)  # the largest share
    calls = max(1, -(-longest // chunk_size))
    parts = []
    for c in range(calls):
        lo = start + c * chunk_size
        # Made on the model's device: no host tensor and no copy per chunk.
        ids = torch.arange(lo, min(stop, lo + chunk_size), dtype=torch.int64, device=device)
        n = ids.numel()
        emb = model.item_embeddings(ids if n else torch.zeros(1, dtype=torch.int64, device=device))
        parts.append(emb[:n].float())
    return start, torch.cat(parts)


def _local_top_k(scores: torch.Tensor, k: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of ``scores [C, n]`` as ``(scores, global ids)``, padded to ``k`` with
    ``-inf`` / id -1 when the share holds fewer items."""
    c, n = scores.shape
    kk = min(k, n)
    vals, idx = torch.topk(scores, kk, dim=1)
    ids = idx + start
    if kk < k:
        pad = k - kk
        vals = torch.cat([vals, vals.new_full((c, pad), -torch.inf)], dim=1)
        ids = torch.cat([ids, ids.new_full((c, pad), -1)], dim=1)
    return vals, ids


def _merge_top_k(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = torch.cat([a[0], b[0]], dim=1), torch.cat([a[1], b[1]], dim=1)
    best, pos = torch.topk(vals, k, dim=1)
    return best, torch.gather(ids, 1, pos)


@torch.no_grad()
def sharded_top_k(queries: torch.Tensor, corpus: torch.Tensor, corpus_start: int, k: int, *,
                  exclude: Jagged | None = None, query_chunk_size: int = 1024,
                  corpus_block_size: int = 32_768, group: dist.ProcessGroup | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top ``k`` items of every query of *every* rank over the whole corpus, from
    each rank's share (``corpus [n_r, D]``, item ids ``corpus_start + i``). A collective.

    Args:
        queries: ``[q_r, D]`` this rank's queries.
        exclude: per query, item ids that may not be returned (e.g. the history), or None.
        query_chunk_size / corpus_block_size: at most ``query_chunk_size x corpus_block_size``
            scores exist at once (128 MiB of float32 by default).

    Returns ``(scores [Q, k], ids [Q, k])`` for the queries of all ranks in rank order (every
    rank the same), best first; ``-inf`` / id -1 where fewer than ``k`` items remain.
    """
    _, world = collectives.world(group)
    all_q, sizes = collectives.all_gather_rows(queries.float(), group)
    excl = None
    if exclude is not None:
        # On the queries' device: the group's (NCCL gathers only GPU tensors), and the scores'.
        dev = all_q.device
        lengths, _ = collectives.all_gather_rows(exclude.lengths.to(dev, torch.int64), group)
        values, _ = collectives.all_gather_rows(exclude.values.to(dev, torch.int64), group)
        excl = Jagged(lengths, values)
    total, n = sum(sizes), corpus.shape[0]
    out_scores, out_ids = [], []
    # The same number of chunks on every rank (one all-gather each): all ranks hold all queries.
    for lo in range(0, total, query_chunk_size):
        hi = min(total, lo + query_chunk_size)
        q = all_q[lo:hi]
        best = (q.new_full((hi - lo, k), -torch.inf), torch.full((hi - lo, k), -1, dtype=torch.int64,
                                                                 device=q.device))
        part = excl.rows(lo, hi) if excl is not None else None
        for b0 in range(0, n, corpus_block_size):
            b1 = min(n, b0 + corpus_block_size)
            scores = q @ corpus[b0:b1].t()
            if part is not None and part.values.numel():
                rows, ids = part.row_index(), part.values - (corpus_start + b0)
                mine = (ids >= 0) & (ids < b1 - b0)
                scores[rows[mine], ids[mine]] = -torch.inf
            best = _merge_top_k(best, _local_top_k(scores, k, corpus_start + b0), k)
        if world > 1:
            vals_all = [torch.empty_like(best[0]) for _ in range(world)]
            ids_all = [torch.empty_like(best[1]) for _ in range(world)]
            dist.all_gather(vals_all, best[0].contiguous(), group=group)
            dist.all_gather(ids_all, best[1].contiguous(), group=group)
            vals, ids = torch.cat(vals_all, dim=1), torch.cat(ids_all, dim=1)
            top, pos = torch.topk(vals, k, dim=1)
            best = (top, torch.gather(ids, 1, pos))
        out_scores.append(best[0])
        out_ids.append(best[1])
    if not out_scores:
        empty = all_q.new_zeros((0, k))
        return empty, empty.long()
    return torch.cat(out_scores), torch.cat(out_ids)


def ranking_metrics(top_scores: torch.Tensor, top_ids: torch.Tensor, targets: Jagged,
                    ks: Sequence[int]) -> dict[str, float]:
    """Sums over queries of ``recall@k``, ``ndcg@k``, ``hitrate@k`` for each ``k`` in ``ks``
    (``<=`` the top-K width), and ``num_queries`` (those with at least one target). Targets are
    sets: repeated ids count once. Items with score ``-inf`` (excluded, or missing) never hit."""
    return host_floats(ranking_sums(top_scores, top_ids, targets, ks))


def ranking_sums(top_scores: torch.Tensor, top_ids: torch.Tensor, targets: Jagged,
                 ks: Sequence[int]) -> dict[str, torch.Tensor]:
    """``ranking_metrics`` as float64 0-dim tensors on the top-K's device, nothing read back."""
    sets = _dedupe(targets)
    n_t = sets.lengths.to(torch.float64)
    pad = sets.padded(fill=-2)  # never an item id, nor the -1 of a missing item
    hits = (top_ids[:, :, None] == pad[:, None, :]).any(-1) & torch.isfinite(top_scores)
    has = (n_t > 0).to(torch.float64)
    out: dict[str, torch.Tensor] = {"num_queries": has.sum()}
    discount = 1.0 / torch.log2(torch.arange(2, top_ids.shape[1] + 2, dtype=torch.float64,
                                             device=top_ids.device))
    for k in ks:
        h = hits[:, :k].to(torch.float64)
        found = h.sum(1)
        dcg = (h * discount[:k]).sum(1)
        ideal_n = torch.clamp(n_t, max=k).long()
        ideal = torch.cumsum(discount[:k], 0)
        idcg = torch.where(ideal_n > 0, ideal[(ideal_n - 1).clamp_min(0)], torch.ones_like(n_t))
        # Queries without targets weigh 0 (a product, not a boolean mask: no data-sized result).
        out[f"recall@{k}"] = (found / n_t.clamp_min(1) * has).sum()
        out[f"ndcg@{k}"] = (dcg / idcg * has).sum()
        out[f"hitrate@{k}"] = ((found > 0).to(torch.float64) * has).sum()
    return out


def host_floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """The crossing to the host: 0-dim tensors as floats, in one copy (one device sync instead
    of one per value)."""
    if not values:
        return {}
    host = torch.stack([v.reshape(()).to(torch.float64) for v in values.values()]).tolist()
    return dict(zip(values, host, strict=True))


def _dedupe(targets: Jagged) -> Jagged:
    """Each row's distinct ids."""
    if targets.values.numel() == 0:
        return targets
    rows = targets.row_index()
    pairs = torch.unique(torch.stack([rows, targets.values]), dim=1)
    lengths = torch.bincount(pairs[0], minlength=targets.lengths.numel())
    return Jagged(lengths, pairs[1])


def seen_exclusions(ev_user: np.ndarray, ev_item: np.ndarray, ev_time: np.ndarray,
                    ev_before: np.ndarray, users: np.ndarray, times: np.ndarray,
                    targets: Sequence[np.ndarray], *, same_time: bool = False) -> list[np.ndarray]:
    """The filtered protocol's exclusions: per query (user ``users[i]`` at time ``times[i]``
    with target set ``targets[i]``), the distinct items the user interacted with before it,
    from the interactions seen (``ev_*``: one per interaction; ``ev_before`` marks a history
    item, known only to precede ``ev_time``, else the interaction is at ``ev_time``). An
    interaction at ``t`` counts when ``t < time``, a history item of a row at ``t`` when
    ``t <= time``; with ``same_time`` also the interactions at ``time`` itself that are not the
    query's targets (the other items of one basket/session). An earlier interaction with a
    target item is excluded too (a system that filters seen items cannot return it). Host-side
    (numpy), as the per-user grouping."""
    order = np.lexsort((ev_time, ev_user))
    u, it, t, before = ev_user[order], ev_item[order], ev_time[order], ev_before[order]
    lo = np.searchsorted(u, users, "left")
    hi = np.searchsorted(u, users, "right")
    out = []
    for i in range(len(users)):
        ts, bf, items = t[lo[i]:hi[i]], before[lo[i]:hi[i]], it[lo[i]:hi[i]]
        keep = np.where(bf, ts <= times[i], ts < times[i])
        if same_time:
            keep |= ~bf & (ts == times[i]) & ~np.isin(items, targets[i])
        out.append(np.unique(items[keep]))
    return out


def check_k_fits_corpus(ks: Sequence[int], num_items: int) -> None:
    """Refuse a cut-off above the corpus size: its top K would hold every item (recall 1.0 by
    construction), a number that says nothing about the model."""
    too_big = [k for k in ks if k > num_items]
    if too_big:
        raise ValueError(f"retrieval cut-off(s) k={too_big} exceed the item corpus of {num_items} "
                         f"items (model.num_items): every item would be in the top K. Use k <= "
                         f"{num_items}.")


def full_corpus_metrics(model: RetrievalModel, queries: torch.Tensor, targets: Jagged,
                        ks: Sequence[int], *, exclude: Jagged | None = None,
                        num_items: int | None = None, device: torch.device | None = None,
                        query_chunk_size: int = 1024, corpus_chunk_size: int = 65_536,
                        group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Recall/NDCG/HitRate at each ``k`` of this rank's ``queries`` and everyone else's, over
    the whole corpus (``model.num_items`` unless ``num_items``): the mean over all ranks'
    queries with a target, identical on every rank. A collective.

    ``targets``: per query, the item ids that count as hits; ``exclude``: per query, items never
    returned (the history). Returns ``{"recall@10": ..., "ndcg@10": ..., "hitrate@10": ...,
    "num_queries": ...}``."""
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"`k` must be a list of ints >= 1, but is {list(ks)!r}.")
    dev = device if device is not None else queries.device
    n = model.num_items if num_items is None else num_items
    check_k_fits_corpus(ks, n)
    start, corpus = embed_corpus(model, n, dev, chunk_size=corpus_chunk_size, group=group)
    k = max(ks)
    scores, ids = sharded_top_k(queries.to(dev), corpus, start, k, exclude=exclude,
                                query_chunk_size=query_chunk_size, group=group)
    tl, _ = collectives.all_gather_rows(targets.lengths.to(torch.int64).to(dev), group)
    tv, _ = collectives.all_gather_rows(targets.values.to(torch.int64).to(dev), group)
    sums = ranking_metrics(scores, ids, Jagged(tl, tv), ks)
    count = sums.pop("num_queries")
    out = {name: value / count if count else float("nan") for name, value in sums.items()}
    out["num_queries"] = count
    return out


__all__ = [
    "METRICS",
    "Jagged",
    "check_k_fits_corpus",
    "corpus_share",
    "embed_corpus",
    "full_corpus_metrics",
    "ranking_metrics",
    "seen_exclusions",
    "sharded_top_k",
]
