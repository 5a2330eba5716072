"""Open Bandit Dataset (real ZOZOTOWN click log) -> hourly parquet partitions.

``python -m recsys_trainer.data.generators.open_bandit --out DIR`` reads the four 10,000-row
sample CSVs (``{random,bts}_{men,women}``) and writes
``DIR/dt=YYYY-MM-DD/hour=HH/part-<source>.parquet``: 168 hourly windows (2019-11-24 00h to
2019-11-30 23h, UTC), one file per source per hour (an hour with no rows from a source has no
file for it). Columns:

* ``row_id`` (int64, unique over the whole output), ``source`` (e.g. ``"random_men"``),
  ``timestamp`` (UTC, us), ``item_id``, ``position``, ``click`` (the label),
  ``propensity_score``,
* ``user_feature_0..3`` (hashed-hex strings), ``user_features`` (the four as a ``list<string>``:
  a multi-valued feature),
* ``affinity_0..45`` (float; the men campaign has 34 items, so its 34..45 are null).

``open_bandit_features()`` is a matching ``FeatureSpec``.

Where the CSVs come from: the samples ship inside the wheel of Open Bandit Pipeline, ``obp``
0.4.1 on the package registry (``obp/dataset/obd/{random,bts}/{men,women}/*.csv``; 1.3 MB).
``scripts/setup`` downloads that wheel once, without installing it (``fetch_sample``, or
``--fetch`` here), into ``cache_dir()``; the converter reads the CSVs straight from the zip, so
it never needs the network. ``--wheel FILE`` reads another copy of the wheel, ``--source DIR`` a
directory of the CSVs (``random_men_men.csv`` ..., or the wheel's ``random/men/men.csv`` layout,
as in the zr-obp repository's ``obd/`` directory).

The data: ZOZO, Inc.'s Open Bandit Dataset, published with Y. Saito, S. Aihara, M. Matsutani,
Y. Narita, "Open Bandit Dataset and Pipeline: Towards Realistic and Reproducible Off-Policy
Evaluation", NeurIPS 2021 Datasets and Benchmarks track (arXiv:2008.07146); cite it when you use
the data. The samples are distributed in the obp wheel under the Apache License 2.0 (the wheel's
``LICENSE``, copied next to the converted partitions). The full-size dataset
(https://research.zozo.com/data.html) is not used here.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recsys_trainer.data.inputs import DenseFeature, SparseFeature
from recsys_trainer.data.spec import FeatureSpec

SOURCES = ("random_men", "random_women", "bts_men", "bts_women")
NUM_AFFINITY = 46
NUM_USER_FEATURES = 4
OBP_VERSION = "0.4.1"
OBP_WHEEL = f"obp-{OBP_VERSION}-py3-none-any.whl"
OBP_WHEEL_SHA256 = "87dec9caf4283c25ab13036532e0a24566f1c7bdcad1653a8ded43b2f5ef8208"
_WHEEL_LICENSE = f"obp-{OBP_VERSION}.dist-info/LICENSE"


class OpenBanditSampleError(FileNotFoundError):
    """The Open Bandit sample is not here and cannot be fetched (or is not the expected one).
    The message says how to provide it: ``--wheel FILE`` or ``--source DIR``."""


def cache_dir() -> Path:
    """Where ``fetch_sample`` keeps the obp wheel: ``$XDG_CACHE_HOME/recsys_trainer``
    (``~/.cache/recsys_trainer`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recsys_trainer"


def _how_to_provide() -> str:
    names = ", ".join(f"{s}_{s.split('_')[1]}.csv" for s in SOURCES)
    return (f"Where the registry is reachable, run scripts/setup (or `python -m "
            f"recsys_trainer.data.generators.open_bandit --fetch`) once; elsewhere copy "
            f"{OBP_WHEEL} (`pip download --no-deps --only-binary=:all: --python-version 3.10 "
            f"obp=={OBP_VERSION}` on a machine that reaches the registry) and pass `--wheel FILE`, "
            f"or pass `--source DIR` with the four CSVs ({names})")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_wheel(path: Path) -> None:
    digest = _sha256(path)
    if digest != OBP_WHEEL_SHA256:
        raise OpenBanditSampleError(
            f"{path} is not the obp {OBP_VERSION} wheel the Open Bandit sample comes from (sha256 "
            f"{digest}, expected {OBP_WHEEL_SHA256}); delete it and fetch it again. "
            + _how_to_provide() + ".")


