"""Field checks shared by every configuration dataclass (``TrainingArguments``,
``SparseOptimizer``, ``ParquetReadOptions``, the CLI's own sections).

Each raises ``ValueError`` with one message shape: "`name` must be <what is allowed>, but is
<value>." ``name`` is the field as the user wrote it (``train_steps``, ``data.batch_size``). The
CLI turns these errors into ``ConfigError``s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fail(name: str, allowed: str, value: Any) -> None:
    """Raise the standard message for field ``name``."""
    raise ValueError(f"`{name}` must be {allowed}, but is {value!r}.")


def check_type(name: str, value: Any, types: tuple[type, ...], allowed: str) -> None:
    """``value`` is one of ``types`` (a bool counts as an int only when ``bool`` is listed)."""
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        fail(name, allowed, value)


def check_int(name: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> None:
    """An int >= ``minimum`` (None too, with ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fail(name, f"an int >= {minimum}{' or None' if allow_none else ''}", value)


def check_number(name: str, value: Any, *, above: float | None = None,
                 at_least: float | None = None, allow_none: bool = False) -> None:
    """A number (int or float) ``> above`` or ``>= at_least`` (None too, with ``allow_none``)."""
    if value is None and allow_none:
        return
    bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (
        (above is None or value > above) and (at_least is None or value >= at_least))
    if not ok:
        fail(name, f"a number {bound}{' or None' if allow_none else ''}", value)


def check_choice(name: str, value: Any, choices: Sequence[Any], *, quote: bool = True) -> None:
    """One of ``choices`` (listed with their repr, or bare with ``quote=False``)."""
    if value not in choices:
        listed = ", ".join(repr(c) if quote else str(c) for c in choices)
        fail(name, f"one of {listed}", value)
