"""``NonFiniteLossHook``: an alias of ``TrainingArguments(non_finite_loss=...)`` as a hook."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from recsys_trainer.hooks.base import Hook, TrainerView

if TYPE_CHECKING:
    from recsys_trainer.step import NonFiniteGuard


class NonFiniteLossHook(Hook):
    """Stop, or skip steps, when the training loss is NaN or infinite on any rank.

    The policy belongs to the Trainer (``TrainingArguments.non_finite_loss`` and
    ``max_non_finite_skips``, documented there); this hook is the same setting for code and
    configs that list it as a hook: at ``before_train`` it sets the Trainer's policy to
    ``action`` / ``max_skips``. ``num_skipped`` and ``skipped_steps`` read the Trainer's count.
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop", max_skips: int | None = None) -> None:
        if action not in ("stop", "skip"):
            raise ValueError(f"`action` must be 'stop' or 'skip', but is {action!r}.")
        if max_skips is not None and (action != "skip" or max_skips < 1):
            raise ValueError(f"`max_skips` needs action='skip' and a value >= 1, but is {max_skips!r}.")
        self.action: Literal["stop", "skip"] = action
        self.max_skips = max_skips
        self._guard: NonFiniteGuard | None = None

    def before_train(self, trainer: TrainerView) -> None:
        self._guard = trainer.non_finite
        self._guard.configure(self.action, self.max_skips)

    @property
    def num_skipped(self) -> int:
        """Steps skipped for a non-finite loss in this run (0 before training)."""
        return self._guard.num_skipped if self._guard is not None else 0

    @property
    def skipped_steps(self) -> list[int]:
        """The global steps this process skipped."""
        return list(self._guard.skipped_steps) if self._guard is not None else []
