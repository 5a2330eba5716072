"""recsys_trainer.torchrec_compat: the version-dependent torchrec names and their fallbacks, and
the check of the installed torch / fbgemm-gpu / torchrec combination. Fast, one process (plus
one short child process that never imports torch)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer import torchrec_compat as compat

REPO = Path(__file__).resolve().parent.parent


def _kjt() -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.arange(10, dtype=torch.int64),
                             lengths=torch.tensor([1, 2, 0, 3, 3, 1], dtype=torch.int32),
                             weights=torch.linspace(0, 1, 10))


def _same(x: KeyedJaggedTensor, y: KeyedJaggedTensor) -> bool:
    return (x.keys() == y.keys() and torch.equal(x.values(), y.values())
            and torch.equal(x.lengths(), y.lengths())
            and torch.equal(x.weights(), y.weights()))


def test_the_input_dist_permute_fallback_permutes_as_torchrec_does() -> None:
    kjt = _kjt()
    order = [2, 0, 1]
    order_tensor = torch.tensor(order, dtype=torch.int32)
    want = kjt.permute(order, order_tensor)
    assert want.keys() == ["c", "a", "b"]
    assert _same(compat._input_dist_permute_fallback(kjt, order, order_tensor), want)
    assert _same(compat.input_dist_permute(kjt, order, order_tensor), want)
    try:  # torchrec 1.7+: the module hands out torchrec's own function
        from torchrec.distributed.mc_modules import input_dist_permute
    except ImportError:  # 1.6: the fallback
        assert compat.input_dist_permute is compat._input_dist_permute_fallback
    else:
        assert compat.input_dist_permute is input_dist_permute
        assert _same(input_dist_permute(kjt, order, order_tensor), want)


def test_the_lazy_names_are_torchrecs_classes() -> None:
    from torchrec.distributed import mc_modules

    assert compat.ShardedManagedCollisionCollection is mc_modules.ShardedManagedCollisionCollection
    assert compat.ManagedCollisionCollectionSharder is mc_modules.ManagedCollisionCollectionSharder
    assert compat.ManagedCollisionCollectionContext is mc_modules.ManagedCollisionCollectionContext
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        compat.nope  # noqa: B018


def test_attributes_torchrec_16_never_sets_read_as_false() -> None:
    old = torch.nn.Module()  # as torchrec 1.6's ShardedManagedCollisionCollection: neither set
    assert compat.uses_2d_weights(old) is False
    assert compat.frees_features_storage_early(old) is False
    new = torch.nn.Module()
    new._use_2d_weights = True
    new._free_features_storage_early = True
    assert compat.uses_2d_weights(new) is True
    assert compat.frees_features_storage_early(new) is True


def test_the_installed_stack_is_a_supported_pair() -> None:
    stack = compat.installed_stack()
    assert stack is not None
    assert stack[0].split("+")[0] == torch.__version__.split("+")[0]
    assert compat.stack_problem(stack) is None, compat.stack_problem(stack)


@pytest.mark.parametrize("stack, severity, named", [
    (("2.11.0+cu130", "1.6.0", "1.6.1"), None, ""),
    (("2.14.1", "1.9.0", "1.9.2"), None, ""),
    (("2.13.0+cpu", "1.7.0", "1.8.0"), "error", "fbgemm-gpu 1.8.0 is the build for torch 2.13"),
    (("2.13.0", "1.9.0", "1.9.2"), "error", "fbgemm-gpu 1.8.0 is the build for torch 2.13"),
    (("2.15.0", "1.9.0", "1.9.2"), "error", "fbgemm-gpu 1.9.0 is the build for torch 2.14"),
    (("2.10.0", "1.5.0", "1.5.0"), "error", "older than the oldest supported pair"),
    (("2.13.0", "1.8.0", "1.9.2"), "warning", "not a supported pair"),
    # a patch or development build of the right fbgemm-gpu line: untested, not refused
    (("2.13.0", "1.8.1", "1.8.0"), "warning", "not a supported pair"),
    (("2.13.0a0+git1234", "1.8.0a0", "1.8.0"), "warning", "not a supported pair"),
    (("2.14.1", "1.8.1", "1.8.0"), "error", "fbgemm-gpu 1.9.0 is the build for torch 2.14"),
    (("2.15.0", "1.10.0", "1.10.0"), "warning", "not a supported pair"),
])
def test_stack_problem_names_the_installed_stack_and_the_supported_pairs(
        stack: tuple[str, str, str], severity: str | None, named: str) -> None:
    problem = compat.stack_problem(stack)
    if severity is None:
        assert problem is None
        return
    assert problem is not None
    assert problem[0] == severity
    assert f"installed: torch {stack[0]}, fbgemm-gpu {stack[1]}, torchrec {stack[2]}" in problem[1]
    assert named in problem[1]
    assert "torch 2.11.x + fbgemm-gpu 1.6.0 + torchrec 1.6.1" in problem[1]


def test_check_installed_stack_raises_for_a_broken_mix_and_warns_for_an_unknown_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compat.ALLOW_ANY_STACK_ENV, raising=False)
    monkeypatch.setattr(compat, "installed_stack", lambda: ("2.13.0", "1.9.0", "1.9.2"))
    with pytest.raises(compat.UnsupportedStackError, match=r"torch 2\.13\.0, fbgemm-gpu 1\.9\.0"):
        compat.check_installed_stack()
    for value in ("1", "true", "YES"):
        monkeypatch.setenv(compat.ALLOW_ANY_STACK_ENV, value)
        with pytest.warns(compat.UnknownStackWarning, match="fbgemm-gpu 1.9.0"):
            compat.check_installed_stack()
    monkeypatch.setattr(compat, "installed_stack", lambda: ("2.15.0", "1.10.0", "1.10.0"))
    monkeypatch.delenv(compat.ALLOW_ANY_STACK_ENV)
    with pytest.warns(compat.UnknownStackWarning, match="torch 2.15.0"):
        compat.check_installed_stack()
    monkeypatch.setattr(compat, "installed_stack", lambda: None)  # e.g. serving without torchrec
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_installed_stack()


def test_importing_the_package_names_a_broken_mix_before_anything_imports_torchrec(
        tmp_path: Path) -> None:
    # A dist-info found first on sys.path: the metadata of an fbgemm-gpu built for torch 2.12.
    dist = tmp_path / "fbgemm_gpu-1.7.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fbgemm-gpu\nVersion: 1.7.0\n")
    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    code = ("import sys\ntry:\n    import recsys_trainer\nexcept ImportError as e:\n"
            "    print(type(e).__name__, e)\nprint('torch' in sys.modules, 'torchrec' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    env.pop(compat.ALLOW_ANY_STACK_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=str(tmp_path)).stdout
    if compat.SUPPORTED_STACKS[torch_minor][0] == "1.7.0":  # torch 2.12: that is its pair
        assert out.strip().endswith("False False")
        return
    assert out.startswith("UnsupportedStackError installed: torch "), out
    assert "fbgemm-gpu 1.7.0" in out
    assert out.strip().endswith("False False"), out  # named before torch was imported


def _gpu_wheels_pairs() -> dict[str, tuple[str, str]]:
    path = str(REPO / "scripts" / "gpu-wheels")
    loader = importlib.machinery.SourceFileLoader("_gpu_wheels_for_test", path)
    spec = importlib.util.spec_from_loader("_gpu_wheels_for_test", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return dict(module.PAIRS)


def test_setup_gpu_wheels_and_the_package_offer_the_same_pairs() -> None:
    setup = (REPO / "scripts" / "setup").read_text()
    cases = dict((m, (f, r)) for m, f, r in re.findall(
        r"^\s*(2\.\d+)\) fbgemm=([\d.]+) torchrec=([\d.]+) ;;", setup, re.M))
    assert cases == compat.SUPPORTED_STACKS
    assert _gpu_wheels_pairs() == compat.SUPPORTED_STACKS


_PLANNER_LOG = "torchrec.distributed.planner.storage_reservations"


def test_quiet_stack_notices_drops_the_listed_notices_within_and_nothing_else(caplog: Any) -> None:
    caplog.set_level(logging.WARNING)
    planner_log = logging.getLogger(_PLANNER_LOG)
    reservation = "HeuristicalStorageReservation is known to cause issues, particularly during dry run"
    dry_run = ("There is a known issue with TorchRec's dense tensor size calculation in dry run "
               "scenarios, where tensors are not materialized.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with compat.quiet_stack_notices():
            warnings.warn(reservation, FutureWarning, stacklevel=1)
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead.",
                          FutureWarning, stacklevel=1)
            warnings.warn("another deprecation", FutureWarning, stacklevel=1)
            planner_log.warning(dry_run)
            planner_log.warning("another planner warning")
        warnings.warn(reservation, FutureWarning, stacklevel=1)  # outside: shown as ever
        planner_log.warning(dry_run)
    assert [str(w.message) for w in seen] == ["another deprecation", reservation]
    assert [r.getMessage() for r in caplog.records if r.name == _PLANNER_LOG] == [
        "another planner warning", dry_run]


def test_a_run_shows_none_of_the_stack_notices_whose_advice_does_not_apply(
        tmp_path: Path, caplog: Any) -> None:
    # What a newcomer's first run printed on torch 2.13 / torchrec 1.8: the planner's
    # storage-reservation advice (a FutureWarning per rank, a log record on rank 0), DDP's
    # `broadcast_buffers` deprecation per rank, and torch's is_fx_tracing notice per rank.
    from helpers import batches, make_trainer

    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make_trainer(batches(2), output_dir=str(tmp_path)).train()
        # Once per process, so possibly printed by an earlier test: asked for directly too.
        fx_log = logging.getLogger(compat._FX_TRACING_NOTICE[0])
        fx_log.warning("is_fx_tracing will return true for both fx.symbolic_trace and torch.export.")
        fx_log.warning("another torch.fx warning")
    notices = (*compat._NOTICE_WARNINGS, *(p for _, p in compat._NOTICE_RECORDS),
               compat._FX_TRACING_NOTICE[1])
    shown = [str(w.message) for w in seen] + [r.getMessage() for r in caplog.records]
    assert [m for m in shown if m.startswith(notices)] == []
    assert "another torch.fx warning" in shown
