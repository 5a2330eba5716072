"""Run configuration for the ``recsys-train`` CLI: a YAML file, dotted overrides, dataclasses.

A config file has these top-level sections (all optional except ``model`` and ``data``)::

    run: train_and_evaluate     # train | evaluate | train_and_evaluate | predict
    args: {...}                 # TrainingArguments fields
    model: {...}                # DLRMClassifier arguments (ModelConfig), or {class: pkg.Model, ...}
    data: {kind: synthetic, ...}  or  {kind: parquet, ...}  or  {kind: kafka, ...}
          (SyntheticDataConfig / ParquetDataConfig / KafkaDataConfig)
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
``data: kind: parquet`` are ``ParquetReadOptions`` (``ParquetWindowDataset``'s), those of
``data: kind: kafka`` ``KafkaSourceOptions`` (``KafkaWindowDataset``'s). The sections
with no runtime dataclass (the bundled model, synthetic data, the dense optimizer factory, the
hooks list) are defined here. Validation lives in the dataclasses, all through
``recsys_trainer.validation``; every error becomes a ``ConfigError`` naming the dotted key, the
bad value and what is allowed. ``apply_overrides`` applies ``--section.key value`` pairs with YAML scalar typing

The package, one concern a module (each imports only those before it):

- ``factory``: ``ConfigError``; a section's mapping into a dataclass (``_build``, the keys its
  constructor takes) or into a component by import path (``_component``).
- ``model``: the ``model`` section (``ModelConfig``, ``ClassModelConfig``, ``dynamic`` tables).
- ``data``: the ``data`` section (``SyntheticDataConfig``, ``ParquetDataConfig``,
  ``ClassDataConfig``).
- ``optimizers``: ``dense_optimizer``, ``lr_scheduler`` names and ``table_optimizers``.
- ``hooks``: the ``hooks`` list (``HookConfig``, ``BUILTIN_HOOKS``).
- ``run``: ``RunConfig`` (the top-level keys, run modes) and the schema resolution between
  ``model`` and ``data``.
- ``yaml_io``: the YAML file, ``--section.key value`` overrides, ``load_config`` and
  ``config_to_dict``.
"""

from __future__ import annotations

from recsys_trainer.config.data import (
    DATA_KINDS,
    ClassDataConfig,
    DataConfig,
    KafkaDataConfig,
    ParquetDataConfig,
    SyntheticDataConfig,
)
from recsys_trainer.config.factory import ConfigError
from recsys_trainer.config.hooks import BUILTIN_HOOKS, HookConfig
from recsys_trainer.config.model import MODEL_ALIASES, MODEL_CLASSES, ClassModelConfig, ModelConfig
from recsys_trainer.config.optimizers import (
    DENSE_OPTIMIZER_ALIASES,
    DENSE_OPTIMIZERS,
    LR_SCHEDULER_ALIASES,
    DenseOptimizerConfig,
)
from recsys_trainer.config.run import RUN_MODES, SECTIONS, RunConfig, RunMode
from recsys_trainer.config.yaml_io import (
    apply_overrides,
    coerce_value,
    config_to_dict,
    load_config,
    load_yaml,
)

# Every public name of the former single module stays importable from here (the CLI and the
# docs name `config.RUN_MODES`); the private helpers live in the modules above.
__all__ = [
    "BUILTIN_HOOKS",
    "ClassDataConfig",
    "ClassModelConfig",
    "DATA_KINDS",
    "DENSE_OPTIMIZERS",
    "DENSE_OPTIMIZER_ALIASES",
    "ConfigError",
    "DataConfig",
    "DenseOptimizerConfig",
    "HookConfig",
    "LR_SCHEDULER_ALIASES",
    "MODEL_ALIASES",
    "MODEL_CLASSES",
    "ModelConfig",
    "KafkaDataConfig",
    "ParquetDataConfig",
    "RUN_MODES",
    "RunConfig",
    "RunMode",
    "SECTIONS",
    "SyntheticDataConfig",
    "apply_overrides",
    "coerce_value",
    "config_to_dict",
    "load_config",
    "load_yaml",
]
