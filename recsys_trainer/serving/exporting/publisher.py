"""The publisher: builds, uploads and points, one publish per committed checkpoint.

The serving side of online learning's write path: ``Publisher`` holds the published chain (the
pointer, and the full export of its state in a local staging directory) and turns each
checkpoint handed to it into a base or a delta at the location, then ``LATEST``; ``worker_main``
is the publisher process's loop around it (``python -m
recsys_trainer.serving.exporting._publish_worker``). The training side, when a publish is due
and how a checkpoint is handed over, is ``recsys_trainer.hooks.publish.PublishHook``; the
location's format is ``recsys_trainer.serving.published``; what a follower does with it,
``serving.runtime.follow``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import threading
import time
from typing import Any

import pyarrow.fs as pafs
import torch
from torch import nn

from recsys_trainer import storage
from recsys_trainer.checkpoint import layout
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.exporting.artifact import write_artifact
from recsys_trainer.serving.exporting.export import export_delta, export_for_serving

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

    def publish(self, job: dict[str, Any]) -> dict[str, Any]:
        """Publish ``job`` (``checkpoint``, ``step``, ``window``, ``window_time``: when that
        window landed, or None; ``blocked_s``); the record as a dict (``PublishRecord``'s
        fields). Never raises."""
        t0 = time.perf_counter()
        made: list[str] = []
        base = {"step": job["step"], "window": job["window"], "blocked_s": job["blocked_s"],
                "checkpoint": job["checkpoint"]}
        try:
            with layout.reading(job["checkpoint"]):
                rec = self._publish(job, made)
        except Exception as e:  # noqa: BLE001 - reported; a publish never stops training
            for d in made:
                shutil.rmtree(d, ignore_errors=True)
            if isinstance(e, pub.PublishedError):
                # The location refused the pointer (an artifact of the chain is gone, or a newer
                # publisher wrote LATEST): no delta can continue this chain; the next is a base.
                self.pointer = None
            return {**base, "sequence": self.sequence if self.sequence is not None else -1,
                    "kind": "failed", "ref": None, "bytes": 0,
                    "seconds": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"}
        rec.update(base, seconds=time.perf_counter() - t0, error=None)
        try:
            root = storage.resolve(self.location, self.filesystem)
            assert self.pointer is not None
            rec["rotated"] = pub.rotate(root, self.keep_bases, self.pointer, history=self.history)
            kept = set(pub.list_artifacts(root))
            self.history = [p for p in self.history if p.base in kept]
        except Exception as e:  # noqa: BLE001 - rotation is tried again after the next publish
            rec["rotation_error"] = f"{type(e).__name__}: {e}"
        return rec

    def _publish(self, job: dict[str, Any], made: list[str]) -> dict[str, Any]:
        root = storage.resolve(self.location, self.filesystem)
        if self.sequence is None:
            existing = pub.read_pointer(root)
            self.sequence = existing.sequence if existing is not None else 0
        self.sequence += 1  # never reused, even when this publish fails
        seq, step, window = self.sequence, int(job["step"]), job["window"]
        window_time = job.get("window_time")
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
            summary = export_delta(job["checkpoint"], self.prev_full, local_delta,
                                   full_out_dir=full_dir, **self.opts)
            if summary.bytes <= self.max_delta_fraction * self.base_bytes:
                ref = f"{pub.DELTAS}/{name}"
                n = self._upload(local_delta, root, ref)
                shutil.rmtree(local_delta, ignore_errors=True)
                pointer = pub.Pointer(seq, prev.base, (*prev.deltas, ref), step,
                                      _content_hash(full_dir), window, window_time, time.time())
                self._write_pointer(root, pointer)
                self._commit(pointer, full_dir, None)
                return {"sequence": seq, "kind": "delta", "ref": ref, "bytes": n}
            logger.info("the delta of step %d is %d bytes, over %.0f%% of the base's %d: "
                        "publishing a new base", step, summary.bytes,
                        100 * self.max_delta_fraction, self.base_bytes)
            shutil.rmtree(local_delta, ignore_errors=True)
        name = pub.artifact_name(seq, step)
        if full_dir is None:
            full_dir = os.path.join(self.stage, f"full-{name}")
            made.append(full_dir)
            export_for_serving(job["checkpoint"], full_dir, **self.opts)
        ref = f"{pub.BASES}/{name}"
        n = self._upload(full_dir, root, ref)
        pointer = pub.Pointer(seq, ref, (), step, _content_hash(full_dir), window, window_time,
                              time.time())
        self._write_pointer(root, pointer)
        self._commit(pointer, full_dir, n)
        return {"sequence": seq, "kind": "base", "ref": ref, "bytes": n}

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


PARENT_CHECK_S = 0.5
"""How often the publisher process checks that the training process that started it lives."""


def _exit_with_parent(parent: int) -> None:
    """End this process when ``parent`` is gone (reparented), even mid-publish: the publisher
    runs in a session of its own, out of reach of the signals that end the job, so it must not
    outlive it (a publish cut short leaves no pointer naming a partial artifact)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def worker_main(init_path: str) -> None:
    """The publisher process: jobs are JSON lines on stdin, records JSON lines on the original
    stdout (everything else it prints goes to stderr). When jobs queue up, only the newest is
    published (the others are answered ``superseded``). Ends at EOF, or when the training
    process that started it is gone."""
    parent = int(os.environ.get("RECSYS_PUBLISH_PARENT", os.getppid()))
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True,
                     name="recsys-publisher-parent").start()
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING,
                        format="%(levelname)s:publisher:%(name)s:%(message)s")
    logging.getLogger("recsys_trainer").setLevel(logging.INFO)
    # Background work: one thread, and a lower priority than the training process it serves.
    torch.set_num_threads(1)
    with contextlib.suppress(OSError):
        os.nice(10)
    init = torch.load(init_path, weights_only=False)
    publisher = Publisher(**init)
    buffer, eof = b"", False
    while not eof:
        if b"\n" not in buffer:
            data = os.read(0, 1 << 16)
            if not data:
                break
            buffer += data
        while select.select([0], [], [], 0)[0]:
            data = os.read(0, 1 << 16)
            if not data:
                eof = True
                break
            buffer += data
        *lines, buffer = buffer.split(b"\n")
        jobs = [json.loads(line) for line in lines if line.strip()]
        for old in jobs[:-1]:
            print(json.dumps({"sequence": -1, "kind": "superseded", "ref": None, "bytes": 0,
                              "seconds": 0.0, "step": old["step"], "window": old["window"],
                              "blocked_s": old["blocked_s"], "checkpoint": old["checkpoint"],
                              "error": None}), file=results, flush=True)
        if jobs:
            print(json.dumps(publisher.publish(jobs[-1])), file=results, flush=True)


__all__ = ["PARENT_CHECK_S", "Publisher", "worker_main"]
