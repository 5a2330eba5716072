"""The optimizer sections: ``dense_optimizer`` (``DenseOptimizerConfig`` or a class by import
path), ``lr_scheduler`` (a class by import path) and the names they may use, and
``table_optimizers`` (one ``SparseOptimizer`` per table name or glob). ``sparse_optimizer`` is
``SparseOptimizer`` itself, built in ``recsys_trainer.config.run``."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from recsys_trainer.config.factory import ConfigError, _build
from recsys_trainer.optimizers import SparseOptimizer
from recsys_trainer.validation import check_number, check_type

# Dense optimizers by config name -> torch.optim class name.
DENSE_OPTIMIZERS = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
}

# Short names of ``class:`` values in `dense_optimizer` and `lr_scheduler` (import paths work
# too).
DENSE_OPTIMIZER_ALIASES = {k: f"torch.optim.{v}" for k, v in DENSE_OPTIMIZERS.items()}
LR_SCHEDULER_ALIASES = {
    name: f"torch.optim.lr_scheduler.{cls}" for name, cls in (
        ("step", "StepLR"), ("multistep", "MultiStepLR"), ("exponential", "ExponentialLR"),
        ("cosine", "CosineAnnealingLR"), ("linear", "LinearLR"), ("constant", "ConstantLR"),
        ("onecycle", "OneCycleLR"), ("plateau", "ReduceLROnPlateau"))
}


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
        """The ``torch.optim`` class that ``name`` stands for."""
        import torch

        cls: type[Any] = getattr(torch.optim, DENSE_OPTIMIZERS[self.name])
        return cls

    def factory(self) -> Any:
        """``params -> Optimizer`` as ``Trainer(dense_optimizers=(factory, None))`` wants."""
        cls, lr, kwargs = self.optimizer_class(), self.lr, dict(self.kwargs)
        return lambda params: cls(params, lr=lr, **kwargs)


def _parse_table_optimizers(raw: Any) -> dict[str, SparseOptimizer]:
    """``table_optimizers: {table name or glob: {name, lr, kwargs}}``."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"`table_optimizers` must be a mapping of table names or globs to "
                          f"sparse optimizers ({{name, lr, kwargs}}), but is {raw!r}.")
    return {str(k): _build(SparseOptimizer, f"table_optimizers.{k}", v) for k, v in raw.items()}
