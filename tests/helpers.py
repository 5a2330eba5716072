"""Small builders shared by tests: a tiny DLRM, planted-signal data, an event recorder."""

from __future__ import annotations

from typing import Any

import torch

from recsys_trainer import Hook, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.synthetic import PlantedSignal, synthetic_batches
from recsys_trainer.hooks.base import EVENTS, StepOutput
from recsys_trainer.models import DLRMClassifier

FEATURES = ["f0", "f1", "f2", "f3"]
NUM_DENSE = 4
ROWS = 200  # rows per table: 2 ranks x 4 tables -> 2 tables each (table-wise)


def tiny_model(seed: int = 0) -> DLRMClassifier:
    torch.manual_seed(seed)
    return DLRMClassifier(FEATURES, NUM_DENSE, ROWS, embedding_dim=8, dense_arch=(16,), over_arch=(16, 1))


def batches(n: int, batch_size: int = 32, seed: int = 0) -> list[Batch]:
    sig = PlantedSignal.make(len(FEATURES), NUM_DENSE, ROWS, seed=7, strength=1.5)
    return synthetic_batches(n, batch_size, FEATURES, NUM_DENSE, ROWS, seed=seed, signal=sig)


def make_trainer(
    train: Any = None,
    eval_: Any = None,
    hooks: list[Hook] | None = None,
    dense_lr: float = 1e-2,
    sparse: SparseOptimizer | None = None,
    dense_sgd: bool = False,
    **args: Any,
) -> Trainer:
    args.setdefault("output_dir", "/tmp/recsys_trainer_test")
    args.setdefault("log_steps", 1000)

    def dense(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if dense_sgd:
            return torch.optim.SGD(params, lr=dense_lr)
        return torch.optim.Adam(params, lr=dense_lr)

    return Trainer(
        model=tiny_model(),
        args=TrainingArguments(**args),
        train_dataset=train,
        eval_dataset=eval_,
        hooks=hooks or [],
        dense_optimizers=(dense, None),
        sparse_optimizer=sparse or SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False,
    )


class Recorder(Hook):
    """Records every event with its salient argument, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def handled_events(self) -> set[str] | None:
        return set(EVENTS)

    def __getattribute__(self, name: str) -> Any:
        if name in EVENTS:
            events = object.__getattribute__(self, "events")

            def record(trainer: Trainer, *a: Any) -> None:
                arg = ""
                if a and isinstance(a[0], str | int) and not isinstance(a[0], bool):
                    arg = f"({a[0]})"
                if name == "out_of_data":
                    arg = f"({a[0]},{a[1]})"
                if a and isinstance(a[0], StepOutput):
                    arg = f"({a[0].step})"
                events.append(name + arg)

            return record
        return object.__getattribute__(self, name)
