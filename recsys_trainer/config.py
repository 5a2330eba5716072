"""Run configuration for the ``recsys-train`` CLI: a YAML file, dotted overrides, dataclasses.

A config file has these top-level sections (all optional except ``model`` and ``data``)::

    run: train_and_evaluate     # train | evaluate | train_and_evaluate | predict
    args: {...}                 # TrainingArguments fields
    model: {...}                # DLRMClassifier arguments (ModelConfig), or {class: pkg.Model, ...}
    data: {kind: synthetic, ...}  or  {kind: parquet, ...}   (SyntheticDataConfig / ParquetDataConfig)
          or {class: pkg.make_dataset, train_args: {...}, eval_args: {...}}  (ClassDataConfig)
    dense_optimizer: {name: adam, lr: 0.001, kwargs: {}}  or  {class: torch.optim.Adam, lr: 0.001}
    lr_scheduler: {class: step, step_size: 100}       # optional
    sparse_optimizer: {name: rowwise_adagrad, lr: 0.05, kwargs: {}}
    table_optimizers: {t_user: {name: rowwise_adagrad, lr: 0.005}}   # per table name or glob
    hooks: [metrics, {name: jsonl, every: 10}, {class: my_pkg.MyHook, ...}]
    predict: {output_dir: ..., activation: sigmoid}   # PredictOptions; `run: predict` scores data.eval

Any mapping with ``class`` names a callable by import path (nnScaler style, see
``recsys_trainer.component``), called with the mapping's other keys; each section's short names
(``adam``, ``step``, ``metrics``, ``dlrm``) are aliases of the built-in ones.

YAML only *fills* dataclasses, and where the runtime has one it is the schema: ``args`` fills
``TrainingArguments``, ``sparse_optimizer`` and each ``table_optimizers`` entry fill
``SparseOptimizer``, and the options of
``data: kind: parquet`` are ``ParquetReadOptions`` (``ParquetWindowDataset``'s). The sections
with no runtime dataclass (the bundled model, synthetic data, the dense optimizer factory, the
hooks list) are defined here. Validation lives in the dataclasses, all through
``recsys_trainer.validation``; every error becomes a ``ConfigError`` naming the dotted key, the
bad value and what is allowed. ``apply_overrides`` applies ``--section.key value`` pairs with YAML scalar typing
(``100`` is an int, ``1e-3`` a float, ``null`` None, ``[a, b]`` a list).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import pyarrow.fs as pafs
import yaml

from recsys_trainer import storage
from recsys_trainer.args import TrainingArguments
from recsys_trainer.component import CLASS_KEY, ComponentSpec, is_component
from recsys_trainer.data.parquet import ParquetReadOptions
from recsys_trainer.dynamic import ID_SPACE, DynamicTable
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
from recsys_trainer.optimizers import SparseOptimizer
from recsys_trainer.predict import PredictOptions
from recsys_trainer.serving.export import ExportOptions
from recsys_trainer.validation import check_choice, check_int, check_number, check_type

RunMode = Literal["train", "evaluate", "train_and_evaluate", "predict", "export"]
RUN_MODES = ("train", "evaluate", "train_and_evaluate", "predict", "export")
SECTIONS = ("run", "args", "model", "data", "dense_optimizer", "lr_scheduler", "sparse_optimizer",
            "table_optimizers", "hooks", "predict", "export")

# Dense optimizers by config name -> torch.optim class name.
DENSE_OPTIMIZERS = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
}

# Short names of ``class:`` values, per section (import paths work everywhere).
MODEL_ALIASES = {"dlrm": "recsys_trainer.models.DLRMClassifier"}
DENSE_OPTIMIZER_ALIASES = {k: f"torch.optim.{v}" for k, v in DENSE_OPTIMIZERS.items()}
LR_SCHEDULER_ALIASES = {
    name: f"torch.optim.lr_scheduler.{cls}" for name, cls in (
        ("step", "StepLR"), ("multistep", "MultiStepLR"), ("exponential", "ExponentialLR"),
        ("cosine", "CosineAnnealingLR"), ("linear", "LinearLR"), ("constant", "ConstantLR"),
        ("onecycle", "OneCycleLR"), ("plateau", "ReduceLROnPlateau"))
}

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
}


def _component(key: str, raw: Any, *, positional: tuple[str, ...] = (),
               aliases: dict[str, str] | None = None) -> ComponentSpec:
    """``{class: path, **kwargs}`` at config key ``key``, checked now (path, signature)."""
    try:
        return ComponentSpec.from_mapping(key, raw, positional=positional, aliases=aliases)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


class ConfigError(ValueError):
    """An invalid configuration; the message names the dotted key, the value and what is allowed."""


T = TypeVar("T")


def _allowed(cls: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _build(cls: type[T], section: str, raw: Any) -> T:
    """``cls(**raw)`` with config-style errors for unknown keys, missing keys and bad values."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"`{section}` must be a mapping of keys to values, but is {raw!r}.")
    allowed = _allowed(cls)
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise ConfigError(
            f"unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(f'`{section}.{k}`' for k in unknown)}; allowed keys in `{section}`: "
            f"{', '.join(allowed)}."
        )
    required = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if f.init and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
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


