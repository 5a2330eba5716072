"""``LambdaHook``: a hook from plain callables, handy in tests and notebooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from recsys_trainer.hooks.base import EVENTS, Hook


class LambdaHook(Hook):
    """``LambdaHook(after_step=lambda trainer, out: ...)``: each keyword names an event."""

    def __init__(self, **callbacks: Callable[..., Any]) -> None:
        unknown = sorted(set(callbacks) - set(EVENTS))
        if unknown:
            raise ValueError(f"unknown hook events {unknown}; events are: {', '.join(EVENTS)}.")
        self._callbacks = callbacks

    def handled_events(self) -> set[str] | None:
        return set(self._callbacks)

    def __getattribute__(self, name: str) -> Any:
        if name in EVENTS:
            cbs = object.__getattribute__(self, "_callbacks")
            if name in cbs:
                return cbs[name]
        return object.__getattribute__(self, name)
