"""A tiny published location built by hand from real exports, for the follower and
``recsys-serve`` tests: a DLRM trained 5 steps (a checkpoint per step), the export of step 1 as
``bases/b0``, the deltas 1 -> 3 (``deltas/d1``) and 3 -> 5 (``deltas/d2``), and the full exports
of steps 3 and 5 they reproduce (outside the location, the references)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import serving_utils as su

from recsys_trainer import storage
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving import published as pub


@dataclass
class Chain:
    root: str
    pub: str
    """The pristine published location (copy it before changing it: ``fresh_location``)."""
    full: dict[int, str]
    """Step -> a full export of that step (1 is ``bases/b0`` itself)."""
    hashes: dict[int, str]
    rows: pa.Table
    """Rows to score (the held-out window, edge rows included)."""
    expected: dict[int, np.ndarray]
    """Step -> the full export's scores of ``rows``, ``[rows, outputs]``."""

    def fresh_location(self, where: str) -> str:
        shutil.copytree(self.pub, where)
        return where

    def point(self, location: str | storage.Location, sequence: int, base: str, deltas: tuple[str, ...], step: int,
              *, check: bool = True, window: str | None = None) -> pub.Pointer:
        """Write ``LATEST`` naming ``base`` + ``deltas`` (whose end state is ``step``'s)."""
        p = pub.Pointer(sequence=sequence, base=base, deltas=deltas, step=step,
                        content_hash=self.hashes[step], window=window or f"hour={step:02d}",
                        window_time=1.7e9 + step, published_at=time.time())
        pub.write_pointer(location, p, check=check)
        return p

    def step_of(self, scores: np.ndarray) -> int | None:
        """The step whose full export gives exactly ``scores`` (None: none does)."""
        scores = scores.reshape(len(scores), -1)
        for step, want in self.expected.items():
            if scores.shape == want.shape and np.array_equal(scores, want):
                return step
        return None


_CACHE: dict[str, Chain] = {}


def build_chain(root: str) -> Chain:
    """The chain under ``root`` (built once per process: the module-scoped fixtures of the
    follower and server tests share it)."""
    if "chain" in _CACHE:
        return _CACHE["chain"]
    from recsys_trainer.serving import Scorer, export_delta, export_for_serving

    windows = su.write_data(os.path.join(root, "data"), "dlrm")
    su.make_trainer("dlrm", root, windows, steps=5, save_steps=1).train()
    ckpt = os.path.join(root, "ckpt")
    loc = os.path.join(root, "pub")
    spec, model = su.spec_and_model("dlrm")
    base = os.path.join(loc, "bases", "b0")
    export_for_serving(os.path.join(ckpt, "step_00000001"), base, model=model, features=spec)
    full = {1: base, 3: os.path.join(root, "full3"), 5: os.path.join(root, "full5")}
    export_delta(os.path.join(ckpt, "step_00000003"), base, os.path.join(loc, "deltas", "d1"),
                 full_out_dir=full[3], model=su.spec_and_model("dlrm")[1], features=spec)
    export_delta(os.path.join(ckpt, "step_00000005"), full[3], os.path.join(loc, "deltas", "d2"),
                 full_out_dir=full[5], model=su.spec_and_model("dlrm")[1], features=spec)
    rows = pq.read_table(windows[-1])
    hashes, expected = {}, {}
    for step, path in full.items():
        hashes[step] = mf.read_manifest(storage.resolve(path))["content_hash"]
        out = Scorer(path).score(rows)
        expected[step] = out.reshape(len(out), -1)
    assert len({e.tobytes() for e in expected.values()}) == 3, "the steps must score apart"
    chain = Chain(root=root, pub=loc, full=full, hashes=hashes, rows=rows, expected=expected)
    _CACHE["chain"] = chain
    return chain


def add_base(chain: Chain, location: str, name: str, step: int) -> str:
    """A copy of step ``step``'s full export as ``bases/<name>`` of ``location``."""
    ref = f"bases/{name}"
    shutil.copytree(chain.full[step], os.path.join(location, ref))
    return ref
