"""Section mappings into objects: ``ConfigError``, dataclasses filled from a mapping (``_build``)
and components named by import path (``_component``, ``{class: pkg.Name, **kwargs}``).

Every other module of ``recsys_trainer.config`` builds its sections through these two, so that
every error names the dotted key, the bad value and what is allowed in the same words.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, TypeVar

from recsys_trainer.component import ComponentSpec


class ConfigError(ValueError):
    """An invalid configuration; the message names the dotted key, the value and what is allowed."""


def _component(key: str, raw: Any, *, positional: tuple[str, ...] = (),
               aliases: dict[str, str] | None = None) -> ComponentSpec:
    """``{class: path, **kwargs}`` at config key ``key``, checked now (path, signature)."""
    try:
        return ComponentSpec.from_mapping(key, raw, positional=positional, aliases=aliases)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


T = TypeVar("T")


def _parameters(cls: type[Any]) -> tuple[list[inspect.Parameter], bool]:
    """The keyword parameters ``cls(...)`` takes, and whether it also takes ``**kwargs``.

    The constructor's signature is the schema, not ``dataclasses.fields``: a dataclass's
    ``InitVar`` and a hand-written ``__init__`` (e.g. ``TrainingArguments``' alias keys) are
    keys that it accepts but that are not fields. The dataclass's own field order comes first,
    so the keys an error lists read as the class declares them (``kw_only`` fields move to the
    end of a generated ``__init__``)."""
    params = [p for p in inspect.signature(cls).parameters.values()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if dataclasses.is_dataclass(cls):
        order = {f.name: i for i, f in enumerate(dataclasses.fields(cls))}
        params.sort(key=lambda p: order.get(p.name, len(order)))  # stable: the rest keep theirs
    var_kw = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls).parameters.values())
    return params, var_kw


def _build(cls: type[T], section: str, raw: Any) -> T:
    """``cls(**raw)`` with config-style errors for unknown keys, missing keys and bad values.

    The mapping reaches the constructor as written (nested mappings included): a key is
    allowed when the constructor takes it, and the constructor converts and validates."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"`{section}` must be a mapping of keys to values, but is {raw!r}.")
    params, var_kw = _parameters(cls)
    allowed = [p.name for p in params]
    # A constructor with **kwargs names its own unknown keys (as a TypeError, below).
    unknown = [] if var_kw else sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(f'`{section}.{k}`' for k in unknown)}; allowed keys in `{section}`: "
            f"{', '.join(allowed)}."
        )
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(
            f"missing required key{'s' if len(missing) > 1 else ''} "
            f"{', '.join(f'`{section}.{k}`' for k in missing)}."
        )
    try:
        return cls(**dict(raw))
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        # The config's own dataclasses name their keys in full (`model.embedding_dim`); the
        # runtime ones name just the field (`train_steps`): say which section it is in.
        msg = str(exc)
        raise ConfigError(msg if f"`{section}." in msg else f"`{section}`: {msg}") from exc
