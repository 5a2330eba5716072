"""Which committed checkpoints rotation deletes: a pure function of what is on disk.

``select_to_delete`` reads nothing and deletes nothing: it is given the committed checkpoints
(their step, commit time, recorded metrics and ``KEEP`` flag), the ``RetentionPolicy`` and the
steps to protect, and returns the ones to delete. The manager lists the checkpoints, calls it,
and does the deleting (``layout.remove_checkpoint``), so the policy is tested without a disk
(``tests/test_checkpoint_rotation.py``). The same split as fairseq2's checkpoint manager.

This module imports nothing from the checkpoint package: ``layout`` re-exports its names, which
lived there before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar


class Rotatable(Protocol):
    """What rotation reads of a committed checkpoint (``layout.CheckpointInfo`` has it)."""

    @property
    def step(self) -> int: ...

    @property
    def commit_time(self) -> float: ...

    @property
    def keep(self) -> bool: ...

    @property
    def metrics(self) -> Mapping[str, float]: ...


InfoT = TypeVar("InfoT", bound=Rotatable)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints survive rotation.

    Keeps the ``max_to_keep`` newest; in addition (not counted against it) the ones marked
    ``KEEP``, the best by ``keep_best_metric`` (``keep_best_mode`` "min" or "max"; only
    checkpoints that recorded the metric compete), and one per ``keep_every_n_hours`` of commit
    time (the oldest of each period).
    """

    max_to_keep: int = 5
    keep_every_n_hours: float | None = None
    keep_best_metric: str | None = None
    keep_best_mode: Literal["min", "max"] = "min"


def select_to_delete(
    infos: Iterable[InfoT], policy: RetentionPolicy, protected_steps: Iterable[int] = ()
) -> list[InfoT]:
    """The checkpoints rotation deletes (pure), oldest first. Never the newest, never a
    protected step (e.g. the one just committed, the one resumed from), never one marked keep,
    never the best."""
    ordered = sorted(infos, key=lambda i: i.step)
    if not ordered:
        return []
    keep: set[int] = {i.step for i in ordered[-policy.max_to_keep:]}
    keep.add(ordered[-1].step)
    keep.update(protected_steps)
    keep.update(i.step for i in ordered if i.keep)
    metric = policy.keep_best_metric
    if metric is not None:
        scored = [i for i in ordered if metric in i.metrics and not math.isnan(i.metrics[metric])]
        if scored:
            sign = 1.0 if policy.keep_best_mode == "min" else -1.0
            best = min(scored, key=lambda i: (sign * i.metrics[metric], -i.step))
            keep.add(best.step)
    if policy.keep_every_n_hours is not None:
        period = policy.keep_every_n_hours * 3600.0
        last: float | None = None
        for i in ordered:
            if last is None or i.commit_time >= last + period:
                keep.add(i.step)
                last = i.commit_time
    return [i for i in ordered if i.step not in keep]
