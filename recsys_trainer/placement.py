"""``Placement``: where this process trains, decided once per job.

``place(args)`` is the one place a run starts its process group, picks its device, sizes the
CPU threads and seeds the generators; every component that needs to know where it runs (the
sharded model, the metrics, the checkpoint writer, the datasets' agreement) receives the
``Placement`` instead of asking ``torch.distributed`` or ``torch.cuda`` again. This is the
"device zone" of docs/devices.md: the model's zone is ``placement.device``; everything the
control collectives agree on stays on the host (``placement.gang``).

``recsys-train`` calls ``place`` before it builds the datasets and the model (so a model's dense
layers are initialised from ``args.seed``); ``Trainer(model=..., args=...)`` without a placement
calls it itself, once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from recsys_trainer.args import TrainingArguments
from recsys_trainer.distributed import (
    Gang,
    ProcessGroupGang,
    configure_cpu_threads,
    init_distributed,
    new_control_group,
)
from recsys_trainer.logs import default_logging
from recsys_trainer.rng import seed_everything


@dataclass(frozen=True)
class Placement:
    """This rank's place in the job: its device and the groups its collectives run on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    """The model's device: ``cuda:<local device>`` or ``cpu`` (``args.device``, resolved once)."""
    process_group: dist.ProcessGroup | None
    """The group of the model's tensor collectives (sharding, DDP, metric sync)."""
    gang: Gang
    """The control collectives (agreement on stops, listings, checkpoint decisions): a gloo
    group, so they run on the host whatever the model's device."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def place(args: TrainingArguments, gang: Gang | None = None) -> Placement:
    """Start (or join) the process group, pick the device, size the CPU threads and seed every
    generator with ``args.seed``; all ranks call this together (it creates the control group).

    ``gang``: the control collectives to use instead of a new gloo group (tests pass a
    ``FakeGang``)."""
    # The group first: accelerate would create it itself (torch's env:// rendezvous, whose keys a
    # torchrun restart finds stale; see distributed.attempt_store) and uses ours.
    info = init_distributed(args.device, args.collective_timeout_s)
    default_logging(info.rank)  # rank 0's INFO lines visible without a logging set-up
    configure_cpu_threads(info.local_world_size)
    seed_everything(args.seed)
    if gang is None:
        gang = ProcessGroupGang(new_control_group(args.collective_timeout_s))
    return Placement(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                     local_world_size=info.local_world_size, device=info.device,
                     process_group=dist.group.WORLD, gang=gang)


__all__ = ["Placement", "place"]
