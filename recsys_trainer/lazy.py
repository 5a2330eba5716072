"""Package attributes imported on first use (PEP 562), so that importing a package (e.g. the
serving scorer's ``recsys_trainer.data`` and ``recsys_trainer.serving``) does not import the
training stack its other names need."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, names: Mapping[str, str]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose attribute ``name`` is
    ``names[name]``'s attribute of that name, imported when first read and then stored in the
    package (later reads skip ``__getattr__``)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *names])

    return __getattr__, __dir__


__all__ = ["lazy_attributes"]
