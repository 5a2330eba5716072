"""Shared builders for the hook and metric tests: a tiny DLRM, windowed in-memory data (the Open
Bandit sample and a planted-signal synthetic set), and an exact rank-based AUC reference."""

from __future__ import annotations

import csv
import io
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer import Hook, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.base import WindowedDataset
from recsys_trainer.data.generators.open_bandit import read_sample_csv
from recsys_trainer.data.generators.synthetic import PlantedSignal, synthetic_batches
from recsys_trainer.models import DLRMClassifier

FEATURES = ["f0", "f1", "f2", "f3"]
NUM_DENSE = 4
ROWS = 200  # embedding rows per table


def tiny_model(seed: int = 0) -> DLRMClassifier:
    torch.manual_seed(seed)
    return DLRMClassifier(FEATURES, NUM_DENSE, ROWS, embedding_dim=8, dense_arch=(16,),
                          over_arch=(16, 1))


def synthetic(num_batches: int, batch_size: int = 64, seed: int = 0) -> list[Batch]:
    sig = PlantedSignal.make(len(FEATURES), NUM_DENSE, ROWS, seed=7, strength=1.5)
    return synthetic_batches(num_batches, batch_size, FEATURES, NUM_DENSE, ROWS, seed=seed, signal=sig)


def _h(s: str) -> int:
    return zlib.crc32(s.encode()) % ROWS


def open_bandit_batches(batch_size: int = 333, source: str = "random_men") -> list[Batch]:
    """The real click log as batches: item, position and two hashed user features as ids (f3 is
    the user proxy: all four user features hashed), four affinities as dense features. The
    sample is the obp wheel scripts/setup fetched
    (``recsys_trainer.data.generators.open_bandit``)."""
    ids: list[list[int]] = []
    dense: list[list[float]] = []
    labels: list[float] = []
    with io.StringIO(read_sample_csv(source).decode(), newline="") as f:
        for row in csv.DictReader(f):
            user = "|".join(row[f"user_feature_{i}"] for i in range(4))
            ids.append([int(row["item_id"]), int(row["position"]), _h(row["user_feature_0"]), _h(user)])
            dense.append([float(row[f"user-item_affinity_{i}"]) for i in range(NUM_DENSE)])
            labels.append(float(row["click"]))
    out = []
    for s in range(0, len(ids), batch_size):
        idx = np.array(ids[s:s + batch_size], dtype=np.int64)
        b = idx.shape[0]
        out.append(Batch(
            dense=torch.tensor(dense[s:s + batch_size], dtype=torch.float32),
            sparse=KeyedJaggedTensor(keys=FEATURES, values=torch.from_numpy(idx.T.reshape(-1).copy()),
                                     lengths=torch.ones(4 * b, dtype=torch.int32), stride=b),
            labels=torch.tensor(labels[s:s + batch_size], dtype=torch.float32),
        ))
    return out


def user_ids(batch: Batch) -> torch.Tensor:
    """GAUC group ids for these data sets: feature f3 (one id per row)."""
    return batch.sparse["f3"].values()


class ListWindows(WindowedDataset):
    """Named windows of batches; rank r reads batches r, r + n, ... of each (uneven by design)."""

    def __init__(self, windows: dict[str, list[Batch]]) -> None:
        self._windows = windows
        self._rank, self._world = 0, 1

    def setup(self, rank: int, world_size: int) -> None:
        self._rank, self._world = rank, world_size

    def window_ids(self) -> Iterator[str]:
        yield from self._windows

    def iter_window(self, window_id: str, skip_batches: int = 0) -> Iterator[Batch]:
        mine = self._windows[window_id][self._rank::self._world]
        return iter(mine[skip_batches:])


def make_trainer(train: Any = None, eval_: Any = None, hooks: list[Hook] | None = None,
                 model: torch.nn.Module | None = None, **args: Any) -> Trainer:
    args.setdefault("log_steps", 1000)
    return Trainer(
        model=model if model is not None else tiny_model(),
        args=TrainingArguments(**args),
        train_dataset=train,
        eval_dataset=eval_,
        hooks=hooks or [],
        dense_optimizers=(lambda params: torch.optim.Adam(params, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False,
    )


def rank_auc(preds: np.ndarray, labels: np.ndarray) -> float:
    """Exact AUC by the Mann-Whitney U statistic with mid-ranks for ties (unweighted)."""
    preds = np.asarray(preds, dtype=np.float64)
    order = np.argsort(preds, kind="stable")
    sorted_p = preds[order]
    ranks = np.empty(len(preds), dtype=np.float64)
    i = 0
    while i < len(sorted_p):
        j = i
        while j + 1 < len(sorted_p) and sorted_p[j + 1] == sorted_p[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
