"""Warm start ("model bank"): initialise a fresh run from parts of other checkpoints.

A source names a checkpoint (or an output directory: its newest committed checkpoint) and, per
component, glob patterns over *this* model's parameter names::

    ModelBankSource(
        path="/ckpt/yesterday",
        include={"tables": ["*t_user*", "*t_item*"], "dense": ["*"]},
        exclude={"dense": ["*over_arch*"]},
        name_map={"t_user_v1": "t_user"},     # source-name fragment -> this model's fragment
    )

Components: ``tables`` (embedding tables), ``dense`` (other model state), ``optimizer`` (the
fused and dense optimizer state of the selected parameters), ``counters`` (global step, epoch,
lr scheduler and dense lr), ``data`` (data position and dataset state). Sources apply in order
(a later one overwrites). A table whose row count differs copies the overlapping rows and warns.
``ModelBankSource`` lives beside ``TrainingArguments`` (``recsys_trainer.args``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_trainer.args import ModelBankSource
from recsys_trainer.checkpoint import contents, layout, writer
from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.checkpoint.export import read_full, saved_keys
from recsys_trainer.checkpoint.loading import remap_position
from recsys_trainer.distributed import Gang

logger = logging.getLogger(__name__)



def _global_size(v: Any) -> tuple[int, ...]:
    return tuple(v.size()) if isinstance(v, ShardedTensor | torch.Tensor) else ()


@torch.no_grad()
def _copy_overlap(live: Any, full: torch.Tensor) -> None:
    """Copy the rows both have (the first min(rows) rows) from a whole source tensor into the
    local part of ``live`` (a ShardedTensor's local shards, or a plain tensor)."""
    parts: list[tuple[torch.Tensor, list[int]]]
    if isinstance(live, ShardedTensor):
        parts = [(s.tensor, list(s.metadata.shard_offsets)) for s in live.local_shards()]
    else:
        parts = [(live, [0] * live.dim())]
    for t, off in parts:
        r0, r1 = off[0], min(off[0] + t.shape[0], full.shape[0])
        if r1 <= r0:
            continue
        src = full[r0:r1]
        if t.dim() > 1:
            src = src[:, off[1]: off[1] + t.shape[1]]
        # A source of another precision (an fp32 bank into an fp16 table) is rounded to
        # nearest, as DCP rounds a checkpoint of another precision: the warm start is the
        # table a resume of that checkpoint would hold.
        t[: r1 - r0].copy_(src.to(t.dtype))


def warm_start(components: contents.Components, sources: Sequence[ModelBankSource],
               gang: Gang) -> None:
    """Apply every source to the training state ``components`` in order (all ranks of
    ``gang`` call this together)."""
    for src in sources:
        _apply(components, src, gang)


def _apply(components: contents.Components, src: ModelBankSource, gang: Gang) -> None:
    info = layout.resolve_checkpoint(src.path, "model bank source")
    with layout.reading(info.where):
        _apply_read(components, src, gang, info)


def _apply_read(components: contents.Components, src: ModelBankSource, gang: Gang,
                info: layout.CheckpointInfo) -> None:
    manifest = layout.read_manifest(info.where) or {}
    layout.verify_files(info.where, manifest, checksums=False)
    meta = saved_keys(info.path)
    target: dict[str, Any] = {}
    overlap: list[tuple[str, Any]] = []
    missing: list[str] = []

    def add(fqn: str, live: Any, name: str, is_table: bool) -> None:
        md = meta.get(fqn)
        if md is None:
            missing.append(fqn)
            return
        saved_size = tuple(getattr(md, "size", ()))
        if saved_size == _global_size(live):
            target[fqn] = live
        elif is_table and saved_size[1:] == _global_size(live)[1:]:
            logger.warning("model bank: %s has %d rows in %s and %d here; copying the first %d",
                           name, saved_size[0], info.path, _global_size(live)[0],
                           min(saved_size[0], _global_size(live)[0]))
            overlap.append((fqn, live))
        else:
            raise CheckpointError(
                f"model bank: {fqn!r} in {info.path!r} has shape {list(saved_size)}, but this "
                f"model's {name!r} has {list(_global_size(live))}; exclude it or map its name.",
                step=info.step, path=info.path, kind="mismatch")

    model_state = contents.model_state(components, lambda _k: True)
    # Dynamic (managed-collision) tables: each rank's id map is its own shard and its rows only
    # mean something with that map, so copying either into another run would scramble ids.
    dynamic_prefixes = {k.split("_managed_collision_collection.")[0]
                        for k in model_state if "_managed_collision_collection." in k}
    for k, v in model_state.items():
        comp = "tables" if contents.is_table_key(k, v) else "dense"
        if src.selects(comp, k):
            if any(k.startswith(p) for p in dynamic_prefixes):
                raise CheckpointError(
                    f"model bank: {k!r} belongs to a dynamic table, which cannot be warm-started "
                    "(its id map is a per-rank shard). Resume the run itself instead, or leave "
                    f"the table out with exclude={{{comp!r}: [...]}}.",
                    step=info.step, path=info.path, kind="mismatch")
            add(f"model.{src.source_name(k)}", v, k, comp == "tables")
    if "optimizer" in src.include:
        contents.init_optimizer_state(components)
        for pk, entry in contents.optimizer_state(components, lambda _k: True)["state"].items():
            name = contents.optim_param_name(pk)
            if not src.selects("optimizer", name):
                continue
            for sk, v in entry.items():
                add(f"optim.state.{src.source_name(pk)}.{src.source_name(sk)}", v, name,
                    pk.startswith("sparse."))
    if missing:
        logger.warning("model bank: %d selected entries are not in %s, e.g. %s", len(missing),
                       info.path, missing[:5])
    if target:
        try:
            # Flat fqn keys: DCP flattens nested dicts to the same dotted names.
            dcp.load(target, storage_reader=writer.storage_reader(info.where),
                     process_group=gang.group)
        except Exception as e:
            raise CheckpointError(f"model bank: loading from {info.path!r} failed: {e}",
                                  step=info.step, path=info.path, kind="load_failed") from e
    for fqn, live in overlap:
        # Row counts differ: read the source tensor whole on this rank and copy the overlap
        # into the local shards (a one-off cost of warm starting).
        _copy_overlap(live, read_full(info.where, {fqn})[fqn])
    _apply_extra(components, src, info, gang)
    logger.info("model bank: initialised %d entries (+%d resized) from %s", len(target),
                len(overlap), info.path)


_POSITION = ("window_index", "batches_in_window", "window_id", "window_segments")
"""The counters that say where in the data a run is (what include "data" copies)."""


def _apply_extra(components: contents.Components, src: ModelBankSource,
                 info: layout.CheckpointInfo, gang: Gang) -> None:
    want_counters = bool(src.include.get("counters"))
    want_data = bool(src.include.get("data"))
    if not (want_counters or want_data):
        return
    same_world = info.world_size == gang.world_size
    rank = gang.rank if same_world else 0
    extra = contents.load_extra(info.where.join(contents.extra_file_name(rank)), info.step)
    ts = extra[contents.COUNTERS]
    if want_counters:
        contents.set_counters(components, {
            "global_step": ts["global_step"], "epoch": ts["epoch"],
            "windows_done": ts.get("windows_done", extra["manager"].get("windows_done", 0))})
        contents.apply_dense_param_groups(components, extra["dense_param_groups"])
        scheduler = components.get("lr_scheduler")
        if scheduler is not None and extra["lr_scheduler"] is not None:
            scheduler.load_state_dict(extra["lr_scheduler"])
    if want_data:
        train = components.get("train_dataset")
        position = {"window_segments": [], **{k: ts[k] for k in _POSITION if k in ts}}
        if not same_world:
            # Mid-window: the rows no rank of the source run consumed, as a resume would.
            try:
                position = remap_position(position, info, world_size=gang.world_size,
                                          policy="exact", train_dataset=train)
            except CheckpointError as e:
                raise CheckpointError(
                    f"model bank: {e} (A model bank source ignores reshard_data_position: "
                    "drop 'data' from its include to start this run's data afresh.)",
                    step=info.step, path=info.path, kind="reshard") from e
        contents.set_counters(components, {k: position[k] for k in _POSITION})
        if train is not None and extra["train_dataset"]:
            if same_world:
                train.load_state_dict(extra["train_dataset"])
            else:
                contents.load_resharded_dataset_state(train, extra["train_dataset"],
                                                      info.world_size)
