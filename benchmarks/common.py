"""Shared pieces of the benchmarks: the model, data, timing, torchrun launching, markdown.

Every benchmark compares variants *measured in the same run* and reports ratios: this kind of
host is noisy (+-10-15% run to run), so an absolute samples/s from one run means little.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.synthetic import PlantedSignal, synthetic_batches
from recsys_trainer.distributed import shutdown
from recsys_trainer.models import DINClassifier, DLRMClassifier, weighted_bce_with_logits

NUM_DENSE = 13
DENSE_ARCH = (512, 256, 64)
OVER_ARCH = (512, 256, 1)


def sparse_names(num_tables: int) -> list[str]:
    return [f"cat_{i}" for i in range(num_tables)]


def make_batches(num_batches: int, batch_size: int, num_tables: int, num_embeddings: int,
                 seed: int) -> list[Batch]:
    """Synthetic DLRM batches (Zipf ids, one id per feature per row)."""
    sig = PlantedSignal.make(num_tables, NUM_DENSE, num_embeddings, seed=1234, strength=0.35)
    return synthetic_batches(num_batches, batch_size, sparse_names(num_tables), NUM_DENSE,
                             num_embeddings, seed=seed, signal=sig)


SEQUENCE_MAX_LEN = 50
NUM_ITEMS = 100_000


def with_items(batches: list[Batch], sequence: bool, seed: int) -> list[Batch]:
    """``batches`` plus a candidate item per row: as one more pooled feature ``item`` (the
    DLRM without a sequence), or with each row's history of 1..``SEQUENCE_MAX_LEN`` items
    (uniform lengths) as ``batch.sequence`` keys ``item``/``hist_item`` (the DIN)."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for b in batches:
        n = b.batch_size
        item = torch.randint(0, NUM_ITEMS, (n,), generator=rng)
        ones = torch.ones(n, dtype=torch.int32)
        if not sequence:
            extra = KeyedJaggedTensor(keys=["item"], values=item, lengths=ones, stride=n)
            out.append(dataclasses.replace(b, sparse=KeyedJaggedTensor.concat([b.sparse, extra])))
            continue
        lens = torch.randint(1, SEQUENCE_MAX_LEN + 1, (n,), generator=rng, dtype=torch.int32)
        hist = torch.randint(0, NUM_ITEMS, (int(lens.sum()),), generator=rng)
        seq = KeyedJaggedTensor(keys=["item", "hist_item"], values=torch.cat([item, hist]),
                                lengths=torch.cat([ones, lens]), stride=n)
        out.append(dataclasses.replace(b, sequence=seq))
    return out


def sequence_models(num_tables: int, num_embeddings: int, embedding_dim: int,
                    ) -> tuple[DLRMClassifier, DINClassifier]:
    """The benchmark DLRM with the candidate item as a pooled table, and the same DLRM with the
    candidate and a max_len-50 history in one shared item table, attention-pooled (DIN)."""
    names = sparse_names(num_tables)
    arch = {"dense_arch": (*DENSE_ARCH[:-1], embedding_dim), "over_arch": OVER_ARCH}
    without = DLRMClassifier([*names, "item"], NUM_DENSE, [num_embeddings] * num_tables + [NUM_ITEMS],
                             embedding_dim, **arch)
    with_seq = DINClassifier(names, NUM_DENSE, num_items=NUM_ITEMS, max_len=SEQUENCE_MAX_LEN,
                             num_embeddings=num_embeddings, embedding_dim=embedding_dim, **arch)
    return without, with_seq


def dlrm(num_tables: int, num_embeddings: int, embedding_dim: int,
         dtype: str = "fp32") -> DLRMClassifier:
    """The benchmark model (tables on the meta device, for DMP; stored in ``dtype``)."""
    return DLRMClassifier(sparse_names(num_tables), NUM_DENSE, num_embeddings, embedding_dim,
                          dense_arch=(*DENSE_ARCH[:-1], embedding_dim), over_arch=OVER_ARCH,
                          embedding_dtype=dtype)


class PlainDLRM(nn.Module):
    """The same DLRM in plain PyTorch: ``nn.EmbeddingBag(sparse=True)`` per table, torchrec's
    dense/interaction/over arches. Takes ``(dense, [(ids, offsets)] per table, labels)``."""

    def __init__(self, num_tables: int, num_embeddings: int, embedding_dim: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        # Tables built where they train: 26 x 1M x 128 is 13 GB, slow to initialise on a CPU.
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(num_embeddings, embedding_dim, mode="sum", sparse=True, device=device)
            for _ in range(num_tables)
        )
        self.dense_arch = DenseArch(NUM_DENSE, [*DENSE_ARCH[:-1], embedding_dim])
        self.inter_arch = InteractionArch(num_tables)
        # As torchrec's DLRM: the dense vector plus every pairwise dot of the F+1 vectors.
        over_in = embedding_dim + num_tables * (num_tables - 1) // 2 + num_tables
        self.over_arch = OverArch(over_in, list(OVER_ARCH))

    def forward(self, dense: torch.Tensor, sparse: Sequence[tuple[torch.Tensor, torch.Tensor]],
                labels: torch.Tensor) -> torch.Tensor:
        emb = torch.stack([t(ids, offsets) for t, (ids, offsets) in zip(self.tables, sparse, strict=True)], 1)
        logits = self.over_arch(self.inter_arch(self.dense_arch(dense), emb)).squeeze(-1)
        return weighted_bce_with_logits(logits, labels, None)


def plain_inputs(batch: Batch) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """A ``Batch`` as ``PlainDLRM`` inputs (what a plain-PyTorch data loader would yield)."""
    jt = batch.sparse.to_dict()
    sparse = [(jt[k].values(), jt[k].offsets()[:-1].contiguous()) for k in batch.sparse.keys()]
    return batch.dense, sparse, batch.labels


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_name(device: torch.device) -> str:
    """What the benchmark ran on, for the report (the GPU's name, or the CPU core count)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU, {os.cpu_count()} cores (torch {torch.__version__})"


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA kernels run asynchronously to the host's clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torchrun(script: str, nproc: int, args: Sequence[str], timeout_s: float) -> Any:
    """Run ``script --worker --out FILE args`` under torchrun (standalone); returns rank 0's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", script, "--worker", "--out", out, *args]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
               "PYTHONUNBUFFERED": "1"}
        p = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
        if p.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"{' '.join(cmd)} failed with exit status {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
            )
        with open(out) as f:
            return json.load(f)


def worker_result(out: str, result: Any) -> None:
    """The worker's end of ``torchrun()``: rank 0 writes ``result`` as JSON to ``out``; every
    rank then leaves the process group."""
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    shutdown()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def quiet_torchrec() -> None:
    """Silence the planner's dry-run warnings (they drown the benchmark's output)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
