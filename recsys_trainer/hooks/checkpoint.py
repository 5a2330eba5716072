"""``CheckpointHook``: when the Trainer saves, decided in one hook.

The training loop announces its resume points (``on_resume_point``: after a step, a finished
window, a finished epoch, while a stream waits, the end of training, a preemption stop) and never
calls the checkpoint manager itself; this hook turns those points into saves on the configured
periods (``args.checkpoint``, through the run's one period rule, ``recsys_trainer.periods``),
finishes the save in flight while a stream waits for its next window, records evaluation
metrics for keep-best retention, and saves within the grace period on a preemption. The manager
only saves, resumes and rotates. The Trainer adds this hook after every other hook, so
``after_evaluate`` records what the other hooks added to the metrics, and ``on_preempt`` closes
the manager after the other hooks have seen the preemption.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.checkpoint.manager import CheckpointManager
from recsys_trainer.hooks.base import Hook, ResumePoint, TrainerView
from recsys_trainer.periods import Trigger

if TYPE_CHECKING:
    from recsys_trainer.preemption import Preemption


_WAIT_SLICE_S = 0.05
"""While a stream waits, how often the wait for a save's commit asks for a stop signal."""


class CheckpointHook(Hook):
    """Saves ``manager``'s checkpoints at the Trainer's resume points.

    - ``"step"``: commits a finished asynchronous save; ``save_steps`` / ``save_every_n_rows``.
    - ``"window"`` / ``"epoch"``: ``save_every_n_windows`` (and ``save_every_n_event_seconds``)
      / ``save_every_n_epochs`` (fired once
      the resume position has moved past the window or epoch, after its evaluation).
    - ``"wait"``: a stream waits for its next window (every rank is at the same heartbeat):
      waits for the save in flight to commit, so that its ``after_save_checkpoint`` (a
      publisher's hand-over) happens now rather than at the next window's first step.
    - ``"end"``: ``save_end``, then waits for the save in flight to commit (before
      ``after_train``).
    - ``"preempt"``: saves the step every rank stopped after, within what is left of
      ``args.preemption_grace_s``, and fills in ``trainer.preemption``.
    """

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        s = manager.settings
        self.trigger = Trigger.of({
            "save_steps": (s.save_steps, "steps"),
            "save_every_n_rows": (s.save_every_n_rows, "rows"),
            "save_every_n_windows": (s.save_every_n_windows, "windows"),
            "save_every_n_epochs": (s.save_every_n_epochs, "epochs"),
            "save_every_n_event_seconds": (s.save_every_n_event_seconds, "event_seconds"),
        })
        """When this hook saves (the manager's ``settings``' periods)."""

    def on_resume_point(self, trainer: TrainerView, point: ResumePoint) -> None:
        m = self.manager
        if point == "step":
            m.poll()
            if self.trigger and self.trigger.due("step", trainer.state):
                m.save()
        elif point == "window":
            if self.trigger.due("window", trainer.state):
                m.save()
        elif point == "epoch":
            if self.trigger.due("epoch", trainer.state):
                m.save()
        elif point == "wait":
            # Every rank is here together, and the stream has nothing to train: waiting costs no
            # training time, and a failed save is raised on every rank at this same heartbeat.
            # A stop signal ends the wait (the preemption save drains this save within the
            # grace period); the next heartbeat stops every rank. Waiting here runs no
            # collective, so ranks that leave it at different times stay matched.
            while m.in_flight and not trainer.stop_signalled:
                time.sleep(_WAIT_SLICE_S)
            if not trainer.stop_signalled:
                m.wait()
        elif point == "end":
            if m.settings.save_end:
                m.save()
            m.finish()
        elif point == "preempt":
            assert trainer.preemption is not None, "the Trainer names the preemption first"
            self._save_for_preemption(trainer.preemption, trainer.args.preemption_grace_s)

    def _save_for_preemption(self, p: Preemption, grace_s: float | None) -> None:
        assert grace_s is not None, "no preemption without preemption_grace_s"
        # The grace period counts from the signal: what the stop, the other hooks and the
        # agreement took since then is not the save's to spend.
        assert p.signalled_at is not None, "the Trainer names when the signal came"
        signalled_at = p.signalled_at
        if not self.manager.will_save():
            p.error = "this run saves no checkpoints (no save trigger is set)"
            return
        try:
            p.checkpoint = self.manager.save_within(grace_s - (time.monotonic() - signalled_at))
            p.committed = True
            p.seconds_to_commit = time.monotonic() - signalled_at
        except CheckpointError as e:
            p.error = str(e)
            p.save_still_running = e.kind == "deadline"

    def after_evaluate(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        # Last of the hooks: the record holds what the others added (keep_best_metric may name it).
        self.manager.record_metrics(metrics)

    def on_preempt(self, trainer: TrainerView, preemption: Preemption) -> None:
        if not preemption.save_still_running:
            self.manager.close()  # releases output_dir's lock


__all__ = ["CheckpointHook"]
