"""The CPU guard against device bugs: code that runs on the model's device must take every
tensor's device from its inputs or the placement (docs/devices.md has the zones and the rules).

Developers and CI have no GPU, and on the CPU a tensor made without a device sits on the same
device as everything else: the bug only shows on a GPU ("Expected all tensors to be on the same
device ... cuda:0 and cpu!"). Two checks make the CPU suite see it:

1. Static (AST, fast): in the device-side modules listed in ``DEVICE_SIDE`` (every other
   module of the package is in ``NOT_DEVICE_SIDE`` with a reason), no tensor constructor
   without a device or with a host one (``torch.zeros``, ``torch.arange``, ``torch.tensor``,
   ..., ``torch.Generator()``; ``device="cpu:0"``, ``torch.device("cpu")``, ``None``; a
   ``**kwargs`` splat counts as unknown), no legacy typed constructor (``torch.LongTensor``)
   or ``torch.from_numpy``, no ``new_*`` / ``*_like`` with a host device, and no ``.cpu()`` /
   ``.numpy()`` / ``.to(<host>)`` round trip; torch is followed through its import aliases.
   Exceptions: ``ALLOWED`` (each entry says why) and tensors made to become a module's buffer
   or parameter (they move with the module).
2. Behavioural: the device-side pure-torch paths run with their inputs (and modules) on the
   ``meta`` device. PyTorch refuses to mix a ``meta`` tensor with a CPU tensor in one op, just
   as it refuses a CUDA one, so a tensor made on the host fails here as on a GPU. Cross-rank
   paths run against a fake two-rank group whose gathers refuse a tensor off the group's device,
   as NCCL refuses host tensors.

``meta`` has no data. Where the code reads a value back (``.item()``, ``int(t)``, ``bool(t)``)
or makes a data-sized result (``nonzero``, boolean masks, ``unique``, ``bincount``,
``repeat_interleave`` by counts), the ``meta_reads`` fixture supplies an assumed value: every
read gives 1 (``True``), every data-sized result keeps one entry per input (as torch's own
``meta_nonzero_assume_all_nonzero``). A read-back is a crossing, not a device mix; the inputs
are chosen so that the assumed sizes agree (one target per query, one id per row). A copy to
the host (``.cpu()``) cannot run on ``meta`` at all: tests stop at that crossing (the code
exposes the part before it, e.g. ``ClickMetrics.gathered_rows``) or patch the crossing
function (``retrieval.metrics.host_floats``), as each test's docstring says.
"""

from __future__ import annotations

import ast
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recsys_trainer

META = torch.device("meta")
PACKAGE = Path(recsys_trainer.__file__).resolve().parent

# ----------------------------------------------------------------------------- static check

DEVICE_SIDE: tuple[str, ...] = (
    # metrics, losses, models
    "metrics.py",
    "models/__init__.py",
    "models/blocks.py",
    "models/losses.py",
    "models/dlrm.py",
    "models/din.py",
    "models/mmoe.py",
    "models/retrieval_base.py",
    "models/two_tower.py",
    "models/sasrec.py",
    "models/dcn.py",
    "models/hstu.py",
    "models/hstu_layer.py",
    "models/jagged.py",
    "models/checks.py",
    # the training loop and what it runs on the model's device: the step, autocast and loss
    # scaling, the batch's move to the device, sharding (DMP/DDP), the optimizers' state, the
    # per-device generators
    "trainer.py",
    "pipeline.py",
    "step.py",
    "precision.py",
    "batch.py",
    "sharding.py",
    "optimizers.py",
    "rng.py",
    # hooks' metric state and the hooks that read the model's tensors
    "hooks/_interval.py",
    "hooks/base.py",
    "hooks/metrics.py",
    "hooks/retrieval_metrics.py",
    "hooks/nonfinite.py",
    "hooks/dynamic_tables.py",
    # retrieval: models, losses, frequencies, collectives, evaluation, the export's embedding
    "retrieval/__init__.py",
    "retrieval/candidates.py",
    "retrieval/catalog.py",
    "retrieval/checks.py",
    "retrieval/collectives.py",
    "retrieval/export.py",
    "retrieval/frequency.py",
    "retrieval/kjt.py",
    "retrieval/losses.py",
    "retrieval/metrics.py",
    "retrieval/protocol.py",
    # dynamic tables: the id maps and what runs on their buffers
    "dynamic/__init__.py",
    "dynamic/id_map.py",
    "dynamic/ids.py",
    "dynamic/modules.py",
    "dynamic/policy.py",
    "dynamic/reset.py",
    "dynamic/sharded_map.py",
    "dynamic/state.py",
    "dynamic/stats.py",
    "dynamic/tables.py",
    "dynamic/pooled_sharding.py",
    # the dynamic export's lookups (public: they may be given device tensors); the live
    # components' tensors a checkpoint takes and restores; the warm start's copy into them
    "checkpoint/dynamic_export.py",
    "checkpoint/contents.py",
    "checkpoint/model_bank.py",
)
"""Modules whose tensors live on the model's device (paths under ``recsys_trainer/``)."""

