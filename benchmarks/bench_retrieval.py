"""Retrieval benchmarks: the step cost of the retrieval losses, and full-corpus evaluation speed.

    python benchmarks/bench_retrieval.py [--quick] [--ranks 1 2] [--part losses eval]

**Losses** (``--part losses``): the Trainer trains ``TwoTowerModel`` (user id and segment plus a
mean-pooled 1..50-item history; item id and category; 100k items, dim 64) on in-memory batches
with each loss, interleaved in rounds, against the *same towers with a pointwise loss* (binary
cross-entropy of each row's positive and of one shuffled in-batch item as its negative), the
baseline: ``in_batch`` (in-batch softmax with the streaming logQ correction), ``in_batch_no_logq``,
``mixed_S`` (+S uniform negatives), ``sampled_S`` (S uniform negatives only; S from
``--negatives``, default 128 and 1024) and, at 2+ ranks, ``cross_rank`` (in-batch negatives of
every rank; ``cross_rank_sync``: the same with the gather made where the loss needs it, not
overlapped with the user tower); beside ``mixed_S``/``sampled_S``, ``pointwise_S``: the pointwise
loss also scoring the S uniform negatives as 0 (the same items through the same towers, so the
ratio to it is the softmax's own cost). Reported: step time (median round) / pointwise step time, and the same for rank
0's process CPU time (all its threads; less inflated by other jobs on a shared host, but blind to
what overlapping a collective with compute saves). Goal: <= 1.2x.

**Evaluation** (``--part eval``): ``retrieval.metrics.full_corpus_metrics`` (the item tower over
the corpus, every query scored against all of it, sharded top-K merged across ranks) for corpus
sizes from 25k to 400k items, 4096 queries per rank. Reported: queries/s and nanoseconds per
(query, item) pair. Goal: the cost grows linearly in the corpus (ns per pair flat).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from common import device_name, markdown_table, quiet_torchrec, torchrun, worker_result
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.models import TwoTowerModel, weighted_bce_with_logits
from recsys_trainer.retrieval.metrics import Jagged, full_corpus_metrics

NUM_USERS, NUM_CATS, MAX_LEN = 100_000, 100, 50
LOSS_VARIANTS = ("pointwise", "in_batch", "in_batch_no_logq", "mixed", "sampled", "cross_rank",
                 "cross_rank_sync")


class PointwiseTwoTower(TwoTowerModel):
    """The same towers trained pointwise: BCE of (query, positive) as 1 and (query, another
    row's item) as 0: the baseline the softmax losses are measured against. With uniform
    negatives (``pointwise_S``), also (query, each of them) as 0: the same items through the
    same towers as ``mixed_S`` and ``sampled_S``, so that the ratio is the loss's own cost."""

    def _loss(self, query: torch.Tensor, items: torch.Tensor, item_ids: torch.Tensor,
              weights: torch.Tensor | None, negatives: torch.Tensor | None,
              negative_ids: torch.Tensor | None, pending: Any = None) -> torch.Tensor:
        pos = (query * items).sum(-1) / self.temperature
        neg = (query * items.roll(1, 0)).sum(-1) / self.temperature
        logits = [pos, neg]
        if negatives is not None:
            logits.append((query @ negatives.T).flatten() / self.temperature)
        labels = torch.cat([torch.ones_like(pos)] + [torch.zeros_like(x) for x in logits[1:]])
        w = None if weights is None else torch.cat(
            [weights, weights] + ([] if negatives is None else [weights.repeat_interleave(len(negatives))]))
        return weighted_bce_with_logits(torch.cat(logits), labels, w)


class SyncGatherTwoTower(TwoTowerModel):
    """Cross-rank negatives gathered where the loss needs them (after the user tower), not
    launched before it: what overlapping the exchange with the user tower saves."""

    def _launch_candidates(self, items: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None) -> None:
        return None


def expand_variants(variants: list[str], negatives: list[int]) -> list[str]:
    """``mixed`` / ``sampled`` once per number of uniform negatives (``mixed_128``, ...), and
    ``pointwise_S`` beside them: the pointwise loss over the same uniform negatives."""
    out = [f"{v}_{n}" if v in ("mixed", "sampled") else v
           for v in variants for n in (negatives if v in ("mixed", "sampled") else [0])]
    if "pointwise" in variants and ("mixed" in variants or "sampled" in variants):
        out[out.index("pointwise") + 1:out.index("pointwise") + 1] = [f"pointwise_{n}" for n in negatives]
    return out


def model_for(variant: str, num_items: int, table_device: str = "meta") -> TwoTowerModel:
    kw: dict[str, Any] = {}
    kind, _, n = variant.partition("_") if variant.startswith(("mixed_", "sampled_", "pointwise_")) \
        else (variant, "", "")
    if kind == "pointwise" and n:
        kw["num_uniform_negatives"] = int(n)
    if kind == "in_batch_no_logq":
        kw["log_q_correction"] = False
    elif kind == "mixed":
        kw["num_uniform_negatives"] = int(n)
    elif kind == "sampled":
        kw.update(loss="sampled", num_uniform_negatives=int(n))
    elif kind in ("cross_rank", "cross_rank_sync"):
        kw["cross_rank_negatives"] = True
    cls = {"pointwise": PointwiseTwoTower, "cross_rank_sync": SyncGatherTwoTower}.get(kind, TwoTowerModel)
    catalog = {"item_id": torch.arange(num_items).numpy(), "item_cat": (torch.arange(num_items) % NUM_CATS).numpy()}
    return cls(["user_id", "segment"], num_items=num_items, user_num_embeddings=[NUM_USERS, NUM_CATS],
               item_side_features={"item_cat": NUM_CATS}, item_catalog=catalog, max_len=MAX_LEN,
               embedding_dim=64, tower_dims=(128, 64), table_device=table_device, **kw)


def make_batches(n: int, batch_size: int, num_items: int, seed: int) -> list[Batch]:
    """Rows with a Zipf-popular item, its category, a 1..50-item history and a user."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_items + 1, dtype=torch.float64)
    popularity = 1.0 / ranks
    out = []
    for _ in range(n):
        item = torch.multinomial(popularity, batch_size, replacement=True, generator=g)
        lens = torch.randint(1, MAX_LEN + 1, (batch_size,), generator=g, dtype=torch.int32)
        hist = torch.multinomial(popularity, int(lens.sum()), replacement=True, generator=g)
        ones = torch.ones(batch_size, dtype=torch.int32)
        user = torch.randint(0, NUM_USERS, (batch_size,), generator=g)
        out.append(Batch(
            dense=torch.zeros(batch_size, 0),
            sparse=KeyedJaggedTensor(keys=["user_id", "segment"], values=torch.cat([user, user % NUM_CATS]),
                                     lengths=torch.cat([ones, ones]), stride=batch_size),
            labels=torch.ones(batch_size),
            sequence=KeyedJaggedTensor(keys=["item", "hist_item", "item_cat"],
                                       values=torch.cat([item, hist, item % NUM_CATS]),
                                       lengths=torch.cat([ones, lens, ones]), stride=batch_size)))
    return out


def trainer_run(model: torch.nn.Module, batches: list[Batch], device: torch.device) -> Any:
    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments

    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench_retrieval_"),
                               train_epoch=10**9, train_steps=1, log_steps=10**9,
                               resume_from=None, device=device.type),
        train_dataset=lambda: itertools.cycle(batches),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False)

    def run(n: int) -> None:
        trainer.args.train_steps = trainer.state.global_step + n
        trainer.train()

    return run


def losses_worker(a: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from recsys_trainer.distributed import init_distributed

    info = init_distributed(a.device)
    variants = [v for v in expand_variants(a.variants, a.negatives)
                if not v.startswith("cross_rank") or info.world_size > 1]
    batches = make_batches(4, a.batch_size, a.num_items, seed=info.rank)
    runs = {}
    for v in variants:
        torch.manual_seed(0)
        runs[v] = trainer_run(model_for(v, a.num_items), batches, info.device)
        runs[v](a.warmup)
    seconds = {v: 0.0 for v in variants}
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            runs[v](a.steps)
            c1 = time.process_time()
            dist.barrier()
            took = time.perf_counter() - t0
            seconds[v] += took
            rounds[v].append(took)
            cpu[v].append(c1 - c0)
    # The median round: other processes on a shared host make single rounds spike. The process
    # CPU time (all its threads, this rank's) is less inflated by them than the wall time.
    return {"world_size": info.world_size, "device": device_name(info.device),
            "step_s": {v: statistics.median(rounds[v]) / a.steps for v in variants},
            "cpu_step_s": {v: statistics.median(cpu[v]) / a.steps for v in variants},
            "mean_step_s": {v: seconds[v] / (a.steps * a.rounds) for v in variants}, "rounds": rounds}


def eval_worker(a: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from recsys_trainer.distributed import init_distributed

    info = init_distributed(a.device)
    out = {}
    for n in a.corpus:
        torch.manual_seed(0)  # the same (unsharded) towers on every rank: the corpus is split
        model = model_for("in_batch", n, table_device=info.device.type).eval()
        g = torch.Generator().manual_seed(info.rank)
        queries = torch.nn.functional.normalize(torch.randn(a.queries, 64, generator=g), dim=-1)
        targets = Jagged.one_per_row(torch.randint(0, n, (a.queries,), generator=g))
        full_corpus_metrics(model, queries[:64], targets.rows(0, 64), [10, 100])  # warm up
        times = []
        for _ in range(a.eval_repeats):
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                full_corpus_metrics(model, queries, targets, [10, 50, 100])
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out[n] = min(times)
    return {"world_size": info.world_size, "device": device_name(info.device), "seconds": out,
            "queries_per_rank": a.queries}


def worker(a: argparse.Namespace) -> None:
    quiet_torchrec()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    worker_result(a.out, losses_worker(a) if a.part == "losses" else eval_worker(a))


def report_losses(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    rows = []
    for res in results:
        base, cpu_base = res["step_s"]["pointwise"], res["cpu_step_s"]["pointwise"]
        for v, s in res["step_s"].items():
            r, c = res["rounds"][v], res["cpu_step_s"][v]
            # mixed_S / sampled_S against pointwise_S: the same items through the same towers.
            same = f"pointwise_{v.partition('_')[2]}" if v.startswith(("mixed_", "sampled_")) else ""
            vs_same = f"{s / res['step_s'][same]:.2f}" if same in res["step_s"] else ""
            rows.append([res["world_size"], v, f"{s * 1000:.1f}", f"{s / base:.2f}", vs_same,
                         f"{max(r) / min(r):.2f}", f"{c * 1000:.1f}", f"{c / cpu_base:.2f}"])
    return "\n".join([
        "## Retrieval losses: step cost", "",
        f"TwoTowerModel, {a.num_items:,} items, dim 64, towers (128, 64), batch {a.batch_size}/rank, "
        f"{a.rounds} interleaved rounds x {a.steps} steps after {a.warmup} warm-up (ms/step: the "
        f"median round), on "
        f"{results[0]['device']}", "",
        markdown_table(["ranks", "loss", "ms/step", "x pointwise", "x pointwise_S (same items)",
                        "round spread", "CPU ms/step", "CPU x pointwise"], rows), "",
        "Goal: each softmax loss <= 1.2x the pointwise step of the same towers."])


def report_eval(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    rows = []
    for res in results:
        q = res["queries_per_rank"] * res["world_size"]
        for n, s in sorted(res["seconds"].items(), key=lambda kv: int(kv[0])):
            rows.append([res["world_size"], f"{int(n):,}", f"{s:.2f}", f"{q / s:,.0f}",
                         f"{s / (q * int(n)) * 1e9:.2f}"])
    return "\n".join([
        "## Full-corpus evaluation", "",
        f"`full_corpus_metrics`: item tower over the corpus + every query against every item, "
        f"top-100 merged across ranks; {a.queries} queries per rank, best of {a.eval_repeats}, on "
        f"{results[0]['device']}", "",
        markdown_table(["ranks", "corpus", "seconds", "queries/s", "ns per (query, item)"], rows), "",
        "Goal: linear in the corpus (ns per pair flat as the corpus grows)."])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer steps (~2-4 min)")
    p.add_argument("--part", nargs="+", default=["losses", "eval"], choices=["losses", "eval"])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-items", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(LOSS_VARIANTS), choices=LOSS_VARIANTS)
    p.add_argument("--negatives", type=int, nargs="+", default=[128, 1024],
                   help="uniform negatives of the mixed and sampled variants (one variant each)")
    p.add_argument("--corpus", type=int, nargs="+", default=[25_000, 100_000, 400_000])
    p.add_argument("--queries", type=int, default=4096, help="eval queries per rank")
    p.add_argument("--eval-repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads per rank (default: the cores split over the ranks; 1 "
                        "compares 1 and 2 ranks at equal threads and keeps a shared host sane)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.batch_size, a.steps, a.rounds, a.warmup = min(a.batch_size, 512), min(a.steps, 8), 2, 3
        a.corpus, a.queries, a.eval_repeats = [c for c in a.corpus if c <= 100_000], 1024, 1
    if a.worker:
        a.part = a.part[0]
        worker(a)
        return
    common = [f"--num-items={a.num_items}", f"--batch-size={a.batch_size}", f"--warmup={a.warmup}",
              f"--steps={a.steps}", f"--rounds={a.rounds}", f"--queries={a.queries}",
              f"--eval-repeats={a.eval_repeats}", f"--device={a.device}", f"--threads={a.threads}",
              "--variants", *a.variants, "--negatives", *map(str, a.negatives),
              "--corpus", *map(str, a.corpus)]
    sections = []
    for part in a.part:
        results = [torchrun(os.path.abspath(__file__), n, ["--part", part, *common], a.timeout)
                   for n in a.ranks]
        sections.append(report_losses(results, a) if part == "losses" else report_eval(results, a))
    print("\n\n".join(sections))


if __name__ == "__main__":
    main()
