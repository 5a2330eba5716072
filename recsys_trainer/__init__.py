"""recsys_trainer: a hook-list trainer for recommendation models with a sparse/dense split."""

from recsys_trainer.args import TrainingArguments
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
from recsys_trainer.rng import seed_everything
from recsys_trainer.sharding import SparseOptimizer, supported_sparse_optimizers
from recsys_trainer.trainer import Trainer, TrainerState

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "EarlyStoppingHook",
    "Hook",
    "JsonlMetricsHook",
    "LambdaHook",
    "LoggerHook",
    "MetricReport",
    "MetricReportHook",
    "MicroBatchOutput",
    "NonFiniteLossHook",
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