# ---------------------------------------------------------------------------- model


def _dynamic_table(key: str, raw: Any) -> DynamicTable:
    """The ``DynamicTable`` that the mapping at config key ``key`` gives by field names
    (``{num_slots: 1000000, eviction_interval_rows: 4096}``); errors name ``key.<field>``."""
    try:
        return _build(DynamicTable, key, raw)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"`{key}`: `DynamicTable.", f"`{key}.")) from exc


def _dynamic_spec(key: str, raw: Any, per_feature: bool = True,
                  ) -> DynamicTable | dict[str, DynamicTable]:
    """``DynamicTable``'s fields at config key ``key`` (every table dynamic), or, with
    ``per_feature``, one such mapping per feature (``{user: {num_slots: 1000000}}``: only those
    features' tables dynamic)."""
    if isinstance(raw, Mapping) and not raw:
        raise ConfigError(f"`{key}` is empty: give DynamicTable's fields ({{num_slots: 1000000}}: "
                          "every table dynamic)"
                          + (", or one such mapping per feature" if per_feature else "")
                          + f", or leave `{key}` out (no dynamic table).")
    nested = [k for k, v in raw.items() if isinstance(v, Mapping)] if isinstance(raw, Mapping) else []
    if per_feature and nested:
        flat = sorted(set(raw) - set(nested))
        if flat:
            raise ConfigError(
                f"`{key}` takes either DynamicTable's fields ({{num_slots: 1000000}}: every table "
                f"dynamic) or one such mapping per feature ({{user: {{num_slots: 1000000}}}}), "
                f"not both: {', '.join(f'`{key}.{k}`' for k in flat)} is a value, "
                f"{', '.join(f'`{key}.{k}`' for k in nested)} a mapping.")
        return {f: _dynamic_table(f"{key}.{f}", v) for f, v in raw.items()}
    return _dynamic_table(key, raw)


def _takes_dynamic_table(fn: Any) -> tuple[bool, bool]:
    """Whether ``fn`` (a model class or function) has a ``dynamic`` argument annotated with
    ``DynamicTable`` (``DLRMClassifier``, ``DINClassifier``): a mapping given for it in a config
    is then built into one; and whether it also takes ``Mapping[str, DynamicTable]`` (one per
    feature, ``DLRMClassifier``)."""
    target = getattr(fn, "__init__") if isinstance(fn, type) else fn  # noqa: B009
    try:
        hint = typing.get_type_hints(target).get("dynamic")
    except Exception:  # annotations that do not resolve: leave the argument as written
        return False, False
    options = typing.get_args(hint) or (hint,)
    per_feature = any(typing.get_origin(a) in (Mapping, dict)
                      and typing.get_args(a)[1:] == (DynamicTable,) for a in options)
    return DynamicTable in options or per_feature, per_feature


