"""The whole config: ``RunConfig`` from a parsed YAML document (``RunConfig.from_dict``: the
top-level keys, the run mode, each section through its own module) and the schema resolution
that ties ``model`` to ``data`` (features and table sizes from a parquet feature spec, or
required of the model with synthetic data or a dataset by import path)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from recsys_trainer.args import TrainingArguments
from recsys_trainer.component import ComponentSpec, is_component
from recsys_trainer.config.data import DATA_KINDS, ClassDataConfig, DataConfig, SyntheticDataConfig
from recsys_trainer.config.factory import ConfigError, _build, _component
from recsys_trainer.config.hooks import HookConfig, _parse_hooks
from recsys_trainer.config.model import ClassModelConfig, ModelConfig, _model_config
from recsys_trainer.config.optimizers import (
    DENSE_OPTIMIZER_ALIASES,
    LR_SCHEDULER_ALIASES,
    DenseOptimizerConfig,
    _parse_table_optimizers,
)
from recsys_trainer.optimizers import SparseOptimizer
from recsys_trainer.predict import PredictOptions
from recsys_trainer.serving.exporting.export import ExportOptions

RunMode = Literal["train", "evaluate", "train_and_evaluate", "predict", "export"]
RUN_MODES = ("train", "evaluate", "train_and_evaluate", "predict", "export")
SECTIONS = ("run", "args", "model", "data", "dense_optimizer", "lr_scheduler", "sparse_optimizer",
            "table_optimizers", "hooks", "predict", "export")


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
    """Where and how ``run: export`` writes the serving artifact (``serving.exporting.export``)."""
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
        # `args` is a thin pass-through: the mapping, nested sections included, goes to
        # TrainingArguments(**mapping) as written; the keys allowed are its constructor's.
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

