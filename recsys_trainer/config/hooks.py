"""The ``hooks`` section: a list of built-in hooks by config name (``metrics``, ``{name: jsonl,
every: 10}``) or hook classes by import path, each a ``HookConfig`` built once the run starts."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recsys_trainer.component import CLASS_KEY, ComponentSpec, is_component
from recsys_trainer.config.factory import ConfigError, _component
from recsys_trainer.hooks import (
    EarlyStoppingHook,
    Hook,
    JsonlMetricsHook,
    LoggerHook,
    MetricReportHook,
    NonFiniteLossHook,
    ProfilerHook,
    ProgressHook,
    TensorBoardHook,
)
from recsys_trainer.hooks.publish import PublishHook

# Built-in hooks by config name.
BUILTIN_HOOKS: dict[str, type[Hook]] = {
    "logger": LoggerHook,
    "metrics": MetricReportHook,
    "jsonl": JsonlMetricsHook,
    "tensorboard": TensorBoardHook,
    "progress": ProgressHook,
    "profiler": ProfilerHook,
    "early_stopping": EarlyStoppingHook,
    "non_finite_loss": NonFiniteLossHook,
    "publish": PublishHook,
}


@dataclass(frozen=True)
class HookConfig:
    """One entry of ``hooks``: a built-in hook's config name and its constructor arguments, or
    (``spec``) a hook class by import path."""

    name: str
    kwargs: dict[str, Any]
    spec: ComponentSpec | None = None

    def build(self, index: int) -> Hook:
        """The hook, for entry ``hooks[index]`` (errors name that key)."""
        key = f"hooks[{index}]"
        if self.spec is not None:
            hook = self.spec.build()
            if not isinstance(hook, Hook):
                raise ConfigError(f"`{key}` ({self.name}) built a {type(hook).__name__}, not a "
                                  "recsys_trainer.Hook; subclass Hook.")
            return hook
        cls = BUILTIN_HOOKS[self.name]
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        unknown = sorted(set(self.kwargs) - set(accepted))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(f'`{key}.{k}`' for k in unknown)} for hook "
                f"{self.name!r}; allowed: {', '.join(['name', *accepted])}."
            )
        try:
            return cls(**self.kwargs)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"`{key}` ({self.name}): {exc}") from exc


def _parse_hooks(raw: Any) -> list[HookConfig]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"`hooks` must be a list of hook names or mappings with `name`, but is {raw!r}.")
    out = []
    for i, entry in enumerate(raw):
        if is_component(entry) and entry[CLASS_KEY] not in BUILTIN_HOOKS:
            spec = _component(f"hooks[{i}]", entry)
            out.append(HookConfig(spec.path, spec.kwargs, spec))
            continue
        if is_component(entry):  # `class: metrics`: the alias of a built-in hook
            entry = {"name" if k == CLASS_KEY else k: v for k, v in entry.items()}
        if isinstance(entry, str):
            name, kwargs = entry, {}
        elif isinstance(entry, Mapping) and "name" in entry:
            kwargs = {str(k): v for k, v in entry.items() if k != "name"}
            name = entry["name"]
        else:
            raise ConfigError(
                f"`hooks[{i}]` must be a hook name or a mapping with `name` and the hook's "
                f"arguments, but is {entry!r}."
            )
        if name not in BUILTIN_HOOKS:
            raise ConfigError(
                f"`hooks[{i}]` names hook {name!r}; allowed: {', '.join(BUILTIN_HOOKS)}."
            )
        out.append(HookConfig(name, kwargs))
    return out
