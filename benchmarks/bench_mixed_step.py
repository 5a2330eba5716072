"""What making some of a model's tables dynamic costs per step: a DLRM with 26 pooled features,
``user`` and ``item`` dynamic (``DLRMClassifier(dynamic={feature: DynamicTable})``, a
``MixedEmbeddingBagCollection``) against the same DLRM with every table hashed.

    python benchmarks/bench_mixed_step.py [--rounds 8] [--quick]
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_mixed_step.py   # 2 ranks

Batches: ``ChurnStream``'s ``user`` and ``item`` (20,000 of each, raw 63-bit ids) and 24
categoricals ``c0..c23`` drawn uniformly below ``--vocab`` (each rank its own rows), 4 dense
features, 512 rows per rank and step; dim 16, fused row-wise Adagrad 0.05, Adam 3e-3.

- ``hashed``: user and item hashed into 2,850 rows each (the rows a 1,600-slot dynamic table's
  bytes buy at dim 16, ``bench_dynamic.py``), the categoricals into ``--vocab`` rows: one
  ``EmbeddingBagCollection``;
- ``split``: the tables of ``hashed`` in two collections, user and item in one, the
  categoricals in the other (what holding two sharded collections costs, whatever they hold);
- ``mixed``: user and item dynamic (the default ``DynamicTable``, 1,600 slots), the
  categoricals as in ``hashed``.

Step time per step as process CPU time and wall time; the models take turns every ``--chunk``
batches (which one goes first rotates), over ``--rounds`` fresh windows of the stream of 40
batches each, after one window that warms up and fills the maps. Printed: mean and median of
each over ``hashed``. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch
from bench_dynamic import train_step
from torch import nn
from torchrec.models.dlrm import SparseArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments, shutdown
from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.id_stream import ChurnStream
from recsys_trainer.data.hashing import stable_hash_ints
from recsys_trainer.dynamic import ID_SPACE, DynamicTable
from recsys_trainer.dynamic.modules import _merge_keyed
from recsys_trainer.models import DLRMClassifier, make_tables

DIM, SLOTS, HASHED_ROWS, CATEGORICALS = 16, 1600, 2850, 24
MODELS = ("hashed", "split", "mixed")
FEATURES = ["user", "item", *(f"c{i}" for i in range(CATEGORICALS))]


class TwoCollections(nn.Module):
    """``split``: two ``EmbeddingBagCollection``s (the first two tables, then the others)
    merged as ``MixedEmbeddingBagCollection`` merges its two."""

    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.ids = EmbeddingBagCollection(tables=tables[:2], device=torch.device("meta"))
        self.categoricals = EmbeddingBagCollection(tables=tables[2:], device=torch.device("meta"))
        self._tables = tables
        self._dims = [DIM] * len(tables)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._tables

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return _merge_keyed(self.categoricals(features), self.ids(features), FEATURES,
                            self._dims)


def with_categoricals(batches: list[Batch], vocab: int, seed: int) -> list[Batch]:
    """The stream's batches with ``CATEGORICALS`` more features of one id below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in batches:
        rows = b.sparse.stride()
        cats = torch.randint(0, vocab, (CATEGORICALS * rows,), generator=g)
        kjt = KeyedJaggedTensor(
            keys=[*b.sparse.keys(), *(f"c{i}" for i in range(CATEGORICALS))],
            values=torch.cat([b.sparse.values(), cats]),
            lengths=torch.ones((2 + CATEGORICALS) * rows, dtype=torch.int32), stride=rows)
        out.append(Batch(dense=b.dense, sparse=kjt, labels=b.labels))
    return out


def hash_ids(batches: list[Batch], rows: int) -> list[Batch]:
    """``user`` and ``item`` hashed into ``rows`` rows (``stable_hash_ints``), the rest as is."""
    out = []
    for b in batches:
        # ChurnStream's batches: user then item, one id per row.
        assert b.sparse.keys()[:2] == ["user", "item"] and b.sparse.lengths().eq(1).all()
        v = b.sparse.values().clone()
        n = 2 * b.sparse.stride()
        v[:n] = torch.from_numpy((stable_hash_ints(v[:n].numpy()) % np.uint64(rows)).astype(np.int64))
        out.append(Batch(dense=b.dense, labels=b.labels, sparse=KeyedJaggedTensor(
            keys=b.sparse.keys(), values=v, lengths=b.sparse.lengths(), stride=b.sparse.stride())))
    return out