NOT_DEVICE_SIDE: dict[str, str] = {
    "dynamic/relayout.py": "plans the re-routing on the host from a gathered copy of the maps; "
                           "every tensor that meets a table is moved with .to(<the table's device>)",
    "dynamic/config.py": "table settings (Python values), no tensors",
    "distributed.py": "the control gang's collectives run on gloo with host tensors",
    "predict.py": "the crossing of predictions to the host (numpy, the output files)",
    **dict.fromkeys(
        ("hooks/__init__.py", "hooks/early_stopping.py", "hooks/jsonl.py", "hooks/lambda_hook.py",
         "hooks/logger.py", "hooks/profiler.py", "hooks/progress.py", "hooks/tensorboard.py"),
        "reports Python values the metric hooks already read back; makes no tensors"),
    **dict.fromkeys(
        ("__init__.py", "__main__.py", "lazy.py", "logs.py", "component.py", "validation.py",
         "args.py", "cli.py", "periods.py", "smoke.py", "torchrec_compat.py",
         "config/__init__.py", "config/data.py", "config/factory.py", "config/hooks.py",
         "config/model.py", "config/optimizers.py", "config/run.py", "config/yaml_io.py",
         "builder.py", "eval_schedule.py", "trainer_state.py", "hooks/checkpoint.py",
         "hooks/publish.py"),
        "configuration, entry points and plumbing: Python values, makes no tensors"),
    "placement.py": "decides the model's device once (torch.device values); makes no tensors",
    "table_dtypes.py": "names torch dtypes, makes no tensor",
    "table_precision.py": "probes FBGEMM's kernels on a 4-row table of its own, every tensor "
                          "made on the device it probes; touches no model tensor",
    "plot.py": "renders a run's metrics log (JSON lines) to PNG files on the host",
    "storage.py": "filesystems and paths (pyarrow.fs); no tensors",
    "preemption.py": "signals become an agreed stop (a flag on the control gang); no tensors",
    **dict.fromkeys(
        ("checkpoint/__init__.py", "checkpoint/errors.py", "checkpoint/layout.py",
         "checkpoint/lock.py", "checkpoint/rotation.py", "checkpoint/resume.py"),
        "checkpoint files, markers, retention and the output_dir lock; no tensors"),
    **dict.fromkeys(
        ("checkpoint/manager.py", "checkpoint/save_pipeline.py", "checkpoint/loading.py"),
        "when and where to save and load; the tensors they hand on are the components' own "
        "(checkpoint/contents.py, scanned)"),
    "checkpoint/writer.py": "the save's host side by design: pinned host staging buffers and "
                            "zero-copy views of host tensors for DCP",
    "checkpoint/export.py": "reads checkpoints into host state dicts, without torch.distributed "
                            "or a device",
    **dict.fromkeys(
        tuple(f"data/{m}.py" for m in (
            "__init__", "base", "batch_check", "chunk", "columns", "decode", "errors", "hashing",
            "inputs", "parquet", "parquet_files", "parquet_plan", "prefetch", "spec", "sync",
            "vocab/__init__", "vocab/build", "vocab/features", "vocab/lookup", "vocab/state",
            "windows",
            "generators/__init__", "generators/churn_dataset", "generators/criteo_synthetic",
            "generators/generated", "generators/id_stream", "generators/interactions_synthetic",
            "generators/open_bandit", "generators/stream_writer", "generators/synthetic",
            "generators/kafka_producer", "generators/sequences_synthetic",
            "kafka/__init__", "kafka/client", "kafka/dataset", "kafka/formats",
            "kafka/mock_broker", "kafka/options", "kafka/positions", "kafka/reading",
            "kafka/tracker", "kafka/windowing")),
        "the input pipeline: rows decoded into host (CPU) batches; the Trainer moves each batch "
        "to the device (Batch.to), and the exit flag all-reduces on the control gang (gloo)"),
    **dict.fromkeys(
        tuple(f"serving/{m}.py" for m in (
            "__init__", "delta", "manifest", "quantize", "routing", "published",
            "runtime/__init__", "runtime/scorer",
            "runtime/tables", "runtime/follow", "runtime/server", "exporting/__init__",
            "exporting/export", "exporting/model_parts", "exporting/artifact",
            "exporting/publisher", "exporting/publisher_client", "exporting/_publish_worker",
            "program")),
        "serving runs on the host: the export copies the model to host tensors first and the "
        "Scorer scores on the CPU"),
}
"""Modules of the package that are deliberately left out of the scan, and why."""

ALLOWED: dict[tuple[str, str, str], str] = {
    ("metrics.py", "ClickMetrics.result", ".cpu"):
        "the crossing: the gathered rows go to the host once for the exact metrics",
    ("hooks/retrieval_metrics.py", "RetrievalMetricHook._take", ".cpu"):
        "per-user evaluation: user ids and times go to the host for the gang's object gather",
    ("hooks/retrieval_metrics.py", "RetrievalMetricHook._per_user", ".cpu"):
        "per-user evaluation groups users on the host (numpy); the selection goes back to the device",
    ("hooks/retrieval_metrics.py", "RetrievalMetricHook._per_user", ".numpy"):
        "as above: the per-user grouping is numpy on the host",
    ("retrieval/export.py", "export_item_embeddings", ".cpu"):
        "the export's copy of the embedded corpus to the host, for the parquet file",
    ("retrieval/export.py", "export_item_embeddings", ".numpy"):
        "as above: the file is written from numpy",
    ("retrieval/frequency.py", "ItemFrequencyEstimator.__init__", "torch.Generator"):
        "hash parameters drawn on the host from the seed (the same on every device and rank), "
        "registered as buffers and moved with the module",
    ("models/retrieval_base.py", "_fixed_draw", "torch.Generator"):
        "evaluation negatives drawn once on the host so that every device gets the same ids; "
        "the caller moves them to the device once and keeps them there",
    ("models/retrieval_base.py", "_fixed_draw", "torch.randint"):
        "as above",
    ("retrieval/catalog.py", "load_item_catalog", "torch.from_numpy"):
        "reads the catalog file on the host; the model registers the columns as buffers",
}
"""(module, function, what) -> why a host tensor is right there (a host-side helper in a
device module, or a crossing)."""

