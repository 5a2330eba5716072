"""What a checkpoint holds, and how it is taken from and put back into named ``Stateful``
components (the Trainer's ``state_components()``; nothing here knows the Trainer).

Components, by name (absent ones are simply not saved or restored):

====================  ==========================================================================
``model``             the sharded model (an ``nn.Module``; loaded with ``strict=False``, since
                      checkpoints may leave parameters out)
``dense_optimizer``   ``{"state": {param: {...}}, "param_groups": [...]}`` (``OptimizerState``);
                      needs ``init_state()`` so lazily made state can be loaded into in place
``sparse_optimizer``  the same for the fused optimizer (its state sharded like its tables)
``trainer_state``     the counters and the data position (keys listed in ``COUNTER_KEYS``)
``lr_scheduler``, ``scaler``, ``rng``, ``hooks``, ``train_dataset``, ``eval_dataset``,
``non_finite``        per-rank state, saved as their ``state_dict()``
====================  ==========================================================================

What scoring restores (``evaluate``/``predict`` of a trained model, ``RestoreMode``
"scoring"): the ``model`` component, every component whose object declares
``needed_for_scoring = True`` (state the model's outputs depend on that is not in its
``state_dict()``: e.g. ``dynamic_tables``, which re-routes id maps read at another layout to
the shards that own their ids; a vocabulary that maps raw ids to rows would be one), and the
counters in ``MODEL_COUNTERS`` (so logs and metrics name the model's step). Never a dataset's
position, the optimizers, the RNG or the hooks: the data may be configured differently from
training's (another batch size, passthrough columns, eval data where training had none).

Two parts, both from one consistent step:

* **tensors**, saved with ``torch.distributed.checkpoint`` (DCP): ``{"model": model state,
  "optim": {"state": {"dense.<param>": {...}, "sparse.<param>": {...}}}}`` -- sharded tables
  (ShardedTensor), dense parameters and both optimizers' state. DCP records global shapes and
  offsets, so a different world size or plan reshards on load.
* **per-rank extra state**, one small ``torch.save`` file per rank: every other component's
  ``state_dict()`` (under its name), the dense optimizer's param groups (``dense_param_groups``:
  lr...), the manager's own counters, and the ``TrainingArguments`` used.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, cast

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.stateful import Stateful

from recsys_trainer.args import name_matches
from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.storage import Location, read_bytes

EXTRA_FORMAT_VERSION = 1
MODEL = "model"
DENSE_OPTIMIZER = "dense_optimizer"
SPARSE_OPTIMIZER = "sparse_optimizer"
COUNTERS = "trainer_state"
_OPTIMIZERS = (("dense", DENSE_OPTIMIZER), ("sparse", SPARSE_OPTIMIZER))
_TENSOR_COMPONENTS = (MODEL, DENSE_OPTIMIZER, SPARSE_OPTIMIZER)
_DATASETS = ("train_dataset", "eval_dataset")
COUNTER_KEYS = ("global_step", "epoch", "window_index", "batches_in_window", "window_id",
                "window_segments", "windows_done", "rows_unread", "rows_seen")
"""The ``trainer_state`` component's keys that checkpoints read (step naming, triggers, the
model bank's counters/data, remapping the data position to another world size)."""

MODEL_COUNTERS = ("global_step", "epoch")
"""The counters a scoring restore sets: which model it is, not where training was."""

Components = Mapping[str, Stateful]

RestoreMode = Literal["training", "scoring"]
"""What a load restores: everything a resumed training needs, or only what scoring needs."""


def scoring_components(components: Components) -> list[str]:
    """The names of the components a scoring restore loads: ``model``, and every component
    whose object has ``needed_for_scoring = True`` (see the module docstring)."""
    return [name for name, comp in components.items()
            if name == MODEL or getattr(comp, "needed_for_scoring", False) is True]