def fetch_sample(dest: str | os.PathLike[str] | None = None) -> Path:
    """Download the obp 0.4.1 wheel (the Open Bandit sample CSVs) with pip into ``dest``
    (default ``cache_dir()``), check its sha256, and return its path; a no-op when a checked
    copy is there. Only pip talks to the registry, with its usual configuration (``PIP_*``
    variables, pip.conf); nothing is installed. A registry that cannot be reached is an
    ``OpenBanditSampleError`` saying how to pass ``--wheel FILE`` or ``--source DIR`` instead."""
    folder = Path(dest) if dest is not None else cache_dir()
    target = folder / OBP_WHEEL
    if target.is_file():
        _check_wheel(target)
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
        # --python-version 3.10: obp 0.4.1's metadata refuses newer interpreters for
        # installing; a download of its pure-Python wheel is not an install.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.10", "--disable-pip-version-check", "--retries", "1",
               "--timeout", "30", "--dest", tmp, f"obp=={OBP_VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = Path(tmp) / OBP_WHEEL
        if done.returncode != 0 or not got.is_file():
            said = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise OpenBanditSampleError(
                f"could not download obp=={OBP_VERSION} (the Open Bandit sample) from the package "
                f"registry: pip exited {done.returncode}: {' | '.join(said)}. "
                + _how_to_provide() + " to `python -m recsys_trainer.data.generators.open_bandit`.")
        _check_wheel(got)
        os.replace(got, target)  # atomic: a cache never holds a half-written wheel
    return target


def _csv_bytes(sample: Path, source: str) -> bytes:
    """The CSV of ``source`` (e.g. ``"random_men"``) from a wheel or a directory."""
    policy, campaign = source.split("_")
    if sample.is_file():
        _check_wheel(sample)
        with zipfile.ZipFile(sample) as z:
            return z.read(f"obp/dataset/obd/{policy}/{campaign}/{campaign}.csv")
    candidates = [sample / f"{policy}_{campaign}_{campaign}.csv", sample / policy / campaign / f"{campaign}.csv"]
    for path in candidates:
        if path.is_file():
            return path.read_bytes()
    raise OpenBanditSampleError(
        f"the Open Bandit CSV of {source!r} is not in {sample} (looked for "
        f"{' and '.join(str(c) for c in candidates)}). " + _how_to_provide() + ".")


def _sample_path(sample: str | os.PathLike[str] | None) -> Path:
    if sample is not None:
        path = Path(sample)
        if not path.exists():
            raise OpenBanditSampleError(f"{path} does not exist. " + _how_to_provide() + ".")
        return path
    path = cache_dir() / OBP_WHEEL
    if not path.is_file():
        raise OpenBanditSampleError(
            f"the Open Bandit sample has not been fetched ({path} is missing). "
            + _how_to_provide() + ".")
    return path


def read_sample_csv(source: str, sample: str | os.PathLike[str] | None = None) -> bytes:
    """The raw CSV bytes of one sample (``source`` in ``SOURCES``) from ``sample``: the obp
    wheel, a directory of the CSVs, or (None) the wheel ``fetch_sample`` cached."""
    if source not in SOURCES:
        raise ValueError(f"`source` must be one of {list(SOURCES)}, but is {source!r}.")
    return _csv_bytes(_sample_path(sample), source)


def _read_source(sample: Path, source: str) -> pa.Table:
    t = pacsv.read_csv(io.BytesIO(_csv_bytes(sample, source)), convert_options=pacsv.ConvertOptions(
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


def convert(out_dir: str, sample: str | os.PathLike[str] | None = None, row_group_size: int = 64,
            sources: Sequence[str] = SOURCES) -> int:
    """Write the hourly partitions; returns the number of windows written. ``sample``: the obp
    wheel or a directory of the CSVs (default: the wheel ``fetch_sample`` cached)."""
    path = _sample_path(sample)
    tables = [_read_source(path, s) for s in sources]
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
    if path.is_file():  # the wheel's license travels with data converted from it
        with zipfile.ZipFile(path) as z, open(os.path.join(out_dir, "LICENSE.obp.txt"), "wb") as f:
            shutil.copyfileobj(z.open(_WHEEL_LICENSE), f)
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
    p.add_argument("--out", help="output directory for dt=/hour= partitions")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--source", metavar="DIR", help="a directory with the Open Bandit CSVs")
    where.add_argument("--wheel", metavar="FILE", help=f"a copy of {OBP_WHEEL}")
    p.add_argument("--fetch", action="store_true",
                   help=f"download {OBP_WHEEL} into {cache_dir()} (what scripts/setup runs)")
    p.add_argument("--row-group-size", type=int, default=64)
    a = p.parse_args(argv)
    if not a.fetch and a.out is None:
        p.error("--out is required (or --fetch)")
    try:
        if a.fetch:
            print(f"Open Bandit sample: {fetch_sample()}")
        if a.out is not None:
            n = convert(a.out, a.source or a.wheel, a.row_group_size)
            print(f"wrote {n} hourly windows under {a.out} (Open Bandit Dataset, ZOZO, Inc.; "
                  "Saito et al., NeurIPS 2021, arXiv:2008.07146; Apache-2.0 via obp)")
    except OpenBanditSampleError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


__all__ = ["NUM_AFFINITY", "NUM_USER_FEATURES", "OBP_VERSION", "OBP_WHEEL", "OBP_WHEEL_SHA256",
           "OpenBanditSampleError", "SOURCES", "cache_dir", "convert", "fetch_sample", "main",
           "open_bandit_features", "read_sample_csv"]


if __name__ == "__main__":
    main()
