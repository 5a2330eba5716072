"""Windows on object storage against a real S3 server (SeaweedFS on 127.0.0.1, tests/s3_server.py):
listing, globs, ranged reads, errors that name the URL, and 2-rank training over a bucket,
including a partition uploaded while the job waits."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from data_utils import row_id_spec, row_ids, write_windows
from dist_utils import run_distributed
from s3_server import S3Server, upload_dir

from recsys_trainer.data.errors import DataError
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import StreamingWindows, Window, glob_windows, partitioned_windows
from recsys_trainer.hooks.lambda_hook import LambdaHook
from recsys_trainer.storage import StorageError


def test_s3_server_round_trips_a_multipart_parquet_file(s3_server: S3Server) -> None:
    """The fixture's identity lets pyarrow write (multipart) and read back a parquet file, and
    list it; the fixture is what every other object-storage test stands on."""
    fs = s3_server.filesystem()
    table = pa.table({"a": pa.array(range(300_000), pa.int64())})
    key = f"{s3_server.bucket}/fixture/t.parquet"
    pq.write_table(table, key, filesystem=fs)
    assert pq.read_table(key, filesystem=fs).equals(table)
    listed = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{s3_server.bucket}/fixture"))]
    assert listed == [key]


def _upload_windows(server: S3Server, local: str, prefix: str, rows: list[list[int]],
                    row_group_size: int = 8) -> int:
    total = write_windows(local, rows, row_group_size=row_group_size)
    upload_dir(server.filesystem(), local, f"{server.bucket}/{prefix}")
    return total


def _all_rows(ds: ParquetWindowDataset, world_size: int) -> list[list[list[int]]]:
    """Per window, per rank: the row ids that rank reads."""
    out = []
    for w in list(ds.window_ids()):
        per_rank = []
        for r in range(world_size):
            ds.setup(r, world_size)
            per_rank.append([i for b in ds.iter_window(w) for i in row_ids(b)])
        out.append(per_rank)
    return out


def test_windows_in_a_bucket_list_and_read_like_the_same_files_on_local_disk(
        s3_server: S3Server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = str(tmp_path / "local")
    _upload_windows(s3_server, local, "same", [[12, 5], [9], [20, 3]], row_group_size=4)
    # Not windows: a writer's temporary directory and a data-less partition marker.
    fs = s3_server.filesystem()
    with fs.open_output_stream(f"{s3_server.bucket}/same/_temporary/x/part-9.parquet") as f:
        f.write(b"junk")
    url = s3_server.url("same")

    # The standard AWS environment (endpoint included) is enough for an s3:// URL.
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    remote = partitioned_windows(url)
    assert [w.id for w in remote] == [w.id for w in partitioned_windows(local)]
    assert remote[0].files == (f"{url}/hour=00/part-0.parquet", f"{url}/hour=00/part-1.parquet")
    s3_rows = _all_rows(ParquetWindowDataset(url, row_id_spec(), batch_size=4, shuffle=True, seed=3), 2)
    local_rows = _all_rows(ParquetWindowDataset(local, row_id_spec(), batch_size=4, shuffle=True, seed=3), 2)
    assert s3_rows == local_rows and sum(len(r) for w in s3_rows for r in w) == 49

    # An explicit filesystem (no environment needed): paths are bucket/prefix inside it.
    for k in s3_server.env():
        monkeypatch.delenv(k)
    explicit = ParquetWindowDataset(f"{s3_server.bucket}/same", row_id_spec(), batch_size=4,
                                    shuffle=True, seed=3, filesystem=fs)
    assert _all_rows(explicit, 2) == local_rows

    # Globs: one window per pattern, matched per path component (``**``: any depth).
    ws = glob_windows({"a": f"{s3_server.bucket}/same/hour=0[02]/part-1.parquet",
                       "b": f"{s3_server.bucket}/same/**/part-0.parquet",
                       "none": f"{s3_server.bucket}/same/hour=7*/*.parquet"}, filesystem=fs)
    assert [(w.id, len(w.files)) for w in ws] == [("a", 2), ("b", 3)]
    assert ws[0].files == (f"{s3_server.bucket}/same/hour=00/part-1.parquet",
                           f"{s3_server.bucket}/same/hour=02/part-1.parquet")


def test_a_rank_downloads_only_the_byte_ranges_of_its_rows(s3_server: S3Server, tmp_path) -> None:
    """Row-group reads are ranged requests: a rank reading a tenth of a file's rows (its row
    groups plus the footer) downloads a small part of the file, not the file."""
    fs = s3_server.filesystem()
    n = 200_000
    rng = np.random.default_rng(0)
    table = pa.table({"row_id": np.arange(n, dtype=np.int64), "y": rng.random(n, dtype=np.float32),
                      "item": rng.integers(0, 100, n), "tag": pa.array(["t"] * n)})
    key = f"{s3_server.bucket}/ranged/hour=00/part-0.parquet"
    pq.write_table(table, key, filesystem=fs, row_group_size=10_000)
    size = fs.get_file_info(key).size
    ds = ParquetWindowDataset(s3_server.url("ranged"), row_id_spec(), batch_size=1000,
                              sharding="row_groups", filesystem=fs)
    ds.setup(3, 10)
    before = s3_server.bytes_sent()
    got = [i for b in ds.iter_window(next(iter(ds.window_ids()))) for i in row_ids(b)]
    sent = s3_server.bytes_sent() - before
    assert got == list(range(30_000, 40_000)) + list(range(130_000, 140_000))
    assert sent < 0.3 * size, f"downloaded {sent:.0f} of {size} bytes for a tenth of the rows"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_missing_bucket_wrong_credentials_and_unreachable_endpoint_name_the_url_in_seconds(
        s3_server: S3Server, tmp_path) -> None:
    fs = s3_server.filesystem()
    cases = [
        ("missing_bucket", "s3://no-such-bucket/windows", fs),
        ("denied", s3_server.url("same"), s3_server.filesystem(access_key="nobody", secret_key="x")),
        ("denied", s3_server.url("same"), s3_server.filesystem(secret_key="wrong-secret")),
        ("unreachable", s3_server.url("same"), pafs.S3FileSystem(
            endpoint_override=f"http://127.0.0.1:{_closed_port()}", access_key="a", secret_key="b",
            region="us-east-1", retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3))),
    ]
    for kind, url, filesystem in cases:
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            list(ParquetWindowDataset(url, row_id_spec(), batch_size=4, filesystem=filesystem).window_ids())
        assert time.monotonic() - t0 < 10, kind
        assert info.value.kind == kind and info.value.url == url, (kind, str(info.value))
        assert url in str(info.value)
    # A file that cannot be read for lack of access is an error naming it, never skipped as corrupt.
    _upload_windows(s3_server, str(tmp_path / "w"), "denied-read", [[4]])
    key = f"{s3_server.bucket}/denied-read/hour=00/part-0.parquet"
    bad = s3_server.filesystem(secret_key="wrong-secret")
    ds = ParquetWindowDataset([Window("w", (key,))], row_id_spec(), batch_size=4, filesystem=bad,
                              on_corrupt="skip")
    with pytest.raises(DataError, match=f"{key}.*access denied"):
        list(ds.iter_window("w"))


def test_env_endpoint_that_is_down_fails_listing_within_the_bounded_retry(monkeypatch) -> None:
    """Credentials and endpoint from the environment, endpoint down: the bounded retry ends in
    seconds with an error naming the URL and the variable to check."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"cannot access s3://bucket/prefix: .*AWS_ENDPOINT_URL"):
        partitioned_windows("s3://bucket/prefix")
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------- 2 ranks over a bucket