class OptimizerComponent(Protocol):
    """An optimizer component: ``Stateful`` plus ``init_state()`` (see the module docstring).

    Not a subclass of ``Stateful``: subclassing torch's runtime-checkable protocol with
    ``typing.Protocol`` breaks every ``isinstance(x, Stateful)`` check (DCP makes them)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
    def init_state(self) -> None: ...


def extra_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class KeyFilter:
    """Which parameter names are saved: not matching ``params_not_save``, and accepted by
    ``save_filter_fn``. Applied to model keys and to the optimizer state of those parameters."""

    def __init__(self, params_not_save: Sequence[str] | None = None,
                 save_filter_fn: Callable[[str], bool] | None = None) -> None:
        self.params_not_save = list(params_not_save or [])
        self.save_filter_fn = save_filter_fn

    def __call__(self, name: str) -> bool:
        if self.params_not_save and name_matches(name, self.params_not_save):
            return False
        return self.save_filter_fn is None or bool(self.save_filter_fn(name))


def is_table_key(key: str, value: Any) -> bool:
    """Embedding-table parameters: sharded tensors, or anything under an embedding collection
    (``data_parallel`` tables are plain tensors)."""
    return isinstance(value, ShardedTensor) or ".embedding_bags." in key or ".embeddings." in key


def optim_param_name(key: str) -> str:
    """``"dense.<param>"`` / ``"sparse.<param>"`` -> the parameter's name."""
    return key.split(".", 1)[1] if key.startswith(("dense.", "sparse.")) else key


def counters(components: Components) -> dict[str, Any]:
    """The ``trainer_state`` component's state (see ``COUNTER_KEYS``)."""
    return components[COUNTERS].state_dict()


def set_counters(components: Components, values: Mapping[str, Any]) -> None:
    """Overwrite some counters, keeping the others."""
    state = counters(components)
    state.update(values)
    components[COUNTERS].load_state_dict(state)


def model_state(components: Components, keep: Callable[[str], bool]) -> dict[str, Any]:
    """The model's state dict (tensors share storage with the live model), filtered."""
    return {k: v for k, v in components[MODEL].state_dict().items() if keep(k)}


def optimizer_state(components: Components, keep: Callable[[str], bool]) -> dict[str, Any]:
    """Both optimizers' keyed state (``{"state": {"dense.<param>": {...}, "sparse.<param>":
    {...}}}``), tensors shared with the live optimizers, filtered by parameter name."""
    out: dict[str, Any] = {}
    for prefix, name in _OPTIMIZERS:
        if name in components:
            for param, entry in components[name].state_dict()["state"].items():
                if keep(param):
                    out[f"{prefix}.{param}"] = entry
    return {"state": out}


def tensor_state(components: Components, keep: Callable[[str], bool]) -> dict[str, Any]:
    return {"model": model_state(components, keep), "optim": optimizer_state(components, keep)}


def init_optimizer_state(components: Components) -> None:
    """Create the optimizers' lazily made state (Adam's moments...) so DCP can load into it in
    place, without changing any parameter."""
    for _, name in _OPTIMIZERS:
        if name in components:
            cast(OptimizerComponent, components[name]).init_state()


def load_model_state(components: Components, loaded: dict[str, Any]) -> None:
    """After DCP loaded in place into tensors that share storage with the model: hand them to
    the model too, for modules whose ``state_dict`` returns copies."""
    components[MODEL].load_state_dict(loaded, strict=False)  # type: ignore[call-arg]


# ---------------------------------------------------------------------------- extra state