CONSTRUCTORS = frozenset({
    "zeros", "ones", "empty", "full", "arange", "range", "tensor", "as_tensor", "asarray",
    "randn", "rand", "randint", "randperm", "linspace", "logspace", "eye", "empty_strided",
    "scalar_tensor", "tril_indices", "triu_indices", "frombuffer", "Generator",
    "sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_compressed_tensor",
    "bartlett_window", "blackman_window", "hamming_window", "hann_window", "kaiser_window",
})
"""``torch.<name>(...)`` calls that make a tensor (or generator) on the CPU unless given a
device. (``zeros_like``, ``new_zeros`` and the like take their device from a tensor.)"""

HOST_ONLY = frozenset({
    "from_numpy",
    # The legacy typed constructors: CPU tensors (they refuse a CUDA device).
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor",
    "CharTensor", "ShortTensor", "IntTensor", "LongTensor", "BoolTensor",
})
"""``torch.<name>(...)`` calls that always give a host tensor."""


def _torch_aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """The names the module binds to torch (``import torch``, ``import torch as th``) and the
    names it imports from torch (``from torch import zeros as z`` -> {"z": "zeros"}), anywhere
    in the module: a constructor reached through an alias is still a constructor."""
    modules: set[str] = set()
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch":
                    modules.add(a.asname or "torch")
                elif a.name.startswith("torch.") and a.asname is None:
                    modules.add("torch")  # ``import torch.nn`` binds ``torch`` too
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = a.name
    return modules, names


