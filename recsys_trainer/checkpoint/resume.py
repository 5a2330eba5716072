"""Choosing the checkpoint a run resumes from, the same on every rank, and what guards it.

``choose_source`` picks it (``resume_from``: ``"auto"``, a path, or None), verifying every
candidate on every rank with ``verify_everywhere`` (one collective decides, so ranks never pick
different ones) and moving one that fails aside with ``quarantine``. ``remove_incomplete``
clears what crashed saves left; ``check_no_foreign_checkpoints`` refuses to save next to another
trajectory's checkpoints. Loading the chosen one is ``checkpoint.loading``.

All functions here take what they use as arguments (the gang, ``output_dir`` as a ``Location``
and as the name messages use); ``CheckpointManager`` composes them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from recsys_trainer.checkpoint import layout
from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.distributed import Gang
from recsys_trainer.storage import Location, remove_tree, same_place

# The manager's logger: users filter and read these messages under that name
# (docs/checkpoint.md quotes them).
logger = logging.getLogger("recsys_trainer.checkpoint.manager")

Failure = tuple[int, str, str | None, str]
"""``(rank, message, path, kind)`` of a verification that failed on one rank."""


def resolve_resume_source(resume_from: str | None, out: Location,
                          locate: Callable[[str], Location]) -> layout.CheckpointInfo | None:
    """The checkpoint ``resume_from`` names, without verifying it: None for a fresh start, the
    newest committed one in ``out`` for ``"auto"``, else the checkpoint (or the newest of the
    output directory) at that path, resolved with ``locate``."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        return layout.latest_committed(out)
    return layout.resolve_checkpoint(locate(resume_from), "`resume_from`")


def remove_incomplete(out: Location) -> None:
    """Delete the step directories of ``out`` that never committed (rank 0, at the start of
    training, with no save of this run in flight)."""
    for loc in layout.list_incomplete(out):
        logger.warning("removing incomplete checkpoint %s (its save never committed)", loc.url)
        try:
            remove_tree(loc)
        except OSError as e:  # it is never loaded anyway; try again at the next start
            logger.warning("could not remove %s: %s", loc.url, e)


def choose_source(gang: Gang, *, resume_from: str | None, out: Location, output_dir: str,
                  verify_checksums: bool, may_quarantine: bool,
                  locate: Callable[[str], Location]) -> layout.CheckpointInfo | None:
    """The checkpoint to restore, the same on every rank (or a ``CheckpointError`` on every
    rank). An explicit ``resume_from`` is taken as it is (its load verifies it, strictly).
    ``"auto"`` tries the committed checkpoints newest first: every rank verifies the
    candidate's files (sizes and CRC32s, as a load would) and one collective decides, so
    ranks never pick different ones; one that fails on any rank is skipped with a warning
    naming it and why, and with ``may_quarantine`` rank 0 moves it aside
    (``layout.quarantine``): left under its step name, this run's own save of that step
    would be skipped as already committed. Checkpoints that exist but none verifies are an
    error, never a silent fresh start."""
    if resume_from != "auto":
        source = resolve_resume_source(resume_from, out, locate)
        # Only the agreement on the step.
        verify_everywhere(gang, source, output_dir=output_dir,
                          verify_checksums=verify_checksums, verify=False)
        return source
    candidates = layout.list_committed(out)
    skipped: list[tuple[layout.CheckpointInfo, str]] = []
    for info in [*reversed(candidates), None]:
        failures = verify_everywhere(gang, info, output_dir=output_dir,
                                     verify_checksums=verify_checksums)
        if info is None:
            break
        if not failures:
            # Moved aside only now that there is one to fall back to: with none, a restart
            # must meet the same error, not an output_dir that looks empty.
            for bad, why in skipped:
                moved = quarantine(gang, bad, why, output_dir=output_dir) \
                    if may_quarantine else None
                logger.warning(
                    "checkpoint step %d at %s fails verification, so it is not resumed "
                    "from: %s. %s", bad.step, bad.path, why,
                    f"It is kept for inspection at {moved}." if moved else
                    "It is left where it is (this run does not save into its directory).")
            if skipped:
                logger.warning("resuming from %s (step %d), the newest checkpoint that "
                               "verifies", info.path, info.step)
            return info
        # The facts only: the advice in the message is for a load that has no fallback.
        skipped.append((info, "; ".join(
            f"rank {r}: {msg.replace(layout.UNUSABLE_ADVICE, '').strip().rstrip('.')}"
            for r, msg, _, _ in failures)))
    if not skipped:
        return None
    raise CheckpointError(
        f"no committed checkpoint in {output_dir!r} verifies, so there is nothing to "
        f"resume from: {'; '.join(f'step {i.step} ({why})' for i, why in skipped)}. Repair "
        "them, or move them out of the output directory to start from scratch there (or "
        "use another output_dir).", path=output_dir, kind="corrupt")


