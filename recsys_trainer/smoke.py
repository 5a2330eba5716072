"""Test mode (``TrainingArguments(smoke_test=True)``, ``recsys-train CONFIG --smoke``): run every
part of a long job once, in seconds, before submitting it.

On the real model, data, hooks and optimizers, the Trainer then runs these phases instead of the
configured job, and reports the first that fails (``SmokeTestError`` names it and the exception):

1. ``train``: ``SMOKE_TRAIN_STEPS`` optimizer steps (fetch, forward, backward, both optimizers,
   the hooks' step events), when there is a train dataset;
2. ``evaluate``: one eval batch, when there is an eval dataset;
3. ``save``: one checkpoint, committed (every rank's files, then the marker);
4. ``resume``: that checkpoint loaded back into every component, then one more train step from
   the restored data position;
5. ``predict``: when the job is ``Trainer.predict`` (``run: predict``), one batch per rank of the
   first window scored and committed into the temporary directory (never the job's scores
   directory).

Everything is written to a fresh temporary directory, removed at the end, never among
``output_dir``'s checkpoints (a ``checkpointer`` passed to the Trainer is not used). Where
``output_dir`` is a local path, that directory is ``tempfile``'s (``$TMPDIR``, made by rank 0 and
checked on every rank). Where it is on object storage (``s3://...``), it is a new prefix
``_smoke-<random>`` inside ``output_dir``: the save and resume then go through the same bucket,
credentials and commit protocol as the real job's, and ranks on different nodes need no shared
disk (checkpoint listings only see ``step_<N>`` directories, so the prefix is never resumed
from). ``output_dir``'s checkpoints are not resumed from (``resume_from`` is ignored); ``model_bank`` warm-starts still
run, as in the real job. The periodic log/eval/save settings are replaced: the hooks log every
step, nothing is saved but phase 3.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from recsys_trainer.args import (
    CheckpointArguments,
    EvalArguments,
    LoggingArguments,
    TrainingArguments,
)
from recsys_trainer.checkpoint import layout
from recsys_trainer.checkpoint.manager import CheckpointManager
from recsys_trainer.distributed import Gang
from recsys_trainer.storage import probe_writable, resolve

logger = logging.getLogger("recsys_trainer")

SMOKE_TRAIN_STEPS = 2
"""Optimizer steps of the ``train`` phase (one more runs after the resume)."""

PHASES = ("train", "evaluate", "save", "resume", "predict")


class SmokeTestError(RuntimeError):
    """A smoke-test phase failed; ``phase`` names it, ``__cause__`` is the exception."""

    def __init__(self, phase: str, exc: BaseException) -> None:
        super().__init__(f"smoke test failed in phase {phase!r}: {type(exc).__name__}: {exc}")
        self.phase = phase


SMOKE_PREFIX = "_smoke-"
"""Name prefix of the smoke test's directory inside an ``output_dir`` on object storage."""


def smoke_directory(gang: Gang, output_dir: str | None = None) -> str:
    """A new temporary directory every rank sees: ``output_dir/_smoke-<random>`` where
    ``output_dir`` is on object storage, else one under ``$TMPDIR`` (rank 0 makes it; all check
    it)."""
    if output_dir is not None and not resolve(output_dir).is_local:
        name = gang.broadcast_object(f"{SMOKE_PREFIX}{uuid.uuid4().hex[:12]}" if gang.rank == 0 else None)
        return f"{output_dir.rstrip('/')}/{name}"
    path = gang.broadcast_object(tempfile.mkdtemp(prefix="recsys-smoke-") if gang.rank == 0 else None)
    seen = gang.all_gather_object(os.path.isdir(path))
    missing = [r for r, ok in enumerate(seen) if not ok]
    if missing:
        raise SmokeTestError("setup", FileNotFoundError(
            f"rank 0 made the smoke test's directory {path!r}, but rank(s) {missing} do not see "
            "it; set TMPDIR to a directory every node shares (checkpoints need one)."))
    return path


