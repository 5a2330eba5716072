"""Following a published location: ``Follower`` keeps a ``Scorer`` at the model a training job
publishes (``published.py``: ``bases/``, ``deltas/`` and the ``LATEST`` pointer).

Each poll reads ``LATEST``. When it names what is served, nothing happens. When it names the
served base with more deltas after the ones applied, those deltas are applied in order to a
``copy()`` of the served scorer; otherwise (another base, or a chain that does not continue the
served one) the pointer's base is loaded and its deltas applied. The new scorer is then
checked against the pointer (its content hash must be the pointer's) and swapped in by
replacing one reference: a ``score()`` running in another thread holds the old model until it
returns, and the next one gets the new model; none sees a half-applied delta.

Failures never make it serve a wrong model:

- a delta of the served chain that is missing or corrupt: the pointer's base and all its
  deltas are loaded instead (a log line names the delta); if the pointer's own chain is broken
  too, the last good model stays, with a ``FollowError`` (kind ``"delta"``) until the training
  job publishes a new base, which is loaded then;
- a base that cannot be read, a pointer that is corrupt or cannot be read, a store that cannot
  be reached: the last good model stays, with a ``FollowError`` naming what failed (kinds
  ``"base"``, ``"pointer"``, ``"storage"``), and the next poll tries again;
- a chain whose end is not the state the pointer names (kind ``"mismatch"``): not served.

``last_error`` is cleared by a poll that brings the served model to the pointer's state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow.fs as pafs

from recsys_trainer import storage
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.manifest import ArtifactError
from recsys_trainer.serving.published import Pointer, PublishedError, read_pointer
from recsys_trainer.serving.runtime.scorer import Rows, Scorer

logger = logging.getLogger(__name__)

ErrorKind = Literal["pointer", "storage", "base", "delta", "mismatch", "internal"]


class FollowError(ArtifactError):
    """Why the served model is not the one the published pointer names. ``kind``: ``"pointer"``
    (``LATEST`` corrupt or of another format), ``"storage"`` (the store cannot be read:
    unreachable, access denied, no such bucket),
    ``"base"`` (the pointer's base cannot be read or loaded), ``"delta"`` (a delta of the
    pointer's chain is missing, corrupt or out of order), ``"mismatch"`` (the chain does not
    end at the pointer's content hash), ``"internal"`` (anything else). ``sequence``: the
    pointer's, when it was read; ``at``: the unix time it happened."""

    def __init__(self, message: str, *, kind: ErrorKind, sequence: int | None = None) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.sequence = sequence
        self.at = time.time()

    def to_json(self) -> dict[str, Any]:
        return {"error": "FollowError", "kind": self.kind, "message": str(self),
                "sequence": self.sequence, "at": self.at}


class NoModelError(RuntimeError):
    """``score`` before any model was loaded (nothing published yet, or nothing readable)."""


@dataclass(frozen=True)
class Served:
    """What a ``Follower`` serves: the scorer and the pointer state it holds. Replaced whole on
    a swap, never changed."""

    scorer: Scorer
    sequence: int
    """The sequence of the pointer this state was loaded from."""
    base: str
    deltas: tuple[str, ...]
    """The pointer's ``bases/<name>`` and the ``deltas/<name>`` applied over it, in order."""
    step: int | None
    content_hash: str
    window: str | None
    window_time: float | None
    """The newest training window the model reflects and the unix time it landed."""
    published_at: float
    loaded_at: float
    """The unix time this state was swapped in."""

    def to_json(self) -> dict[str, Any]:
        return {"sequence": self.sequence, "step": self.step, "content_hash": self.content_hash,
                "window": self.window, "window_time": self.window_time,
                "published_at": self.published_at, "loaded_at": self.loaded_at,
                "base": self.base, "deltas": list(self.deltas),
                "outputs": list(self.scorer.output_names)}


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, ArtifactError | storage.StorageError) else \
        f"{type(e).__name__}: {e}"


