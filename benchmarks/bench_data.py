"""Reader throughput on a Criteo-like schema (13 dense, 26 sparse) vs raw pyarrow and the trainer.

    python benchmarks/bench_data.py [--rows 1000000] [--string-ids] [--reps 5] [--train-steps 30]

Prints three rates measured in the same run (compare them as ratios; this host is noisy):

* raw: ``pyarrow.parquet.read_table`` (default options, threads on) of the same files and the
  same columns the reader projects on, into Arrow tables;
* reader: ``ParquetWindowDataset`` reading the same files and decoding every row into ``Batch``
  (dense tensor + KJT + labels), with its default background prefetch;
* the Trainer's consumption on the benchmark model (DLRM, 26 tables, world size 1), on the CPU
  or, with ``--device cuda``, on the GPU (``--embedding-dim``/``--num-embeddings`` set its size);
* with ``--reader-procs N`` (N > 1), also N reader processes, each reading its row-range share of
  the same windows (as N ranks' readers would), started together: their summed rows/s is what
  the reader could deliver to one GPU if its batches came from N processes.

After one warm-up pass of each (page cache, imports), raw and reader runs alternate ``--reps``
times (the order flips every round so load drift hits both alike); the reader/raw ratio is
taken per round and its median reported, with the median and best rates.
Goal: reader >= 0.5x raw and >= 3x trainer (on a GPU: >= 1.5x the GPU's consumption).

``--schema inputs`` (``both``, the default, runs this after the Criteo-like one) measures the same
three rates on "real inputs": the same 13 dense + 26 hashed columns, with four transforms
declared in the ``FeatureSpec`` (clip + log1p + standardize on every dense column, a bucketized
float column, hour-of-day by div/mod of a timestamp, a cross of two id columns) and a behaviour
sequence column (``list<int64>``, 0-100 ids per row, ``SequenceFeature(max_len=50)``); raw reads
the same columns, and the Trainer trains a DLRM whose extra input is the sum of the sequence's
embeddings (an ``EmbeddingCollection`` over ``Batch.sequence``).
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import tempfile
import time
from statistics import median

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from recsys_trainer.batch import Batch
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec

NUM_DENSE, NUM_SPARSE = 13, 26


MAX_LEN = 50


def write_data(root: str, rows: int, files_per_window: int, windows: int, string_ids: bool,
               inputs: bool = False) -> None:
    """Criteo-like files; ``inputs`` adds ``price`` (float), ``ts`` (int64 seconds) and
    ``hist`` (a list of 0-100 int64 ids per row)."""
    rng = np.random.default_rng(0)
    per_file = rows // (files_per_window * windows)
    for w in range(windows):
        d = os.path.join(root, f"hour={w:02d}")
        os.makedirs(d, exist_ok=True)
        for f in range(files_per_window):
            cols: dict[str, pa.Array] = {"label": pa.array(rng.integers(0, 2, per_file).astype(np.float32))}
            for i in range(NUM_DENSE):
                cols[f"I{i + 1}"] = pa.array(rng.exponential(5, per_file).astype(np.float32))
            for i in range(NUM_SPARSE):
                ids = (rng.zipf(1.3, per_file) - 1) % 1_000_000
                cols[f"C{i + 1}"] = (pa.array(ids).cast(pa.string()) if string_ids
                                     else pa.array(ids.astype(np.int64)))
            if inputs:
                cols["price"] = pa.array(rng.lognormal(3, 1, per_file))
                cols["ts"] = pa.array(rng.integers(1_700_000_000, 1_700_000_000 + 86400 * 30, per_file))
                lens = rng.integers(0, 101, per_file)
                offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                values = pa.array((rng.zipf(1.3, int(offsets[-1])) - 1) % 1_000_000)
                cols["hist"] = pa.ListArray.from_arrays(pa.array(offsets), values)
            pq.write_table(pa.table(cols), os.path.join(d, f"part-{f}.parquet"), row_group_size=65536)


def spec(num_embeddings: int) -> FeatureSpec:
    return FeatureSpec(
        labels=["label"], dense=[f"I{i + 1}" for i in range(NUM_DENSE)],
        sparse=[SparseFeature(name=f"C{i + 1}", num_embeddings=num_embeddings, hash=True)
                for i in range(NUM_SPARSE)],
    )


def inputs_spec(num_embeddings: int) -> FeatureSpec:
    """``spec`` plus four transforms and a sequence feature (see the module docstring)."""
    base = spec(num_embeddings)
    return FeatureSpec(
        labels=["label"],
        dense=[DenseFeature(column=f"I{i + 1}", clip=(0.0, None), log1p=True, standardize=(1.5, 0.8))
               for i in range(NUM_DENSE)],
        sparse=[*base.sparse,
                SparseFeature(name="price_b", column="price", num_embeddings=11,
                              boundaries=[5, 10, 15, 20, 30, 40, 60, 80, 120, 200]),
                SparseFeature(name="hour", column="ts", num_embeddings=24, div=3600, mod=24),
                SparseFeature(name="C1xC2", num_embeddings=num_embeddings, cross=["C1", "C2"])],
        sequence=[SequenceFeature(name="hist", num_embeddings=num_embeddings, hash=True, max_len=MAX_LEN)],
    )


class SeqDLRM(torch.nn.Module):
    """DLRM over the pooled features, with the sum of the behaviour sequence's embeddings (an
    ``EmbeddingCollection`` over ``Batch.sequence``) as extra dense inputs."""

    def __init__(self, fs: FeatureSpec, embedding_dim: int) -> None:
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection

        from recsys_trainer.models import DLRMClassifier

        super().__init__()
        self.dlrm = DLRMClassifier(fs.sparse_names, fs.num_dense + embedding_dim,
                                   [s.num_embeddings for s in fs.sparse], embedding_dim=embedding_dim,
                                   dense_arch=(512, 256), over_arch=(512, 256, 1))
        q = fs.sequence[0]
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name=f"t_{q.name}", embedding_dim=embedding_dim, num_embeddings=q.num_embeddings,
            feature_names=[q.name])], device=torch.device("meta"))
        self.key = q.name

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        hist = self.ec(batch.sequence)[self.key].to_padded_dense(desired_length=MAX_LEN).sum(1)
        return self.dlrm(Batch(dense=torch.cat([batch.dense, hist], dim=1), sparse=batch.sparse,
                               labels=batch.labels, weights=batch.weights))


def bench_raw(files: list[str], columns: list[str]) -> float:
    t0 = time.perf_counter()
    rows = sum(pq.read_table(f, columns=columns).num_rows for f in files)
    return rows / (time.perf_counter() - t0)


def bench_reader(root: str, fs: FeatureSpec, batch_size: int) -> float:
    ds = ParquetWindowDataset(root, fs, batch_size=batch_size, prefetch_batches=4)
    t0 = time.perf_counter()
    rows = 0
    for w in ds.window_ids():
        for b in ds.iter_window(w):
            rows += b.batch_size
    return rows / (time.perf_counter() - t0)


def _reader_proc(root: str, fs: FeatureSpec, batch_size: int, rank: int, procs: int,
                 start: object, results: object) -> None:
    ds = ParquetWindowDataset(root, fs, batch_size=batch_size, prefetch_batches=4)
    ds.setup(rank, procs)
    start.wait()  # type: ignore[attr-defined]  # every process's imports are done: start together
    t0 = time.perf_counter()
    rows = 0
    for w in ds.window_ids():
        for b in ds.iter_window(w):
            rows += b.batch_size
    results.put((rows, t0, time.perf_counter()))  # type: ignore[attr-defined]


def bench_reader_procs(root: str, fs: FeatureSpec, batch_size: int, procs: int) -> float:
    """Summed rows/s of ``procs`` reader processes, each reading its share (rank i of procs)."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_reader_proc, args=(root, fs, batch_size, r, procs, start, results))
          for r in range(procs)]
    for p in ps:
        p.start()
    out = [results.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    rows = sum(o[0] for o in out)
    return rows / (max(o[2] for o in out) - min(o[1] for o in out))


def bench_trainer(root: str, fs: FeatureSpec, batch_size: int, steps: int, device: str = "cpu",
                  embedding_dim: int = 64) -> float:
    from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
    from recsys_trainer.models import DLRMClassifier

    ds = ParquetWindowDataset(root, fs, batch_size=batch_size)
    w = next(ds.window_ids())
    batches = []
    for b in ds.iter_window(w):
        batches.append(b.pin_memory() if device == "cuda" else b)
        if len(batches) >= steps + 5:
            break
    model: torch.nn.Module
    if fs.sequence:
        model = SeqDLRM(fs, embedding_dim)
    else:
        model = DLRMClassifier(fs.sparse_names, NUM_DENSE, [s.num_embeddings for s in fs.sparse],
                               embedding_dim=embedding_dim, dense_arch=(512, 256),
                               over_arch=(512, 256, 1))
    warm = 5  # skip warm-up steps (allocation, first-touch of tables)
    t0: list[float] = []
    from recsys_trainer.hooks.lambda_hook import LambdaHook

    def after_step(t: object, out: object) -> None:
        if len(t0) == 0 and out.step == warm:  # type: ignore[attr-defined]
            if device == "cuda":
                torch.cuda.synchronize()  # the clock starts when the warm-up steps have run
            t0.append(time.perf_counter())

    trainer = Trainer(model, TrainingArguments(output_dir=tempfile.mkdtemp(), log_steps=10_000,
                                               device=device),
                      train_dataset=batches, hooks=[LambdaHook(after_step=after_step)],
                      add_logger_hook=False,
                      sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05))
    trainer.train()
    if device == "cuda":
        torch.cuda.synchronize()
    steps_done = trainer.state.global_step
    rate = (steps_done - warm) * batch_size / (time.perf_counter() - t0[0])
    from recsys_trainer import shutdown

    shutdown()  # nccl warns (and may leak) when a process exits with its group alive
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--string-ids", action="store_true", help="sparse ids as strings (hashed)")
    p.add_argument("--reps", type=int, default=5, help="interleaved raw/reader rounds")
    p.add_argument("--train-steps", type=int, default=30, help="0 skips the trainer measurement")
    p.add_argument("--num-embeddings", type=int, default=100_000)
    p.add_argument("--embedding-dim", type=int, default=64, help="of the trainer's model")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the trainer runs")
    p.add_argument("--reader-procs", type=int, nargs="*", default=[],
                   help="also measure this many reader processes together (e.g. 2 4 8)")
    p.add_argument("--schema", default="both", choices=("criteo", "inputs", "both"),
                   help="criteo: 13 dense + 26 ids; inputs: the same with four transforms and a "
                        "sequence column (max_len 50); both (default): one after the other")
    a = p.parse_args()
    torch.set_flush_denormal(True)
    schemas = ["criteo", "inputs"] if a.schema == "both" else [a.schema]
    for i, schema in enumerate(schemas):
        if i:
            print()
        run_schema(a, schema == "inputs")