@dataclass(kw_only=True)
class ModelConfig:
    """The bundled ``DLRMClassifier`` (``recsys_trainer.models``)."""

    kind: Literal["dlrm"] = "dlrm"
    """The model family. Only "dlrm" is bundled."""
    sparse_features: list[str] | int | None = None
    """Sparse feature names, or a count ``n`` meaning ``cat_0 .. cat_{n-1}``. With parquet data
    it defaults to the feature spec's sparse names (and must match them if given)."""
    num_dense: int | None = None
    """Dense inputs. With parquet data it defaults to the feature spec's dense column count."""
    num_embeddings: int | list[int] | None = None
    """Rows per table (one int for all, or one per feature). With parquet data it defaults to
    the feature spec's ``num_embeddings``."""
    embedding_dim: int = 16
    """Embedding width (the bottom MLP's last layer is set to it)."""
    dense_arch: list[int] = field(default_factory=lambda: [64])
    """Bottom (dense) MLP layer sizes."""
    over_arch: list[int] = field(default_factory=lambda: [64, 1])
    """Top MLP layer sizes (the last must be 1: one logit)."""
    dynamic: dict[str, Any] | None = None
    """Make every table dynamic: the fields of ``recsys_trainer.dynamic.DynamicTable``, e.g.
    ``{num_slots: 1000000}``; or only some: one such mapping per feature, ``{user: {num_slots:
    1000000}, item: {num_slots: 200000}}`` (the other tables stay hashed). A dynamic table has
    ``num_slots`` rows and takes raw ids (give its parquet feature ``num_embeddings:
    9223372036854775807``, the id space, so that ids pass unhashed); ``num_embeddings`` does not
    size it (synthetic data draws ids below it)."""

    def __post_init__(self) -> None:
        check_choice("model.kind", self.kind, ("dlrm",), quote=False)
        if self.sparse_features is not None:
            if isinstance(self.sparse_features, int) and not isinstance(self.sparse_features, bool):
                check_int("model.sparse_features", self.sparse_features)
                self.sparse_features = [f"cat_{i}" for i in range(self.sparse_features)]
            elif not (isinstance(self.sparse_features, list) and self.sparse_features
                      and all(isinstance(s, str) for s in self.sparse_features)):
                raise ValueError(
                    "`model.sparse_features` must be a non-empty list of names or an int >= 1, "
                    f"but is {self.sparse_features!r}."
                )
        if self.num_dense is not None:
            check_int("model.num_dense", self.num_dense, minimum=0)
        if isinstance(self.num_embeddings, list):
            for n in self.num_embeddings:
                check_int("model.num_embeddings[]", n)
        elif self.num_embeddings is not None:
            check_int("model.num_embeddings", self.num_embeddings)
        self._check_dynamic_features()
        check_int("model.embedding_dim", self.embedding_dim)
        for key in ("dense_arch", "over_arch"):
            sizes = getattr(self, key)
            if not (isinstance(sizes, list) and sizes):
                raise ValueError(f"`model.{key}` must be a non-empty list of ints >= 1, but is {sizes!r}.")
            for s in sizes:
                check_int(f"model.{key}[]", s)
        if self.over_arch[-1] != 1:
            raise ValueError(
                f"`model.over_arch` must end with 1 (one logit per row), but is {self.over_arch!r}."
            )

    def _check_dynamic_features(self) -> None:
        """Per-feature ``dynamic``, once the features are known (with parquet data they come
        from the feature spec): only features of the model, one lookup path, and no feature
        left hashed with a table of the raw id space (one meant to be dynamic)."""
        spec = None if self.dynamic is None else _dynamic_spec("model.dynamic", self.dynamic)
        if not isinstance(spec, dict) or not isinstance(self.sparse_features, list):
            return
        unknown = sorted(set(spec) - set(self.sparse_features))
        if unknown:
            raise ConfigError(f"`model.dynamic` names features {unknown} that the model does not "
                              f"have; its sparse features are {self.sparse_features}.")
        lookups = {f: s.pooled_lookup for f, s in spec.items()}
        if len(set(lookups.values())) > 1:
            raise ConfigError("`model.dynamic.<feature>.pooled_lookup` must be the same for every "
                              f"dynamic feature, but is {lookups}.")
        rows = self.num_embeddings
        if isinstance(rows, int):
            rows = [rows] * len(self.sparse_features)
        for f, n in zip(self.sparse_features, rows or [], strict=False):
            if f not in spec and n >= ID_SPACE:
                raise ConfigError(
                    f"feature {f!r} takes raw ids (num_embeddings {n}, the id space) but "
                    f"`model.dynamic` does not name it: add `model.dynamic.{f}`, or give it the "
                    "rows of a hashed table.")

    def build(self) -> Any:
        """The unsharded model (tables on the meta device). Needs the schema fields resolved."""
        from recsys_trainer.models import DLRMClassifier

        assert isinstance(self.sparse_features, list) and self.num_dense is not None
        assert self.num_embeddings is not None
        return DLRMClassifier(
            sparse_features=self.sparse_features,
            num_dense=self.num_dense,
            num_embeddings=self.num_embeddings,
            embedding_dim=self.embedding_dim,
            dense_arch=tuple(self.dense_arch),
            over_arch=tuple(self.over_arch),
            dynamic=None if self.dynamic is None else _dynamic_spec("model.dynamic", self.dynamic),
        )