def _train_worker(source: str | StreamingWindows, signal_after: str | None = None) -> dict[str, Any]:
    from test_data_distributed import _trainer

    from recsys_trainer.storage import resolve

    seen: list[int] = []
    windows: list[str] = []

    def after_window(t: Any, w: str) -> None:
        windows.append(w)
        if signal_after is not None and t.is_rank_zero:
            loc = resolve(signal_after)
            with loc.filesystem.open_output_stream(f"{loc.path}/{w}") as f:
                f.write(b"trained")

    hook = LambdaHook(after_data=lambda t, b: seen.extend(row_ids(b)), after_window=after_window)
    ds = ParquetWindowDataset(source, row_id_spec(), batch_size=4)
    trainer = _trainer(row_id_spec(), ds, hooks=[hook])
    trainer.train()
    return {"seen": seen, "windows": windows, "steps": trainer.state.global_step,
            "unread": trainer.state.rows_unread}


@pytest.mark.distributed
def test_two_ranks_train_over_windows_in_a_bucket_reading_every_row_once(
        s3_server: S3Server, tmp_path) -> None:
    total = _upload_windows(s3_server, str(tmp_path), "train2", [[16, 16], [24], [8]])
    r0, r1 = run_distributed(_train_worker, 2, timeout_s=180, args=(s3_server.url("train2"),),
                             env=s3_server.env())
    assert r0["windows"] == r1["windows"] == ["hour=00", "hour=01", "hour=02"]
    assert r0["steps"] == r1["steps"] == 4 + 3 + 1
    everything = r0["seen"] + r1["seen"]
    assert sorted(everything) == list(range(total)) and r0["unread"] == r1["unread"] == 0


