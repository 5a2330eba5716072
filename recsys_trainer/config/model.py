"""The ``model`` section: the bundled DLRM's fields (``ModelConfig``) or a model by import path
(``ClassModelConfig``), and the ``dynamic`` tables either one may take (``DynamicTable``'s fields
as a mapping, for every table or per feature)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from recsys_trainer.component import CLASS_KEY, ComponentSpec, is_component
from recsys_trainer.config.factory import ConfigError, _build, _component
from recsys_trainer.dynamic import ID_SPACE, DynamicTable
from recsys_trainer.table_precision import data_type
from recsys_trainer.validation import check_choice, check_int

# Short names of ``class:`` values in `model` (import paths work too).
MODEL_ALIASES = {"dlrm": "recsys_trainer.models.DLRMClassifier"}

MODEL_CLASSES = {name: f"recsys_trainer.models.{cls}" for name, cls in (
    ("dcn", "DCNClassifier"), ("din", "DINClassifier"), ("mmoe", "MMoEClassifier"),
    ("two_tower", "TwoTowerModel"), ("sasrec", "SASRecModel"),
    ("hstu_ranking", "HSTURankingModel"), ("hstu_retrieval", "HSTURetrievalModel"))}
"""The other bundled models by short name: ``model: {class: dcn, <its arguments>}`` is the class
at that import path with those arguments (unlike ``dlrm``, nothing is derived from the data)."""


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
    embedding_dtype: str | dict[str, str] = "fp32"
    """The tables' precision: ``fp32``, ``fp16`` or ``bf16`` (CUDA only), for every table, or
    ``{t_<feature>: fp16}`` per table (the others fp32); hashed and dynamic tables alike."""

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
        dtypes = self.embedding_dtype
        for key, value in (dtypes.items() if isinstance(dtypes, dict) else [(None, dtypes)]):
            data_type(value, "model.embedding_dtype" + (f".{key}" if key else ""))
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
            embedding_dtype=self.embedding_dtype,
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
        """The model from its import path, with a ``dynamic`` mapping built into
        ``DynamicTable``s where the callable is annotated to take them."""
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
    """The bundled DLRM (``kind: dlrm`` or ``class: dlrm``), another bundled model by short
    name (``MODEL_CLASSES``) or a model class by import path."""
    if not is_component(raw):
        return _build(ModelConfig, "model", raw)
    if raw[CLASS_KEY] in MODEL_ALIASES:
        # The alias keeps the bundled model's config: its schema still comes from the data.
        return _build(ModelConfig, "model", {k: v for k, v in raw.items() if k != CLASS_KEY})
    if raw[CLASS_KEY] in MODEL_CLASSES:
        raw = {**raw, CLASS_KEY: MODEL_CLASSES[raw[CLASS_KEY]]}
    return ClassModelConfig(_component("model", raw))

