"""The churny id stream (``id_stream.ChurnStream``) as hourly parquet partitions: data to try
dynamic tables on files, as a job reads them.

    python -m recsys_trainer.data.generators.churn_dataset --out data/churn [--hours 12] [--rows-per-hour 20480]

Each window ``w`` of the stream is ``out/hour=HH/part-0.parquet`` with the columns ``label``,
``d0..d3`` (noise), ``user`` and ``item`` (raw 63-bit ids: declare them with
``num_embeddings=recsys_trainer.dynamic.ID_SPACE`` so that they reach a dynamic table unhashed;
``churn_features`` does) and ``device``: one of ``DEVICES``, a string with a planted effect of
its own (a small categorical, for a hashed table). The label is Bernoulli of
``sigmoid(stream logit + device effect)``. ``_signal.json`` holds the oracle AUC, scored by that
true logit, of each window and of windows ``1..`` together: what training on hour ``t`` and
evaluating on hour ``t + 1`` can reach at most.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from recsys_trainer.data.generators.generated import write_signal, write_whole, written_once
from recsys_trainer.data.generators.id_stream import ChurnStream
from recsys_trainer.data.inputs import DenseFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.dynamic.ids import ID_SPACE
from recsys_trainer.metrics import weighted_auc

DEVICES = ("ios", "android", "web", "tv", "tablet", "car")
"""The ``device`` column's values."""
DEVICE_TABLE_ROWS = 16
"""``churn_features``' hashed rows for ``device``."""
_CHUNK_ROWS = 4096


def churn_features(stream: ChurnStream | None = None) -> FeatureSpec:
    """The ``FeatureSpec`` of these files: the stream's ``user`` and ``item`` as raw ids (the id
    space, for dynamic tables), ``device`` hashed into ``DEVICE_TABLE_ROWS`` rows."""
    s = stream or ChurnStream()
    return FeatureSpec(
        labels=["label"],
        dense=[DenseFeature(column=f"d{i}") for i in range(s.num_dense)],
        sparse=[*(SparseFeature(name=f, num_embeddings=ID_SPACE) for f in s.features),
                SparseFeature(name="device", num_embeddings=DEVICE_TABLE_ROWS)])


def write_churn_dataset(out: str | os.PathLike[str], stream: ChurnStream,
                        rows_per_hour: int = 20_480) -> dict[str, Any]:
    """Write every window of ``stream`` under ``out`` (see the module docstring); returns (and
    writes) ``_signal.json``: ``oracle_auc`` over windows ``1..`` and ``oracle_auc_per_window``
    (``hour=HH`` -> the AUC of the true logit on that window's rows)."""
    if rows_per_hour < 1:
        raise ValueError(f"`rows_per_hour` must be >= 1, but is {rows_per_hour}.")
    root = Path(out)
    rng = np.random.default_rng([stream.seed, 0xDE])
    effect = rng.normal(0.0, 0.5, size=len(DEVICES))
    # The stream draws a window in batches at evenly spaced times: as many as 4096-row
    # chunks need, of equal size, so the rows spread over the whole hour.
    chunks = -(-rows_per_hour // _CHUNK_ROWS)
    size = -(-rows_per_hour // chunks)
    per_window: dict[str, float] = {}
    logits: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for w in range(stream.windows):
        batches = stream.window(w, chunks, size, seed=0)
        ids = torch.cat([b.sparse.values().view(2, -1) for b in batches], dim=1).numpy()
        dense = torch.cat([b.dense for b in batches]).numpy()
        n = rows_per_hour
        device = np.asarray(rng.integers(0, len(DEVICES), size=n))
        logit = torch.cat([b.passthrough["logit"] for b in batches]).numpy()[:n] + effect[device]
        label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        user, item = stream.features
        table = pa.table({"label": label, **{f"d{i}": dense[:n, i] for i in range(dense.shape[1])},
                          user: ids[0, :n], item: ids[1, :n],
                          "device": pa.array(np.asarray(DEVICES)[device])})
        part = root / f"hour={w:02d}"
        part.mkdir(parents=True, exist_ok=True)
        write_whole(part / "part-0.parquet", table, row_group_size=8192)
        per_window[part.name] = _auc(logit, label)
        if w > 0:
            logits.append(logit)
            labels.append(label)
    meta: dict[str, Any] = {
        "hours": stream.windows, "rows_per_hour": rows_per_hour,
        "num_users": stream.num_users, "num_items": stream.num_items, "seed": stream.seed,
        "oracle_auc": _auc(np.concatenate(logits), np.concatenate(labels)) if logits else None,
        "oracle_auc_per_window": per_window}
    write_signal(root, meta)
    return meta


def _auc(logit: np.ndarray, label: np.ndarray) -> float:
    return weighted_auc(torch.from_numpy(logit), torch.from_numpy(label), torch.ones(len(label)))


def ensure_churn_dataset(root: str | os.PathLike[str], stream: ChurnStream,
                         rows_per_hour: int) -> dict[str, Any]:
    """The dataset at ``root``'s ``_signal.json``, rank 0 writing the dataset first if it is
    missing (``generated.written_once``: join the job first). An existing dataset is reused as
    it is: delete it to change its size."""
    return written_once(root, lambda: write_churn_dataset(root, stream, rows_per_hour),
                        f"{stream.windows} hourly windows x {rows_per_hour} rows")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hours", type=int, default=12)
    ap.add_argument("--rows-per-hour", type=int, default=20_480)
    ap.add_argument("--ids", type=int, default=20_000, help="users, and items")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    stream = ChurnStream(num_users=a.ids, num_items=a.ids, windows=a.hours, seed=a.seed)
    print(json.dumps(write_churn_dataset(a.out, stream, a.rows_per_hour)))


__all__ = ["DEVICES", "DEVICE_TABLE_ROWS", "churn_features", "ensure_churn_dataset", "main",
           "write_churn_dataset"]


if __name__ == "__main__":
    main()
