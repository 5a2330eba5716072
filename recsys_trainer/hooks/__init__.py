"""Hooks: the ``Hook`` base class and the built-in hooks."""

from recsys_trainer.hooks.base import EVENTS, Hook, HookList, MicroBatchOutput, StepOutput
from recsys_trainer.hooks.lambda_hook import LambdaHook
from recsys_trainer.hooks.logger import LoggerHook

__all__ = ["EVENTS", "Hook", "HookList", "LambdaHook", "LoggerHook", "MicroBatchOutput", "StepOutput"]
