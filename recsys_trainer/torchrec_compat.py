"""The torchrec names whose presence depends on the torchrec release, in one place, and the check
that the installed torch / fbgemm-gpu / torchrec are a combination this package knows.

The package runs on the pairs ``scripts/setup`` offers (``SUPPORTED_STACKS``; each checked on
CPU by ``scripts/compat-check``, the torch 2.11 one on an H100 too, docs/gpu.md). fbgemm-gpu's
libraries are built against one torch release and torchrec against one fbgemm-gpu, so the three
move together. Between torchrec 1.6.1 and 1.9.2 the package's code meets these differences:

- ``torchrec.distributed.mc_modules.input_dist_permute`` (a ``features.permute(order,
  order_tensor)`` wrapped for ``torch.fx``) exists from 1.7.0; 1.6.1 permutes inline.
- ``ShardedManagedCollisionCollection._use_2d_weights`` (2-D weights routed by the write
  dists) and ``._free_features_storage_early`` exist from 1.7.0; 1.6.1 never sets them, which
  means neither feature: read them with :func:`uses_2d_weights` and
  :func:`frees_features_storage_early`.

Every other torchrec name the package imports exists, with the same name and module, in
1.6.1, 1.7.0, 1.8.0 and 1.9.2 (checked against each release's source, and by the test tier and
the examples in each pair's venv).

Importing this module imports neither torch nor torchrec: the stack check reads the installed
distributions' metadata, so ``import recsys_trainer`` can run it before anything imports
torchrec (an fbgemm-gpu built for another torch fails there with ``OSError: Could not load this
library: .../fbgemm_gpu_config.so``, which says nothing of versions). The torchrec names below
are imported on first use (PEP 562).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torchrec.distributed.mc_modules import (
        ManagedCollisionCollectionContext as ManagedCollisionCollectionContext,
    )
    from torchrec.distributed.mc_modules import (
        ManagedCollisionCollectionSharder as ManagedCollisionCollectionSharder,
    )
    from torchrec.distributed.mc_modules import (
        ShardedManagedCollisionCollection as ShardedManagedCollisionCollection,
    )
    from torchrec.distributed.mc_modules import input_dist_permute as input_dist_permute
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# torch minor -> (fbgemm-gpu, torchrec): the releases made together, the same table as
# scripts/setup's and scripts/gpu-wheels' (tests/test_torchrec_compat.py holds them equal).
SUPPORTED_STACKS: dict[str, tuple[str, str]] = {
    "2.11": ("1.6.0", "1.6.1"),
    "2.12": ("1.7.0", "1.7.0"),
    "2.13": ("1.8.0", "1.8.0"),
    "2.14": ("1.9.0", "1.9.2"),
}
ALLOW_ANY_STACK_ENV = "RECSYS_TRAINER_ALLOW_ANY_STACK"
"""Set to 1 (or true, yes) to turn :class:`UnsupportedStackError` into a warning (a build of
one's own, say)."""


class UnsupportedStackError(ImportError):
    """The installed torch / fbgemm-gpu / torchrec are a combination known not to load.

    An ``ImportError``: code that treats the training stack as optional (``try: import ...
    except ImportError``) keeps working."""


class UnknownStackWarning(UserWarning):
    """The installed torch / fbgemm-gpu / torchrec are not a supported pair; they may work."""


def _release(version: str) -> str:
    """``2.11.0+cu130`` -> ``2.11.0``: local labels name the build, not the release."""
    return version.split("+", 1)[0]


def _minor(version: str) -> str:
    return ".".join(_release(version).split(".")[:2])


def _installed(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_stack() -> tuple[str, str, str] | None:
    """(torch, fbgemm-gpu, torchrec) versions installed, or None where one of them is not
    (a serving-only install: then nothing here applies)."""
    torch_v = _installed("torch")
    fbgemm_v = _installed("fbgemm-gpu", "fbgemm-gpu-cpu")
    torchrec_v = _installed("torchrec")
    if torch_v is None or fbgemm_v is None or torchrec_v is None:
        return None
    return torch_v, fbgemm_v, torchrec_v


def _describe(stack: tuple[str, str, str]) -> str:
    return f"torch {stack[0]}, fbgemm-gpu {stack[1]}, torchrec {stack[2]}"


def _supported() -> str:
    return "; ".join(f"torch {t}.x + fbgemm-gpu {f} + torchrec {r}"
                     for t, (f, r) in SUPPORTED_STACKS.items())


def stack_problem(stack: tuple[str, str, str]) -> tuple[Literal["error", "warning"], str] | None:
    """None where ``stack`` (torch, fbgemm-gpu, torchrec versions) is a supported pair, else
    how bad it is and a message naming the stack and the supported pairs.

    The policy follows what was measured (docs/gpu.md, "Compatibility: scripts/compat-check"):

    - an fbgemm-gpu built for another torch does not load: of the 16 mixes of torch 2.11-2.14
      with fbgemm-gpu-cpu 1.6.0-1.9.0 only the four pairs' load, the other 12 fail with
      ``OSError: Could not load this library`` (undefined torch C++ symbols). An error, for an
      fbgemm-gpu of the table next to another torch, and for a torch of the table next to
      another fbgemm-gpu;
    - a torch older than the oldest pair comes with a torchrec older than 1.6, which lacks
      names the package imports (1.5.1: ``KernelConfig``, ``TopologyFactory`` and
      ``TrainerConfig`` of ``torchrec.distributed.planner.types``): an error;
    - a newer torch with an fbgemm-gpu outside the table, or another torchrec next to the
      right fbgemm-gpu, is untested rather than known broken (torchrec is pure Python and kept
      every name the package uses from 1.6 to 1.9): a warning, not an error, so a new release
      can be tried without editing the package, and whatever then breaks is traced to the
      untested stack by the warning's text.
    """
    torch_v, fbgemm_v, torchrec_v = stack
    minor = _minor(torch_v)
    want = SUPPORTED_STACKS.get(minor)
    installed = _describe(stack)
    if want is not None and _release(fbgemm_v) == want[0] and _release(torchrec_v) == want[1]:
        return None
    # fbgemm-gpu is built for a torch release line: compared by major.minor, so that a patch or
    # a development build of the right line (1.8.1, 1.8.0a0) is untested, not refused.
    built_for = {_minor(f): m for m, (f, _) in SUPPORTED_STACKS.items()}.get(_minor(fbgemm_v))
    if want is not None and _minor(fbgemm_v) != _minor(want[0]):
        return "error", (
            f"installed: {installed}. fbgemm-gpu {want[0]} is the build for torch {minor}; "
            f"fbgemm-gpu {fbgemm_v} is not, and its libraries do not load with this torch. "
            f"Supported: {_supported()} (scripts/setup installs them).")
    if built_for is not None and built_for != minor:
        return "error", (
            f"installed: {installed}. fbgemm-gpu {fbgemm_v} is the build for torch {built_for}; "
            f"its libraries do not load with torch {minor}. Supported: {_supported()} "
            f"(scripts/setup installs them).")
    try:
        older = (tuple(int(x) for x in minor.split("."))
                 < min(tuple(int(x) for x in m.split(".")) for m in SUPPORTED_STACKS))
    except ValueError:  # not a numbered release: judge it by its behaviour, not its name
        older = False
    if older:
        return "error", (
            f"installed: {installed}. torch {minor} is older than the oldest supported pair, "
            f"and the torchrec of its time lacks names this package imports. "
            f"Supported: {_supported()}.")
    return "warning", (
        f"installed: {installed}, which is not a supported pair (untested; it may work). "
        f"Supported: {_supported()}. scripts/compat-check checks a pair.")


def check_installed_stack() -> None:
    """Raise :class:`UnsupportedStackError` for a combination known not to load, warn
    (:class:`UnknownStackWarning`) for an untested one; nothing for a supported pair or where
    torch, fbgemm-gpu or torchrec is not installed. ``RECSYS_TRAINER_ALLOW_ANY_STACK=1`` turns
    the error into a warning."""
    stack = installed_stack()
    if stack is None:
        return
    problem = stack_problem(stack)
    if problem is None:
        return
    severity, message = problem
    if severity == "error" and os.environ.get(ALLOW_ANY_STACK_ENV, "").lower() not in ("1", "true", "yes"):
        raise UnsupportedStackError(
            f"{message} Set {ALLOW_ANY_STACK_ENV}=1 to import recsys_trainer anyway.")
    warnings.warn(message, UnknownStackWarning, stacklevel=2)


def uses_2d_weights(module: Any) -> bool:
    """``ShardedManagedCollisionCollection._use_2d_weights`` (the batch's weights are 2-D, routed
    by the write dists); False on torchrec 1.6, which has no such path and never sets it.
    Read from ``__dict__``: an ``nn.Module`` attribute lookup that misses costs microseconds
    (``__getattr__`` searches parameters, buffers and submodules first)."""
    return bool(module.__dict__.get("_use_2d_weights", False))


def frees_features_storage_early(module: Any) -> bool:
    """``ShardedManagedCollisionCollection._free_features_storage_early`` (the input dist hands
    the unpermuted batch to ``ctx.early_releasable_inputs``); False on torchrec 1.6, which
    has neither."""
    return bool(module.__dict__.get("_free_features_storage_early", False))


def _input_dist_permute_fallback(features: KeyedJaggedTensor, features_order: list[int],
                                 features_order_tensor: Any) -> KeyedJaggedTensor:
    """torchrec 1.7+'s ``input_dist_permute``, for 1.6.1 (whose input dist permutes inline):
    the same call. Not ``torch.fx.wrap``-ed: the package calls it from a sharded module's
    input dist, which torchrec's pipelines run eagerly, never under a trace."""
    return features.permute(features_order, features_order_tensor)


def _load_input_dist_permute() -> Any:
    try:
        from torchrec.distributed.mc_modules import input_dist_permute as found
    except ImportError:  # torchrec 1.6.x
        return _input_dist_permute_fallback
    return found


# Notices the supported stacks print, on every run, about calls this package makes, where the
# advice does not apply to those calls; each is matched by the start of its text, so that a
# reworded or a new notice still shows. `quiet_stack_notices` drops them around the calls.
_NOTICE_WARNINGS = (
    # torchrec 1.8+, whenever a planner is built with its default storage reservation: "We
    # recommend passing a dense_tensor_estimate, or migrating to FixedPercentageStorageReservation".
    # It is about planning a model whose modules are not materialised (a "dry run"); the
    # package plans the real model, dense modules materialised (only the tables are on the meta
    # device, and the planner sizes those apart), so the heuristic's estimate is from real sizes.
    "HeuristicalStorageReservation is known to cause issues",
    # torch 2.13+, when torchrec's DistributedModelParallel wraps the dense part in DDP with
    # broadcast_buffers=False: torchrec's call, with nothing for a user of this package to change.
    "`broadcast_buffers` is deprecated",
)
_NOTICE_RECORDS = (
    # torchrec 1.8+, logged on every plan made without a dense_tensor_estimate: the same advice
    # as the first warning above, for the same case.
    ("torchrec.distributed.planner.storage_reservations",
     "There is a known issue with TorchRec's dense tensor size calculation in dry run"),
)
# torch 2.13+ logs this once per process, the first time anything builds a torchrec
# KeyedJaggedTensor (its metaclass, torch.fx's ProxyableClassMeta, asks is_fx_tracing()):
# advice to torch.fx's callers, here torchrec's metaclass, with nothing for a user to change.
_FX_TRACING_NOTICE = ("torch.fx._symbolic_trace", "is_fx_tracing will return true for both")


class _DropNotice(logging.Filter):
    """Drops a logger's records whose message starts with ``prefix``; lets every other through."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


_fx_tracing_filter = _DropNotice(_FX_TRACING_NOTICE[1])


_MC_LOAD_HOOK = "ManagedCollisionModule.__init__.<locals>._load_state_dict_post_hook"
"""torchrec's managed-collision modules register this load hook: a function local to
``__init__`` (it calls ``module.validate_state()``), which pickle cannot name."""


def _validate_after_load(module: Any, incompatible_keys: Any) -> None:
    """torchrec's managed-collision load hook as a function pickle can name: after a state
    dict is loaded the module checks its state (``validate_state``), as torchrec's does."""
    module.validate_state()


def picklable_load_hooks(model: Any) -> int:
    """In ``model``'s managed-collision modules (dynamic tables), replace torchrec's local load
    hook by the equal ``_validate_after_load``, so that the model can be pickled whole (the
    publisher process receives the architecture that way); returns how many were replaced."""
    replaced = 0
    for module in model.modules():
        hooks = module._load_state_dict_post_hooks
        for key, hook in list(hooks.items()):
            if getattr(hook, "__qualname__", None) == _MC_LOAD_HOOK:
                hooks[key] = _validate_after_load
                replaced += 1
    return replaced


def quiet_fx_tracing_notice() -> None:
    """Drop torch's once-per-process ``is_fx_tracing`` notice (``_FX_TRACING_NOTICE``) for the
    rest of the process; every other record of its logger passes. Idempotent. The first
    KeyedJaggedTensor of a run prints it, at no call of the package's own, hence not scoped."""
    logging.getLogger(_FX_TRACING_NOTICE[0]).addFilter(_fx_tracing_filter)  # a no-op when there


@contextlib.contextmanager
def quiet_stack_notices() -> Iterator[None]:
    """Within: drop the supported stacks' notices about the package's sharding calls whose
    advice does not apply to them (the planner's storage-reservation advice, DDP's
    ``broadcast_buffers`` deprecation met by torchrec's own call; see ``_NOTICE_WARNINGS``);
    every other warning and log record passes. A newcomer's first run then shows no WARNING
    that they must learn to ignore."""
    filters = [(logging.getLogger(name), _DropNotice(prefix)) for name, prefix in _NOTICE_RECORDS]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for prefix in _NOTICE_WARNINGS:
                warnings.filterwarnings("ignore", message=re.escape(prefix), category=FutureWarning)
            yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


# name -> how to get it, on first read (PEP 562): importing this module stays torch-free.
_LAZY: dict[str, Any] = {
    "input_dist_permute": _load_input_dist_permute,
    "ManagedCollisionCollectionContext": "torchrec.distributed.mc_modules",
    "ManagedCollisionCollectionSharder": "torchrec.distributed.mc_modules",
    "ShardedManagedCollisionCollection": "torchrec.distributed.mc_modules",
}


def __getattr__(name: str) -> Any:
    how = _LAZY.get(name)
    if how is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = how() if callable(how) else getattr(importlib.import_module(how), name)
    setattr(sys.modules[__name__], name, value)  # later reads skip __getattr__
    return value


__all__ = [
    "ALLOW_ANY_STACK_ENV",
    "SUPPORTED_STACKS",
    "ManagedCollisionCollectionContext",
    "ManagedCollisionCollectionSharder",
    "ShardedManagedCollisionCollection",
    "UnknownStackWarning",
    "UnsupportedStackError",
    "check_installed_stack",
    "frees_features_storage_early",
    "input_dist_permute",
    "installed_stack",
    "quiet_fx_tracing_notice",
    "quiet_stack_notices",
    "stack_problem",
    "uses_2d_weights",
]