def smoke_arguments(args: TrainingArguments, output_dir: str,
                    logging_dir: str | None = None) -> TrainingArguments:
    """``args`` for the smoke test: its own output and logging dirs, a few steps, every report
    each step, one evaluation batch, no periodic save or resume. Of the checkpoint section it
    keeps only how the real job's saves are written and what they hold (the one save of the
    ``save`` phase then goes through the same path); the eval and logging sections are fresh."""
    c = args.checkpoint
    checkpoint = CheckpointArguments(
        save_concurrency_per_rank=c.save_concurrency_per_rank, async_save=c.async_save,
        model_bank=c.model_bank, params_not_save=c.params_not_save,
        save_filter_fn=c.save_filter_fn, reshard_data_position=c.reshard_data_position,
        max_to_keep=c.max_to_keep, resume_from=None)
    return dataclasses.replace(
        args, output_dir=output_dir, train_steps=SMOKE_TRAIN_STEPS, train_epoch=1,
        checkpoint=checkpoint, eval=EvalArguments(eval_steps=1),
        logging=LoggingArguments(logging_dir=logging_dir, log_steps=1))


class Runs(Protocol):
    """A Trainer's entry points as they run (``Trainer.train`` and the others call one)."""

    def train(self) -> None: ...
    def train_and_evaluate(self) -> None: ...
    def evaluate(self) -> dict[str, float]: ...
    def predict(self, ds: Any, options: Any, filesystem: Any, max_windows: int | None = None,
                max_batches: int | None = None) -> Any: ...


class _Trainer(Protocol):
    """What the smoke test uses of the Trainer (a protocol: this module must not import it)."""

    args: TrainingArguments
    state: Any
    train_dataset: Any
    eval_dataset: Any
    checkpointer: CheckpointManager
    gang: Gang

    @property
    def is_rank_zero(self) -> bool: ...
    def save_checkpoint(self, path: str | None = None) -> str: ...
    def load_checkpoint(self, path: str) -> None: ...


class _SmokeRuns:
    """``Runs`` in test mode: every entry point runs the phases around the real ones."""

    def __init__(self, smoke: SmokeTest, trainer: _Trainer, direct: Runs) -> None:
        self._smoke, self._trainer, self._direct = smoke, trainer, direct

    def train(self) -> None:
        self._smoke.run(self._trainer, self._direct)

    def train_and_evaluate(self) -> None:
        self._smoke.run(self._trainer, self._direct)

    def evaluate(self) -> dict[str, float]:
        self._smoke.run(self._trainer, self._direct)
        return self._smoke.eval_metrics

    def predict(self, ds: Any, options: Any, filesystem: Any, max_windows: int | None = None,
                max_batches: int | None = None) -> Any:
        # The phases, then one batch of the first window scored into the smoke directory (never
        # into `output_dir`, never the whole data).
        direct = self._direct
        self._smoke.run(self._trainer, direct, predict=lambda out: direct.predict(
            ds, dataclasses.replace(options, output_dir=out), None, max_windows=1, max_batches=1))
        return self._smoke.predict_summary


