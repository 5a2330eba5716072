"""Open Bandit Dataset (real ZOZOTOWN click log) -> hourly parquet partitions.

``python -m recsys_trainer.data.open_bandit --out DIR`` reads the four 10,000-row sample CSVs
(``{random,bts}_{men,women}``) and writes ``DIR/dt=YYYY-MM-DD/hour=HH/part-<source>.parquet``:
168 hourly windows (2019-11-24 00h to 2019-11-30 23h, UTC), one file per source per hour (an
hour with no rows from a source has no file for it). Columns:

* ``row_id`` (int64, unique over the whole output), ``source`` (e.g. ``"random_men"``),
  ``timestamp`` (UTC, us), ``item_id``, ``position``, ``click`` (the label),
  ``propensity_score``,
* ``user_feature_0..3`` (hashed-hex strings), ``user_features`` (the four as a ``list<string>``:
  a multi-valued feature),
* ``affinity_0..45`` (float; the men campaign has 34 items, so its 34..45 are null).

``open_bandit_features()`` is a matching ``FeatureSpec``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_trainer.data.features import DenseFeature, FeatureSpec, SparseFeature

DEFAULT_SOURCE = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "data", "open_bandit"
)
SOURCES = ("random_men", "random_women", "bts_men", "bts_women")
NUM_AFFINITY = 46
NUM_USER_FEATURES = 4


def _read_source(src_dir: str, source: str) -> pa.Table:
    policy, campaign = source.split("_")
    path = os.path.join(src_dir, f"{policy}_{campaign}_{campaign}.csv")
    if not os.path.exists(path):
        raise FileNotFoundError(f"Open Bandit file {path} is missing; pass --source DIR.")
    t = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
        column_types={"timestamp": pa.timestamp("us", tz="UTC")} | {
            f"user_feature_{i}": pa.string() for i in range(NUM_USER_FEATURES)},
    ))
    n = t.num_rows
    cols: dict[str, pa.Array | pa.ChunkedArray] = {
        "source": pa.array([source] * n, pa.string()),
        "timestamp": t["timestamp"],
        "item_id": t["item_id"].cast(pa.int64()),
        "position": t["position"].cast(pa.int64()),
        "click": t["click"].cast(pa.int64()),
        "propensity_score": t["propensity_score"].cast(pa.float64()),
    }
    for i in range(NUM_USER_FEATURES):
        cols[f"user_feature_{i}"] = t[f"user_feature_{i}"]
    # The four user features as one list<string> column: a multi-valued (jagged) feature.
    flat = pa.chunked_array([pa.concat_arrays([
        t[f"user_feature_{i}"].combine_chunks() for i in range(NUM_USER_FEATURES)])])
    order = np.arange(n * NUM_USER_FEATURES).reshape(NUM_USER_FEATURES, n).T.reshape(-1)
    cols["user_features"] = pa.ListArray.from_arrays(
        pa.array(np.arange(0, n * NUM_USER_FEATURES + 1, NUM_USER_FEATURES, dtype=np.int32)),
        flat.combine_chunks().take(pa.array(order)),
    )
    for i in range(NUM_AFFINITY):
        name = f"user-item_affinity_{i}"
        cols[f"affinity_{i}"] = (t[name].cast(pa.float32()) if name in t.column_names
                                 else pa.nulls(n, pa.float32()))
    return pa.table(cols)


def convert(out_dir: str, source_dir: str = DEFAULT_SOURCE, row_group_size: int = 64,
            sources: Sequence[str] = SOURCES) -> int:
    """Write the hourly partitions; returns the number of windows written."""
    tables = [_read_source(source_dir, s) for s in sources]
    table = pa.concat_tables(tables)
    row_id = pa.array(np.arange(table.num_rows, dtype=np.int64))
    table = table.add_column(0, "row_id", row_id)
    hours = pc.floor_temporal(table["timestamp"], unit="hour")
    hour_us = hours.cast(pa.int64()).to_numpy()
    windows = 0
    for h in np.unique(hour_us):
        ts = np.datetime64(int(h), "us").astype("datetime64[s]").item()
        part = os.path.join(out_dir, f"dt={ts:%Y-%m-%d}", f"hour={ts:%H}")
        os.makedirs(part, exist_ok=True)
        in_hour = hour_us == h
        for s in sources:
            mask = in_hour & (table["source"].to_numpy(zero_copy_only=False) == s)
            if mask.any():
                pq.write_table(table.filter(pa.array(mask)), os.path.join(part, f"part-{s}.parquet"),
                               row_group_size=row_group_size)
        windows += 1
    return windows


def open_bandit_features(num_embeddings: int = 1000) -> FeatureSpec:
    """Label ``click``; dense propensity, position and 46 affinities (null -> 0); sparse item,
    position, source, the four hashed user features and their multi-valued list."""
    return FeatureSpec(
        labels=["click"],
        dense=[DenseFeature(column="propensity_score"),
               *(DenseFeature(column=f"affinity_{i}") for i in range(NUM_AFFINITY))],
        sparse=[
            SparseFeature(name="item_id", num_embeddings=64),
            SparseFeature(name="position", num_embeddings=4),
            SparseFeature(name="source", num_embeddings=16),
            *(SparseFeature(name=f"user_feature_{i}", num_embeddings=num_embeddings)
              for i in range(NUM_USER_FEATURES)),
            SparseFeature(name="user_features", num_embeddings=num_embeddings),
        ],
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory for dt=/hour= partitions")
    p.add_argument("--source", default=DEFAULT_SOURCE, help="directory with the Open Bandit CSVs")
    p.add_argument("--row-group-size", type=int, default=64)
    a = p.parse_args(argv)
    n = convert(a.out, os.path.abspath(a.source), a.row_group_size)
    print(f"wrote {n} hourly windows under {a.out}")


if __name__ == "__main__":
    main()
