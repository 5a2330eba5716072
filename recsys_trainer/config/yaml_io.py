"""The config as text: reading the YAML file (``load_yaml``), command-line overrides with YAML
typing (``coerce_value``, ``apply_overrides``), the entry point that validates the result
(``load_config``) and the resolved config back as plain data (``config_to_dict``)."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import yaml

from recsys_trainer.component import CLASS_KEY, ComponentSpec
from recsys_trainer.config.data import ClassDataConfig
from recsys_trainer.config.factory import ConfigError
from recsys_trainer.config.model import ModelConfig
from recsys_trainer.config.run import SECTIONS, RunConfig


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config file (an empty file is an empty config)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path!r}: {exc.strerror}.") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"the config file {path!r} is not valid YAML: {exc}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"the config file {path!r} must hold a mapping of sections, but holds {doc!r}.")
    return doc


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def coerce_value(text: str) -> Any:
    """A command-line value with YAML typing: ``100`` -> 100, ``0.5`` and ``1e-3`` -> float
    (YAML 1.1 alone reads ``1e-3`` as a string), ``null``/``None`` -> None, ``true`` -> True,
    ``[a, b]`` -> list, ``{k: v}`` -> dict; anything else stays a string."""
    if text.strip() == "None":
        return None
    if _FLOAT.match(text.strip()):
        return float(text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Set ``section.key[.subkey|.index]`` to a YAML-typed value in a copy of ``raw``.

    Mappings on the path are created as needed; list items are addressed by index
    (``hooks.0.every``). Unknown keys are left for validation to report.
    """
    out = copy.deepcopy(raw)
    for dotted, text in overrides:
        parts = [p for p in dotted.split(".")]
        if not parts or any(not p for p in parts):
            raise ConfigError(f"bad override key `{dotted}`; write e.g. `--args.train_steps 100`.")
        if parts[0] not in SECTIONS:
            raise ConfigError(
                f"override `--{dotted}` names unknown section `{parts[0]}`; allowed: {', '.join(SECTIONS)}."
            )
        node: Any = out
        for i, part in enumerate(parts[:-1]):
            where = ".".join(parts[: i + 1])
            if isinstance(node, list):
                node = node[_index(node, part, where)]
                continue
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict | list):
                raise ConfigError(f"override `--{dotted}`: `{where}` is {nxt!r}, not a mapping.")
            node = nxt
        last = parts[-1]
        value = coerce_value(text)
        if isinstance(node, list):
            node[_index(node, last, dotted)] = value
        else:
            node[last] = value
    return out


def _index(items: list[Any], part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"`{where}`: index {part!r} is not in a list of {len(items)} items.")
    return int(part)


def load_config(path: str | None, overrides: Sequence[tuple[str, str]] = ()) -> RunConfig:
    """Read ``path`` (None: an empty config), apply ``overrides``, validate."""
    raw = load_yaml(path) if path is not None else {}
    return RunConfig.from_dict(apply_overrides(raw, overrides))


_NOT_PRINTED = {"save_filter_fn"}
"""Settings that hold Python callables (set from code, never from YAML): left out of the dump."""


def _plain(value: Any) -> Any:
    """``value`` as YAML can dump it: a dataclass (a nested section of ``TrainingArguments``)
    becomes its mapping, without the callables; anything else is returned as it is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: v for k, v in dataclasses.asdict(value).items() if k not in _NOT_PRINTED}
    return value


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data (what ``recsys-train --print-config`` shows): ``args``
    by section (``checkpoint``, ``eval``, ``logging``), as the YAML may write it."""
    args = {f.name: _plain(getattr(cfg.args, f.name)) for f in dataclasses.fields(cfg.args)
            if f.name not in _NOT_PRINTED}
    m, d, o = cfg.model, cfg.data, cfg.dense_optimizer
    out = {
        "run": cfg.run,
        "args": args,
        "model": dataclasses.asdict(m) if isinstance(m, ModelConfig) else m.spec.to_dict(),
        "data": d.to_dict() if isinstance(d, ClassDataConfig)
        else {"kind": d.kind, **dataclasses.asdict(d)},
        "dense_optimizer": o.to_dict() if isinstance(o, ComponentSpec) else dataclasses.asdict(o),
        "sparse_optimizer": dataclasses.asdict(cfg.sparse_optimizer),
        "table_optimizers": {k: dataclasses.asdict(v) for k, v in cfg.table_optimizers.items()},
        "hooks": [{CLASS_KEY if h.spec else "name": h.name, **h.kwargs} for h in cfg.hooks],
        "predict": None if cfg.predict is None else dataclasses.asdict(cfg.predict),
        "export": None if cfg.export is None else dataclasses.asdict(cfg.export),
    }
    if cfg.lr_scheduler is not None:
        out["lr_scheduler"] = cfg.lr_scheduler.to_dict()
    return out

