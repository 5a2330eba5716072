"""An embedding table's storage precision: ``fp32``, ``fp16`` or ``bf16`` weights.

The setting is torchrec's own, ``EmbeddingBagConfig`` / ``EmbeddingConfig(data_type=...)``:
torchrec groups the tables of one precision into one FBGEMM table-batched module built with
that ``weights_precision``, the planner sizes them by it, and DCP saves them in it. This module
names the precisions (``TABLE_DTYPES``), turns a name into torchrec's ``DataType`` and back,
and refuses, before sharding and naming the table, a precision that FBGEMM's kernels cannot
train on the device with the table's optimizer (``check_tables``): FBGEMM 1.8.0's CPU kernel has
no bf16 forward (``"split_embedding_cpu_forward_2" not implemented for 'BFloat16'``), so a bf16
table on CPU would otherwise fail at its first step; no table is ever trained in fp32 instead.

What each kernel does is probed, not listed: one 4-row table-batched module of that precision
and optimizer runs a forward and a backward on the device, once per process
(``kernel_trains``), so another FBGEMM release that adds a kernel is used without a change here.

Rounding: FBGEMM's CUDA kernels round half-precision updates stochastically (torchrec passes
``stochastic_rounding=True``, FBGEMM's default); its CPU kernel rounds to nearest, whatever the
flag (measured: 100 SGD steps of 1e-4 on a weight of 1.0 leave an fp16 row at 1.0, fp32 at
0.99). ``rounds_stochastically`` probes that too; docs/tables.md says what it costs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torchrec.modules.embedding_configs import DataType

from recsys_trainer.table_dtypes import TORCH_DTYPES

TABLE_DTYPES: dict[str, DataType] = {name: DataType[name.upper()] for name in TORCH_DTYPES}
"""The precisions a training table may be stored in, by the names configs use (those of
``table_dtypes``), as torchrec's ``DataType``."""

# FBGEMM's names for the fused optimizers recsys_trainer.optimizers offers (EmbOptimType).
_EMB_OPT = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD",
            "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adam": "ADAM",
            "partial_rowwise_adam": "PARTIAL_ROWWISE_ADAM", "lamb": "LAMB",
            "partial_rowwise_lamb": "PARTIAL_ROWWISE_LAMB", "lars_sgd": "LARS_SGD"}


def data_type(name: str, field: str = "embedding_dtype") -> DataType:
    """torchrec's ``DataType`` for a precision's name (``"fp16"``); a named error otherwise."""
    if name not in TABLE_DTYPES:
        raise ValueError(f"`{field}` must be one of {', '.join(map(repr, TABLE_DTYPES))}, but "
                         f"is {name!r}.")
    return TABLE_DTYPES[name]


def dtype_name(dt: DataType) -> str:
    """The name of a training precision (``DataType.FP16`` -> ``"fp16"``), or torchrec's
    name for the others (``"INT8"``)."""
    for name, d in TABLE_DTYPES.items():
        if d == dt:
            return name
    return str(dt.value)


def table_dtype_names(configs: list[Any]) -> dict[str, str]:
    """``{table: precision name}`` of torchrec table configs."""
    return {c.name: dtype_name(c.data_type) for c in configs}


