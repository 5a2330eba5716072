"""Hooks: the ``Hook`` base class and the built-in hooks."""

from recsys_trainer.hooks.base import (
    EVENTS,
    Hook,
    HookList,
    MetricReport,
    MicroBatchOutput,
    SaveRequest,
    StepOutput,
    TrainerView,
)
from recsys_trainer.hooks.dynamic_tables import DynamicTableStatsHook
from recsys_trainer.hooks.early_stopping import EarlyStoppingHook
from recsys_trainer.hooks.jsonl import JsonlMetricsHook, read_jsonl
from recsys_trainer.hooks.lambda_hook import LambdaHook
from recsys_trainer.hooks.logger import LoggerHook
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.hooks.nonfinite import NonFiniteLossHook
from recsys_trainer.hooks.profiler import ProfilerHook
from recsys_trainer.hooks.progress import ProgressHook
from recsys_trainer.hooks.tensorboard import TensorBoardHook
from recsys_trainer.lazy import lazy_attributes
from recsys_trainer.metrics import METRIC_NAMES, ClickMetrics
from recsys_trainer.step import StepTimings

__all__ = [
    "DynamicTableStatsHook",
    "EVENTS",
    "METRIC_NAMES",
    "ClickMetrics",
    "EarlyStoppingHook",
    "Hook",
    "HookList",
    "JsonlMetricsHook",
    "LambdaHook",
    "LoggerHook",
    "MetricReport",
    "MetricReportHook",
    "MicroBatchOutput",
    "NonFiniteLossHook",
    "ProfilerHook",
    "ProgressHook",
    "PublishError",
    "PublishHook",
    "PublishRecord",
    "SaveRequest",
    "StepOutput",
    "StepTimings",
    "TensorBoardHook",
    "TrainerView",
    "read_jsonl",
]

# Imported on first use (PEP 562): the publish hook brings the serving export, the checkpoint
# stack and the data decoding (about 50 modules) that the other hooks never need. A publish's
# report is the pipe's type, named from its one home.
_LAZY = {"PublishError": "recsys_trainer.hooks.publish",
         "PublishHook": "recsys_trainer.hooks.publish",
         "PublishRecord": "recsys_trainer.serving.exporting.publisher_client"}
__getattr__, __dir__ = lazy_attributes("recsys_trainer.hooks", _LAZY)