@dataclass(frozen=True)
class ClassModelConfig:
    """``model: {class: my_pkg.module.Model, **kwargs}``: any ``nn.Module`` class (or function
    returning one) by import path, called with the other keys. The Trainer's contract applies
    (``forward(batch)`` returns the loss or ``(loss, outputs)``); nothing is derived from the
    data: pass the feature names and table sizes your constructor wants. A ``dynamic`` argument
    annotated ``DynamicTable`` (``DINClassifier``'s) takes its fields as a mapping."""

    spec: ComponentSpec

    def __post_init__(self) -> None:
        self._dynamic()  # checked when the config is loaded

    def _dynamic(self) -> DynamicTable | dict[str, DynamicTable] | None:
        raw = self.spec.kwargs.get("dynamic")
        takes, per_feature = _takes_dynamic_table(self.spec.target)
        if not isinstance(raw, Mapping) or not takes:
            return None
        return _dynamic_spec("model.dynamic", raw, per_feature)

    def build(self) -> Any:
        from torch import nn

        dynamic = self._dynamic()
        spec = self.spec if dynamic is None else dataclasses.replace(
            self.spec, kwargs={**self.spec.kwargs, "dynamic": dynamic})
        model = spec.build()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"`model` ({self.spec.path}) built a {type(model).__name__}, not a "
                              "torch.nn.Module.")
        return model


def _model_config(raw: Any) -> ModelConfig | ClassModelConfig:
    """The bundled DLRM (``kind: dlrm`` or ``class: dlrm``) or a model class by import path."""
    if not is_component(raw):
        return _build(ModelConfig, "model", raw)
    if raw[CLASS_KEY] in MODEL_ALIASES:
        # The alias keeps the bundled model's config: its schema still comes from the data.
        return _build(ModelConfig, "model", {k: v for k, v in raw.items() if k != CLASS_KEY})
    return ClassModelConfig(_component("model", raw))


# ---------------------------------------------------------------------------- data


@dataclass(kw_only=True)
class SyntheticDataConfig:
    """In-memory synthetic clicks with a planted signal (``recsys_trainer.data.synthetic``); the
    schema (features, table sizes) comes from ``model``. Each rank generates its own rows."""

    kind: Literal["synthetic"] = "synthetic"
    batch_size: int = 512
    """Rows per batch, per rank."""
    train_batches: int = 100
    """Train batches per rank per epoch."""
    eval_batches: int = 0
    """Held-out batches per rank (0: no eval data)."""
    seed: int = 0
    """Rank r draws train rows with seed ``seed + r`` and eval rows with ``seed + 10000 + r``."""
    signal_strength: float = 0.35
    """Spread of the planted id scores (0: labels are noise)."""
    signal_seed: int = 1234
    """Seed of the planted signal (the same on every rank)."""

    def __post_init__(self) -> None:
        check_int("data.batch_size", self.batch_size)
        check_int("data.train_batches", self.train_batches)
        check_int("data.eval_batches", self.eval_batches, minimum=0)
        check_type("data.seed", self.seed, (int,), "an int")
        check_type("data.signal_seed", self.signal_seed, (int,), "an int")
        check_number("data.signal_strength", self.signal_strength, at_least=0)


