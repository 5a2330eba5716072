"""Components named by import path in a config: ``{class: "my_pkg.module.Name", **kwargs}``.

The nnScaler convention: any model, optimizer, lr scheduler, hook or dataset a config names is a
callable found by its dotted import path (or by a short alias the section defines, such as
``adam`` for ``torch.optim.Adam``), called with the mapping's other keys as keyword arguments.
Everything that can go wrong with the path or the arguments is found when the config is loaded,
before any process group exists, and reported as one ``ValueError`` naming the config key and
the path: the module cannot be imported, it has no such attribute, the attribute is not
callable, or the keyword arguments do not fit its signature.

Some components need an argument only known at build time (a dense optimizer needs the
parameters, an lr scheduler its optimizer): ``ComponentSpec(..., positional=("params",))``
checks the keywords as if those came first, and ``factory()`` returns the factory
``params -> Optimizer`` the Trainer asks for.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

CLASS_KEY = "class"
"""The mapping key that names a component's import path."""


def import_path(key: str, path: Any, aliases: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """The callable ``path`` names (``"pkg.module.Name"``, ``"pkg.module:Name"`` or an alias).

    Raises ``ValueError`` naming ``key`` and ``path`` when the module is missing, the attribute
    is missing, or the object is not callable.
    """
    aliases = aliases or {}
    if not isinstance(path, str) or not path:
        raise ValueError(f"`{key}` must be an import path such as 'my_pkg.module.Name'"
                         f"{_alias_note(aliases)}, but is {path!r}.")
    target = aliases.get(path, path)
    module_name, sep, attr = target.partition(":") if ":" in target else target.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"`{key}` is {path!r}, which is not an import path: write "
                         f"'my_pkg.module.Name'{_alias_note(aliases)}.")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"`{key}` is {path!r}, but module {module_name!r} cannot be imported ({exc}); is its "
            "package installed, or its directory on PYTHONPATH on every node?") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise ValueError(f"`{key}` is {path!r}, but {obj.__name__!r} has no attribute "
                             f"{part!r} (it has: {', '.join(public)}).")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"`{key}` is {path!r}, which is a {type(obj).__name__}, not a class or "
                         "function to call.")
    return obj  # type: ignore[no-any-return]


def _alias_note(aliases: Mapping[str, str]) -> str:
    return f" or one of {', '.join(aliases)}" if aliases else ""


@dataclass(frozen=True)
class ComponentSpec:
    """A callable by import path plus the keyword arguments to call it with.

    ``positional`` names arguments given at build time, before the keywords (``("params",)`` for
    an optimizer). The signature is checked when the spec is made.
    """

    key: str
    """The config key, for messages (``model``, ``hooks[2]``)."""
    path: str
    """As written in the config (an alias or an import path)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    positional: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise ValueError(f"`{self.key}`: the arguments of {self.path!r} must be a mapping "
                             f"of names to values, but are {self.kwargs!r}.")
        self.check()

    @classmethod
    def from_mapping(cls, key: str, raw: Mapping[str, Any], *, positional: tuple[str, ...] = (),
                     aliases: Mapping[str, str] | None = None) -> ComponentSpec:
        """From a config mapping ``{class: path, **kwargs}``."""
        kwargs = {str(k): v for k, v in raw.items() if k != CLASS_KEY}
        return cls(key, cast(Any, raw.get(CLASS_KEY)), kwargs, positional, dict(aliases or {}))

    @property
    def target(self) -> Callable[..., Any]:
        return import_path(f"{self.key}.{CLASS_KEY}", self.path, self.aliases)

    def check(self) -> None:
        """Resolve the path and bind the keywords (after ``positional``) to its signature."""
        fn = self.target
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return  # a builtin without a signature: its own call will say what is wrong
        params = [p for p in sig.parameters if p != "self"][len(self.positional):]
        open_ended = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        unknown = [] if open_ended else sorted(set(self.kwargs) - set(params))
        if unknown:
            raise ValueError(
                f"unknown argument{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(f'`{self.key}.{k}`' for k in unknown)} for {_name(fn)} "
                f"({self.path}); its arguments: {', '.join(params) or 'none'}.")
        try:
            sig.bind(*self.positional, **self.kwargs)
        except TypeError as exc:
            raise ValueError(
                f"`{self.key}` ({self.path}): the arguments {sorted(self.kwargs)} do not fit "
                f"{_name(fn)}: {exc}; its arguments: {', '.join(params) or 'none'}."
            ) from exc

    def build(self, *positional: Any) -> Any:
        """Call the target with ``positional`` then the keywords; an error it raises is
        re-raised naming the key and the path."""
        try:
            return self.target(*positional, **self.kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"`{self.key}` ({self.path}): {exc}") from exc

    def factory(self) -> Callable[..., Any]:
        """``(*positional) -> component``: a factory for arguments known only at build time
        (``params -> Optimizer`` for ``Trainer(dense_optimizers=(factory, ...))``)."""
        return self.build

    def to_dict(self) -> dict[str, Any]:
        """As written in a config (what ``--print-config`` shows)."""
        return {CLASS_KEY: self.path, **self.kwargs}


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def is_component(raw: Any) -> bool:
    """Whether a config value names a component by ``class``."""
    return isinstance(raw, Mapping) and CLASS_KEY in raw


__all__ = ["CLASS_KEY", "ComponentSpec", "import_path", "is_component"]