def run_schema(a: argparse.Namespace, inputs: bool) -> None:
    """Measure and print raw / reader / trainer rates for one schema."""
    with tempfile.TemporaryDirectory() as root:
        write_data(root, a.rows, files_per_window=4, windows=2, string_ids=a.string_ids, inputs=inputs)
        files = sorted(glob.glob(os.path.join(root, "*", "*.parquet")))
        fs = inputs_spec(a.num_embeddings) if inputs else spec(a.num_embeddings)
        bench_raw(files, fs.columns())  # warm-up: page cache, pyarrow thread pool
        bench_reader(root, fs, a.batch_size)  # warm-up: imports, allocator
        raws: list[float] = []
        readers: list[float] = []
        for rep in range(a.reps):
            for which in (("raw", "reader") if rep % 2 == 0 else ("reader", "raw")):
                if which == "raw":
                    raws.append(bench_raw(files, fs.columns()))
                else:
                    readers.append(bench_reader(root, fs, a.batch_size))
        multi = {n: bench_reader_procs(root, fs, a.batch_size, n) for n in a.reader_procs if n > 1}
        train = (bench_trainer(root, fs, a.batch_size, a.train_steps, a.device, a.embedding_dim)
                 if a.train_steps > 0 else None)
    ratios = [r / w for r, w in zip(readers, raws, strict=True)]
    raw_rate, reader_rate, ratio = median(raws), median(readers), median(ratios)
    kind = "string (hashed)" if a.string_ids else "int64 (hashed)"
    extra = (" + 4 transforms (dense clip/log1p/standardize, bucketize, div/mod, cross) + a sequence "
             f"column (0-100 ids per row, max_len {MAX_LEN})") if inputs else ""
    print(f"schema: {NUM_DENSE} dense + {NUM_SPARSE} sparse {kind}{extra}, {a.rows} rows, batch "
          f"{a.batch_size}, {a.reps} interleaved rounds (median; best in brackets)")
    print(f"raw pyarrow read_table : {raw_rate:12,.0f} rows/s  [{max(raws):12,.0f}]")
    print(f"ParquetWindowDataset   : {reader_rate:12,.0f} rows/s  [{max(readers):12,.0f}]  "
          f"({ratio:.2f}x raw, median of per-round ratios {', '.join(f'{x:.2f}' for x in ratios)}; "
          "goal >= 0.5x)")
    for n, rate in multi.items():
        vs = f", {rate / train:.2f}x the trainer" if train else ""
        print(f"{n} reader processes    : {rate:12,.0f} rows/s  ({rate / reader_rate:.2f}x one reader{vs})")
    if train is not None:
        where = (f"{torch.cuda.get_device_name()}, dim {a.embedding_dim}" if a.device == "cuda"
                 else f"CPU, dim {a.embedding_dim}")
        goal = "1.5x" if a.device == "cuda" else "3x"
        model = "DLRM + sequence EmbeddingCollection" if inputs else "DLRM"
        print(f"trainer consumption    : {train:12,.0f} rows/s on {where}, {model}  (one reader is "
              f"{reader_rate / train:.2f}x, goal >= {goal})")


if __name__ == "__main__":
    main()