class Follower:
    """Serves the model published at ``location`` (a path or URL; ``filesystem`` for explicit
    credentials), following its ``LATEST`` pointer.

    ``poll_once()`` polls now (tests, or a caller's own loop); ``start()`` polls every
    ``poll_s`` seconds in a daemon thread until ``stop()``. ``score(rows)`` is thread-safe and
    scores with the model served when it is called. ``served`` is what is served (None before
    the first load); ``last_error`` why the served model is not the pointer's (None when it is).
    ``verify``: check every file's sha256 against its manifest (default). ``retry_s``: a
    pointer that failed to load is tried again after this many seconds (default: every poll
    for the store/pointer errors, ``max(poll_s, 10)`` for a broken chain or base).
    ``on_swap(served)``: called in the polling thread after each swap.
    """

    def __init__(self, location: str | os.PathLike[str], *, poll_s: float = 2.0,
                 filesystem: pafs.FileSystem | None = None, verify: bool = True,
                 retry_s: float | None = None,
                 on_swap: Callable[[Served], None] | None = None) -> None:
        if not poll_s > 0:
            raise ValueError(f"`poll_s` must be > 0, but is {poll_s!r}.")
        self.root = storage.resolve(os.fspath(location), filesystem)
        self.location = self.root.url
        self.poll_s = float(poll_s)
        self.retry_s = max(self.poll_s, 10.0) if retry_s is None else float(retry_s)
        self.verify = verify
        self.on_swap = on_swap
        self._served: Served | None = None
        self.last_error: FollowError | None = None
        self.last_poll: float | None = None
        self._started_at = 0.0  # when start() started the polling thread
        """The unix time the last poll finished."""
        self.swaps = 0
        self._failed: tuple[Pointer, float] | None = None  # a pointer that failed, and when
        self._stale_seen: int | None = None  # the older pointer last warned about
        self._poll_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ serving

    @property
    def served(self) -> Served | None:
        return self._served

    @property
    def scorer(self) -> Scorer | None:
        s = self._served
        return None if s is None else s.scorer

    def score(self, rows: Rows, *, activation: str | None = None) -> np.ndarray:
        """``Scorer.score`` with the model served now; ``NoModelError`` before one is loaded."""
        return self.score_with_model(rows, activation=activation)[0]

    def score_with_model(self, rows: Rows, *, activation: str | None = None,
                         ) -> tuple[np.ndarray, Served]:
        """The scores and the state that scored them (one read of the served reference, so a
        swap during the call does not mix them up)."""
        served = self._served
        if served is None:
            why = f" ({self.last_error})" if self.last_error is not None else ""
            raise NoModelError(f"no model is served yet from {self.location!r}: nothing "
                               f"published there yet, or nothing readable{why}.")
        return served.scorer.score(rows, activation=activation), served

    # ------------------------------------------------------------------ polling

    def start(self) -> Follower:
        """Poll every ``poll_s`` seconds in a daemon thread (the first poll at once)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._started_at = time.time()
        self._thread = threading.Thread(target=self._run, name="recsys-follower", daemon=True)
        self._thread.start()
        return self

    def stalled_s(self) -> float | None:
        """Seconds since the polling thread last finished a poll (or started), when that is
        over ``max(3 * poll_s, 60)``: a read of the store that hangs (a stalled mount, a store
        that accepts and never answers) would otherwise leave ``last_error`` empty while the
        model silently ages. None when polling is on time or no thread polls."""
        if self._thread is None or not self._thread.is_alive():
            return None
        since = time.time() - max(self.last_poll or 0.0, self._started_at)
        return since if since > max(3 * self.poll_s, 60.0) else None

    def stop(self, timeout: float | None = 30.0) -> None:
        """End the polling thread (after the poll under way, if any)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 - the thread must go on polling
                logger.exception("following %s: the poll failed", self.location)
                self.last_error = FollowError(f"the poll of {self.location!r} failed: "
                                              f"{_describe(e)}", kind="internal")
            self._stop.wait(self.poll_s)

    def poll_once(self) -> bool:
        """Read the pointer and bring the served model to it; True when a new model was
        swapped in. Never raises for a store, pointer or artifact error: it is ``last_error``,
        and the last good model stays served."""
        with self._poll_lock:
            try:
                return self._poll()
            finally:
                self.last_poll = time.time()

    def _poll(self) -> bool:
        try:
            pointer = read_pointer(self.root)
        except PublishedError as e:
            return self._fail(f"the published pointer cannot be followed: {e}", "pointer", None)
        except (storage.StorageError, OSError) as e:
            return self._fail(f"the published pointer of {self.location!r} cannot be read: "
                              f"{_describe(e)}", "storage", None)
        if pointer is None:
            self.last_error = None  # nothing published yet: nothing wrong
            return False
        current = self._served
        if current is not None and pointer.sequence < current.sequence \
                and pointer.published_at <= current.published_at:
            # An older pointer than the one served (a stale publisher that outlived its job
            # wrote it): never go back. A location started over has newer publish times.
            if self._stale_seen != pointer.sequence:
                self._stale_seen = pointer.sequence
                logger.warning("following %s: the pointer went back to sequence %d (published "
                               "%.0f s before the served sequence %d); keeping the served model",
                               self.location, pointer.sequence,
                               current.published_at - pointer.published_at, current.sequence)
            return False
        if current is not None and pointer.content_hash == current.content_hash:
            # The state served (a content hash names it exactly), perhaps republished under
            # another sequence or window, or as a base of its own: only what is said of it moves.
            if _served(current.scorer, pointer, current.loaded_at) != current:
                self._swap(_served(current.scorer, pointer, current.loaded_at), log=False)
            self.last_error = None
            self._failed = None
            return False
        if self._failed is not None and self._failed[0] == pointer \
                and time.time() - self._failed[1] < self.retry_s:
            return False  # this pointer failed a moment ago; its error stands
        t0 = time.perf_counter()
        scorer = self._load(pointer, current)
        if scorer is None:
            return False
        if scorer.content_hash != pointer.content_hash:
            return self._fail(
                f"the chain {pointer.base} + {len(pointer.deltas)} delta(s) of {self.location!r} "
                f"ends at content hash {scorer.content_hash[:12]} (step {scorer.step}), but the "
                f"pointer (sequence {pointer.sequence}) says {pointer.content_hash[:12]} (step "
                f"{pointer.step}); not serving it.", "mismatch", pointer)
        self._swap(_served(scorer, pointer), seconds=time.perf_counter() - t0)
        return True

    def _load(self, pointer: Pointer, current: Served | None) -> Scorer | None:
        """The scorer of ``pointer``'s state, or None (``last_error`` set)."""
        base_loc, delta_locs = pub.chain(self.root, pointer)
        refs = list(pointer.deltas)
        if current is not None and pointer.base == current.base \
                and tuple(refs[:len(current.deltas)]) == current.deltas:
            # The served chain continues: the new deltas onto a copy of the served scorer.
            n = len(current.deltas)
            scorer = current.scorer.copy()
            try:
                for ref, loc in zip(refs[n:], delta_locs[n:], strict=True):
                    self._apply(scorer, ref, loc)
                return scorer
            except ArtifactError as e:
                logger.warning("following %s: %s; loading the pointer's base %s and its %d "
                               "delta(s) instead", self.location, e, pointer.base, len(refs))
        # Another base, or the served chain broke: the pointer's base, then all its deltas.
        try:
            scorer = Scorer(base_loc.url, filesystem=base_loc.filesystem, verify=self.verify)
        except (ArtifactError, storage.StorageError, OSError, RuntimeError, ValueError,
                KeyError) as e:
            self._fail(f"the base {pointer.base} of {self.location!r} (pointer sequence "
                       f"{pointer.sequence}) cannot be loaded: {_describe(e)}; "
                       f"{self._keeping()}", "base", pointer)
            return None
        try:
            for ref, loc in zip(refs, delta_locs, strict=True):
                self._apply(scorer, ref, loc)
        except ArtifactError as e:
            self._fail(f"{e}; {self._keeping()} until the training job publishes a new base",
                       "delta", pointer)
            return None
        return scorer

    def _apply(self, scorer: Scorer, ref: str, loc: storage.Location) -> None:
        """``apply_delta``, its failures as an ``ArtifactError`` naming the delta."""
        try:
            scorer.apply_delta(loc.url, filesystem=loc.filesystem)
        except (ArtifactError, storage.StorageError, OSError, RuntimeError, ValueError,
                KeyError) as e:
            raise ArtifactError(f"the delta {ref} of {self.location!r} is missing, corrupt or "
                                f"out of order ({_describe(e)})") from e

    def _keeping(self) -> str:
        s = self._served
        if s is None:
            return "no model is served"
        return f"serving the last good model (sequence {s.sequence}, step {s.step})"

    def _fail(self, message: str, kind: ErrorKind, pointer: Pointer | None) -> bool:
        error = FollowError(message, kind=kind,
                            sequence=None if pointer is None else pointer.sequence)
        if self.last_error is None or str(self.last_error) != message:
            logger.error("following %s: %s", self.location, message)
        self.last_error = error
        if pointer is not None:
            self._failed = (pointer, time.time())
        return False

    def _swap(self, served: Served, *, seconds: float | None = None, log: bool = True) -> None:
        previous = self._served
        self._served = served  # the swap: one reference, read once per score()
        self.last_error = None
        self._failed = None
        self.swaps += 1
        if log:
            how = ("loaded" if previous is None or previous.base != served.base
                   else f"+{len(served.deltas) - len(previous.deltas)} delta(s)")
            logger.info("following %s: serving sequence %d, step %s, %s%s (%s%s)",
                        self.location, served.sequence, served.step, served.base,
                        f" + {len(served.deltas)} delta(s)" if served.deltas else "", how,
                        "" if seconds is None else f", {seconds:.2f} s")
        if self.on_swap is not None:
            self.on_swap(served)


def follow(location: str | os.PathLike[str], *, poll_s: float = 2.0, start: bool = True,
           **kwargs: Any) -> Follower:
    """A ``Follower`` of the published location ``location`` (a path or URL a training job
    publishes to): it has polled once (a model is loaded when one was published and readable),
    and with ``start`` polls every ``poll_s`` seconds in a background thread (``stop()`` ends
    it). ``kwargs``: ``Follower``'s (``filesystem``, ``verify``, ...)."""
    follower = Follower(location, poll_s=poll_s, **kwargs)
    follower.poll_once()
    if start:
        follower.start()
    return follower


def _served(scorer: Scorer, pointer: Pointer, loaded_at: float | None = None) -> Served:
    return Served(scorer=scorer, sequence=pointer.sequence, base=pointer.base,
                  deltas=tuple(pointer.deltas), step=scorer.step,
                  content_hash=scorer.content_hash, window=pointer.window,
                  window_time=pointer.window_time, published_at=pointer.published_at,
                  loaded_at=time.time() if loaded_at is None else loaded_at)


__all__ = ["ErrorKind", "FollowError", "Follower", "NoModelError", "Served", "follow"]
