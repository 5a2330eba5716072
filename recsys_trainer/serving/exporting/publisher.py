"""The publisher: builds, uploads and points, one publish per committed checkpoint.

The serving side of online learning's write path: ``Publisher`` holds the published chain (the
pointer, and the full export of its state in a local staging directory) and turns each
checkpoint handed to it (a ``PublishJob``) into a base or a delta at the location, then
``LATEST``, and reports a ``PublishRecord``. It runs in the publisher process
(``publisher_client.run_publisher``: the pipe to the training job, both ends), or in the
training process with ``PublishHook(background=False)``. When a publish is due is
``recsys_trainer.hooks.publish.PublishHook``'s; the location's format is
``recsys_trainer.serving.published``; what a follower does with it, ``serving.runtime.follow``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any

import pyarrow.fs as pafs
from torch import nn

from recsys_trainer import storage
from recsys_trainer.checkpoint import layout
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.exporting.artifact import write_artifact
from recsys_trainer.serving.exporting.export import export_delta, export_for_serving
from recsys_trainer.serving.exporting.publisher_client import PublishJob, PublishRecord

logger = logging.getLogger(__name__)


class Publisher:
    """Builds, uploads and points: one publish per ``publish(job)``. Holds the chain (the
    current pointer, the full export of its state in ``stage``). Runs in the publisher process
    (or in the training process with ``background=False``)."""

    def __init__(self, *, location: str, filesystem: pafs.FileSystem | None, stage: str,
                 model: nn.Module, spec: Any, full_every: int, max_delta_fraction: float,
                 keep_bases: int, quantize: str | None, activation: str,
                 output_names: list[str] | None) -> None:
        self.location, self.filesystem, self.stage = location, filesystem, stage
        self.model, self.spec = model, spec
        self.full_every, self.max_delta_fraction = full_every, max_delta_fraction
        self.keep_bases = keep_bases
        self.opts: dict[str, Any] = {"model": model, "features": spec, "quantize": quantize,
                                     "activation": activation, "output_names": output_names}
        self.pointer: pub.Pointer | None = None
        self.history: list[pub.Pointer] = []
        self.sequence: int | None = None
        self.prev_full: str | None = None
        self.base_bytes = 0

    def publish(self, job: PublishJob) -> PublishRecord:
        """Publish ``job``'s checkpoint as a base or a delta, then rotate; never raises (a
        failure is a ``"failed"`` record)."""
        t0 = time.perf_counter()
        made: list[str] = []
        try:
            with layout.reading(job.checkpoint):
                kind, ref, n = self._publish(job, made)
        except Exception as e:  # noqa: BLE001 - reported; a publish never stops training
            for d in made:
                shutil.rmtree(d, ignore_errors=True)
            if isinstance(e, pub.PublishedError):
                # The location refused the pointer (an artifact of the chain is gone, or a newer
                # publisher wrote LATEST): no delta can continue this chain; the next is a base.
                self.pointer = None
            return PublishRecord.unpublished(
                job, "failed", f"{type(e).__name__}: {e}",
                sequence=self.sequence if self.sequence is not None else -1,
                seconds=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        rotation_error = None
        try:
            root = storage.resolve(self.location, self.filesystem)
            assert self.pointer is not None
            pub.rotate(root, self.keep_bases, self.pointer, history=self.history)
            kept = set(pub.list_artifacts(root))
            self.history = [p for p in self.history if p.base in kept]
        except Exception as e:  # noqa: BLE001 - rotation is tried again after the next publish
            rotation_error = f"{type(e).__name__}: {e}"
        assert self.sequence is not None
        return PublishRecord(self.sequence, kind, ref, job.step, job.window, n, seconds,
                             job.blocked_s, checkpoint=job.checkpoint,
                             rotation_error=rotation_error)

    def _publish(self, job: PublishJob, made: list[str]) -> tuple[str, str, int]:
        """Publish ``job`` (``made``: the local directories made, removed on a failure);
        ``(kind, ref, bytes uploaded)``."""
        root = storage.resolve(self.location, self.filesystem)
        if self.sequence is None:
            existing = pub.read_pointer(root)
            self.sequence = existing.sequence if existing is not None else 0
        self.sequence += 1  # never reused, even when this publish fails
        seq, step, window, window_time = self.sequence, job.step, job.window, job.window_time
        prev = self.pointer
        if prev is not None:
            lost = [ref for ref in (prev.base, *prev.deltas) if not pub.is_committed(root, ref)]
            if lost:
                # Deleted by hand or by another process: a delta on this chain could never be
                # followed (the pointer would name what is gone), so start a new one.
                logger.warning("the published chain lost %s; publishing a new base", lost)
                prev = None
        full_dir: str | None = None
        if prev is not None and self.prev_full is not None and len(prev.deltas) < self.full_every:
            name = pub.artifact_name(seq, step, prev.base.partition("/")[2])
            local_delta = os.path.join(self.stage, f"delta-{name}")
            full_dir = os.path.join(self.stage, f"full-{name}")
            made += [local_delta, full_dir]
            summary = export_delta(job.checkpoint, self.prev_full, local_delta,
                                   full_out_dir=full_dir, **self.opts)
            if summary.bytes <= self.max_delta_fraction * self.base_bytes:
                ref = f"{pub.DELTAS}/{name}"
                n = self._upload(local_delta, root, ref)
                shutil.rmtree(local_delta, ignore_errors=True)
                pointer = pub.Pointer(seq, prev.base, (*prev.deltas, ref), step,
                                      _content_hash(full_dir), window, window_time, time.time())
                self._write_pointer(root, pointer)
                self._commit(pointer, full_dir, None)
                return "delta", ref, n
            logger.info("the delta of step %d is %d bytes, over %.0f%% of the base's %d: "
                        "publishing a new base", step, summary.bytes,
                        100 * self.max_delta_fraction, self.base_bytes)
            shutil.rmtree(local_delta, ignore_errors=True)
        name = pub.artifact_name(seq, step)
        if full_dir is None:
            full_dir = os.path.join(self.stage, f"full-{name}")
            made.append(full_dir)
            export_for_serving(job.checkpoint, full_dir, **self.opts)
        ref = f"{pub.BASES}/{name}"
        n = self._upload(full_dir, root, ref)
        pointer = pub.Pointer(seq, ref, (), step, _content_hash(full_dir), window, window_time,
                              time.time())
        self._write_pointer(root, pointer)
        self._commit(pointer, full_dir, n)
        return "base", ref, n

    def _write_pointer(self, root: storage.Location, pointer: pub.Pointer) -> None:
        """``LATEST``, unless another publisher has written a newer one since (a job that
        restarted while this publisher finished): then a ``PublishedError``, and this one
        neither points nor rotates (its rotation would delete the newer chain)."""
        current = pub.read_pointer(root)
        if current is not None and current.sequence >= pointer.sequence:
            raise pub.PublishedError(
                f"{root.url!r} has a newer pointer (sequence {current.sequence}, step "
                f"{current.step}) than this publish (sequence {pointer.sequence}, step "
                f"{pointer.step}): another publisher writes there; this one stops pointing.")
        pub.write_pointer(root, pointer)

    def _commit(self, pointer: pub.Pointer, full_dir: str, base_bytes: int | None) -> None:
        """The publish is visible: its full state becomes the next delta's base."""
        if self.prev_full is not None and self.prev_full != full_dir:
            shutil.rmtree(self.prev_full, ignore_errors=True)
        self.prev_full = full_dir
        self.pointer = pointer
        self.history.append(pointer)
        if base_bytes is not None:
            self.base_bytes = base_bytes

    def _upload(self, local_dir: str, root: storage.Location, ref: str) -> int:
        """Copy the committed artifact ``local_dir`` to ``ref`` under the location with the
        artifacts' commit protocol (manifest, files, ``COMMITTED`` last); returns its bytes."""
        with open(os.path.join(local_dir, mf.MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
        files = {}
        for name in manifest["files"]:
            with open(os.path.join(local_dir, *name.split("/")), "rb") as f:
                files[name] = f.read()
        return write_artifact(pub.artifact_location(root, ref).url, manifest, files,
                              self.filesystem)


def _content_hash(full_dir: str) -> str:
    with open(os.path.join(full_dir, "manifest.json"), "rb") as f:
        return str(json.loads(f.read())["content_hash"])


__all__ = ["Publisher"]