def verify_everywhere(gang: Gang, info: layout.CheckpointInfo | None, *, output_dir: str,
                      verify_checksums: bool, verify: bool = True) -> list[Failure]:
    """Every rank checks ``info``'s files (with ``verify``); one collective makes every rank
    agree that they all look at the same step and learn which ranks found it bad. Returns
    ``[(rank, message, path, kind)]`` of the failures (empty: usable everywhere)."""
    step = info.step if info is not None else -1
    error: CheckpointError | None = None
    if info is not None and verify:
        try:
            manifest = layout.read_manifest(info.where)
            if manifest is None:
                raise CheckpointError(
                    f"checkpoint step {step} at {info.path!r} lost its {layout.MARKER} "
                    "marker after it was listed (rotated away by another job?).",
                    step=step, path=info.path, kind="missing")
            layout.verify_files(info.where, manifest, checksums=verify_checksums)
        except CheckpointError as e:
            error = e
        except OSError as e:  # a read that fails is as bad as a wrong checksum
            error = CheckpointError(f"checkpoint step {step}: reading {info.path!r} "
                                    f"failed: {e}", step=step, path=info.path, kind="corrupt")
    # max and -min of the step in one all-reduce: a disagreement is seen on every rank.
    high, neg_low, failed = gang.all_reduce_max([step, -step, int(error is not None)])
    if high != -neg_low:
        raise CheckpointError(
            f"ranks disagree on the checkpoint to resume from (this rank sees step {step}, "
            f"others between {-neg_low} and {high}); is {output_dir!r} on a filesystem "
            "shared by all ranks?", step=high, path=output_dir, kind="mismatch")
    if not failed:
        return []
    mine = None if error is None else (str(error), error.path, error.kind)
    return [(r, *g) for r, g in enumerate(gang.all_gather_object(mine)) if g is not None]


def raise_verification_failure(info: layout.CheckpointInfo, failures: list[Failure],
                               world_size: int) -> None:
    """Raise the first of ``failures`` (of a load with no fallback), naming which ranks found
    the checkpoint bad when there are several ranks."""
    rank, msg, bad, kind = failures[0]
    seen = "" if world_size == 1 else \
        f" (found by rank{'s' if len(failures) > 1 else ''} " \
        f"{', '.join(str(f[0]) for f in failures)})"
    raise CheckpointError(msg + seen, step=info.step, path=bad, kind=kind)


def quarantine(gang: Gang, info: layout.CheckpointInfo, why: str, *, output_dir: str) -> str:
    """Rank 0 moves a checkpoint that failed verification aside; every rank learns where to
    (or the error, raised on every rank: left in place it would shadow this run's save)."""
    moved: str | None = None
    error: str | None = None
    if gang.rank == 0:
        try:
            moved = layout.quarantine(info.where, f"step {info.step} failed verification "
                                      f"when a run resumed: {why}").url
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"{type(e).__name__}: {e}"
    moved, error = gang.broadcast_object((moved, error))
    if error is not None or moved is None:
        raise CheckpointError(
            f"checkpoint step {info.step} at {info.path!r} fails verification ({why}), and "
            f"moving it out of the way failed: {error}. Move it out of {output_dir!r} "
            "by hand (this run would otherwise skip its own save of that step as already "
            "committed), or resume from another checkpoint by path.",
            step=info.step, path=info.path, kind="corrupt")
    return moved


def check_no_foreign_checkpoints(start: int, source: layout.CheckpointInfo | None, *,
                                 out: Location, output_dir: str,
                                 resume_from: str | None) -> None:
    """Refuse to save into an ``output_dir`` that holds committed checkpoints of another
    trajectory at or after this run's start step ``start`` (a fresh start or a roll-back next
    to newer checkpoints): this run's save of such a step would be skipped as already done,
    and a restart with ``resume_from="auto"`` would load the other run's state. (With
    ``"auto"`` the source is the newest, so this never fires.) Same answer on every rank:
    the ranks agreed on ``source`` and read the same directory. Only for a run that saves."""
    foreign = [i.step for i in layout.list_committed(out)
               if i.step >= start and not (source is not None and
                                           same_place(i.where, source.where))]
    if foreign:
        # Under torchrun --max-restarts a restarted attempt meets its own earlier attempt's
        # checkpoints here, and every restart would fail the same way.
        restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        hint = (f" Under torchrun --max-restarts={restarts} a restarted attempt must resume "
                "from them: set `resume_from` to \"auto\" (the default)."
                if resume_from is None and restarts not in ("", "0") else "")
        raise CheckpointError(
            f"`output_dir` {output_dir!r} holds committed checkpoints at steps "
            f"{foreign}, at or after step {start} where this run starts (resume_from="
            f"{resume_from!r}); this run's saves of those steps would be skipped, and a "
            f"restart would resume from them instead of from this run. Move them out of "
            f"`output_dir`, or use another `output_dir`.{hint}",
            step=start, path=output_dir, kind="mismatch")