class SmokeTest:
    """Runs the phases on a Trainer built with ``smoke_test=True``: the builder makes one (all
    ranks together), builds the Trainer's components with its ``args``, and ``around`` wraps the
    Trainer's entry points so ``train``, ``evaluate``, ``train_and_evaluate`` and ``predict``
    run it."""

    def __init__(self, args: TrainingArguments, gang: Gang) -> None:
        self.output_dir = smoke_directory(gang, args.output_dir)
        """The smoke test's own directory (``smoke_directory``), removed at the end."""
        self.logging_dir = self.output_dir if resolve(self.output_dir).is_local else \
            tempfile.mkdtemp(prefix="recsys-smoke-logs-")
        """The hooks' local files (a local ``output_dir`` holds them itself; one on object
        storage cannot, so each rank gets a local temporary directory, removed at the end)."""
        self.args = smoke_arguments(args, self.output_dir, self.logging_dir)
        """The job's ``args`` for the smoke test (``smoke_arguments``): what the Trainer runs
        with."""
        self.report: dict[str, Any] = {}
        """What ran: steps, eval rows, the checkpoint, seconds per phase."""
        self.eval_metrics: dict[str, float] = {}
        """The ``evaluate`` phase's metrics (what ``Trainer.evaluate()`` returns in test mode)."""
        self.predict_summary: Any = None
        """The ``predict`` phase's ``PredictSummary`` (what ``Trainer.predict()`` returns)."""

    def around(self, trainer: _Trainer, direct: Runs) -> Runs:
        """The entry points of ``trainer`` in test mode: each runs the phases on ``direct``."""
        return _SmokeRuns(self, trainer, direct)

    def run(self, trainer: _Trainer, direct: Runs,
            predict: Callable[[str], Any] | None = None) -> dict[str, Any]:
        """All phases, on every rank, through ``direct`` (the real entry points); returns
        ``report``. Raises ``SmokeTestError``.

        ``predict(output_dir)``: the ``predict`` phase (``Trainer.predict`` in test mode), scoring
        into ``output_dir`` and returning its ``PredictSummary``."""
        t_all = time.perf_counter()
        seconds: dict[str, float] = {}
        phase = PHASES[0]
        try:
            if trainer.train_dataset is not None:
                t0 = time.perf_counter()
                direct.train()
                seconds[phase] = time.perf_counter() - t0
            phase = "evaluate"
            if trainer.eval_dataset is not None:
                t0 = time.perf_counter()
                metrics = direct.evaluate()
                seconds[phase] = time.perf_counter() - t0
                self.eval_metrics = metrics
                self.report["eval_samples"] = metrics["num_samples"]
            phase = "save"
            t0 = time.perf_counter()
            # The real job probes output_dir at its start; here no periodic save is set, so the
            # manager skips that probe: run it (an object store may create a mistyped bucket on
            # the first upload, which would let the save pass).
            problems = trainer.gang.all_gather_object(probe_writable(self.output_dir))
            failed = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
            if failed:
                raise RuntimeError(f"{self.output_dir!r} is not writable ({'; '.join(failed)})")
            saved_step = trainer.state.global_step
            path = trainer.save_checkpoint()
            if not layout.is_committed(path):
                raise RuntimeError(f"the checkpoint {path} has no commit marker after the save")
            seconds[phase] = time.perf_counter() - t0
            phase = "resume"
            t0 = time.perf_counter()
            trainer.load_checkpoint(path)
            if trainer.state.global_step != saved_step:
                raise RuntimeError(f"the loaded checkpoint is at step {trainer.state.global_step}, "
                                   f"not {saved_step}")
            if trainer.train_dataset is not None:
                # One more step from the restored position; one more epoch allowed, so data of
                # just 2 batches (its epoch ended in the saved state) still trains a step.
                trainer.args.train_steps = saved_step + 1
                trainer.args.train_epoch = trainer.state.epoch + 2
                direct.train()
                if trainer.state.global_step != saved_step + 1:
                    raise RuntimeError(f"training after the resume ended at step "
                                       f"{trainer.state.global_step}, not {saved_step + 1}")
            seconds[phase] = time.perf_counter() - t0
            if predict is not None:
                phase = "predict"
                t0 = time.perf_counter()
                self.predict_summary = predict(f"{self.output_dir.rstrip('/')}/predictions")
                self.report["predicted_rows"] = self.predict_summary.rows_written
                seconds[phase] = time.perf_counter() - t0
            trainer.gang.barrier()  # every rank is done with the directory before it goes
        except SmokeTestError:
            raise
        except Exception as exc:
            raise SmokeTestError(phase, exc) from exc
        finally:
            trainer.checkpointer.close()
            if trainer.is_rank_zero:
                remove_smoke_directory(self.output_dir)
            if self.logging_dir != self.output_dir:
                shutil.rmtree(self.logging_dir, ignore_errors=True)
        self.report.update(steps=trainer.state.global_step, checkpoint_step=saved_step,
                           seconds={k: round(v, 3) for k, v in seconds.items()},
                           total_s=round(time.perf_counter() - t_all, 3))
        if trainer.is_rank_zero:
            logger.info("smoke test passed: %s", self.report)
        return self.report


def remove_smoke_directory(path: str) -> None:
    """Delete the smoke test's directory, local or on object storage; a failure is logged, not
    raised (the phases' outcome is what the user asked about)."""
    loc = resolve(path)
    if loc.is_local:
        shutil.rmtree(loc.path, ignore_errors=True)
        return
    try:
        loc.filesystem.delete_dir(loc.path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("smoke test: could not remove %s: %s", loc.url, exc)


__all__ = ["PHASES", "SMOKE_PREFIX", "SMOKE_TRAIN_STEPS", "Runs", "SmokeTest", "SmokeTestError",
           "smoke_arguments", "smoke_directory"]
