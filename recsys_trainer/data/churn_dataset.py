"""The churny id stream (``id_stream.ChurnStream``) as hourly parquet partitions: data to try
dynamic tables on files, as a job reads them.

    python -m recsys_trainer.data.churn_dataset --out data/churn [--hours 12] [--rows-per-hour 20480]

Each window ``w`` of the stream is ``out/hour=HH/part-0.parquet`` with the columns ``label``,
``d0..d3`` (noise), ``user`` and ``item`` (raw 63-bit ids: declare them with
``num_embeddings=recsys_trainer.dynamic.ID_SPACE`` so that they reach a dynamic table unhashed;
``churn_features`` does) and ``device``: one of ``DEVICES``, a string with a planted effect of
its own (a small categorical, for a hashed table). The label is Bernoulli of
``sigmoid(stream logit + device effect)``. ``_signal.json`` holds the oracle AUC of windows
``1..`` scored by that true logit: what training on hour ``t`` and evaluating on hour ``t + 1``
can reach at most.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from recsys_trainer.data.id_stream import ChurnStream
from recsys_trainer.data.inputs import DenseFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.dynamic.ids import ID_SPACE
from recsys_trainer.metrics import weighted_auc

log = logging.getLogger(__name__)

DEVICES = ("ios", "android", "web", "tv", "tablet", "car")
"""The ``device`` column's values."""
DEVICE_TABLE_ROWS = 16
"""``churn_features``' hashed rows for ``device``."""
_CHUNK_ROWS = 4096


def churn_features(stream: ChurnStream | None = None) -> FeatureSpec:
    """The ``FeatureSpec`` of these files: ``user`` and ``item`` as raw ids (the id space, for
    dynamic tables), ``device`` hashed into ``DEVICE_TABLE_ROWS`` rows."""
    s = stream or ChurnStream()
    return FeatureSpec(
        labels=["label"],
        dense=[DenseFeature(column=f"d{i}") for i in range(s.num_dense)],
        sparse=[SparseFeature(name="user", num_embeddings=ID_SPACE),
                SparseFeature(name="item", num_embeddings=ID_SPACE),
                SparseFeature(name="device", num_embeddings=DEVICE_TABLE_ROWS)])


def write_churn_dataset(out: str | os.PathLike[str], stream: ChurnStream,
                        rows_per_hour: int = 20_480) -> dict[str, Any]:
    """Write every window of ``stream`` under ``out`` (see the module docstring); returns (and
    writes) ``_signal.json``."""
    if rows_per_hour < 1:
        raise ValueError(f"`rows_per_hour` must be >= 1, but is {rows_per_hour}.")
    root = Path(out)
    rng = np.random.default_rng([stream.seed, 0xDE])
    effect = rng.normal(0.0, 0.5, size=len(DEVICES))
    logits: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for w in range(stream.windows):
        chunks = -(-rows_per_hour // _CHUNK_ROWS)
        batches = stream.window(w, chunks, _CHUNK_ROWS, seed=0)
        ids = np.concatenate([b.sparse.values().view(2, -1).numpy() for b in batches], axis=1)
        dense = torch.cat([b.dense for b in batches]).numpy()
        device = np.asarray(rng.integers(0, len(DEVICES), size=ids.shape[1]))
        logit = torch.cat([b.passthrough["logit"] for b in batches]).numpy() + effect[device]
        label = (rng.random(len(logit)) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        n = rows_per_hour
        table = pa.table({"label": label[:n],
                          **{f"d{i}": dense[:n, i] for i in range(dense.shape[1])},
                          "user": ids[0, :n], "item": ids[1, :n],
                          "device": pa.array(np.asarray(DEVICES)[device[:n]])})
        part = root / f"hour={w:02d}"
        part.mkdir(parents=True, exist_ok=True)
        tmp = part / "part-0.parquet.tmp"
        pq.write_table(table, tmp, row_group_size=8192)
        tmp.replace(part / "part-0.parquet")  # a reader never sees a half-written file
        if w > 0:
            logits.append(logit[:n])
            labels.append(label[:n])
    y = torch.from_numpy(np.concatenate(labels)) if labels else torch.zeros(0)
    meta: dict[str, Any] = {
        "hours": stream.windows, "rows_per_hour": rows_per_hour,
        "num_users": stream.num_users, "num_items": stream.num_items, "seed": stream.seed,
        "ctr": float(y.mean()) if len(y) else None,
        "oracle_auc": weighted_auc(torch.from_numpy(np.concatenate(logits)), y, torch.ones(len(y)))
        if len(y) else None}
    (root / "_signal.json").write_text(json.dumps(meta, indent=1))
    return meta


def ensure_churn_dataset(root: str | os.PathLike[str], stream: ChurnStream,
                         rows_per_hour: int) -> dict[str, Any]:
    """Rank 0 writes the dataset if ``root/_signal.json`` is missing while the other ranks wait
    at a barrier (join the job first); returns ``_signal.json``. An existing dataset is reused
    as it is: delete it to change its size."""
    meta_file = Path(root) / "_signal.json"
    if int(os.environ.get("RANK", "0")) == 0 and not meta_file.exists():
        log.info("writing %d hourly windows x %d rows to %s", stream.windows, rows_per_hour, root)
        write_churn_dataset(root, stream, rows_per_hour)
    if dist.is_initialized():
        dist.barrier()
    meta: dict[str, Any] = json.loads(meta_file.read_text())
    return meta


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


if __name__ == "__main__":
    main()
