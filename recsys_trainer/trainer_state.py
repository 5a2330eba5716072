"""``TrainerState``: the counters the Trainer owns (the training position, saved in checkpoints).

Its own module so that what reads the counters (hooks, through ``hooks.base.TrainerView``) can
name their type without importing the Trainer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from recsys_trainer.data.base import Segment


@dataclass
class TrainerState:
    """The counters the Trainer owns (saved in checkpoints, restored on resume)."""

    global_step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Current (0-based) epoch; after training, the number of epochs started."""
    window_index: int = 0
    """Index of the current train window within the epoch."""
    batches_in_window: int = 0
    """Micro-batches *trained* in the current train window (the resume position); after a
    change of world size inside the window, those of the part since the change."""
    window_segments: list[list[int]] = field(default_factory=list)
    """The current train window's parts trained before the job changed its world size, oldest
    first, as ``[world_size, batches per rank]`` (``data.base.Segment``); empty unless an
    elastic resume landed in the middle of the window."""
    window_id: str | None = None
    windows_done: int = 0
    """Train windows finished in the whole run (every epoch; a window cut short by
    ``train_steps`` or a stop is not): what periods in windows count, so that a resumed run
    saves and publishes after the same windows as one never stopped."""
    event_time_s: float = 0.0
    """The event time trained through: the end (unix s) of the last finished train window of
    an event-time source (``WindowedDataset.window_end_time``; a Kafka topic's), 0 without one.
    What periods in ``event_seconds`` count."""
    last_window_event_s: float = 0.0
    """How far the last finished train window moved ``event_time_s``."""
    mode: Literal["idle", "train", "eval", "predict"] = "idle"
    rows_unread: int = 0
    """Train rows dropped because another rank ran out of data first (whole run)."""
    rows_seen: int = 0
    """Training rows of all ranks in the steps done (the same on every rank; periods in rows)."""
    last_step_rows: int = 0
    """Rows of all ranks in the last step."""
    eval_owed: list[str] | None = None
    """The evaluation ``train_and_evaluate`` owes after the current train window: its eval
    window ids (``[]``: all eval data), None when none is owed. Saved, so that a run stopped
    after its last step but before that evaluation finished evaluates on resume."""
    stop_reason: str | None = None

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items()
                if k not in ("mode", "stop_reason", "last_step_rows", "last_window_event_s")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Checkpoints from before rows_seen / eval_owed / window_segments / windows_done existed
        # (the manager recorded the windows; checkpoint.loading passes that count on).
        state = {"rows_seen": 0, "eval_owed": None, "window_segments": [], "windows_done": 0,
                 "event_time_s": 0.0, **state}
        expected = set(self.state_dict())
        if set(state) != expected:
            raise ValueError(
                f"trainer state keys differ: missing {sorted(expected - set(state))}, "
                f"unexpected {sorted(set(state) - expected)}."
            )
        for k, v in state.items():
            setattr(self, k, v)
        self.window_segments = [list(map(int, s)) for s in self.window_segments]

    def segments(self) -> list[Segment]:
        """``window_segments`` as ``Segment``s (what the train dataset is handed)."""
        return [Segment(w, b) for w, b in self.window_segments]

    def finish_window_in_event_time(self, end: float | None) -> None:
        """A train window ending at event time ``end`` (None: not an event-time window) is
        finished: ``event_time_s`` moves there (never back)."""
        before = self.event_time_s
        if end is not None and end > before:
            self.event_time_s = float(end)
        self.last_window_event_s = self.event_time_s - before

    def next_window(self, index: int) -> None:
        """The resume position moves to the start of train window ``index``."""
        self.window_index, self.batches_in_window, self.window_segments = index, 0, []


__all__ = ["TrainerState"]
