"""The Criteo-schema generator behind the main example."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recsys_trainer.data.generators.criteo_synthetic import (
    DENSE_COLUMNS,
    SPARSE_COLUMNS,
    criteo_features,
    write_dataset,
)
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows


def test_generated_hours_are_readable_windows_with_the_criteo_schema_and_a_learnable_signal(tmp_path) -> None:
    meta = write_dataset(tmp_path, hours=3, rows_per_hour=3000, row_group_size=1000)
    assert json.loads((tmp_path / "_signal.json").read_text()) == meta
    assert 0.7 < meta["oracle_auc"] < 0.95 and 0.1 < meta["ctr"] < 0.5
    windows = partitioned_windows(str(tmp_path))
    assert len(windows) == 3
    table = pq.read_table(next(tmp_path.glob("dt=*/hour=00/part-0.parquet")))
    assert table.column_names == ["row_id", "label", *DENSE_COLUMNS, *SPARSE_COLUMNS]
    assert table.column("I1").null_count > 0  # Criteo-like missing counts
    ds = ParquetWindowDataset(windows, criteo_features(1000), batch_size=512)
    ds.setup(0, 1)
    batches = list(ds.iter_window(windows[0].id))
    assert sum(b.batch_size for b in batches) == 3000
    kjt = batches[0].sparse
    assert kjt.keys() == SPARSE_COLUMNS
    assert int(kjt.values().max()) < 1000 and int(kjt.values().min()) >= 0


def test_the_same_seed_writes_the_same_rows(tmp_path) -> None:
    write_dataset(tmp_path / "a", hours=1, rows_per_hour=500)
    write_dataset(tmp_path / "b", hours=1, rows_per_hour=500)
    a = pq.read_table(next((tmp_path / "a").glob("*/*/part-0.parquet")))
    b = pq.read_table(next((tmp_path / "b").glob("*/*/part-0.parquet")))
    assert a.equals(b)


def test_a_generated_file_that_does_not_fit_leaves_no_temporary_file(tmp_path) -> None:
    import pyarrow as pa
    from fs_utils import small_tmpfs

    from recsys_trainer.data.generators.generated import write_whole

    table = pa.table({"x": list(range(200_000))})
    with small_tmpfs(str(tmp_path / "disk"), 256) as disk:
        with pytest.raises(OSError):
            write_whole(Path(disk) / "part-0.parquet", table)
        assert list(Path(disk).iterdir()) == []


def _write_where_rank_0_cannot(root: str) -> dict[str, object]:
    import time

    from recsys_trainer.data.generators.generated import written_once
    from recsys_trainer.distributed import init_distributed

    init_distributed("cpu", timeout_s=120)
    t0 = time.monotonic()
    try:
        written_once(root, lambda: write_dataset(root, hours=1, rows_per_hour=100), "1 hour")
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.distributed
def test_a_generated_dataset_rank_0_cannot_write_is_an_error_on_every_rank(tmp_path) -> None:
    from dist_utils import run_distributed
    from fs_utils import read_only

    with read_only(str(tmp_path / "ro")) as root:
        r0, r1 = run_distributed(_write_where_rank_0_cannot, 2, 120, args=(root,))
    assert r0["error"].startswith("OSError: ") and "Read-only file system" in r0["error"]
    # Rank 1 names rank 0's error instead of waiting for it (or reading a file never written).
    assert r1["error"] == (f"RuntimeError: rank 0 could not write the generated dataset (1 hour) "
                           f"at {root}: {r0['error']}")
    assert r1["seconds"] < 30


def test_planted_crosses_are_pure_interactions_that_only_move_the_click(tmp_path) -> None:
    import numpy as np

    from recsys_trainer.data.generators.criteo_synthetic import CrossSignal

    crosses = CrossSignal.make()
    # Centred along every axis: no column (for the 3-column cross, no pair) carries any of it.
    for table in crosses.tables:
        for axis in range(table.ndim):
            assert np.allclose(table.mean(axis=axis), 0.0)
    plain = write_dataset(tmp_path / "plain", hours=2, rows_per_hour=4000)
    crossed = write_dataset(tmp_path / "crossed", hours=2, rows_per_hour=4000, crosses=crosses)
    assert crossed["crosses"] == [["C1", "C2"], ["C3", "C4"], ["C5", "C6", "C7"]]
    # The ceiling rises with the crosses; a model blind to them can reach the lower one at best.
    assert crossed["oracle_auc"] > crossed["oracle_auc_without_crosses"] + 0.03
    a = pq.read_table(next((tmp_path / "plain").glob("dt=*/hour=00/part-0.parquet")))
    b = pq.read_table(next((tmp_path / "crossed").glob("dt=*/hour=00/part-0.parquet")))
    # Every input column as without the crosses; only the clicks differ.
    assert a.drop(["label"]).equals(b.drop(["label"])) and not a.column("label").equals(b.column("label"))
    assert "crosses" not in plain
    with pytest.raises(ValueError, match="each cross must name 2 or more distinct columns"):
        CrossSignal.make(columns=[(0, 0)])
