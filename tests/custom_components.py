"""Components a user would write in their own package, named by import path in CLI configs
(``class: custom_components.ConcatMLP``; the tests put this directory on ``PYTHONPATH``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_trainer import Hook, Trainer
from recsys_trainer.batch import Batch
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.hooks.base import StepOutput
from recsys_trainer.models import weighted_bce_with_logits


class ConcatMLP(nn.Module):
    """Pooled embeddings concatenated with the dense inputs, then an MLP: not the bundled DLRM,
    and built from plain keyword arguments only."""

    def __init__(self, sparse_features: list[str], num_embeddings: int, num_dense: int,
                 embedding_dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.features = list(sparse_features)
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=embedding_dim,
                                       num_embeddings=num_embeddings, feature_names=[f])
                    for f in self.features],
            device=torch.device("meta"),
        )
        self.mlp = nn.Sequential(nn.Linear(num_dense + embedding_dim * len(self.features), hidden),
                                 nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse)
        x = torch.cat([batch.dense, *(pooled[f] for f in self.features)], dim=1)
        logits = self.mlp(x).squeeze(-1)
        return weighted_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()


class StepLog(Hook):
    """Writes, per rank, the steps trained, the dense lr after each step and the model's class
    to ``{path}.rank{r}.json`` when training ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[int] = []
        self.lrs: list[float] = []

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        self.steps.append(trainer.state.global_step)
        self.lrs.append(trainer.dense_lr())

    def after_train(self, trainer: Trainer) -> None:
        model = trainer.model.module  # DistributedModelParallel -> the user's module
        with open(f"{self.path}.rank{trainer.rank}.json", "w") as f:
            json.dump({"steps": self.steps, "lrs": self.lrs, "rows_seen": trainer.state.rows_seen,
                       "model": type(model).__name__, "pid": os.getpid()}, f)


class FailAt(Hook):
    """Raises ``RuntimeError("planted failure")`` in one event (smoke-test phases)."""

    def __init__(self, event: str) -> None:
        self.event = event

        def fail(*_: Any) -> None:
            raise RuntimeError(f"planted failure in {event}")

        setattr(self, event, fail)

    def handled_events(self) -> set[str]:
        return {self.event}


def row_windows(root: str, batch_size: int = 8, shuffle: bool = False) -> ParquetWindowDataset:
    """A dataset factory by import path: windows of ``tests/data_utils.write_windows`` rows."""
    from data_utils import row_id_spec

    return ParquetWindowDataset(root, row_id_spec(), batch_size=batch_size, shuffle=shuffle)


NOT_CALLABLE = 42


class Progress(Hook):
    """Appends ``step restart pid time`` after every step to ``{path}.rank{r}`` and then sleeps
    ``pace_s``, so a test can time a fault by the step a job reached (and see which torchrun
    attempt trained which steps)."""

    def __init__(self, path: str, pace_s: float = 0.0) -> None:
        self.path = path
        self.pace_s = pace_s

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        with open(f"{self.path}.rank{trainer.rank}", "a") as f:
            f.write(f"{trainer.state.global_step} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')} "
                    f"{os.getpid()} {time.time():.3f}\n")
        time.sleep(self.pace_s)
