"""``DynamicTableStatsHook``: occupancy, admissions and evictions of dynamic tables per window.

The Trainer adds it by itself when the model has dynamic tables (see
``recsys_trainer.dynamic``). After every train window it sums each table's counters over the
ranks (one small all-reduce on the control gang), logs one line per table on rank 0, and fires
``on_metrics`` with ``MetricReport(mode="train", scope="window")`` so every reporting hook sees
the figures: ``TensorBoardHook`` writes ``train_window/dynamic/<table>/<name>`` at the window's
index, ``JsonlMetricsHook`` a ``metrics`` record.
"""

from __future__ import annotations

import logging
from typing import Any

from recsys_trainer import dynamic
from recsys_trainer.hooks.base import Hook, MetricReport, TrainerView

logger = logging.getLogger("recsys_trainer")

_COUNTERS = ("slots", "occupied", "admitted", "evicted", "expired")
_PER_WINDOW = ("admitted", "evicted", "expired")


class DynamicTableStatsHook(Hook):
    """Reports, after each train window and for each dynamic table (totals over all ranks):

    - ``occupancy``: occupied slots / slots (the fallback rows count as slots);
    - ``occupied``: slots holding an id;
    - ``admitted`` / ``evicted`` / ``expired``: ids given a slot / resident ids that lost theirs
      to another id / resident ids unseen for the table's ``expire_after_*`` (their rows
      freed), *during this window*.

    The previous window's totals are part of the hook's checkpointed state, so the first window
    after a resume reports that window only (a resume at another world size restarts the
    tables' counters, ``counters_epoch`` in ``table_stats``, and the baseline with them). Add it
    on every rank (it takes part in a collective).
    """

    def __init__(self) -> None:
        self._prev: dict[str, dict[str, int]] = {}
        self._windows = 0
        self._epochs: dict[str, int] = {}

    def after_window(self, trainer: TrainerView, window_id: str) -> None:
        if trainer.state.mode != "train":
            return
        local = dynamic.table_stats(trainer.model)
        if not local:
            return
        tables = sorted(local)
        # Every rank holds a shard of every dynamic table (row-wise), so the table order and
        # vector length agree across ranks.
        flat = [float(local[t][k]) for t in tables for k in _COUNTERS]
        total = trainer.gang.all_reduce_sum_float(flat)
        values: dict[str, float] = {}
        for i, table in enumerate(tables):
            now = {k: int(total[i * len(_COUNTERS) + j]) for j, k in enumerate(_COUNTERS)}
            epoch = local[table]["counters_epoch"]
            if self._epochs.get(table, 0) != epoch:
                self._prev.pop(table, None)  # the counters restarted (another world size)
            self._epochs[table] = epoch
            prev = self._prev.get(table, {})
            delta = {k: now[k] - prev.get(k, 0) for k in _PER_WINDOW}
            occupancy = now["occupied"] / now["slots"] if now["slots"] else 0.0
            values.update({
                f"dynamic/{table}/occupancy": occupancy,
                f"dynamic/{table}/occupied": float(now["occupied"]),
                **{f"dynamic/{table}/{k}": float(v) for k, v in delta.items()},
            })
            self._prev[table] = now
            if trainer.is_rank_zero:
                logger.info(
                    "dynamic table %s after window %s: %d/%d slots occupied (%.1f%%), %d admitted, "
                    "%d evicted, %d expired in the window", table, window_id, now["occupied"],
                    now["slots"], 100.0 * occupancy, delta["admitted"], delta["evicted"],
                    delta["expired"],
                )
        report = MetricReport(mode="train", scope="window", step=trainer.state.global_step,
                              values=values, window_id=window_id, window_index=self._windows)
        self._windows += 1
        trainer.hooks.fire("on_metrics", trainer, report)

    def state_dict(self) -> dict[str, Any]:
        return {"prev": {t: dict(v) for t, v in self._prev.items()}, "windows": self._windows,
                "epochs": dict(self._epochs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prev = {t: dict(v) for t, v in state["prev"].items()}
        self._windows = int(state["windows"])
        self._epochs = dict(state.get("epochs", {}))