def _places_on_module(call: ast.Call) -> bool:
    """A call that makes its argument a module's buffer or parameter (it moves with ``.to``)."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("register_buffer", "register_parameter", "Parameter", "Buffer")


class _Finder(ast.NodeVisitor):
    """Device-less constructors and host round trips, by enclosing function.

    A device counts as the host's when it is a string starting with ``"cpu"``, a
    ``torch.device("cpu"...)`` call or, for a constructor, the literal ``None`` (the default
    device: the host); an ``a if c else b`` is the host's if either branch is. A ``**kwargs``
    splat may or may not carry a device: it is flagged (allow-list it where the caller's
    keywords do carry one)."""

    def __init__(self, torch_modules: set[str] | None = None,
                 torch_names: dict[str, str] | None = None) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, str, int]] = []  # (function, what, line)
        self._placed: set[int] = set()  # ids of calls that end up a buffer or parameter
        self._placed_names: list[set[str]] = []
        self._modules = {"torch"} if torch_modules is None else torch_modules
        self._names = torch_names or {}

    def visit_Module(self, node: ast.Module) -> None:
        modules, names = _torch_aliases(node)
        self._modules |= modules
        self._names = {**self._names, **names}
        self.generic_visit(node)

    def _torch_fn(self, func: ast.AST) -> str | None:
        """``torch.<name>`` (through any alias of torch) or a name imported from torch."""
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id in self._modules):
            return func.attr
        if isinstance(func, ast.Name):
            return self._names.get(func.id)
        return None

    def _host_device(self, value: ast.AST, none_is_host: bool) -> bool:
        if isinstance(value, ast.Constant):
            if value.value is None:
                return none_is_host
            return isinstance(value.value, str) and value.value.startswith("cpu")
        if isinstance(value, ast.Call) and self._torch_fn(value.func) == "device":
            first = value.args[0] if value.args else next(
                (k.value for k in value.keywords if k.arg == "type"), None)
            return (isinstance(first, ast.Constant) and isinstance(first.value, str)
                    and first.value.startswith("cpu"))
        if isinstance(value, ast.IfExp):
            return (self._host_device(value.body, none_is_host)
                    or self._host_device(value.orelse, none_is_host))
        return False

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # Names handed to register_buffer / Parameter in this function: what made them moves
        # with the module.
        names: set[str] = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and _places_on_module(sub):
                names.update(a.id for a in sub.args if isinstance(a, ast.Name))
        self._placed_names.append(names)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and _places_on_module(sub):
                for arg in [*sub.args, *(k.value for k in sub.keywords)]:
                    self._placed.update(id(c) for c in ast.walk(arg) if isinstance(c, ast.Call))
            if isinstance(sub, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id in names for t in sub.targets):
                self._placed.update(id(c) for c in ast.walk(sub.value) if isinstance(c, ast.Call))
            if isinstance(sub, ast.Assign) and any(
                    isinstance(t, ast.Tuple) and any(isinstance(e, ast.Name) and e.id in names
                                                     for e in t.elts) for t in sub.targets):
                self._placed.update(id(c) for c in ast.walk(sub.value) if isinstance(c, ast.Call))
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()
        self._placed_names.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def _what(self, node: ast.Call) -> str | None:
        fn = self._torch_fn(node.func)
        placed = id(node) in self._placed
        device = [k for k in node.keywords if k.arg == "device"]
        if fn in HOST_ONLY and not placed:
            return f"torch.{fn}"
        # torch.normal makes a new tensor only from float mean/std and a size (3rd argument
        # or size=); with tensor mean/std it is on their device.
        is_ctor = fn in CONSTRUCTORS or (fn == "normal" and (
            len(node.args) >= 3 or any(k.arg == "size" for k in node.keywords)))
        if is_ctor and not placed:
            if device:
                if self._host_device(device[0].value, none_is_host=True):
                    return f"torch.{fn}"
            else:
                # No device keyword: the default (the host); a ** splat: unknown.
                return f"torch.{fn}"
        # *_like and x.new_*: the device of a tensor unless told otherwise (None keeps it).
        like = f"torch.{fn}" if fn is not None and fn.endswith("_like") else (
            f".{node.func.attr}" if fn is None and isinstance(node.func, ast.Attribute)
            and node.func.attr.startswith("new_") else None)
        if like is not None and device and self._host_device(device[0].value, none_is_host=False):
            return f'{like}(device="cpu")'
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("cpu", "numpy") and not node.args:
            return f".{node.func.attr}"
        if isinstance(node.func, ast.Attribute) and node.func.attr == "to" and fn is None:
            # x.to("cpu"), x.to(torch.device("cpu")), x.to(device="cpu", ...); to(None) and
            # to(device=None) keep the device.
            targets = node.args[:1] + [k.value for k in device]
            if any(self._host_device(t, none_is_host=False) for t in targets):
                return '.to("cpu")'
        return None

    def visit_Call(self, node: ast.Call) -> None:
        what = self._what(node)
        if what is not None:
            self.found.append((".".join(self.scope) or "<module>", what, node.lineno))
        self.generic_visit(node)


def scan(path: Path) -> list[tuple[str, str, int]]:
    finder = _Finder()
    finder.visit(ast.parse(path.read_text(), str(path)))
    return finder.found


def test_device_side_modules_make_no_tensor_without_a_device() -> None:
    """Every device-less constructor or host round trip in a device-side module is either gone
    or allowed with a reason; every allowance is still used (no stale entries)."""
    missing = [m for m in DEVICE_SIDE if not (PACKAGE / m).is_file()]
    assert not missing, f"DEVICE_SIDE lists modules that do not exist: {missing}"
    bad, used = [], set()
    for module in DEVICE_SIDE:
        for function, what, line in scan(PACKAGE / module):
            key = (module, function, what)
            if key in ALLOWED:
                used.add(key)
            else:
                bad.append(f"recsys_trainer/{module}:{line} in {function}: {what}(...) without a "
                           "device")
    assert not bad, ("tensors made without a device in device-side code (take it from an input, "
                     "e.g. device=x.device, or x.new_zeros; or add an ALLOWED entry saying why):\n"
                     + "\n".join(bad))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that match nothing any more: {stale}"


def test_every_module_of_the_package_is_classified() -> None:
    """Every module of the package (``recsys_trainer/**/*.py``) is listed as device-side or
    left out with a reason, so the static check cannot miss one by omission; no entry names a
    module that is gone, and none is in both lists."""
    listed = set(DEVICE_SIDE) | set(NOT_DEVICE_SIDE)
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}
    unclassified = sorted(modules - listed)
    assert not unclassified, (f"neither in DEVICE_SIDE nor in NOT_DEVICE_SIDE of "
                              f"tests/test_device_guard.py: {unclassified}")
    assert not sorted(listed - modules), f"listed but not in the package: {sorted(listed - modules)}"
    assert not set(DEVICE_SIDE) & set(NOT_DEVICE_SIDE), set(DEVICE_SIDE) & set(NOT_DEVICE_SIDE)
    assert all(NOT_DEVICE_SIDE.values()), "every NOT_DEVICE_SIDE entry says why"


def test_the_static_check_sees_what_it_must() -> None:
    """The checker itself: every way of writing "on the host" that it must see is found (a
    device-less constructor, a host device however spelt, a ``**`` splat, torch through an
    alias, the legacy typed constructors, host round trips); a device taken from a tensor, or
    a tensor that becomes a buffer, is not."""
    src = '''
import torch
import torch as th
from torch import zeros, LongTensor as LT
def f(x, kw):
    a = torch.zeros(3)
    b = torch.arange(3, device=x.device)
    c = torch.tensor([1], device=None)
    return x.cpu().numpy(), x.to("cpu"), torch.from_numpy(a.numpy())
def devices(x, kw, d):
    torch.ones(2, device=torch.device("cpu"))
    torch.ones(2, device="cpu:0")
    torch.ones(2, device=th.device("cpu", 0))
    torch.ones(2, device=None if d is None else d)
    torch.zeros(3, **kw)
    th.zeros(3)
    zeros(3)
    torch.LongTensor([1])
    torch.FloatTensor(2)
    LT([1])
    torch.normal(0.0, 1.0, (3,))
    torch.normal(0.0, 1.0, size=(3,))
    torch.sparse_coo_tensor(x, x, (2, 2))
def moves(x):
    x.to(device="cpu")
    x.to(torch.device("cpu"))
    x.to(dtype=torch.float32, device="cpu")
    x.new_tensor([1], device="cpu")
    torch.empty_like(x, device="cpu")
    x.new_zeros(2, device=torch.device("cpu"))
def fine(x, d, kw):
    torch.zeros(3, device=x.device)
    torch.zeros(3, device=d, **kw)
    x.new_zeros(4)
    x.new_zeros(4, device=None)
    torch.zeros_like(x)
    torch.empty_like(x, device=x.device)
    torch.normal(x, x)
    x.to(d)
    x.to(torch.float32)
    x.to(device=x.device)
    torch.device("cpu")
    torch.sparse_coo_tensor(x, x, (2, 2), device=x.device)
    th.ones(2, device=d)
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("p", torch.arange(4))
        causal = torch.triu(torch.full((2, 2), 1.0))
        self.register_buffer("c", causal)
        self.w = torch.nn.Parameter(torch.zeros(2).normal_())
        self.plain = torch.ones(2)
'''
    finder = _Finder()
    finder.visit(ast.parse(src))
    got = sorted((f, w) for f, w, _ in finder.found)
    assert got == sorted([
        ("f", "torch.zeros"), ("f", "torch.tensor"), ("f", ".cpu"), ("f", ".numpy"),
        ("f", '.to("cpu")'), ("f", "torch.from_numpy"), ("f", ".numpy"),
        *(("devices", f"torch.{w}") for w in (
            "ones", "ones", "ones", "ones", "zeros", "zeros", "zeros", "LongTensor",
            "FloatTensor", "LongTensor", "normal", "normal", "sparse_coo_tensor")),
        ("moves", '.to("cpu")'), ("moves", '.to("cpu")'), ("moves", '.to("cpu")'),
        ("moves", '.new_tensor(device="cpu")'), ("moves", 'torch.empty_like(device="cpu")'),
        ("moves", '.new_zeros(device="cpu")'),
        ("M.__init__", "torch.ones")])


# ----------------------------------------------------------------------------- meta fixtures


def _read(t: torch.Tensor) -> bool | float | int:
    return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1


@pytest.fixture
def meta_reads() -> Iterator[None]:
    """Assumed values for what ``meta`` cannot compute (see the module docstring): a read-back
    gives 1, a data-sized result one entry per input. Only the Meta kernels change; mixing a
    meta tensor with a host tensor still fails."""
    import torch.fx.experimental._config as fx_config
    from torch.library import Library

    def unique2(x: torch.Tensor, sorted: bool = True, return_inverse: bool = False,
                return_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.numel()
        return x.new_empty(n), x.new_empty(x.shape, dtype=torch.long), x.new_empty(n, dtype=torch.long)

    def unique_dim(x: torch.Tensor, dim: int, sorted: bool = True, return_inverse: bool = False,
                   return_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[dim]
        return x.clone(), x.new_empty(n, dtype=torch.long), x.new_empty(n, dtype=torch.long)

    def bincount(x: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
        return x.new_zeros(max(minlength, 1), dtype=torch.long if weights is None else torch.double)

    def repeat_interleave(repeats: torch.Tensor, output_size: int | None = None) -> torch.Tensor:
        return repeats.new_empty(repeats.shape[0] if output_size is None else output_size)

    def masked_select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x.new_empty(torch.broadcast_shapes(x.shape, mask.shape)).reshape(-1)

    lib = Library("aten", "IMPL")
    before = fx_config.meta_nonzero_assume_all_nonzero
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl("_local_scalar_dense", _read, "Meta", allow_override=True)
        lib.impl("_unique2", unique2, "Meta", allow_override=True)
        lib.impl("unique_dim", unique_dim, "Meta", allow_override=True)
        lib.impl("bincount", bincount, "Meta", allow_override=True)
        lib.impl("repeat_interleave.Tensor", repeat_interleave, "Meta", allow_override=True)
        lib.impl("masked_select", masked_select, "Meta", allow_override=True)
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = before
        lib._destroy()


class FakeNccl:
    """A two-rank group whose gathers refuse a tensor that is not on ``device`` (as NCCL
    refuses host tensors) and hand every rank this rank's tensor."""

    def __init__(self, device: torch.device = META) -> None:
        self.device = device
        self.gathered: list[torch.Tensor] = []

    def check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            assert t.device == self.device, (
                f"a tensor on {t.device} entered a collective of a group on {self.device}")

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        self.check(t, *out)
        self.gathered.append(t)
        for o in out:
            o.copy_(t)
        return SimpleNamespace(wait=lambda: None) if async_op else None

    def gather_all_tensors(self, t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        """torchmetrics' gather (``ClickMetrics``' merge)."""
        self.check(t)
        self.gathered.append(t)
        return [t, t]


@pytest.fixture
def two_meta_ranks(monkeypatch: pytest.MonkeyPatch) -> FakeNccl:
    """The retrieval collectives and torchmetrics' sync see two ranks on ``meta``."""
    import torchmetrics.metric

    from recsys_trainer.retrieval import collectives

    group = FakeNccl()
    real_sizes = collectives.all_gather_sizes

    def all_gather_sizes(n: int, device: torch.device, g: Any = None) -> list[int]:
        real_sizes(n, device, g)  # the exchange as it runs, device check included
        return [n, n]  # meta cannot say what the peer sent: as many rows as this rank

    monkeypatch.setattr(collectives, "world", lambda g=None: (0, 2))
    monkeypatch.setattr(collectives, "all_gather_sizes", all_gather_sizes)
    monkeypatch.setattr(torch.distributed, "all_gather", group.all_gather)
    monkeypatch.setattr(torchmetrics.metric, "gather_all_tensors", group.gather_all_tensors)
    return group


def _on_meta(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        assert t is not None and t.device == META, t


def _m(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=META)


# ----------------------------------------------------------------------------- metrics


def test_click_metrics_merge_stays_on_the_metric_device(meta_reads: None, two_meta_ranks: FakeNccl) -> None:
    """Update and the cross-rank merge (``gathered_rows``: ``result()`` up to its crossing, the
    copy to the host, which meta cannot do) on meta, also for a rank with no rows (its padding
    must be on the metric's device, not the host's)."""
    from recsys_trainer.metrics import ClickMetrics

    full = ClickMetrics(with_groups=True).to(META)
    full.distributed_available_fn = lambda: True
    full.update(_m(8), _m(8), _m(8), _m(8, dtype=torch.long))
    rows, groups = full.gathered_rows()
    _on_meta(rows, groups)
    assert rows.shape[1] == 3

    empty = ClickMetrics(with_groups=True).to(META)
    empty.distributed_available_fn = lambda: True
    rows, groups = empty.gathered_rows()
    _on_meta(rows, groups)
    assert len(two_meta_ranks.gathered) == 4


def test_grouped_auc_runs_on_its_inputs_device(meta_reads: None) -> None:
    """``grouped_auc_sums`` (GAUC's work) returns on the inputs' device; ``grouped_auc`` reads
    the three sums back once (a crossing; meta_reads supplies the values)."""
    from recsys_trainer.metrics import grouped_auc, grouped_auc_sums

    parts = grouped_auc_sums(_m(16, dtype=torch.float64), _m(16, dtype=torch.float64),
                             _m(16, dtype=torch.float64), _m(16, dtype=torch.long))
    _on_meta(*parts)
    assert all(p.dim() == 0 for p in parts)
    value, n = grouped_auc(_m(16, dtype=torch.float64), _m(16, dtype=torch.float64),
                           _m(16, dtype=torch.float64), _m(16, dtype=torch.long))
    assert (value, n) == (1.0, 1)


def test_grouped_auc_sizes_its_buffers_by_rows_and_agrees_with_per_group_auc() -> None:
    """The buffers sized by the row count (no read-back of the block and group counts) give
    the per-group AUCs: a group with one class only is left out, ties count one half."""
    from recsys_trainer.metrics import grouped_auc

    p = torch.tensor([0.1, 0.4, 0.4, 0.9, 0.2, 0.3, 0.5, 0.5], dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1, 1, 1, 0, 1], dtype=torch.float64)
    w = torch.tensor([1, 1, 1, 1, 2, 2, 1, 1], dtype=torch.float64)
    g = torch.tensor([7, 7, 7, 7, 3, 3, 5, 5])
    # Group 7: positives 0.4 and 0.9 against negatives 0.1 and 0.4 -> (1.5 + 2) / 4; weight 4.
    # Group 3 has positives only; group 5 ties its one positive with its one negative -> 0.5.
    value, n = grouped_auc(p, y, w, g)
    assert n == 2
    assert value == pytest.approx((4 * 0.875 + 2 * 0.5) / 6, abs=1e-15)
    assert grouped_auc(p[4:6], y[4:6], w[4:6], g[4:6]) == (pytest.approx(math.nan, nan_ok=True), 0)


def test_metric_hook_stores_move_with_the_model_device(meta_reads: None, two_meta_ranks: FakeNccl,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``MetricReportHook`` puts its ``ClickMetrics`` on the trainer's device: rows update there
    and a rank without rows pads on the device its peers gather on. ``result()`` is patched at
    its crossing (the copy to the host) to return the gathered rows' placeholders."""
    from recsys_trainer.hooks.metrics import MetricReportHook
    from recsys_trainer.metrics import ClickMetrics

    def result(self: ClickMetrics, process_group: Any = None) -> dict[str, float]:
        self.distributed_available_fn = lambda: True
        rows, groups = self.gathered_rows(process_group)
        _on_meta(rows, groups)
        return {"num_samples": 0.0, "weight_sum": 0.0, "auc": 1.0, "gauc": 1.0}

    monkeypatch.setattr(ClickMetrics, "result", result)
    fired: list[Any] = []
    trainer = SimpleNamespace(device=META, train_dataset=None, eval_dataset=None, process_group=None,
                              state=SimpleNamespace(global_step=3, mode="eval"), is_rank_zero=False,
                              hooks=SimpleNamespace(fire=lambda *a: fired.append(a)))
    hook = MetricReportHook(group_fn=lambda b: b.users)
    hook.before_evaluate(trainer)  # type: ignore[arg-type]
    assert all(m.device == META for ms in hook._stores.values() for m in ms)
    batch = SimpleNamespace(labels=_m(4), weights=_m(4), users=_m(4, dtype=torch.long))
    step = SimpleNamespace(is_padding=False, micro_batches=[SimpleNamespace(outputs=_m(4), batch=batch)])
    hook.after_eval_step(trainer, step)  # type: ignore[arg-type]
    _on_meta(*hook._stores["eval"][0].rows)
    metrics: dict[str, float] = {}
    hook.after_evaluate(trainer, metrics)  # type: ignore[arg-type]
    assert metrics["auc"] == 1.0 and fired
    # A rank that saw no rows (its stores empty) still gathers on the device.
    hook.before_window(trainer, "w")  # type: ignore[arg-type]
    hook.after_window(trainer, "w")  # type: ignore[arg-type]
    assert len(two_meta_ranks.gathered) == 4


# ----------------------------------------------------------------------------- losses


def test_retrieval_losses_and_their_gradients_stay_on_the_device(meta_reads: None) -> None:
    """Both softmax losses with every option (accidental hits, padding columns, logQ, mixed
    negatives), forward and backward, on meta."""
    from recsys_trainer.retrieval.losses import (
        expected_candidate_log_q,
        in_batch_softmax_loss,
        sampled_softmax_loss,
    )

    b, s, d = 6, 4, 8
    query = _m(b, d).requires_grad_()
    items = _m(b, d).requires_grad_()
    negs = _m(s, d).requires_grad_()
    ids, neg_ids = _m(b, dtype=torch.long), _m(s, dtype=torch.long)
    log_q = expected_candidate_log_q(_m(b, dtype=torch.float64), torch.zeros((), dtype=torch.long,
                                                                              device=META), s, 100)
    _on_meta(log_q)
    loss = in_batch_softmax_loss(query, items, ids, _m(b), item_weights=_m(b), item_log_q=log_q,
                                 negatives=negs, negative_ids=neg_ids, negative_log_q=_m(s))
    loss.backward()
    _on_meta(loss, query.grad, items.grad, negs.grad)
    loss = sampled_softmax_loss(query, items, ids, negs, neg_ids, _m(b), positive_log_q=_m(b),
                                negative_log_q=_m(s), negative_weights=_m(s))
    loss.backward()
    _on_meta(loss)
    _on_meta(in_batch_softmax_loss(_m(0, d), _m(0, d), _m(0, dtype=torch.long)))


def test_ranking_losses_stay_on_the_device(meta_reads: None) -> None:
    """The ranking losses, with their label check (a device assert off the CPU)."""
    from recsys_trainer.models import multi_task_bce_with_logits, weighted_bce_with_logits

    _on_meta(weighted_bce_with_logits(_m(5), _m(5), _m(5)), weighted_bce_with_logits(_m(5), _m(5), None))
    _on_meta(multi_task_bce_with_logits(_m(5, 2), _m(5, 2), _m(5), [1.0, 0.5]),
             multi_task_bce_with_logits(_m(5, 2), _m(5, 2), None))


def test_hstu_and_dcn_compute_on_their_inputs_device(meta_reads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """HSTU's layers with their relative bias and time buckets, its jagged step by length
    bucket (the buckets' sizes are read on the host, a crossing meta cannot make: one bucket
    stands in) and its serving path (every bucket length); DCN-v2's cross and deep parts."""
    from recsys_trainer.models import DCNClassifier, HSTUEncoder, jagged

    enc = HSTUEncoder(8, num_layers=1, num_heads=2, attention_dim=None, linear_dim=None,
                      max_tokens=9, time_bias=True, dropout=0.0).to(META)
    long = torch.long
    _on_meta(enc(_m(3, 9, 8), _m(3, 9, dtype=long), _m(3, 9, dtype=long)))
    counts = torch.full((3,), 4, dtype=long, device=META)
    _on_meta(enc.run_padded(_m(3, 9, 8), counts, _m(3, 9, dtype=long), _m(3, 9, dtype=long), counts - 1))
    monkeypatch.setattr(jagged, "buckets_of", lambda c, m, p="length": [
        jagged.Bucket(torch.arange(c.numel(), device=c.device), 8)])
    _on_meta(enc.run(_m(12, 8), counts, _m(12, dtype=long), _m(12, dtype=long), "length"))
    dcn = DCNClassifier(["a", "b"], 3, 10, 4, cross="mixture", low_rank=2, num_experts=2,
                        deep_arch=(4,), structure="parallel").to(META)
    _on_meta(dcn._logits(_m(5, 3), _m(5, 2, 4)))


# ----------------------------------------------------------------------------- retrieval


class _MetaItems(nn.Module):
    """A ``RetrievalModel`` on meta that refuses ids off its device (an embedding lookup takes
    host ids into a device table without complaint, so the model checks)."""

    def __init__(self, num_items: int = 40, dim: int = 8) -> None:
        super().__init__()
        self.num_items = num_items
        self.table = nn.Parameter(torch.zeros(num_items, dim, device=META))

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        assert ids.device == self.table.device, f"item ids on {ids.device}, the table on {self.table.device}"
        return F.embedding(ids, self.table)


def test_retrieval_evaluation_scores_and_ranks_on_the_device(meta_reads: None, two_meta_ranks: FakeNccl,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Corpus embedding, the sharded top-K (two ranks; exclusions handed in on the host, as a
    caller may) and NDCG/recall on meta. ``host_floats``, the one copy of the results to the
    host, is patched: it checks that every sum is on the device."""
    from recsys_trainer.retrieval import metrics as rm

    start, corpus = rm.embed_corpus(_MetaItems(), 40, META, chunk_size=7)
    _on_meta(corpus)
    q, k = 5, 4
    excl = rm.Jagged.one_per_row(torch.arange(q))  # on the host
    scores, ids = rm.sharded_top_k(_m(q, 8), corpus, start, k, exclude=excl, query_chunk_size=3,
                                   corpus_block_size=6)
    _on_meta(scores, ids)
    sums = rm.ranking_sums(scores, ids, rm.Jagged.one_per_row(_m(2 * q, dtype=torch.long)), [1, 3])
    _on_meta(*sums.values())

    seen: list[dict[str, torch.Tensor]] = []

    def host_floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
        _on_meta(*values.values())
        seen.append(values)
        return dict.fromkeys(values, 1.0)

    monkeypatch.setattr(rm, "host_floats", host_floats)
    out = rm.full_corpus_metrics(_MetaItems(), _m(q, 8), rm.Jagged.one_per_row(_m(q, dtype=torch.long)),
                                 [2, 3], exclude=excl, device=META, query_chunk_size=2)
    assert out["ndcg@3"] == 1.0 and seen
    assert all(t.device == META for t in two_meta_ranks.gathered)


def test_jagged_helpers_keep_their_device(meta_reads: None) -> None:
    from recsys_trainer.retrieval.metrics import Jagged

    j = Jagged.one_per_row(_m(3, dtype=torch.long))
    _on_meta(j.lengths, j.values, j.offsets(), j.row_index(), j.padded())
    empty = Jagged.cat([], META)
    _on_meta(empty.lengths, empty.values)


def test_retrieval_metric_hook_evaluates_on_the_device(meta_reads: None, two_meta_ranks: FakeNccl,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's row store and its evaluation on meta, with the history excluded; the copy of
    the results to the host (``host_floats``) is patched. (The per-user queries group users on
    the host by design: not run here.)"""
    from recsys_trainer.distributed import FakeGang
    from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
    from recsys_trainer.retrieval import metrics as rm

    monkeypatch.setattr(rm, "host_floats", lambda values: (_on_meta(*values.values()),
                                                           dict.fromkeys(values, 0.5))[1])
    model = _MetaItems()
    trainer = SimpleNamespace(model=model, gang=FakeGang(), device=META, process_group=None, rank=0,
                              state=SimpleNamespace(global_step=1), is_rank_zero=False,
                              hooks=SimpleNamespace(fire=lambda *a: None))
    hook = RetrievalMetricHook(k=[2, 5], exclude_history=True, log=False)
    hook.before_evaluate(trainer)  # type: ignore[arg-type]
    outputs = {"query": _m(4, 8), "target": _m(4, dtype=torch.long),
               "history_lengths": torch.ones(4, dtype=torch.long, device=META),
               "history_ids": _m(4, dtype=torch.long)}
    step = SimpleNamespace(is_padding=False, micro_batches=[
        SimpleNamespace(batch=SimpleNamespace(weights=_m(4)), outputs=outputs)])
    hook.after_eval_step(trainer, step)  # type: ignore[arg-type]
    metrics: dict[str, float] = {}
    hook.after_evaluate(trainer, metrics)  # type: ignore[arg-type]
    assert metrics["recall@5"] == 1.0  # the placeholder sums over the placeholder count


def test_retrieval_model_parts_stay_on_the_device(meta_reads: None) -> None:
    """Uniform negatives (training: drawn on the device; evaluation: a fixed draw kept there),
    the item tower's lookup input, the frequency estimate and the logQ of candidates."""
    from recsys_trainer.models import TwoTowerModel
    from recsys_trainer.retrieval.candidates import candidate_log_q
    from recsys_trainer.retrieval.frequency import ItemFrequencyEstimator
    from recsys_trainer.retrieval.kjt import items_only_input

    model = TwoTowerModel(["u"], num_items=50, user_num_embeddings=10, num_uniform_negatives=6,
                          loss="sampled")
    _on_meta(model._uniform_negatives(META))
    model.eval()
    first = model._uniform_negatives(META)
    _on_meta(first)
    assert model._uniform_negatives(META) is first  # drawn once
    cpu = model._uniform_negatives(torch.device("cpu"))
    assert cpu is not None and torch.equal(cpu, TwoTowerModel(
        ["u"], num_items=50, user_num_embeddings=10, num_uniform_negatives=6, loss="sampled"
    ).eval()._uniform_negatives(torch.device("cpu")))

    kjt = items_only_input(["item", "hist_item"], {"item": _m(5, dtype=torch.long)})
    _on_meta(kjt.values(), kjt.lengths())

    freq = ItemFrequencyEstimator(64, num_hashes=3).to(META)
    freq.update(_m(10, dtype=torch.long))
    _on_meta(freq.probability(_m(7, dtype=torch.long)), freq.counts, freq.hash_a)
    _on_meta(candidate_log_q(freq, _m(7, dtype=torch.long), _m(1, dtype=torch.long).sum(), 6, 64))

    model.train()
    model.frequency.to(META)
    out = model._candidates(_m(4, 8), _m(4, dtype=torch.long), _m(4))
    _on_meta(out[0], out[1], out[2], out[4])


# ----------------------------------------------------------------------------- dynamic tables


def _id_map(fallback: int = 1, device: torch.device = torch.device("cpu")) -> Any:
    from recsys_trainer.dynamic import DynamicMCHModule, DynamicTable, make_eviction_policy, mix_ids

    spec = DynamicTable(num_slots=16, eviction_interval=1, fallback_rows=fallback,
                        count_half_life=4.0, admission_threshold=1)
    # Built on its device, as the sharder builds each shard's map (torchrec's history buffers
    # are plain attributes: .to() would not move them).
    m = DynamicMCHModule(zch_size=16, device=device,
                         eviction_policy=make_eviction_policy(spec), eviction_interval=1,
                         input_hash_size=2**63 - 1, input_hash_func=mix_ids, name="t", buckets=1)
    m.fallback_per_shard = fallback
    return m


@pytest.mark.parametrize("fallback", [1, 3])
def test_dynamic_id_map_looks_up_and_reports_on_its_device(meta_reads: None, fallback: int) -> None:
    """An id map on meta: lookups (training, with a pass, and evaluation) and ``open_slots``
    (torchrec returns it on the module's device; so must ours)."""
    m = _id_map(fallback, META)
    ids = _m(6, dtype=torch.long)
    _on_meta(m.train().forward_rows(ids, 6), m.eval().forward_rows(ids, 6), m.open_slots())
    m.train()
    m.run_pass()
    _on_meta(m._mch_sorted_raw_ids, m.fallback_slots(ids))


def test_open_slots_is_on_the_module_device_and_counts_free_slots() -> None:
    m = _id_map(2)
    assert m.open_slots().device == m._mch_sorted_raw_ids.device
    assert int(m.open_slots()) == 16 - 2 - m.occupied()


def test_dynamic_export_lookups_stay_on_the_vectors_device(meta_reads: None) -> None:
    from recsys_trainer.checkpoint.dynamic_export import TableExport

    t = TableExport(ids=_m(5, dtype=torch.long), vectors=_m(5, 4), default=_m(2, 4))
    out, found = t.lookup(_m(3, dtype=torch.long))
    _on_meta(out, found, t.vectors_for(_m(3, dtype=torch.long)))


def test_every_meta_helper_refuses_a_host_tensor(meta_reads: None) -> None:
    """What the guard rests on: with the assumed-value kernels in place, an op mixing meta and
    host tensors still fails, as on a GPU."""
    with pytest.raises(RuntimeError, match="device"):
        _ = _m(3) * torch.ones(3)
    with pytest.raises(AssertionError, match="collective"):
        FakeNccl().check(torch.ones(1))
