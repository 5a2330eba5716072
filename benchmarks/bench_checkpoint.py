"""Checkpoint benchmark: save throughput vs the disk, loop blocking (async vs sync), restore time.

For each world size (1 process, or 2 gloo ranks under torchrun) and table size it builds a
Trainer whose model has big embedding tables (``rows x dim`` in all, fused row-wise Adagrad;
with 2 ranks two tables of ``rows / 2``, one per rank, so each rank writes its own shards
concurrently) plus a small DLRM, then:

* trains ``--first-save-step`` steps with ``save_steps`` set, so the *first* async save happens
  inside the loop as in a real job (its staging buffers are pre-allocated on a helper thread
  from the start of ``train()``; reported: the time it blocked, and how long the
  pre-allocation took);
* ``--repeats`` rounds of: a sync save per ``--threads`` value (the loop is blocked for the
  whole save), each between two probes of the sequential write bandwidth of the same
  directory (16 MiB writes of as many bytes as the checkpoint, by one writer, then fsync; the
  save is compared with the mean of the two), and a steady-state async save (blocked only for
  the snapshot). Ratios are taken per save, then the median over rounds;
* one async save with fresh (cold) staging buffers, for reference;
* restores the last checkpoint.

Goals (issue 4): async blocks the loop for at most 20% of a sync save; save throughput (bytes
of all ranks / wall time of the save) is at least 0.6x the measured disk bandwidth.

``--s3`` (issue 13) instead compares object storage with local disk, in one process: it starts
a local S3 server (SeaweedFS, as the tests do: tests/s3_server.py), and per round makes a sync
save and a restore (with the CRC check) of the same state to the local directory and to the
bucket, alternating which goes first. Reported: medians, the ratio S3 / local per round, and the
server's own limit: one 16 MiB-part upload and one download of as many bytes with pyarrow, i.e.
what a checkpoint could reach at best through that server.

Usage: python benchmarks/bench_checkpoint.py [--quick] [--rows 1e5 1e6 1e7] [--world-sizes 1 2]
       [--threads 1 2 4] [--repeats 3] [--dim 16] [--dir /tmp/x] [--json out.json] [--s3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import markdown_table, quiet_torchrec, torchrun, worker_result  # noqa: E402

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments  # noqa: E402
from recsys_trainer.checkpoint import CheckpointManager  # noqa: E402
from recsys_trainer.checkpoint.writer import StagingBuffers  # noqa: E402
from recsys_trainer.data.generators.synthetic import synthetic_batches  # noqa: E402
from recsys_trainer.models import DLRMClassifier  # noqa: E402


def disk_bandwidth(directory: str, num_bytes: int) -> float:
    """Sequential write MB/s of ``directory``: 16 MiB writes of random bytes, then fsync (as a
    checkpoint does; 16 MiB writes were the fastest size measured here, faster than 1 MiB)."""
    path = os.path.join(directory, "bandwidth.probe")
    block = os.urandom(16 << 20)
    n = max(1, -(-num_bytes // (16 << 20)))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return n * (16 << 20) / dt / 1e6


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench(rows: int, dim: int, root: str, threads: list[int], repeats: int,
          first_save_step: int) -> dict[str, Any]:
    """One configuration, in this process (all ranks run it); rank 0's figures are returned."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = os.path.join(root, f"rows_{rows}_w{world}")
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    big = ["big"] if world == 1 else [f"big{i}" for i in range(world)]
    feats = [*big, "s0", "s1"]
    sizes = [rows // len(big)] * len(big) + [1000, 1000]
    torch.manual_seed(0)
    model = DLRMClassifier(feats, 4, sizes, embedding_dim=dim, dense_arch=(32,), over_arch=(32, 1))
    data = synthetic_batches(first_save_step, 256, feats, 4, 1000, seed=rank)
    trainer = Trainer(
        model, TrainingArguments(output_dir=out, train_steps=first_save_step,
                                 save_steps=first_save_step, log_steps=10**9, resume_from=None,
                                 max_to_keep=2, save_concurrency_per_rank=threads[0],
                                 sharding_types={f"t_{f}": "table_wise" for f in feats}),
        train_dataset=data, sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
        add_logger_hook=False,
    )
    t0 = time.perf_counter()
    trainer.train()  # the first async save happens in the loop, at step first_save_step
    mgr: CheckpointManager = trainer.checkpointer
    first = mgr.history[0]
    train_s = time.perf_counter() - t0 - first.total_s
    step = first_save_step

    def save(blocking: bool, n_threads: int) -> tuple[float, float, int]:
        nonlocal step
        step += 1
        trainer.state.global_step = step
        mgr.settings.save_concurrency_per_rank = n_threads
        if dist.is_initialized():
            dist.barrier()
        mgr.save(blocking=blocking)
        mgr.wait()
        s = mgr.history[-1]
        return s.blocked_s, s.total_s, s.num_bytes

    def probe(num_bytes: int) -> float:
        if dist.is_initialized():
            dist.barrier()
        bw = disk_bandwidth(out, num_bytes) if rank == 0 else 0.0
        if dist.is_initialized():
            dist.barrier()
        return bw

    sync: dict[int, list[float]] = {t: [] for t in threads}
    ratio: dict[int, list[float]] = {t: [] for t in threads}
    disk, blocked, blocked_ratio, async_total = [], [], [], []
    nbytes = first.num_bytes
    for r in range(repeats):
        order = threads if r % 2 == 0 else threads[::-1]  # alternate to cancel drift
        round_sync: dict[int, float] = {}
        # The disk's speed drifts (shared host): every sync save is bracketed by two probes and
        # compared with their mean.
        bws = [probe(nbytes)]
        for t in order:
            _, total, nbytes = save(True, t)
            round_sync[t] = total
            bws.append(probe(nbytes))
            bw = (bws[-2] + bws[-1]) / 2
            sync[t].append(total)
            ratio[t].append(nbytes / total / 1e6 / bw if bw else float("nan"))
        b, total, _ = save(False, threads[0])
        disk.extend(bws)
        blocked.append(b)
        async_total.append(total)
        blocked_ratio.append(b / round_sync[threads[0]])
    prep = mgr._staging.prepared_s
    mgr._staging = StagingBuffers()  # cold: the first save allocates its buffers itself
    cold, _, _ = save(False, threads[0])
    t1 = time.perf_counter()
    mgr.load(os.path.join(out, f"step_{step:08d}"))
    restore = time.perf_counter() - t1
    mgr.close()
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    res: dict[str, Any] = {
        "world": world, "rows": rows, "MB": round(nbytes / 1e6, 1),
        "disk_MBps": round(_median(disk), 1),
    }
    for t in threads:
        res[f"sync_s_t{t}"] = round(_median(sync[t]), 3)
        res[f"sync_vs_disk_t{t}"] = round(_median(ratio[t]), 2)
    res.update({
        "first_async_blocked_s": round(first.blocked_s, 3),
        "first_save_after_s": round(train_s, 2),
        "prealloc_s": round(prep, 3) if prep is not None else None,
        "async_blocked_s": round(_median(blocked), 4),
        "async_blocked_vs_sync": round(_median(blocked_ratio), 3),
        "async_total_s": round(_median(async_total), 3),
        "cold_async_blocked_s": round(cold, 3),
        "restore_s": round(restore, 3),
    })
    return res


def object_store_bandwidth(fs: Any, path: str, num_bytes: int) -> tuple[float, float]:
    """``(upload MB/s, download MB/s)`` of ``num_bytes`` through one pyarrow stream each."""
    block = os.urandom(16 << 20)
    n = max(1, -(-num_bytes // (16 << 20)))
    t0 = time.perf_counter()
    with fs.open_output_stream(path) as f:
        for _ in range(n):
            f.write(block)
    up = time.perf_counter() - t0
    t0 = time.perf_counter()
    with fs.open_input_stream(path) as f:
        while f.read(16 << 20):
            pass
    down = time.perf_counter() - t0
    fs.delete_file(path)
    mb = n * (16 << 20) / 1e6
    return mb / up, mb / down


def bench_s3(rows: int, dim: int, root: str, repeats: int) -> dict[str, Any]:
    """Sync save and restore of one state to local disk and to a local S3 server (one process)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    from s3_server import running_s3_server

    feats = ["big", "s0", "s1"]
    torch.manual_seed(0)
    model = DLRMClassifier(feats, 4, [rows, 1000, 1000], embedding_dim=dim, dense_arch=(32,),
                           over_arch=(32, 1))
    local_dir = os.path.join(root, f"local_{rows}")
    shutil.rmtree(local_dir, ignore_errors=True)
    trainer = Trainer(
        model, TrainingArguments(output_dir=local_dir, train_steps=5, log_steps=10**9,
                                 resume_from=None, sharding_types={f"t_{f}": "table_wise"
                                                                   for f in feats}),
        train_dataset=synthetic_batches(5, 256, feats, 4, 1000, seed=0),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05), add_logger_hook=False,
    )
    trainer.train()
    with running_s3_server(os.path.join(root, f"s3_{rows}")) as server:
        fs = server.filesystem()
        prefix = f"{server.bucket}/bench_{rows}"
        managers = {
            "local": CheckpointManager(local_dir, max_to_keep=2, async_save=False,
                                       resume_from=None),
            "s3": CheckpointManager(prefix, max_to_keep=2, async_save=False, resume_from=None,
                                    filesystem=fs),
        }
        for m in managers.values():
            m.attach(trainer.state_components())
        save_s: dict[str, list[float]] = {k: [] for k in managers}
        load_s: dict[str, list[float]] = {k: [] for k in managers}
        save_ratio, load_ratio, bw_up, bw_down, disk = [], [], [], [], []
        step = trainer.state.global_step
        nbytes = 0
        for r in range(repeats):
            order = list(managers) if r % 2 == 0 else list(managers)[::-1]
            step += 1
            trainer.state.global_step = step
            for name in order:
                mgr = managers[name]
                path = mgr.save(blocking=True)
                save_s[name].append(mgr.history[-1].total_s)
                nbytes = mgr.history[-1].num_bytes
                t0 = time.perf_counter()
                mgr.load(path)
                load_s[name].append(time.perf_counter() - t0)
            save_ratio.append(save_s["s3"][-1] / save_s["local"][-1])
            load_ratio.append(load_s["s3"][-1] / load_s["local"][-1])
            up, down = object_store_bandwidth(fs, f"{prefix}/bandwidth.probe", nbytes)
            bw_up.append(up)
            bw_down.append(down)
            disk.append(disk_bandwidth(local_dir, nbytes))
        for m in managers.values():
            m.close()
    shutil.rmtree(local_dir, ignore_errors=True)
    return {
        "rows": rows, "MB": round(nbytes / 1e6, 1),
        "local_save_s": round(_median(save_s["local"]), 3),
        "s3_save_s": round(_median(save_s["s3"]), 3),
        "save_s3_vs_local": round(_median(save_ratio), 2),
        "local_restore_s": round(_median(load_s["local"]), 3),
        "s3_restore_s": round(_median(load_s["s3"]), 3),
        "restore_s3_vs_local": round(_median(load_ratio), 2),
        "s3_save_MBps": round(nbytes / 1e6 / _median(save_s["s3"]), 1),
        "server_put_MBps": round(_median(bw_up), 1),
        "server_get_MBps": round(_median(bw_down), 1),
        "disk_MBps": round(_median(disk), 1),
    }


def worker(a: argparse.Namespace) -> None:
    from recsys_trainer.distributed import init_distributed

    quiet_torchrec()
    logging.getLogger().setLevel(logging.ERROR)
    init_distributed("cpu")
    results = [bench(int(r), a.dim, a.dir, a.threads, a.repeats, a.first_save_step)
               for r in a.rows]
    worker_result(a.out, results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="rows 1e5 1e6, 2 repeats")
    p.add_argument("--rows", type=float, nargs="+", default=[1e5, 1e6, 1e7])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--threads", type=int, nargs="+", default=[4, 1, 2],
                   help="save_concurrency_per_rank values to time (the first is used for async)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--first-save-step", type=int, default=200)
    p.add_argument("--dir", default=None, help="output directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--s3", action="store_true",
                   help="compare a local S3 server (SeaweedFS) with local disk instead")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.rows, a.repeats = [1e5, 1e6], 2
    a.dir = a.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    os.makedirs(a.dir, exist_ok=True)
    if a.worker:
        worker(a)
        return
    if a.s3:
        quiet_torchrec()
        logging.getLogger().setLevel(logging.ERROR)
        res = [bench_s3(int(r), a.dim, a.dir, a.repeats) for r in a.rows]
        cols = list(res[0])
        print("## Checkpoints: local S3 server vs local disk (1 process, sync save + restore; "
              "medians, ratios within a round)\n")
        print(markdown_table(cols, [[r[c] for c in cols] for r in res]))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
        return
    forwarded = ["--rows", *map(str, a.rows), "--dim", str(a.dim), "--threads",
                 *map(str, a.threads), "--repeats", str(a.repeats), "--first-save-step",
                 str(a.first_save_step), "--dir", a.dir]
    results: list[dict[str, Any]] = []
    for n in a.world_sizes:
        results += torchrun(os.path.abspath(__file__), n, forwarded, a.timeout)
    cols = list(results[0])
    print("## Checkpoint save/restore (medians over rounds; ratios within a round)\n")
    print(markdown_table(cols, [[r[c] for c in cols] for r in results]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
