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
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_trainer.checkpoint import layout
from recsys_trainer.checkpoint import state as cstate
from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.checkpoint.export import read_full, saved_keys

if TYPE_CHECKING:
    from recsys_trainer.trainer import Trainer

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ModelBankSource:
    """One warm-start source (see the module docstring)."""

    path: str
    """A committed checkpoint directory, or an output directory (its newest checkpoint)."""
    include: dict[str, list[str]] = field(
        default_factory=lambda: {"tables": ["*"], "dense": ["*"]})
    """Component -> patterns of this model's names to load; a component not listed is not
    loaded. Patterns: globs, or substrings when they have no wildcard."""
    exclude: dict[str, list[str]] = field(default_factory=dict)
    """Component -> patterns left out (applied after ``include``)."""
    name_map: dict[str, str] = field(default_factory=dict)
    """Source-name fragment -> this model's fragment (renamed tables or modules)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"`model_bank[].path` must be a non-empty path, but is {self.path!r}.")
        for what, comps in (("include", self.include), ("exclude", self.exclude)):
            unknown = sorted(set(comps) - set(cstate.COMPONENTS))
            if unknown:
                raise ValueError(f"`model_bank[].{what}` has unknown components {unknown}; "
                                 f"known: {', '.join(cstate.COMPONENTS)}.")
            for c, pats in comps.items():
                if isinstance(pats, str) or not all(isinstance(p, str) for p in pats):
                    raise ValueError(f"`model_bank[].{what}[{c!r}]` must be a list of patterns, "
                                     f"but is {pats!r}.")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelBankSource:
        """From ``TrainingArguments.model_bank`` entries (same keys as the fields)."""
        unknown = sorted(set(d) - {"path", "include", "exclude", "name_map"})
        if unknown:
            raise ValueError(f"`model_bank` entry has unknown keys {unknown}; "
                             "known: path, include, exclude, name_map.")
        return cls(**d)

    def selects(self, component: str, name: str) -> bool:
        pats = self.include.get(component)
        if not pats or not cstate.matches(name, pats):
            return False
        return not cstate.matches(name, self.exclude.get(component, []))

    def source_name(self, name: str) -> str:
        """This model's name -> the name in the source checkpoint."""
        for src, dst in self.name_map.items():
            if dst in name:
                name = name.replace(dst, src)
        return name


def _resolve(path: str) -> layout.CheckpointInfo:
    if os.path.exists(os.path.join(path, layout.MARKER)) or \
            layout.parse_step(os.path.basename(os.path.normpath(path))) is not None:
        return layout.info_of(path)
    found = layout.latest_committed(path)
    if found is None:
        raise CheckpointError(f"model bank source {path!r} holds no committed checkpoint.",
                              path=path, kind="missing")
    return found


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
        t[: r1 - r0].copy_(src.to(t.dtype))


def warm_start(trainer: Trainer, sources: Sequence[ModelBankSource],
               process_group: dist.ProcessGroup | None = None) -> None:
    """Apply every source to ``trainer`` in order (all ranks call this together)."""
    for src in sources:
        _apply(trainer, src, process_group)


def _apply(trainer: Trainer, src: ModelBankSource, pg: dist.ProcessGroup | None) -> None:
    info = _resolve(src.path)
    manifest = layout.read_manifest(info.path) or {}
    layout.verify_files(info.path, manifest, checksums=False)
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

    for k, v in trainer.model.state_dict().items():
        comp = "tables" if cstate.is_table_key(k, v) else "dense"
        if src.selects(comp, k):
            add(f"model.{src.source_name(k)}", v, k, comp == "tables")
    if "optimizer" in src.include:
        cstate.init_dense_optimizer_state(trainer)
        for pk, entry in trainer.optimizer.state_dict()["state"].items():
            name = cstate.optim_param_name(pk)
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
            dcp.load(target, storage_reader=dcp.FileSystemReader(info.path), process_group=pg)
        except Exception as e:
            raise CheckpointError(f"model bank: loading from {info.path!r} failed: {e}",
                                  step=info.step, path=info.path, kind="load_failed") from e
    for fqn, live in overlap:
        # Row counts differ: read the source tensor whole on this rank and copy the overlap
        # into the local shards (a one-off cost of warm starting).
        _copy_overlap(live, read_full(info.path, {fqn})[fqn])
    _apply_extra(trainer, src, info)
    logger.info("model bank: initialised %d entries (+%d resized) from %s", len(target),
                len(overlap), info.path)


def _apply_extra(trainer: Trainer, src: ModelBankSource, info: layout.CheckpointInfo) -> None:
    want_counters = bool(src.include.get("counters"))
    want_data = bool(src.include.get("data"))
    if not (want_counters or want_data):
        return
    same_world = info.world_size == trainer.world_size
    rank = trainer.rank if same_world else 0
    extra = cstate.load_extra(os.path.join(info.path, cstate.extra_file_name(rank)), info.step)
    ts = extra["trainer_state"]
    if want_counters:
        trainer.state.global_step = ts["global_step"]
        trainer.state.epoch = ts["epoch"]
        cstate.apply_dense_param_groups(trainer, extra["dense_param_groups"])
        if trainer.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            trainer.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    if want_data:
        if not same_world and ts["batches_in_window"]:
            raise CheckpointError(
                f"model bank: {info.path!r} was saved mid-window with world size "
                f"{info.world_size}; its data position cannot be used with world size "
                f"{trainer.world_size}. Drop 'data' from include.", step=info.step,
                path=info.path, kind="reshard")
        trainer.state.window_index = ts["window_index"]
        trainer.state.batches_in_window = ts["batches_in_window"]
        trainer.state.window_id = ts["window_id"]
        if same_world and trainer.train_dataset is not None:
            trainer.train_dataset.load_state_dict(extra["train_dataset"])
