"""The ``data`` section: synthetic clicks (``SyntheticDataConfig``), windowed parquet/CSV files
(``ParquetDataConfig``, whose options are ``ParquetReadOptions``), a Kafka topic
(``KafkaDataConfig``, whose options are ``KafkaSourceOptions``) or a dataset factory by import
path (``ClassDataConfig``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow.fs as pafs

from recsys_trainer import storage
from recsys_trainer.component import CLASS_KEY, ComponentSpec
from recsys_trainer.config.factory import ConfigError, _build, _component
from recsys_trainer.data.kafka.options import KafkaSourceOptions
from recsys_trainer.data.parquet import ParquetReadOptions
from recsys_trainer.validation import check_int, check_number, check_type


@dataclass(kw_only=True)
class SyntheticDataConfig:
    """In-memory synthetic clicks with a planted signal
    (``recsys_trainer.data.generators.synthetic``); the schema (features, table sizes) comes from
    ``model``. Each rank generates its own rows."""

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
        return feature_spec(self.features)

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

    def datasets(self) -> tuple[Any, Any]:
        """The train and eval datasets (None where not configured)."""
        return self.build("train"), self.build("eval")


def feature_spec(features: Mapping[str, Any]) -> Any:
    """The ``FeatureSpec`` a ``data.features`` mapping describes (``labels``, ``dense``,
    ``sparse``, ``sequence``, ...; checked field by field)."""
    from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature
    from recsys_trainer.data.spec import FeatureSpec

    raw = dict(features)
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


@dataclass(kw_only=True)
class KafkaDataConfig(KafkaSourceOptions):
    """A Kafka topic (``recsys_trainer.data.kafka.KafkaWindowDataset``, docs/kafka.md): the
    source's ``KafkaSourceOptions`` fields (``bootstrap_servers``, ``topic``, ``time_column``,
    ``window_s``, ``allowed_lateness_s``, ``batch_size``, ``on_corrupt``, ...) and the feature
    spec."""

    kind: Literal["kafka"] = "kafka"
    features: dict[str, Any] = field(default_factory=dict)
    """The ``FeatureSpec``, as for ``kind: parquet``."""
    eval: Literal["following"] | None = None
    """``"following"``: evaluate on the topic's next window (``train_and_evaluate`` trains on
    window T and evaluates on T + 1 once it closes); None: no eval data."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval not in (None, "following"):
            raise ConfigError(f"`data.eval` must be 'following' or null for `kind: kafka`, but "
                              f"is {self.eval!r}.")
        self.feature_spec()  # validate now, not after the process group is up

    def feature_spec(self) -> Any:
        """The ``FeatureSpec`` described by ``features``."""
        return feature_spec(self.features)

    def datasets(self) -> tuple[Any, Any]:
        """The ``KafkaWindowDataset``, and its following windows (with ``eval: following``;
        else None)."""
        from recsys_trainer.data.kafka import KafkaWindowDataset

        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(KafkaSourceOptions)}
        train = KafkaWindowDataset(self.feature_spec(), **options)
        return train, train.following() if self.eval == "following" else None


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
        """The ``data`` mapping with ``class``: one component for train and, with
        ``eval_args``, one for eval, each checked against the callable's signature now."""
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
        """The dataset for ``train`` or ``eval`` (None if not configured)."""
        spec = self.train if which == "train" else self.eval
        return spec.build() if spec is not None else None

    def datasets(self) -> tuple[Any, Any]:
        """The train and eval datasets (None where not configured)."""
        return self.build("train"), self.build("eval")

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data (``--print-config``)."""
        out: dict[str, Any] = {}
        for which, spec in (("train", self.train), ("eval", self.eval)):
            if spec is not None:
                out[CLASS_KEY] = spec.path
                out[f"{which}_args"] = {k: v for k, v in spec.kwargs.items()}
        return out


DATA_KINDS: dict[str, type[Any]] = {"synthetic": SyntheticDataConfig, "parquet": ParquetDataConfig,
                                     "kafka": KafkaDataConfig}
DataConfig = SyntheticDataConfig | ParquetDataConfig | KafkaDataConfig | ClassDataConfig