def _probe_tbe(device_type: str, rows: int, dim: int, optimizer: str, dtype: str,
               learning_rate: float, **kwargs: Any) -> tuple[Any, torch.device]:
    """A one-table FBGEMM table-batched module of ``rows x dim`` on ``device_type`` (``cuda``:
    on the device; else on the host), trained by ``optimizer`` in ``dtype``, and its device:
    what ``kernel_trains`` and ``rounds_stochastically`` probe."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    cuda = device_type == "cuda"
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.DEVICE if cuda else EmbeddingLocation.HOST,
          ComputeDevice.CUDA if cuda else ComputeDevice.CPU)],
        optimizer=getattr(EmbOptimType, _EMB_OPT[optimizer]),
        weights_precision=SparseType(dtype), learning_rate=learning_rate,
        device=dev if cuda else None, **kwargs)
    return tbe, dev


@functools.cache
def kernel_trains(device_type: str, dtype: str, optimizer: str) -> str | None:
    """None when FBGEMM's table-batched kernel on ``device_type`` runs a forward and a backward
    (the fused ``optimizer`` update) of a ``dtype`` table; else what failed. Probed once per
    process on a 4-row table (a few ms)."""
    try:
        tbe, dev = _probe_tbe(device_type, 4, 4, optimizer, dtype, 0.01)
        out = tbe(torch.tensor([0, 1], device=dev), torch.tensor([0, 1, 2], device=dev))
        out.sum().backward()
    except Exception as e:  # the kernel's own refusal, whatever its type
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return None


@functools.cache
def rounds_stochastically(device_type: str, dtype: str) -> bool:
    """Whether FBGEMM's kernel on ``device_type`` rounds ``dtype`` updates stochastically (as
    torchrec asks: ``stochastic_rounding=True``): 64 SGD steps of a quarter of the weight's
    unit in the last place move a row of 1.0 on average, where rounding to nearest leaves it.
    A ``ValueError`` names a precision the kernel cannot train there (no rounding to probe)."""
    data_type(dtype, "dtype")
    if dtype == "fp32":
        return False
    error = kernel_trains(device_type, dtype, "sgd")
    if error is not None:
        raise ValueError(f"FBGEMM's table-batched kernel on {device_type} cannot train a {dtype} "
                         f"table ({error}), so it has no rounding to probe; ask about a "
                         "precision it trains there.")
    ulp = float(torch.finfo(TORCH_DTYPES[dtype]).eps)  # at 1.0
    tbe, dev = _probe_tbe(device_type, 1, 64, "sgd", dtype, ulp / 4, stochastic_rounding=True)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].fill_(1.0)
    idx, off = torch.tensor([0], device=dev), torch.tensor([0, 1], device=dev)
    # Each step is a quarter ulp: to nearest, 1.0 stays 1.0 forever; stochastically, each
    # step moves it down one ulp with probability 1/4, so 64 steps leave it at 1.0 with
    # probability (3/4)**64, about 1e-8.
    for _ in range(64):
        tbe(idx, off).sum().backward()
    return bool((tbe.split_embedding_weights()[0].float() < 1.0).any())


def check_tables(configs: list[Any], device_type: str, optimizers: Mapping[str, Any]) -> None:
    """Refuse, before sharding, a table whose precision FBGEMM cannot train on ``device_type``
    with the table's fused optimizer (``optimizers``: ``{table: SparseOptimizer}``), naming
    the table, the precision, what failed and what runs; and a precision that is not a
    training one (torchrec's ``INT8``... are for inference modules)."""
    for c in configs:
        name = dtype_name(c.data_type)
        if name not in TABLE_DTYPES:
            raise ValueError(
                f"embedding table {c.name!r} has data_type={c.data_type}, but a trained table is "
                f"stored in one of {', '.join(TABLE_DTYPES)} (DataType.FP32, FP16, BF16); "
                "quantize at export instead (export_for_serving(quantize='int8'/'int4')).")
        if name == "fp32":
            continue
        opt = optimizers[c.name].name if c.name in optimizers else "rowwise_adagrad"
        error = kernel_trains(device_type, name, opt)
        if error is not None:
            works = [n for n in TABLE_DTYPES
                     if n == "fp32" or kernel_trains(device_type, n, opt) is None]
            raise ValueError(
                f"embedding table {c.name!r} is stored in {name} (data_type={c.data_type}), but "
                f"FBGEMM's table-batched kernel on {device_type} cannot train a {name} table "
                f"with the {opt} optimizer ({error}). On {device_type} store it in one of "
                f"{', '.join(works)}: set the model's `embedding_dtype={{{c.name!r}: "
                f"{works[-1]!r}}}` (`model.embedding_dtype` in YAML; `data_type` in your own "
                "torchrec table configs)"
                + ("; or train on CUDA, where bf16 tables train." if name == "bf16"
                   and device_type == "cpu" else "."))


def check_sharding(configs: list[Any], sharding_types: Mapping[str, str],
                   pinned: Mapping[str, str] | None = None) -> None:
    """Refuse a half-precision table sharded ``data_parallel`` (``sharding_types``: ``{table:
    sharding type}`` of the plan; ``pinned``: the user's ``sharding_types`` setting, named in the
    message when it asked for it). Such a table is not an FBGEMM table-batched one: its
    weight is a plain parameter that the dense optimizer updates in place in its own dtype,
    rounding to nearest, and torch's Adam turns an fp16 one to NaN in one step, silently (its
    ``eps`` of 1e-8 is 0 in fp16)."""
    dtypes = table_dtype_names(configs)
    bad = sorted(t for t, st in sharding_types.items()
                 if st == "data_parallel" and dtypes.get(t, "fp32") != "fp32")
    if bad:
        t = bad[0]
        asked = (f"`sharding_types[{t!r}]` asks for it" if pinned and t in pinned
                 else "the sharding plan says so")
        raise ValueError(
            f"embedding table {t!r} is stored in {dtypes[t]} and sharded data_parallel ({asked}; "
            f"{len(bad)} such table(s): {', '.join(map(repr, bad))}), but a data_parallel table "
            f"is a plain parameter that the dense optimizer updates in {dtypes[t]} (with Adam, "
            "whose eps is 0 in fp16, every row is NaN after one step). Shard it "
            f"table_wise or column_wise (`sharding_types={{{t!r}: 'table_wise'}}`): FBGEMM's "
            f"fused optimizer then trains it in {dtypes[t]}; or store it in fp32 "
            "(`embedding_dtype`, torchrec's `data_type`).")


__all__ = ["TABLE_DTYPES", "TORCH_DTYPES", "check_sharding", "check_tables", "data_type", "dtype_name",
           "kernel_trains", "rounds_stochastically", "table_dtype_names"]
