"""Small parquet windows with categorical columns and a tiny model, for the vocabulary tests.

Window ``hour=00`` holds genre ``genre_k`` at least ``k + 1`` times (k = 0..9), ``rare`` once,
years 1990..1996 and items from ``ITEMS_0``; later windows add values never seen in window 0
(``genre_new``, year 2024, ``NEW_ITEM``), which a vocabulary built from window 0 maps to the
OOV row.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.models import weighted_bce_with_logits

TAGS = [f"tag_{i}" for i in range(6)]
ITEMS_0 = [10_000 + 37 * k for k in range(12)]
NEW_ITEM = 99_999
MAX_LEN = 5


def _window_rows(w: int, n: int, rng: np.random.Generator) -> dict[str, list[Any]]:
    if w == 0:
        genres = [f"genre_{k:02d}" for k in range(10) for _ in range(k + 1)] + ["rare"]
        genres += [f"genre_{k:02d}" for k in rng.integers(0, 10, max(0, n - len(genres)))]
        genres = [genres[i] for i in rng.permutation(len(genres))][:n]
        years = [1990 + int(y) for y in rng.integers(0, 7, n)]
        items = ITEMS_0
    else:
        genres = [f"genre_{k:02d}" if k < 10 else "genre_new" for k in rng.integers(0, 11, n)]
        years = [1990 + int(y) if y < 7 else 2024 for y in rng.integers(0, 8, n)]
        items = [*ITEMS_0, NEW_ITEM]
    return {
        "genre": genres,
        "year": years,
        "tags": [[TAGS[int(t)] for t in rng.integers(0, len(TAGS), int(rng.integers(0, 4)))]
                 for _ in range(n)],
        "item": [items[int(i)] for i in rng.integers(0, len(items), n)],
        "hist": [[items[int(i)] for i in rng.integers(0, len(items), int(rng.integers(1, 8)))]
                 for _ in range(n)],
    }


def write_vocab_windows(root: str, rows_per_window: Sequence[int] = (64, 48, 48),
                        files_per_window: int = 2, row_group_size: int = 8, seed: int = 0) -> int:
    """Windows ``hour=w`` of ``files_per_window`` files; returns the total rows. Row ids are
    unique; ``y`` is 1 for rows whose genre index is even (a signal to learn)."""
    rng = np.random.default_rng(seed)
    rid = 0
    for w, n in enumerate(rows_per_window):
        cols = _window_rows(w, n, rng)
        d = os.path.join(root, f"hour={w:02d}")
        os.makedirs(d, exist_ok=True)
        bounds = np.linspace(0, n, files_per_window + 1).astype(int)
        for f in range(files_per_window):
            lo, hi = int(bounds[f]), int(bounds[f + 1])
            genre = cols["genre"][lo:hi]
            t = pa.table({
                "row_id": pa.array(range(rid + lo, rid + hi), pa.int64()),
                "y": pa.array([float(g[-1:].isdigit() and int(g[-1]) % 2 == 0) for g in genre],
                              pa.float32()),
                "genre": pa.array(genre, pa.string()),
                "year": pa.array(cols["year"][lo:hi], pa.int64()),
                "tags": pa.array(cols["tags"][lo:hi], pa.list_(pa.string())),
                "item": pa.array(cols["item"][lo:hi], pa.int64()),
                "hist": pa.array(cols["hist"][lo:hi], pa.list_(pa.int64())),
            })
            pq.write_table(t, os.path.join(d, f"part-{f}.parquet"), row_group_size=row_group_size)
        rid += n
    return rid


def expected_vocabulary(root: str, columns: Sequence[str], window: str = "hour=00",
                        min_count: int = 1, capacity: int | None = None) -> list[Any]:
    """What a vocabulary built from ``window`` must hold: every value of the columns (lists
    flattened, nulls dropped) seen >= ``min_count`` times, most frequent first, ties by value."""
    table = pq.read_table(os.path.join(root, window))
    counts: Counter[Any] = Counter()
    for c in columns:
        for v in table.column(c).to_pylist():
            counts.update(v if isinstance(v, list) else [v])
    kept = sorted((v for v, n in counts.items() if n >= min_count and v is not None),
                  key=lambda v: (-counts[v], v))
    return kept[:capacity]


class TinyModel(nn.Module):
    """Pooled tables for ``batch.sparse`` (``t_<feature>``) and, with sequence features, one
    ``EmbeddingCollection`` table ``t_item`` that all of them read (a shared table)."""

    def __init__(self, spec: FeatureSpec, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=f"t_{s.name}", embedding_dim=dim, num_embeddings=s.num_embeddings,
            feature_names=[s.name]) for s in spec.sparse], device=meta)
        self.seq_names = spec.sequence_names
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name="t_item", embedding_dim=dim, num_embeddings=spec.sequence[0].num_embeddings,
            feature_names=self.seq_names)], device=meta) if spec.sequence else None
        width = spec.num_dense + dim * len(spec.sparse) + (dim if spec.sequence else 0)
        self.top = nn.Linear(width, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [batch.dense * 1e-3, self.ebc(batch.sparse).values()]
        if self.ec is not None:
            seq = self.ec(batch.sequence)
            parts.append(sum(seq[n].to_padded_dense(desired_length=MAX_LEN).sum(1)
                             for n in self.seq_names))
        logits = self.top(torch.cat(parts, dim=1)).squeeze(-1)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()


def make_trainer(spec: FeatureSpec, output_dir: str, train: Any = None, eval_: Any = None,
                 hooks: Sequence[Any] = (), **args: Any) -> Trainer:
    args.setdefault("log_steps", 1000)
    return Trainer(TinyModel(spec), TrainingArguments(output_dir=output_dir, **args),
                   train_dataset=train, eval_dataset=eval_, hooks=list(hooks),
                   dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
                   sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                   add_logger_hook=False)


def ids_by_row(batch: Batch, feature: str) -> dict[int, list[int]]:
    """``{row_id: the ids the reader decoded for feature}`` (row_id is the first dense input)."""
    kjt = batch.sequence if batch.sequence is not None and feature in batch.sequence.keys() \
        else batch.sparse
    jt = kjt[feature]
    rows = [int(r) for r in batch.dense[:, 0].tolist()]
    return {r: ids.tolist() for r, ids in zip(rows, jt.to_dense(), strict=True)}
