"""Object storage against a real S3 server (SeaweedFS on 127.0.0.1, tests/s3_server.py)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq


def test_s3_server_round_trips_a_multipart_parquet_file(s3_server, tmp_path) -> None:
    """The fixture's identity lets pyarrow write (multipart) and read back a parquet file, and
    list it; the fixture is what every other object-storage test stands on."""
    fs = s3_server.filesystem()
    table = pa.table({"a": pa.array(range(300_000), pa.int64())})
    key = f"{s3_server.bucket}/fixture/t.parquet"
    pq.write_table(table, key, filesystem=fs)
    assert pq.read_table(key, filesystem=fs).equals(table)
    listed = [i.path for i in fs.get_file_info(pafs.FileSelector(f"{s3_server.bucket}/fixture"))]
    assert listed == [key]