def make(kind: str, vocab: int, out: str) -> Trainer:
    torch.manual_seed(0)
    if kind == "mixed":
        table = DynamicTable(num_slots=SLOTS)
        rows, dynamic = [ID_SPACE, ID_SPACE], {"user": table, "item": table}
    else:
        rows, dynamic = [HASHED_ROWS, HASHED_ROWS], {}
    model = DLRMClassifier(FEATURES, 4, num_embeddings=rows + [vocab] * CATEGORICALS,
                           embedding_dim=DIM, dense_arch=(32,), over_arch=(32, 1),
                           dynamic=dynamic or None)
    if kind == "split":
        model.dlrm.sparse_arch = SparseArch(TwoCollections(  # type: ignore[arg-type]
            make_tables(FEATURES, rows + [vocab] * CATEGORICALS, DIM)))
    return Trainer(model=model, args=TrainingArguments(output_dir=out, log_steps=10**9),
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=3e-3), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
                   add_logger_hook=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="timed windows of 40 steps")
    ap.add_argument("--chunk", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--vocab", type=int, default=1000, help="rows of each categorical's table")
    ap.add_argument("--out", default="output/bench_mixed_step")
    a = ap.parse_args()
    rounds = 2 if a.quick else a.rounds
    rank = int(os.environ.get("RANK", "0"))
    torch.set_flush_denormal(True)
    # A fresh window of the stream per round (the first one warms up and fills the maps): the
    # dynamic tables keep seeing new ids, as in training.
    stream = ChurnStream(windows=1 + rounds, seed=rank)
    windows = [with_categoricals(stream.window(w, 40, 512, seed=1), a.vocab, seed=10 * w + rank)
               for w in range(1 + rounds)]
    trainers = {k: make(k, a.vocab, os.path.join(a.out, k)) for k in MODELS}
    cpu: dict[str, list[float]] = {k: [] for k in MODELS}
    wall: dict[str, list[float]] = {k: [] for k in MODELS}
    load = os.getloadavg()[0]
    for w, window in enumerate(windows):
        batches = {k: window if k == "mixed" else hash_ids(window, HASHED_ROWS) for k in MODELS}
        order = MODELS[w % len(MODELS):] + MODELS[:w % len(MODELS)]  # who goes first rotates
        for lo in range(0, len(window), a.chunk):
            for k in order:
                for b in batches[k][lo:lo + a.chunk]:
                    c0 = time.process_time()
                    dt = train_step(trainers[k], b)
                    if w > 0:
                        wall[k].append(dt)
                        cpu[k].append(time.process_time() - c0)
    if rank == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(f"# bench_mixed_step\n\n{platform.machine()}, {os.cpu_count()} cores, "
              f"{torch.get_num_threads()} threads, load average {load:.1f} (start) "
              f"{os.getloadavg()[0]:.1f} (end); {world} rank(s), {rounds} windows of "
              f"{len(windows[1])} steps per model\n")
        print("| model | CPU ms mean | CPU ms median | CPU mean x hashed | CPU median x hashed | "
              "wall mean x hashed | wall median x hashed |\n|---|---|---|---|---|---|---|")
        for k in MODELS:
            print(f"| {k} | {1e3 * statistics.fmean(cpu[k]):.2f} | "
                  f"{1e3 * statistics.median(cpu[k]):.2f} | "
                  f"{statistics.fmean(cpu[k]) / statistics.fmean(cpu['hashed']):.3f} | "
                  f"{statistics.median(cpu[k]) / statistics.median(cpu['hashed']):.3f} | "
                  f"{statistics.fmean(wall[k]) / statistics.fmean(wall['hashed']):.3f} | "
                  f"{statistics.median(wall[k]) / statistics.median(wall['hashed']):.3f} |")
    shutdown()


if __name__ == "__main__":
    main()