@pytest.mark.distributed
def test_a_partition_uploaded_while_the_job_waits_is_trained(s3_server: S3Server, tmp_path) -> None:
    fs = s3_server.filesystem()
    prefix = f"{s3_server.bucket}/stream"
    write_windows(str(tmp_path / "w"), [[8], [12]])
    upload_dir(fs, str(tmp_path / "w" / "hour=00"), f"{prefix}/hour=00")
    with fs.open_output_stream(f"{prefix}/hour=00/_SUCCESS"):
        pass
    progress = s3_server.url("stream-progress")

    def producer() -> None:
        # Once the job reports hour=00 trained, the next hour lands: files first, marker last.
        deadline = time.monotonic() + 120
        while fs.get_file_info(f"{s3_server.bucket}/stream-progress/hour=00").type == pafs.FileType.NotFound:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        upload_dir(fs, str(tmp_path / "w" / "hour=01"), f"{prefix}/hour=01")
        with fs.open_output_stream(f"{prefix}/hour=01/_SUCCESS"):
            pass
        time.sleep(1.0)
        with fs.open_output_stream(f"{prefix}/_END"):
            pass

    url = s3_server.url("stream")
    stream = StreamingWindows(_ReadyPartitions(url), end_marker=f"{url}/_END",
                              poll_interval_s=0.2, timeout_s=60)
    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    r0, r1 = run_distributed(_train_worker, 2, timeout_s=180, args=(stream, progress),
                             env=s3_server.env())
    thread.join(5)
    assert r0["windows"] == r1["windows"] == ["hour=00", "hour=01"]
    assert sorted(r0["seen"] + r1["seen"]) == list(range(20))


class _ReadyPartitions:
    """``partitioned_windows(url, ready_marker="_SUCCESS")`` as a picklable callable."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self) -> list[Window]:
        return partitioned_windows(self.url, ready_marker="_SUCCESS")


def test_local_and_file_urls_list_the_same_windows(tmp_path) -> None:
    write_windows(str(tmp_path), [[3], [2]])
    os.makedirs(tmp_path / "_temporary" / "hour=09")
    plain = partitioned_windows(str(tmp_path))
    as_url = partitioned_windows(f"file://{tmp_path}")
    assert [w.id for w in plain] == [w.id for w in as_url] == ["hour=00", "hour=01"]
    assert as_url[0].files == (f"file://{tmp_path}/hour=00/part-0.parquet",)
    ds = ParquetWindowDataset(f"file://{tmp_path}", row_id_spec(), batch_size=4)
    assert [row_ids(b) for w in list(ds.window_ids()) for b in ds.iter_window(w)] == [[0, 1, 2], [3, 4]]


def test_a_cli_config_reads_its_windows_from_a_bucket_named_by_url(
        s3_server: S3Server, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_cli import tiny

    from recsys_trainer.config import ConfigError, RunConfig

    _upload_windows(s3_server, str(tmp_path), "cli", [[5], [3]])
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    raw = tiny()
    raw["model"] = {"embedding_dim": 8}
    raw["data"] = {"kind": "parquet", "train": s3_server.url("cli"), "batch_size": 4,
                   "features": {"labels": ["y"], "dense": ["row_id"],
                                "sparse": [{"name": "item", "num_embeddings": 100}]}}
    ds = RunConfig.from_dict(raw).data.build("train")
    assert [row_ids(b) for w in list(ds.window_ids()) for b in ds.iter_window(w)] == [
        [0, 1, 2, 3], [4], [5, 6, 7]]
    raw["data"]["train"] = s3_server.url("no-such-prefix")
    with pytest.raises(ConfigError, match="no-such-prefix', which is not a directory"):
        RunConfig.from_dict(raw).data.build("train")
    raw["data"]["train"] = "s3://no-such-bucket/cli"
    with pytest.raises(StorageError, match="cannot list s3://no-such-bucket/cli: the bucket does not exist"):
        RunConfig.from_dict(raw).data.build("train")


def test_an_fsspec_scheme_without_a_pyarrow_filesystem_lists_and_reads_windows(tmp_path) -> None:
    """``memory://`` has no native pyarrow filesystem: fsspec's, wrapped in PyFileSystem."""
    import fsspec

    local = str(tmp_path / "w")
    write_windows(local, [[6], [3, 2]], row_group_size=2)
    mem = fsspec.filesystem("memory")
    mem.put(local, "/fsspec-windows", recursive=True)
    try:
        ds = ParquetWindowDataset("memory://fsspec-windows", row_id_spec(), batch_size=4)
        ds.setup(1, 2)
        got = {w: [i for b in ds.iter_window(w) for i in row_ids(b)] for w in list(ds.window_ids())}
        assert got == {"hour=00": [3, 4, 5], "hour=01": [8, 9, 10]}
    finally:
        mem.rm("/fsspec-windows", recursive=True)
