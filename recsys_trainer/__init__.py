"""recsys_trainer: a hook-list trainer for recommendation models with a sparse/dense split.

The public names below are imported on first use (PEP 562), not when the package is: a
process that only scores an exported model (``recsys_trainer.serving``) then never imports
the trainer, torchrec or ``torch.distributed``'s checkpointing. ``from recsys_trainer import
Trainer`` works as before.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING

from recsys_trainer.lazy import lazy_attributes
from recsys_trainer.torchrec_compat import check_installed_stack

# Here, before any module of the package imports torchrec: a torch / fbgemm-gpu / torchrec mix
# known not to load is then named (UnsupportedStackError, with the supported pairs) instead of
# failing on an undefined C++ symbol inside fbgemm-gpu. It reads package metadata only.
check_installed_stack()

if TYPE_CHECKING:
    from recsys_trainer.args import (
        CheckpointArguments,
        EvalArguments,
        LoggingArguments,
        TrainingArguments,
    )
    from recsys_trainer.batch import Batch
    from recsys_trainer.data.base import WindowedDataset
    from recsys_trainer.distributed import shutdown
    from recsys_trainer.hooks import (
        EarlyStoppingHook,
        JsonlMetricsHook,
        MetricReport,
        MetricReportHook,
        NonFiniteLossHook,
        ProfilerHook,
        ProgressHook,
        TensorBoardHook,
    )
    from recsys_trainer.hooks.base import Hook, MicroBatchOutput, StepOutput
    from recsys_trainer.hooks.lambda_hook import LambdaHook
    from recsys_trainer.hooks.logger import LoggerHook
    from recsys_trainer.logs import setup_logging
    from recsys_trainer.optimizers import SparseOptimizer, supported_sparse_optimizers
    from recsys_trainer.preemption import Preempted, Preemption
    from recsys_trainer.rng import seed_everything
    from recsys_trainer.trainer import Trainer
    from recsys_trainer.trainer_state import TrainerState

# pyproject.toml owns the version; the installed distribution's metadata carries it.
__version__ = metadata.version("recsys_trainer")

_LAZY: dict[str, str] = {
    "Batch": "recsys_trainer.batch",
    "EarlyStoppingHook": "recsys_trainer.hooks",
    "Hook": "recsys_trainer.hooks.base",
    "JsonlMetricsHook": "recsys_trainer.hooks",
    "LambdaHook": "recsys_trainer.hooks.lambda_hook",
    "LoggerHook": "recsys_trainer.hooks.logger",
    "MetricReport": "recsys_trainer.hooks",
    "MetricReportHook": "recsys_trainer.hooks",
    "MicroBatchOutput": "recsys_trainer.hooks.base",
    "NonFiniteLossHook": "recsys_trainer.hooks",
    "Preempted": "recsys_trainer.preemption",
    "Preemption": "recsys_trainer.preemption",
    "ProfilerHook": "recsys_trainer.hooks",
    "ProgressHook": "recsys_trainer.hooks",
    "SparseOptimizer": "recsys_trainer.optimizers",
    "StepOutput": "recsys_trainer.hooks.base",
    "TensorBoardHook": "recsys_trainer.hooks",
    "Trainer": "recsys_trainer.trainer",
    "TrainerState": "recsys_trainer.trainer_state",
    "TrainingArguments": "recsys_trainer.args",
    "CheckpointArguments": "recsys_trainer.args",
    "EvalArguments": "recsys_trainer.args",
    "LoggingArguments": "recsys_trainer.args",
    "WindowedDataset": "recsys_trainer.data.base",
    "seed_everything": "recsys_trainer.rng",
    "setup_logging": "recsys_trainer.logs",
    "shutdown": "recsys_trainer.distributed",
    "supported_sparse_optimizers": "recsys_trainer.optimizers",
}

__all__ = [
    "Batch",
    "CheckpointArguments",
    "EarlyStoppingHook",
    "EvalArguments",
    "Hook",
    "JsonlMetricsHook",
    "LambdaHook",
    "LoggerHook",
    "LoggingArguments",
    "MetricReport",
    "MetricReportHook",
    "MicroBatchOutput",
    "NonFiniteLossHook",
    "Preempted",
    "Preemption",
    "ProfilerHook",
    "ProgressHook",
    "SparseOptimizer",
    "StepOutput",
    "TensorBoardHook",
    "Trainer",
    "TrainerState",
    "TrainingArguments",
    "WindowedDataset",
    "seed_everything",
    "setup_logging",
    "shutdown",
    "supported_sparse_optimizers",
]


__getattr__, __dir__ = lazy_attributes("recsys_trainer", _LAZY)


