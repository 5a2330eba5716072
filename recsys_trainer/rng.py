"""The random number generators a run uses: seeding them, and their state as a checkpoint
component (so a resumed run draws the same numbers as an uninterrupted one)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators (every rank the same).

    The Trainer calls it with ``args.seed`` when it is built, which is after the model: a
    model's dense layers are initialised in its constructor, from whatever state torch's
    generator is in (a fresh process seeds it at random). For a reproducible run call it first::

        args = TrainingArguments(seed=7, ...)
        seed_everything(args.seed)
        model = DLRMClassifier(...)
        trainer = Trainer(model, args, ...)

    ``recsys-train`` does this itself, before it builds the datasets and the model."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class RNGState:
    """The global generators of this process as a ``Stateful``: python, numpy, torch CPU, and
    the current CUDA device's when CUDA is in use."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        np.random.set_state(state_dict["numpy"])
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])
