"""Trainer overhead: samples/s of the Trainer vs a hand-written TorchRec loop vs plain PyTorch.

    python benchmarks/bench_trainer.py [--quick] [--ranks 1 2] [--num-embeddings 100000]
    python benchmarks/bench_trainer.py --device cuda --ranks 1 --num-embeddings 1000000 \
        --embedding-dim 128 --batch-size 8192 --sparse-optimizer rowwise_adagrad

Same model (DLRM: 13 dense, 26 tables, bottom MLP 512-256-D, top MLP 512-256-1), same data
(per-rank batch 2048, Zipf ids), same optimizers (sparse Adagrad on the tables, Adam on the
dense part), flush-denormal on, threads = cores // ranks. Variants, each built once per world
size and measured *interleaved* (round r runs every variant for --steps steps, after --warmup
steps each), so machine drift hits all of them alike:

- ``plain_pytorch``: ``nn.EmbeddingBag(sparse=True)`` tables + ``torch.optim.Adagrad`` (sparse
  grads) + Adam, the whole model in DDP (tables replicated, sparse gradients all-reduced).
- ``torchrec_loop``: ``DistributedModelParallel`` (same plan as the Trainer), fused Adagrad in
  backward, Adam on the dense parameters, a plain Python loop. **The baseline.**
- ``torchrec_pipeline``: the same with TorchRec's ``TrainPipelineSparseDist``.
- ``torchrec_loop_fp16`` / ``torchrec_loop_bf16``: ``torchrec_loop`` with every table stored in
  fp16 / bf16 (``DLRMClassifier(embedding_dtype=...)``): the half-precision step against the
  fp32 one, in the same run. Opt-in, so the default run is the one of before half precision:
  ``--half-precision`` adds fp16 (and bf16 with ``--device cuda``, where it trains), or name
  them in ``--variants``.
- ``trainer``: ``recsys_trainer.Trainer`` (pipeline="none"), no hooks.
- ``trainer_pipeline``: ``Trainer`` with ``pipeline="sparse_dist"``.
- ``trainer_no_sequence`` / ``trainer_sequence``: the cost of a sequence feature. The same DLRM
  with one more table, a candidate item (100k rows) read as a pooled feature, and then that
  table as an unpooled ``EmbeddingCollection`` read by the candidate *and* a max_len-50 history
  (1..50 items per row, uniform), attention-pooled into one more interaction vector
  (``models.DINClassifier``); both through the Trainer (pipeline="none"). The report
  gives the step-time ratio sequence / no sequence.

Each measured segment is one "window" of --steps batches for every variant (pipelines are
refilled per segment in both the hand-written and the Trainer variant).

With ``--device cuda`` every variant takes the same pinned CPU batches and copies each to the
GPU (the pipelines on their own copy stream, the loops with ``non_blocking``), as a reader's
batches would arrive; each segment ends with a device synchronisation before the clock stops.
Every variant holds its own tables: at 26 x 1M x 128 that is 13 GB each, so on an 80 GB GPU run
the variants in two groups that share the baseline (``--variants``). The table prints
global samples/s and ratios to ``torchrec_loop`` and ``plain_pytorch`` of the same world size.
Goal: trainer >= 0.95x torchrec_loop; trainer_pipeline > torchrec_loop.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    PlainDLRM,
    device_name,
    dlrm,
    make_batches,
    markdown_table,
    peak_rss_mib,
    plain_inputs,
    quiet_torchrec,
    sequence_models,
    synchronize,
    torchrun,
    with_items,
    worker_result,
)

VARIANTS = ("plain_pytorch", "torchrec_loop", "torchrec_pipeline", "torchrec_loop_fp16",
            "torchrec_loop_bf16", "trainer", "trainer_pipeline", "trainer_no_sequence",
            "trainer_sequence")
HALF_VARIANTS = ("torchrec_loop_fp16", "torchrec_loop_bf16")
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in HALF_VARIANTS]


class Variant:
    """Something that trains ``n`` steps on the benchmark data when called."""

    def __init__(self, name: str, run: Callable[[int], None]) -> None:
        self.name, self.run = name, run
        self.seconds = 0.0
        self.steps = 0
        self.round_seconds: list[float] = []


def _dense_adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _pinned(inputs: Any, pin: bool) -> Any:
    dense, sparse_in, labels = inputs
    if not pin:
        return inputs
    return dense.pin_memory(), [(i.pin_memory(), o.pin_memory()) for i, o in sparse_in], labels.pin_memory()


def build_variants(a: argparse.Namespace, batches: list[Any], names: list[str],
                   device: torch.device) -> list[Variant]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recsys_trainer import SparseOptimizer
    from recsys_trainer.optimizers import dense_parameters
    from recsys_trainer.sharding import shard_model

    sparse = SparseOptimizer(a.sparse_optimizer, lr=0.05)
    out: list[Variant] = []
    cycle = itertools.cycle(batches)

    if "plain_pytorch" in names:
        torch.manual_seed(0)
        plain = PlainDLRM(a.num_tables, a.num_embeddings, a.embedding_dim, device=device).to(device)
        ddp: torch.nn.Module = plain
        if device.type == "cpu":
            ddp = torch.nn.parallel.DistributedDataParallel(plain)
        elif torch.distributed.get_world_size() > 1:
            # NCCL has no all-reduce for sparse gradients ("NCCL does not support all_reduce
            # with sparse tensors", seen on an H100): plain DDP cannot train these tables.
            raise SystemExit("plain_pytorch on CUDA runs at 1 rank only (NCCL cannot all-reduce "
                             "sparse gradients); drop it from --variants for more ranks.")
        emb = [p for n, p in ddp.named_parameters() if ".tables." in n]
        dense = [p for n, p in ddp.named_parameters() if ".tables." not in n]
        opt_sparse = torch.optim.Adagrad(emb, lr=0.05)
        opt_dense = _dense_adam(dense)
        # Split per table on the CPU, as a plain-PyTorch loader would (on the GPU, the KJT's
        # per-key split reads lengths back to the host: a sync that is not the model's cost).
        pin = device.type == "cuda"
        plain_data = itertools.cycle([_pinned(plain_inputs(b), pin) for b in batches])

        def run_plain(n: int) -> None:
            for _ in range(n):
                dense, sparse_in, labels = next(plain_data)
                loss = ddp(dense.to(device, non_blocking=True),
                           [(i.to(device, non_blocking=True), o.to(device, non_blocking=True))
                            for i, o in sparse_in],
                           labels.to(device, non_blocking=True))
                loss.backward()
                opt_sparse.step()
                opt_dense.step()
                opt_sparse.zero_grad(set_to_none=True)
                opt_dense.zero_grad(set_to_none=True)

        out.append(Variant("plain_pytorch", run_plain))

    def torchrec_dmp(dtype: str = "fp32") -> tuple[Any, torch.optim.Optimizer]:
        torch.manual_seed(0)
        dmp = shard_model(dlrm(a.num_tables, a.num_embeddings, a.embedding_dim, dtype), sparse,
                          device, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return dmp, _dense_adam([p for _, p in dense_parameters(dmp)])

    def loop(dmp: Any, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        def run_loop(n: int) -> None:
            for _ in range(n):
                loss, _ = dmp(next(cycle).to(device, non_blocking=True))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        return run_loop

    for name, dtype in (("torchrec_loop", "fp32"), ("torchrec_loop_fp16", "fp16"),
                        ("torchrec_loop_bf16", "bf16")):
        if name in names:
            out.append(Variant(name, loop(*torchrec_dmp(dtype))))

    if "torchrec_pipeline" in names:
        dmp_p, opt_p = torchrec_dmp()
        pipe = TrainPipelineSparseDist(dmp_p, opt_p, device, execute_all_batches=True)

        def run_pipe(n: int) -> None:
            pipe.reset()
            it = iter([next(cycle) for _ in range(n)])
            for _ in range(n):
                pipe.progress(it)

        out.append(Variant("torchrec_pipeline", run_pipe))

    for name, pipeline in (("trainer", "none"), ("trainer_pipeline", "sparse_dist")):
        if name in names:
            # One endless window (the batches cycled), so the Trainer's window bookkeeping and
            # pipeline refill happen once per measured segment, as for the hand-written variants.
            model = dlrm(a.num_tables, a.num_embeddings, a.embedding_dim)
            out.append(Variant(name, trainer_run(model, batches, sparse, device, pipeline)))

    no_seq, seq = sequence_models(a.num_tables, a.num_embeddings, a.embedding_dim)
    for name, model, sequence in (("trainer_no_sequence", no_seq, False),
                                  ("trainer_sequence", seq, True)):
        if name in names:
            out.append(Variant(name, trainer_run(model, with_items(batches, sequence, seed=7),
                                                 sparse, device, "none")))
    return out


def trainer_run(model: torch.nn.Module, batches: list[Any], sparse: Any,
                device: torch.device, pipeline: str) -> Callable[[int], None]:
    """A Trainer over ``batches`` cycled as one endless window; calling it trains n steps."""
    from recsys_trainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench_trainer_"),
                               train_epoch=10**9, train_steps=1, log_steps=10**9,
                               resume_from=None, device=device.type, pipeline=pipeline),
        train_dataset=lambda: itertools.cycle(batches),
        dense_optimizers=(_dense_adam, None),
        sparse_optimizer=sparse,
        add_logger_hook=False,
    )

    def run(n: int) -> None:
        trainer.args.train_steps = trainer.state.global_step + n
        trainer.train()
        assert trainer.state.global_step == trainer.args.train_steps

    return run


def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from recsys_trainer.distributed import configure_cpu_threads, init_distributed

    quiet_torchrec()
    info = init_distributed(a.device)
    configure_cpu_threads(info.local_world_size)  # flush denormals; cores // local ranks threads
    torch.set_flush_denormal(True)
    batches = make_batches(a.distinct_batches, a.batch_size, a.num_tables, a.num_embeddings,
                           seed=info.rank)
    if info.device.type == "cuda":
        batches = [b.pin_memory() for b in batches]  # what lets non_blocking copies overlap
    variants = build_variants(a, batches, a.variants, info.device)
    for v in variants:  # warm up every variant (allocations, caches, denormals settle)
        v.run(a.warmup)
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # alternate to cancel drift
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            v.run(a.steps)
            synchronize(info.device)
            dist.barrier()
            took = time.perf_counter() - t0
            v.seconds += took
            v.steps += a.steps
            v.round_seconds.append(took)
    result = {
        "world_size": info.world_size,
        "batch_size": a.batch_size,
        "peak_rss_mib": peak_rss_mib(),
        "device": device_name(info.device),
        "peak_gpu_mib": (torch.cuda.max_memory_allocated() / 2**20
                         if info.device.type == "cuda" else None),
        "variants": {v.name: {"steps": v.steps, "seconds": v.seconds,
                              "samples_per_s": v.steps * a.batch_size * info.world_size / v.seconds,
                              "round_seconds": v.round_seconds}
                     for v in variants},
    }
    worker_result(a.out, result)


def report(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    rows = []
    for res in results:
        v = res["variants"]
        base = v.get("torchrec_loop", {}).get("samples_per_s")
        plain = v.get("plain_pytorch", {}).get("samples_per_s")
        base_best = min(v["torchrec_loop"]["round_seconds"]) if "torchrec_loop" in v else None
        for name in VARIANTS:
            if name not in v:
                continue
            sps = v[name]["samples_per_s"]
            rounds = v[name]["round_seconds"]
            spread = max(rounds) / min(rounds) if rounds and min(rounds) > 0 else float("nan")
            rows.append([
                res["world_size"], name, f"{sps:,.0f}",
                f"{sps / base:.3f}" if base else "-",
                f"{base_best / min(rounds):.3f}" if base_best and rounds else "-",
                f"{sps / plain:.3f}" if plain else "-",
                f"{spread:.2f}",
            ])
    seq_lines = []
    for res in results:
        v = res["variants"]
        if "trainer_sequence" in v and "trainer_no_sequence" in v:
            ratio = v["trainer_no_sequence"]["samples_per_s"] / v["trainer_sequence"]["samples_per_s"]
            seq_lines.append(f"- {res['world_size']} rank(s): step time with a max_len-50 sequence "
                             f"feature / without = **{ratio:.2f}x**")
    setting = (f"{a.num_tables} tables x {a.num_embeddings:,} x {a.embedding_dim}, batch {a.batch_size}"
               f"/rank, sparse {a.sparse_optimizer} + dense Adam, {a.rounds} interleaved rounds x "
               f"{a.steps} steps after {a.warmup} warmup, on {results[0].get('device', a.device)}")
    return "\n".join([
        "## Trainer overhead",
        "",
        setting,
        "",
        markdown_table(["ranks", "variant", "samples/s", "x torchrec_loop",
                        "x torchrec_loop (fastest rounds)", "x plain_pytorch", "round spread"],
                       rows),
        "",
        "Goal: `trainer` >= 0.95x `torchrec_loop`; `trainer_pipeline` above it. Round spread: "
        "slowest / fastest round of the variant (> 1.1 means the host was noisy; rerun). The "
        "fastest rounds' ratio is the one least disturbed by other jobs on a shared host.",
        *(["", "Cost of a sequence feature (`trainer_sequence` vs `trainer_no_sequence`, the same "
           "DLRM with the candidate item pooled vs with it and a 1..50-item history in one "
           "EmbeddingCollection table, attention-pooled):", *seq_lines] if seq_lines else []),
    ])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small tables and batches, fewer steps (a smoke run, ~1-2 min)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-tables", type=int, default=26)
    p.add_argument("--num-embeddings", type=int, default=100_000)
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--sparse-optimizer", default="adagrad",
                   help="fused optimizer of the TorchRec variants (plain PyTorch uses Adagrad)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--distinct-batches", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS)
    p.add_argument("--half-precision", action="store_true",
                   help="also torchrec_loop with fp16 tables (and bf16 with --device cuda)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per world size")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: one GPU per rank (cuda:LOCAL_RANK, nccl)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.num_embeddings, a.batch_size = min(a.num_embeddings, 10_000), min(a.batch_size, 512)
        a.warmup, a.steps, a.rounds = min(a.warmup, 5), min(a.steps, 10), min(a.rounds, 2)
    if a.worker:
        worker(a)
        return
    if a.half_precision:
        half = HALF_VARIANTS if a.device == "cuda" else HALF_VARIANTS[:1]  # bf16: CUDA only
        a.variants = [*a.variants, *(v for v in half if v not in a.variants)]
    forwarded = [f"--num-tables={a.num_tables}", f"--num-embeddings={a.num_embeddings}",
                 f"--embedding-dim={a.embedding_dim}", f"--batch-size={a.batch_size}",
                 f"--sparse-optimizer={a.sparse_optimizer}", f"--warmup={a.warmup}",
                 f"--steps={a.steps}", f"--rounds={a.rounds}",
                 f"--distinct-batches={a.distinct_batches}", f"--device={a.device}",
                 "--variants", *a.variants]
    results = [torchrun(os.path.abspath(__file__), n, forwarded, a.timeout) for n in a.ranks]
    print(report(results, a))


if __name__ == "__main__":
    main()
