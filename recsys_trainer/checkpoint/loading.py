"""Reading one checkpoint into the attached components: strict key check, restriction of the
load to what the checkpoint holds, and the data position of another world size.

``load_checkpoint`` does the read (every rank, collectively through DCP on the gang's group);
verifying the files first and firing ``after_load_checkpoint`` are the manager's
(``checkpoint.resume.verify_everywhere``), so a load from ``resume`` and one from ``load(path)``
share this code. Everything here takes its inputs as arguments.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed.checkpoint as dcp

from recsys_trainer.args import ReshardDataPosition
from recsys_trainer.checkpoint import contents, layout, writer
from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.distributed import Gang
from recsys_trainer.dynamic import lookup_path_hint

# The manager's logger: users filter and read these messages under that name.
logger = logging.getLogger("recsys_trainer.checkpoint.manager")


def load_checkpoint(components: contents.Components, info: layout.CheckpointInfo, *,
                    gang: Gang, strict: bool, mode: contents.RestoreMode,
                    key_filter: contents.KeyFilter,
                    reshard_data_position: ReshardDataPosition) -> None:
    """Read checkpoint ``info`` into ``components`` (all ranks together). ``mode="scoring"``
    reads only ``contents.scoring_components`` and the model counters. ``key_filter`` is this
    run's ``params_not_save``/``save_filter_fn`` (what strict loading does not require)."""
    path, step, loc = info.path, info.step, info.where
    # Scoring restores a subset; the counters component is read either way (below).
    comps = components if mode == "training" else {
        k: components[k] for k in contents.scoring_components(components)}
    same_world = info.world_size == gang.world_size
    src_rank = gang.rank if same_world else 0
    extra = contents.load_extra(loc.join(contents.extra_file_name(src_rank)), step)

    contents.init_optimizer_state(comps)
    target = contents.tensor_state(comps, lambda _k: True)
    saved = set(writer.storage_reader(loc).read_metadata().state_dict_metadata)
    check_keys(target, saved, key_filter, path=path, step=step, strict=strict)
    target = restrict_to_checkpoint(target, saved)
    try:
        dcp.load(target, storage_reader=writer.storage_reader(loc), process_group=gang.group)
    except Exception as e:
        raise CheckpointError(f"loading checkpoint step {step} from {path!r} failed: {e}",
                              step=step, path=path, kind="load_failed") from e
    # DCP loaded in place into tensors that share storage with the model and optimizers;
    # load_state_dict makes that explicit for modules whose state_dict returns copies.
    contents.load_model_state(comps, target["model"])

    ts = dict(extra[contents.COUNTERS])
    if mode == "scoring":
        contents.apply_extra(comps, extra, same_world=same_world)
        # Which model this is (logs and metrics name its step); not where training was.
        contents.set_counters(components,
                              {k: ts[k] for k in contents.MODEL_COUNTERS if k in ts})
        logger.info("loaded the model of checkpoint step %d from %s for scoring (%s)", step,
                    path, ", ".join(sorted(comps)))
        return
    # Before the counters had it, the manager recorded the train windows finished.
    ts.setdefault("windows_done", int(extra["manager"].get("windows_done", 0)))
    if not same_world:
        ts = remap_position(ts, info, world_size=gang.world_size, policy=reshard_data_position,
                            train_dataset=components.get("train_dataset"))
    contents.apply_extra(comps, extra, same_world=same_world)
    comps[contents.COUNTERS].load_state_dict(ts)
    logger.info("loaded checkpoint step %d from %s (saved with world size %d)", step, path,
                info.world_size)


def check_keys(target: dict[str, Any], saved: set[str], key_filter: contents.KeyFilter, *,
               path: str, step: int, strict: bool) -> None:
    """Strict loading: every state the trainer has must be in the checkpoint, unless this
    run's filters leave it out of checkpoints, and the checkpoint holds nothing else."""
    missing = [f"model.{k}" for k in target["model"]
               if f"model.{k}" not in saved and key_filter(k)]
    for pk, entry in target["optim"]["state"].items():
        if not key_filter(contents.optim_param_name(pk)):
            continue
        missing.extend(f"optim.state.{pk}.{sk}" for sk in entry
                       if f"optim.state.{pk}.{sk}" not in saved)
    if missing and strict:
        raise CheckpointError(
            f"checkpoint step {step} at {path!r} lacks {len(missing)} entries this trainer "
            f"has, e.g. {missing[:5]}; is it from another model? (Use the model bank to "
            f"initialise from a different model.){lookup_path_hint(missing, saved)}",
            step=step, path=path, kind="mismatch")
    # Model keys only: every rank's model state dict names every table (sharded tensors),
    # but a rank's fused optimizer state holds only its own shards' entries.
    have = {f"model.{k}" for k in target["model"]}
    unexpected = sorted(k for k in saved if k.startswith("model.") and k not in have)
    if unexpected and strict:
        raise CheckpointError(
            f"checkpoint step {step} at {path!r} holds {len(unexpected)} entries this "
            f"trainer does not have, e.g. {unexpected[:5]}; is it from another model? (Use "
            f"the model bank to initialise from a different model.)", step=step, path=path,
            kind="mismatch")