@dataclass(kw_only=True)
class ParquetDataConfig(ParquetReadOptions):
    """Windowed parquet/CSV files (``recsys_trainer.data.parquet.ParquetWindowDataset``): the
    sources and the feature spec, plus the dataset's own ``ParquetReadOptions`` fields
    (``batch_size``, ``sharding``, ``shuffle``, ``seed``, ``prefetch_batches``, ``on_corrupt``,
    ``file_format``)."""

    kind: Literal["parquet"] = "parquet"
    train: str | list[str] | None = None
    """A partitioned root directory (``root/dt=.../hour=.../*.parquet``: one window per leaf) or
    a list of globs (one window each)."""
    eval: str | list[str] | None = None
    """The same for evaluation (windowed eval: eval window i follows train window i)."""
    features: dict[str, Any] = field(default_factory=dict)
    """The ``FeatureSpec``: ``labels`` (list), ``dense`` (column names or mappings of
    ``DenseFeature`` fields), ``sparse`` (mappings of ``SparseFeature`` fields: ``name``,
    ``num_embeddings``, ``column``, ``hash``, ...), ``weight_column``, ``on_nan_label``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.train is None and self.eval is None:
            raise ConfigError("`data.train` or `data.eval` must name parquet data (a directory or a list of globs).")
        for key in ("train", "eval"):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, str) or (
                    isinstance(v, list) and v and all(isinstance(s, str) for s in v))):
                raise ConfigError(
                    f"`data.{key}` must be a directory path or a non-empty list of globs, but is {v!r}."
                )
        self.feature_spec()  # validate now, not after the process group is up

    def feature_spec(self) -> Any:
        """The ``FeatureSpec`` described by ``features``."""
        from recsys_trainer.data.features import (
            DenseFeature,
            FeatureSpec,
            SequenceFeature,
            SparseFeature,
        )

        raw = dict(self.features)
        if "dense" in raw:
            raw["dense"] = [
                d if isinstance(d, str) else _build(DenseFeature, f"data.features.dense[{i}]", d)
                for i, d in enumerate(raw["dense"] or [])
            ]
        if "sparse" in raw:
            raw["sparse"] = [
                _build(SparseFeature, f"data.features.sparse[{i}]", s)
                for i, s in enumerate(raw["sparse"] or [])
            ]
        if "sequence" in raw:
            raw["sequence"] = [
                _build(SequenceFeature, f"data.features.sequence[{i}]", q)
                for i, q in enumerate(raw["sequence"] or [])
            ]
        return _build(FeatureSpec, "data.features", raw)

    def build(self, which: Literal["train", "eval"]) -> Any:
        """The ``ParquetWindowDataset`` for ``train`` or ``eval`` (None if not configured)."""
        from recsys_trainer.data.parquet import ParquetWindowDataset

        source = getattr(self, which)
        if source is None:
            return None
        if isinstance(source, str) and not _is_dir(source):
            raise ConfigError(f"`data.{which}` is {source!r}, which is not a directory.")
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParquetReadOptions)}
        if which == "eval":
            options["shuffle"] = False
        return ParquetWindowDataset(source, self.feature_spec(), **options)


def _is_dir(url: str) -> bool:
    """Whether ``url`` (a path or a URL: ``s3://``, ``gs://``, ...) is a directory; storage
    that cannot be reached, denies access or lacks the bucket is a ``StorageError`` naming the
    URL."""
    loc = storage.resolve(url)
    if storage.file_info(loc).type == pafs.FileType.Directory:
        return True
    storage.check_bucket(loc)  # a missing bucket is named as such, not as a missing directory
    return False
@dataclass(frozen=True)
class ClassDataConfig:
    """``data: {class: my_pkg.make_dataset, train_args: {...}, eval_args: {...}, **common}``:
    the train dataset is ``make_dataset(**common, **train_args)`` and the eval dataset
    ``make_dataset(**common, **eval_args)`` (none without ``eval_args``); nnScaler's
    ``train_args``/``val_args``. Each is a ``WindowedDataset`` (the Trainer shards it with
    ``setup(rank, world_size)``) or any re-iterable of ``Batch`` (then: this rank's own data;
    the process group is up when it is built, so ``torch.distributed.get_rank()`` works)."""

    train: ComponentSpec | None
    eval: ComponentSpec | None
    kind: str = "class"

    @staticmethod
    def from_raw(raw: Mapping[str, Any]) -> ClassDataConfig:
        common = {str(k): v for k, v in raw.items() if k not in ("train_args", "eval_args")}
        specs: dict[str, ComponentSpec | None] = {}
        for which in ("train", "eval"):
            extra = raw.get(f"{which}_args", {} if which == "train" else None)
            if extra is None:
                specs[which] = None
                continue
            if not isinstance(extra, Mapping):
                raise ConfigError(f"`data.{which}_args` must be a mapping of keyword arguments, "
                                  f"but is {extra!r}.")
            specs[which] = _component(f"data.{which}_args", {**common, **extra})
        return ClassDataConfig(specs["train"], specs["eval"])

    def build(self, which: Literal["train", "eval"]) -> Any:
        spec = self.train if which == "train" else self.eval
        return spec.build() if spec is not None else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for which, spec in (("train", self.train), ("eval", self.eval)):
            if spec is not None:
                out[CLASS_KEY] = spec.path
                out[f"{which}_args"] = {k: v for k, v in spec.kwargs.items()}
        return out


DATA_KINDS: dict[str, type[Any]] = {"synthetic": SyntheticDataConfig, "parquet": ParquetDataConfig}
DataConfig = SyntheticDataConfig | ParquetDataConfig | ClassDataConfig


# ---------------------------------------------------------------------------- optimizers, hooks


@dataclass(kw_only=True)
class DenseOptimizerConfig:
    """The dense optimizer (over exactly the parameters without a fused optimizer)."""

    name: str = "adam"
    """One of adam, adamw, sgd, adagrad, rmsprop (``torch.optim``)."""
    lr: float = 1e-3
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of the torch optimizer (``weight_decay``, ``betas``, ...)."""

    def __post_init__(self) -> None:
        if self.name not in DENSE_OPTIMIZERS:
            raise ConfigError(
                f"`dense_optimizer.name` must be one of {', '.join(DENSE_OPTIMIZERS)}, but is {self.name!r}."
            )
        check_number("dense_optimizer.lr", self.lr, above=0)
        check_type("dense_optimizer.kwargs", self.kwargs, (dict,), "a mapping")
        cls = self.optimizer_class()
        accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params", "lr")]
        unknown = sorted(set(self.kwargs) - set(accepted))
        if unknown:
            raise ConfigError(
                f"unknown key(s) {', '.join(f'`dense_optimizer.kwargs.{k}`' for k in unknown)} for "
                f"torch.optim.{cls.__name__}; allowed: {', '.join(accepted)}."
            )

    def optimizer_class(self) -> type[Any]:
        import torch

        cls: type[Any] = getattr(torch.optim, DENSE_OPTIMIZERS[self.name])
        return cls

    def factory(self) -> Any:
        """``params -> Optimizer`` as ``Trainer(dense_optimizers=(factory, None))`` wants."""
        cls, lr, kwargs = self.optimizer_class(), self.lr, dict(self.kwargs)
        return lambda params: cls(params, lr=lr, **kwargs)


@dataclass(frozen=True)
class HookConfig:
    """One entry of ``hooks``: a built-in hook's config name and its constructor arguments, or
    (``spec``) a hook class by import path."""

    name: str
    kwargs: dict[str, Any]
    spec: ComponentSpec | None = None

    def build(self, index: int) -> Hook:
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


def _parse_table_optimizers(raw: Any) -> dict[str, SparseOptimizer]:
    """``table_optimizers: {table name or glob: {name, lr, kwargs}}``."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"`table_optimizers` must be a mapping of table names or globs to "
                          f"sparse optimizers ({{name, lr, kwargs}}), but is {raw!r}.")
    return {str(k): _build(SparseOptimizer, f"table_optimizers.{k}", v) for k, v in raw.items()}


# ---------------------------------------------------------------------------- the whole config


@dataclass(kw_only=True)
class RunConfig:
    """Everything the CLI needs to build and run a ``Trainer``."""

    run: RunMode = "train_and_evaluate"
    args: TrainingArguments
    model: ModelConfig | ClassModelConfig
    data: DataConfig
    dense_optimizer: DenseOptimizerConfig | ComponentSpec
    sparse_optimizer: SparseOptimizer
    hooks: list[HookConfig]
    predict: PredictOptions | None = None
    """Where and how ``run: predict`` writes its scores (``Trainer.predict``)."""
    export: ExportOptions | None = None
    """Where and how ``run: export`` writes the serving artifact (``serving.export``)."""
    table_optimizers: dict[str, SparseOptimizer] = field(default_factory=dict)
    """``Trainer(table_optimizers=...)``: ``{table name or glob: SparseOptimizer}``."""
    lr_scheduler: ComponentSpec | None = None

    @staticmethod
    def from_dict(raw: Any) -> RunConfig:
        """Validate a parsed YAML document (see the module docstring for its sections)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"a config must be a mapping with sections {', '.join(SECTIONS)}; got {raw!r}.")
        unknown = sorted(str(k) for k in raw if k not in SECTIONS)
        if unknown:
            raise ConfigError(
                f"unknown top-level key{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(f'`{k}`' for k in unknown)}; allowed: {', '.join(SECTIONS)}."
            )
        run = raw.get("run", "train_and_evaluate")
        if run not in RUN_MODES:
            raise ConfigError(f"`run` must be one of {', '.join(RUN_MODES)}, but is {run!r}.")
        args = _build(TrainingArguments, "args", raw.get("args"))
        model = _model_config(raw.get("model"))
        data_raw = raw.get("data")
        if not isinstance(data_raw, Mapping):
            raise ConfigError(
                f"`data` must be a mapping with `kind` ({', '.join(DATA_KINDS)}) or `class`, but "
                f"is {data_raw!r}."
            )
        data: DataConfig
        if is_component(data_raw):
            data = ClassDataConfig.from_raw(data_raw)
        else:
            kind = data_raw.get("kind", "synthetic")
            if kind not in DATA_KINDS:
                raise ConfigError(f"`data.kind` must be one of {', '.join(DATA_KINDS)}, but is {kind!r}.")
            data = _build(DATA_KINDS[kind], "data", data_raw)
        opt_raw = raw.get("dense_optimizer")
        sched_raw = raw.get("lr_scheduler")
        if sched_raw is not None and not is_component(sched_raw):
            raise ConfigError(f"`lr_scheduler` must be a mapping with `class` (an import path or "
                              f"one of {', '.join(LR_SCHEDULER_ALIASES)}), but is {sched_raw!r}.")
        cfg = RunConfig(
            run=run,
            args=args,
            model=model,
            data=data,
            dense_optimizer=_component("dense_optimizer", opt_raw, positional=("params",),
                                       aliases=DENSE_OPTIMIZER_ALIASES)
            if is_component(opt_raw) else _build(DenseOptimizerConfig, "dense_optimizer", opt_raw),
            lr_scheduler=None if sched_raw is None else _component(
                "lr_scheduler", sched_raw, positional=("optimizer",), aliases=LR_SCHEDULER_ALIASES),
            sparse_optimizer=_build(SparseOptimizer, "sparse_optimizer", raw.get("sparse_optimizer")),
            hooks=_parse_hooks(raw.get("hooks")),
            predict=None if raw.get("predict") is None else _build(PredictOptions, "predict", raw["predict"]),
            export=None if raw.get("export") is None else _build(ExportOptions, "export", raw["export"]),
            table_optimizers=_parse_table_optimizers(raw.get("table_optimizers")),
        )
        if run == "predict" and cfg.predict is None:
            raise ConfigError("`run: predict` needs a `predict` section with `output_dir` (where "
                              "the scores go).")
        if run == "export" and cfg.export is None:
            raise ConfigError("`run: export` needs an `export` section with `output_dir` (where "
                              "the serving artifact goes).")
        cfg._resolve_schema()
        return cfg

    def synthetic_schema(self) -> tuple[list[str], int, int]:
        """``(sparse feature names, num_dense, num_embeddings)`` for ``data.kind: synthetic``:
        the bundled model's fields, or a model by ``class`` whose arguments of the same names
        give them (a list of names, an int, one int)."""
        m = self.model
        raw = dataclasses.asdict(m) if isinstance(m, ModelConfig) else m.spec.kwargs
        names, num_dense, rows = (raw.get(k) for k in ("sparse_features", "num_dense", "num_embeddings"))
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)
                and isinstance(num_dense, int) and isinstance(rows, int)):
            raise ConfigError(
                "`data.kind: synthetic` takes its schema from the model's arguments "
                "`sparse_features` (a list of names), `num_dense` (an int) and `num_embeddings` "
                f"(one int), but `model` gives {names!r}, {num_dense!r}, {rows!r}; give the model "
                "those arguments, or use `data.kind: parquet` or a dataset by `data.class`.")
        return names, num_dense, rows

    def _resolve_schema(self) -> None:
        """Fill the model's features from the data (parquet) or require them (synthetic)."""
        m, d = self.model, self.data
        if not isinstance(m, ModelConfig):
            if isinstance(d, SyntheticDataConfig):
                self.synthetic_schema()  # from the model's arguments of the bundled model's names
            return  # a model by import path gets its schema from its own arguments
        if isinstance(d, ClassDataConfig | SyntheticDataConfig):
            missing = [k for k in ("sparse_features", "num_dense", "num_embeddings") if getattr(m, k) is None]
            if missing:
                what = "`data.class`" if isinstance(d, ClassDataConfig) else "`data.kind: synthetic`"
                raise ConfigError(
                    f"with {what} the model defines the schema: set "
                    f"{', '.join(f'`model.{k}`' for k in missing)}."
                )
        if isinstance(d, ClassDataConfig):
            return
        if isinstance(d, SyntheticDataConfig):
            if isinstance(m.num_embeddings, list):
                raise ConfigError(
                    "with `data.kind: synthetic`, `model.num_embeddings` must be one int (all "
                    f"tables the same size), but is {m.num_embeddings!r}."
                )
        else:
            spec = d.feature_spec()
            derived: dict[str, Any] = {
                "sparse_features": spec.sparse_names,
                "num_dense": spec.num_dense,
                "num_embeddings": [s.num_embeddings for s in spec.sparse],
            }
            for key, value in derived.items():
                given = getattr(m, key)
                if given is None:
                    setattr(m, key, value)
                elif key == "num_embeddings" and isinstance(given, int):
                    if any(n != given for n in value):
                        raise ConfigError(
                            f"`model.num_embeddings` is {given}, but `data.features.sparse` sizes "
                            f"are {value}; leave `model.num_embeddings` unset to take them from the data."
                        )
                    m.num_embeddings = value
                elif given != value:
                    raise ConfigError(
                        f"`model.{key}` is {given!r}, but the data's feature spec gives {value!r}; "
                        f"leave `model.{key}` unset to take it from the data."
                    )
        m._check_dynamic_features()
        if isinstance(m.num_embeddings, list) and isinstance(m.sparse_features, list) and len(
                m.num_embeddings) != len(m.sparse_features):
            raise ConfigError(
                f"`model.num_embeddings` has {len(m.num_embeddings)} sizes for "
                f"{len(m.sparse_features)} sparse features."
            )


# ---------------------------------------------------------------------------- YAML + overrides


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
    import copy

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


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data (what ``recsys-train --print-config`` shows)."""
    args = {f.name: getattr(cfg.args, f.name) for f in dataclasses.fields(cfg.args)
            if f.name != "save_filter_fn"}
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


__all__ = [
    "BUILTIN_HOOKS",
    "ClassDataConfig",
    "ClassModelConfig",
    "DENSE_OPTIMIZERS",
    "ConfigError",
    "DenseOptimizerConfig",
    "HookConfig",
    "ModelConfig",
    "ParquetDataConfig",
    "RunConfig",
    "SyntheticDataConfig",
    "apply_overrides",
    "coerce_value",
    "config_to_dict",
    "load_config",
    "load_yaml",
]