def extra_state(components: Components, *, rank: int, world_size: int,
                manager_state: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """This rank's non-tensor state (returned objects may alias live state: serialise at once)."""
    out: dict[str, Any] = {
        "format_version": EXTRA_FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "manager": dict(manager_state),
        "args": dict(args),
        # Absent components keep the layout of format 1: None, or {} for datasets.
        "lr_scheduler": None,
        "scaler": None,
        **{name: {} for name in _DATASETS},
    }
    for name, comp in components.items():
        if name not in _TENSOR_COMPONENTS:
            out[name] = comp.state_dict()
    if DENSE_OPTIMIZER in components:
        out["dense_param_groups"] = components[DENSE_OPTIMIZER].state_dict()["param_groups"]
    return out


def serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_extra(where: Location, step: int | None = None) -> dict[str, Any]:
    """Read a per-rank extra-state file; a clear ``CheckpointError`` naming it if unreadable."""
    path = where.url
    try:
        raw = read_bytes(where)
        if raw is None:
            raise FileNotFoundError(f"no such file: {path!r}")
        # Our own file (plain Python containers, numpy RNG state): weights_only would reject
        # numpy's RNG tuple, and the file's integrity is checked against the manifest first.
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling error means the file is bad
        raise CheckpointError(f"checkpoint step {step}: cannot read {path!r}: {e}", step=step,
                              path=path, kind="corrupt") from e
    if not isinstance(data, dict) or data.get("format_version") != EXTRA_FORMAT_VERSION:
        raise CheckpointError(f"checkpoint step {step}: {path!r} is not a recsys_trainer state "
                              f"file of format {EXTRA_FORMAT_VERSION}.", step=step, path=path,
                              kind="corrupt")
    return data


def apply_dense_param_groups(components: Components, groups: list[dict[str, Any]]) -> None:
    """Restore the dense optimizer's settings (lr, betas...) from a checkpoint."""
    if DENSE_OPTIMIZER not in components:
        return
    dense = components[DENSE_OPTIMIZER]
    mine = dense.state_dict()["param_groups"]
    if len(groups) != len(mine):
        raise CheckpointError(
            f"the checkpoint's dense optimizer has {len(groups)} param groups, this one has "
            f"{len(mine)}; build the dense optimizer the same way.", kind="mismatch")
    dense.load_state_dict({"state": {}, "param_groups": groups})


def load_resharded_dataset_state(dataset: Stateful, state: dict[str, Any],
                                 world_size: int) -> None:
    """Restore a dataset from rank 0's state saved at another ``world_size``: only what is the
    same on every rank (``WindowedDataset.load_resharded_state_dict``)."""
    load = getattr(dataset, "load_resharded_state_dict", None)
    if load is not None:  # a WindowedDataset; another Stateful has no per-rank split to make
        load(state, world_size)


def apply_extra(components: Components, extra: dict[str, Any], *, same_world: bool) -> None:
    """Restore every per-rank component from ``extra`` except the counters (the caller decides
    how to map the data position). Components the checkpoint has no state for (None, or empty)
    keep theirs: an lr scheduler or scaler added since, a component newer than the checkpoint,
    or a dataset the checkpoint was saved without (``extra_state`` writes ``{}`` for it: eval
    data added to a project whose checkpoints had none). Dataset state is per rank: at another
    world size (``extra`` is then rank 0's) a dataset restores only what is the same on every
    rank, through ``load_resharded_state_dict``. The optimizers' tensors are
    not here: DCP loads them in place."""
    apply_dense_param_groups(components, extra["dense_param_groups"])
    for name, comp in components.items():
        if name in _TENSOR_COMPONENTS or name == COUNTERS:
            continue
        state = extra.get(name)
        if not state:
            continue
        try:
            if name in _DATASETS and not same_world:
                load_resharded_dataset_state(comp, state, int(extra["world_size"]))
            else:
                comp.load_state_dict(state)
        except ValueError as e:
            if name not in _DATASETS:
                raise
            # The dataset's own message says what differs, not which of the datasets it is.
            raise ValueError(
                f"cannot restore `{name}` from the checkpoint: {e} Configure `{name}` as the run "
                "that saved it did, or start a new run (resume_from=None, or another "
                "output_dir); to evaluate or score the trained model, restore it with "
                "resume(mode='scoring') (what run: evaluate / predict do), which restores no "
                "dataset.") from e
