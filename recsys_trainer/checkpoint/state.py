"""What a checkpoint holds, and how it is taken from and put back into a ``Trainer``.

Two parts, both from one consistent step:

* **tensors**, saved with ``torch.distributed.checkpoint`` (DCP): ``{"model": dmp.state_dict(),
  "optim": optimizer.state_dict()}`` -- sharded tables (ShardedTensor), dense parameters, the
  fused sparse optimizer's state (sharded like its table) and the dense optimizer's state. DCP
  records global shapes and offsets, so a different world size or plan reshards on load.
* **per-rank extra state**, one small ``torch.save`` file per rank: trainer counters, data
  position and dataset state, RNG states, hook states, lr scheduler, the dense optimizer's
  param groups (lr...), the grad scaler, and the ``TrainingArguments`` used.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import io
import json
import logging
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_trainer.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from recsys_trainer.trainer import Trainer

logger = logging.getLogger(__name__)

EXTRA_FORMAT_VERSION = 1
COMPONENTS = ("tables", "dense", "optimizer", "counters", "data")
"""Parts of a checkpoint that model-bank sources select from (see ``ModelBankSource``)."""


def extra_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def matches(name: str, patterns: Sequence[str]) -> bool:
    """True when ``name`` matches any pattern: a glob (``*``, ``?``, ``[``) matches the whole
    name; a pattern without wildcards matches as a substring (``"t_user"``)."""
    for p in patterns:
        if any(c in p for c in "*?["):
            if fnmatch.fnmatchcase(name, p):
                return True
        elif p in name:
            return True
    return False


class KeyFilter:
    """Which parameter names are saved: not matching ``params_not_save``, and accepted by
    ``save_filter_fn``. Applied to model keys and to the optimizer state of those parameters."""

    def __init__(self, params_not_save: Sequence[str] | None = None,
                 save_filter_fn: Callable[[str], bool] | None = None) -> None:
        self.params_not_save = list(params_not_save or [])
        self.save_filter_fn = save_filter_fn

    def __call__(self, name: str) -> bool:
        if self.params_not_save and matches(name, self.params_not_save):
            return False
        return self.save_filter_fn is None or bool(self.save_filter_fn(name))


def is_table_key(key: str, value: Any) -> bool:
    """Embedding-table parameters: sharded tensors, or anything under an embedding collection
    (``data_parallel`` tables are plain tensors)."""
    return isinstance(value, ShardedTensor) or ".embedding_bags." in key or ".embeddings." in key


def model_state(trainer: Trainer, keep: Callable[[str], bool]) -> dict[str, Any]:
    """The DMP's state dict (tensors share storage with the live model), filtered."""
    return {k: v for k, v in trainer.model.state_dict().items() if keep(k)}


def optim_param_name(key: str) -> str:
    # CombinedOptimizer prefixes each parameter with its optimizer's name ("dense."/"sparse.").
    return key.split(".", 1)[1] if key.startswith(("dense.", "sparse.")) else key


def optimizer_state(trainer: Trainer, keep: Callable[[str], bool]) -> dict[str, Any]:
    """Both optimizers' keyed state (``{"state": {"dense.<param>": {...}, "sparse.<param>":
    {...}}}``), tensors shared with the live optimizers, filtered by parameter name."""
    sd = trainer.optimizer.state_dict()
    return {"state": {k: v for k, v in sd["state"].items() if keep(optim_param_name(k))}}


def tensor_state(trainer: Trainer, keep: Callable[[str], bool]) -> dict[str, Any]:
    return {"model": model_state(trainer, keep), "optim": optimizer_state(trainer, keep)}


def init_dense_optimizer_state(trainer: Trainer) -> None:
    """Materialise the dense optimizer's lazy state (Adam's moments...) so DCP can load into it
    in place, without changing any parameter: one step on zero grads, then the parameters are
    restored (weight decay would otherwise move them) and the grads cleared. The values are
    overwritten by the load that follows."""
    dense = trainer.optimizer.dense
    params = [p for g in dense.param_groups for p in g["params"]]
    if all(p in dense.state and dense.state[p] for p in params):
        return
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
        dense.step()
        for p, s, g in zip(params, saved, grads, strict=True):
            p.copy_(s)
            p.grad = g


# ---------------------------------------------------------------------------- extra state

def args_to_jsonable(args: Any) -> dict[str, Any]:
    """The TrainingArguments as JSON-friendly values (callables by their repr)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        v = getattr(args, f.name)
        try:
            json.dumps(v)
            out[f.name] = v
        except (TypeError, ValueError):
            out[f.name] = repr(v)
    return out


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _hook_keys(hooks: Any) -> list[tuple[str, Any]]:
    """``(key, hook)`` with keys ``ClassName#k`` (k-th hook of that class), stable when
    stateless hooks are added or removed."""
    seen: dict[str, int] = {}
    out = []
    for h in hooks:
        name = type(h).__qualname__
        out.append((f"{name}#{seen.get(name, 0)}", h))
        seen[name] = seen.get(name, 0) + 1
    return out


def extra_state(trainer: Trainer, manager_state: dict[str, Any]) -> dict[str, Any]:
    """This rank's non-tensor state (returned objects may alias live state: serialise at once)."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    hooks = {}
    for key, h in _hook_keys(trainer.hooks):
        s = h.state_dict()
        if s:
            hooks[key] = s
    return {
        "format_version": EXTRA_FORMAT_VERSION,
        "rank": trainer.rank,
        "world_size": trainer.world_size,
        "trainer_state": trainer.state.state_dict(),
        "manager": dict(manager_state),
        "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
        "dense_param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.dense.param_groups
        ],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_state(),
        "hooks": hooks,
        "train_dataset": trainer.train_dataset.state_dict() if trainer.train_dataset is not None else {},
        "eval_dataset": trainer.eval_dataset.state_dict() if trainer.eval_dataset is not None else {},
        "args": args_to_jsonable(trainer.args),
    }


def serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_extra(path: str, step: int | None = None) -> dict[str, Any]:
    """Read a per-rank extra-state file; a clear ``CheckpointError`` naming it if unreadable."""
    try:
        # Our own file (plain Python containers, numpy RNG state): weights_only would reject
        # numpy's RNG tuple, and the file's integrity is checked against the manifest first.
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling error means the file is bad
        raise CheckpointError(f"checkpoint step {step}: cannot read {path!r}: {e}", step=step,
                              path=path, kind="corrupt") from e
    if not isinstance(data, dict) or data.get("format_version") != EXTRA_FORMAT_VERSION:
        raise CheckpointError(f"checkpoint step {step}: {path!r} is not a recsys_trainer state "
                              f"file of format {EXTRA_FORMAT_VERSION}.", step=step, path=path,
                              kind="corrupt")
    return data


def apply_dense_param_groups(trainer: Trainer, groups: list[dict[str, Any]]) -> None:
    dense = trainer.optimizer.dense
    if len(groups) != len(dense.param_groups):
        raise CheckpointError(
            f"the checkpoint's dense optimizer has {len(groups)} param groups, this one has "
            f"{len(dense.param_groups)}; build the dense optimizer the same way.", kind="mismatch")
    for g, saved in zip(dense.param_groups, groups, strict=True):
        for k, v in saved.items():
            g[k] = v


def apply_hook_states(trainer: Trainer, states: dict[str, Any]) -> None:
    remaining = dict(states)
    for key, h in _hook_keys(trainer.hooks):
        if key in remaining:
            h.load_state_dict(remaining.pop(key))
    if remaining:
        logger.warning("checkpoint holds state for hooks this trainer does not have: %s",
                       sorted(remaining))
