"""``EvalSchedule``: when ``train_and_evaluate`` evaluates, and on which eval data.

One object answers every "evaluate now?" of a training run: after a step or a number of rows
(``args.eval_every_n_steps`` / ``_rows``), after a train window (by default with windowed eval
data: eval window ``i`` after train window ``i``), after an epoch (by default with unwindowed
eval data), and on resume (an evaluation the checkpoint says is owed). It also pairs train and
eval windows and refuses a shifted pair (``WindowPairing``) before an evaluation would use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from recsys_trainer.data.base import IterableAsWindow, Lookahead, WindowedDataset, WindowPairing
from recsys_trainer.periods import Period, Progress


@dataclass(frozen=True)
class EvalPlan:
    """What ``train_and_evaluate`` evaluates while or after training one window."""

    dataset: WindowedDataset
    windows: list[str] | None
    """The eval windows (the paired one), or None: all eval data."""
    after_window: bool
    """Whether it evaluates once the window is trained (else only on a steps/rows period)."""

    @property
    def owed(self) -> list[str]:
        """What the trainer state records as owed while the window trains (``[]``: all)."""
        return list(self.windows or [])


class EvalSchedule:
    """Decides the evaluations of one ``train()`` / ``train_and_evaluate()`` call.

    Args:
        eval_dataset: the eval data, or None (then nothing is ever due).
        period: ``args.eval_period`` (None: after each window with windowed eval data, after each
            epoch with unwindowed).
        enabled: False for ``train()``: nothing is due.
    """

    def __init__(self, eval_dataset: WindowedDataset | None, period: Period | None,
                 enabled: bool) -> None:
        self.dataset = eval_dataset if enabled else None
        self.period = period
        self.windowed = self.dataset is not None and not isinstance(self.dataset, IterableAsWindow)
        self.current: EvalPlan | None = None
        """The plan of the train window being trained (a steps/rows period evaluates it)."""
        self._pairing = WindowPairing()
        self._train_windows: Lookahead[str] | None = None

    def owed_on_resume(self, owed: list[str] | None) -> EvalPlan | None:
        """The evaluation a resumed run still owes (``TrainerState.eval_owed``): the run stopped
        after its last step, before the evaluation after it finished."""
        if self.dataset is None or owed is None:
            return None
        return EvalPlan(self.dataset, owed or None, after_window=True)

    def windows(self, train_windows: Lookahead[str]) -> Iterator[tuple[int, str, EvalPlan | None]]:
        """One epoch's train windows, each with what is evaluated for it; a train/eval pair
        whose ids do not line up is a ``WindowPairingError``, raised before it is used."""
        eval_ids = iter(self.dataset.window_ids()) if self.windowed and self.dataset is not None \
            else None
        self._pairing, self._train_windows = WindowPairing(), train_windows
        for index, window_id in enumerate(train_windows):
            eval_id = next(eval_ids, None) if eval_ids is not None else None
            if eval_ids is not None:
                self._pairing.check(window_id, eval_id)
            yield index, window_id, self._plan(index, eval_id)

    def _plan(self, index: int, eval_id: str | None) -> EvalPlan | None:
        if self.dataset is None or (self.windowed and eval_id is None):
            return None  # windowed eval data that ran out: nothing to pair this window with
        windows = [eval_id] if eval_id is not None else None
        return EvalPlan(self.dataset, windows, after_window=self._due("window", index + 1))

    def check_pair_before_eval(self, training_ended: bool) -> None:
        """Before evaluating a window's pair: where the pairing can only be confirmed by the
        next train window's id, look at it now (never evaluate a shifted pair)."""
        if self.windowed and not training_ended and self._pairing.needs_next_train_id():
            assert self._train_windows is not None
            self._pairing.check_before_eval(self._train_windows.peek())

    def due_after_step(self, progress: Progress) -> EvalPlan | None:
        """The plan to evaluate after this step (steps and rows periods), or None."""
        if self.current is None or self.period is None or not self.period.due_after_step(progress):
            return None
        return self.current

    def due_after_epoch(self, epochs_done: int) -> EvalPlan | None:
        """What to evaluate after an epoch (all eval data), or None."""
        if self.dataset is None or not self._due("epoch", epochs_done):
            return None
        return EvalPlan(self.dataset, None, after_window=False)

    def _due(self, unit: str, done: int) -> bool:
        if self.period is None:
            return self.windowed == (unit == "window")
        return self.period.due_after_window(done) if unit == "window" \
            else self.period.due_after_epoch(done)


__all__ = ["EvalPlan", "EvalSchedule"]
