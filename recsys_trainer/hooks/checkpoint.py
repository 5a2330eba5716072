"""``CheckpointHook``: every save the Trainer makes, in one hook.

The training loop announces its resume points (``on_resume_point``: after a step, a finished
window, a finished epoch, while a stream waits, the end of training, a preemption stop) and never
calls the checkpoint manager itself; this hook turns those points into saves: on the configured
periods (``args.checkpoint``, through the run's one period rule, ``recsys_trainer.periods``) and
where another hook asks for one (``trainer.request_save``: a ``PublishHook``'s publish). It
finishes the save in flight while a stream waits for its next window, records evaluation
metrics for keep-best retention, and saves within the grace period on a preemption. It is also
the manager's listener: it fires ``before_save_checkpoint``, ``after_save_checkpoint`` and
``after_load_checkpoint`` on the hooks, so a save a hook asked for comes back to it through
this hook alone (the hook asks; this hook saves; the manager writes and commits; this hook
fires the commit). The manager only saves, resumes and rotates. The Trainer adds this hook
after every other hook, so a save asked for at a resume point is made at that point,
``after_evaluate`` records what the other hooks added to the metrics, and ``on_preempt``
closes the manager after the other hooks have seen the preemption.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.checkpoint.manager import CheckpointManager
from recsys_trainer.hooks.base import Hook, ResumePoint, SaveRequest, TrainerView
from recsys_trainer.periods import Trigger

if TYPE_CHECKING:
    from recsys_trainer.preemption import Preemption


logger = logging.getLogger(__name__)

_WAIT_SLICE_S = 0.05
"""While a stream waits, how often the wait for a save's commit asks for a stop signal."""


class CheckpointHook(Hook):
    """Saves ``manager``'s checkpoints at the resume points of ``trainer`` (the Trainer that adds
    it), and relays the manager's events to ``trainer``'s hooks (``relay``).

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

    At every point but ``"preempt"`` it also saves when a hook asked for a save there
    (``request``); one save serves its periods and every request (at ``"end"`` a requested save
    blocks, as a hook that asks there hands the checkpoint on at once); at ``"preempt"`` the
    preemption's save serves them.
    """

    def __init__(self, manager: CheckpointManager, trainer: TrainerView) -> None:
        self.manager = manager
        self._trainer = trainer
        s = manager.settings
        self.trigger = Trigger.of({
            "save_steps": (s.save_steps, "steps"),
            "save_every_n_rows": (s.save_every_n_rows, "rows"),
            "save_every_n_windows": (s.save_every_n_windows, "windows"),
            "save_every_n_epochs": (s.save_every_n_epochs, "epochs"),
            "save_every_n_event_seconds": (s.save_every_n_event_seconds, "event_seconds"),
        })
        """When this hook saves (the manager's ``settings``' periods)."""
        self._asked: list[SaveRequest] = []  # to save at the end of this resume point
        self._uncommitted: list[SaveRequest] = []  # asked, not committed yet
        self._saving: list[SaveRequest] = []  # those the save now running serves
        self._save_started = 0.0

    def request(self, reason: str) -> SaveRequest:
        """``TrainerView.request_save``: a save of the current step at the end of this resume
        point (see the class docstring)."""
        step = self._trainer.state.global_step
        path = self.manager.step_path(step)
        asked = SaveRequest(reason, step, path, committed=self.manager.is_committed(path))
        logger.debug("step %d: a save is asked for (%s)", step, reason)
        self._asked.append(asked)
        if not asked.committed:
            self._uncommitted.append(asked)
        return asked

    def relay(self, event: str, path: str) -> None:
        """The manager's listener: fire its event on every hook, a commit's after marking the
        requests it serves committed (a blocking save's with the time it blocked)."""
        if event == "after_save_checkpoint" and self._uncommitted:
            now = time.perf_counter()
            for asked in self._uncommitted:
                if asked.path == path:
                    asked.committed = True
                    if any(asked is r for r in self._saving):
                        asked.blocked_s = now - self._save_started
            self._uncommitted = [r for r in self._uncommitted if not r.committed]
        self._trainer.hooks.fire(event, self._trainer, path)

    def _save(self, due: bool, *, end: bool = False) -> None:
        """Save the current step when a period is ``due`` or a hook asked: one save for all."""
        if not (due or self._asked):
            return
        asked, self._asked = self._asked, []
        self._saving, self._save_started = asked, time.perf_counter()
        try:
            self.manager.save(blocking=True if asked and end else None)
        finally:
            self._saving = []
        blocked = time.perf_counter() - self._save_started
        for r in asked:
            if not r.committed:  # an asynchronous save: its snapshot is what blocked
                r.blocked_s = blocked

    def before_train(self, trainer: TrainerView) -> None:
        self._asked, self._uncommitted = [], []  # left by a run that raised

    def on_resume_point(self, trainer: TrainerView, point: ResumePoint) -> None:
        m = self.manager
        if point == "step":
            m.poll()
            self._save(bool(self.trigger) and self.trigger.due("step", trainer.state))
        elif point == "window":
            self._save(self.trigger.due("window", trainer.state))
        elif point == "epoch":
            self._save(self.trigger.due("epoch", trainer.state))
        elif point == "wait":
            self._save(False)
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
            self._save(m.settings.save_end, end=True)
            m.finish()
        elif point == "preempt":
            assert trainer.preemption is not None, "the Trainer names the preemption first"
            self._asked = []  # the preemption's save serves them (relay)
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
