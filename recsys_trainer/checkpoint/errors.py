"""Typed checkpoint errors: every message names the step and/or the file involved."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found, verified or loaded.

    Attributes:
        step: the checkpoint's global step, when known.
        path: the checkpoint directory or the file at fault, when known.
        kind: a short machine-readable reason (``"missing"``, ``"incomplete"``, ``"corrupt"``,
            ``"mismatch"``, ``"save_failed"``, ``"load_failed"``, ``"reshard"``).
    """

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None,
                 kind: str = "error") -> None:
        super().__init__(message)
        self.step = step
        self.path = path
        self.kind = kind