def restrict_to_checkpoint(target: dict[str, Any], saved: set[str]) -> dict[str, Any]:
    """``target`` without the entries the checkpoint does not hold (what a non-strict load, or
    a filter that left them out of checkpoints, skips)."""
    model = {k: v for k, v in target["model"].items() if f"model.{k}" in saved}
    optim_state = {}
    for pk, entry in target["optim"]["state"].items():
        kept = {k: v for k, v in entry.items() if f"optim.state.{pk}.{k}" in saved}
        if kept:
            optim_state[pk] = kept
    # A rank whose tables all have a stateless optimizer (SGD) holds no optimizer state;
    # DCP reads an empty "optim" mapping there as a missing key "optim.".
    return {"model": model, "optim": {"state": optim_state}} if optim_state else {"model": model}


def remap_position(ts: dict[str, Any], info: layout.CheckpointInfo, *, world_size: int,
                   policy: ReshardDataPosition, train_dataset: Any = None) -> dict[str, Any]:
    """Map the data position of a checkpoint saved with another world size to ``world_size``.

    At a window boundary (no batch of the window trained) the position is the same for any
    world size. Mid-window, each rank's batch count refers to its own share of the window, which
    does not exist at the new world size; ``policy`` (``reshard_data_position``) decides:

    * ``"exact"``: the part trained so far becomes one more of the window's earlier segments
      (``TrainerState.window_segments``: world size, batches per rank) and the new ranks start
      on the rows no old rank consumed (``WindowedDataset.iter_window(earlier=...)``); needs a
      ``train_dataset`` with ``exact_reshard`` (None, as for a bare ``resume()``, is allowed:
      the position is only recorded);
    * ``"error"``: refuse, naming the choices;
    * ``"restart_window"`` / ``"next_window"``: the start of this window / of the next one.
    """
    ts = dict(ts)
    ts["rows_unread"] = 0
    segments = [list(s) for s in ts.get("window_segments", [])]
    if ts["batches_in_window"] == 0 and not segments:
        return ts
    where = (f"in the middle of train window {ts['window_index']} ({ts['window_id']!r}, after "
             f"{_describe(segments, info.world_size, ts['batches_in_window'])})")
    exact_ok = train_dataset is None or getattr(train_dataset, "exact_reshard", False) is True
    if policy == "error" or (policy == "exact" and not exact_ok):
        cannot = ("" if policy == "error" else
                  f" The train dataset ({type(train_dataset).__name__}) cannot tell which rows "
                  "the old ranks consumed (it has no exact_reshard; ParquetWindowDataset has).")
        raise CheckpointError(
            f"checkpoint step {info.step} was saved with world size {info.world_size} {where}; "
            f"this run has world size {world_size}, so that position does not exist "
            f"(reshard_data_position={policy!r}).{cannot} Either resume with "
            f"{info.world_size} ranks, resume from a checkpoint taken at a window boundary "
            f"(save_every_n_windows), or set reshard_data_position='restart_window' (re-read "
            f"the window: some rows twice) or 'next_window' (skip the rest of it).",
            step=info.step, path=info.path, kind="reshard")
    if policy == "exact":
        if ts["batches_in_window"]:
            segments.append([info.world_size, int(ts["batches_in_window"])])
        logger.info("world size changed %d -> %d %s: resuming on the rows no old rank consumed",
                    info.world_size, world_size, where)
        ts["window_segments"], ts["batches_in_window"] = segments, 0
        return ts
    logger.warning("world size changed %d -> %d %s: %s", info.world_size, world_size, where,
                   policy)
    if policy == "next_window":
        ts["window_index"] += 1
    ts["batches_in_window"], ts["window_segments"] = 0, []
    return ts


def _describe(segments: list[list[int]], world_size: int, batches: int) -> str:
    """The window's trained parts, e.g. "18 batches per rank at world size 2, then 5 at 1"."""
    parts = [*segments, [world_size, batches]] if batches or not segments else segments
    return ", then ".join(f"{b} batches per rank at world size {w}" for w, b in parts)
