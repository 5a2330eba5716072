"""The Criteo-schema generator behind the main example."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from recsys_trainer.data.criteo_synthetic import (
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
