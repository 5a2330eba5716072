"""ParquetWindowDataset on one process: windows, sharding, skipping, shuffle, state, bad input."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from data_utils import row_id_spec, row_ids, write_windows

from recsys_trainer.data.errors import DataError
from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.windows import (
    StreamingWindows,
    Window,
    agreed_windows,
    glob_windows,
    partitioned_windows,
)
from recsys_trainer.distributed import FakeGang


def _ds(root: str, **kw) -> ParquetWindowDataset:  # type: ignore[no-untyped-def]
    kw.setdefault("batch_size", 4)
    return ParquetWindowDataset(root, row_id_spec(), **kw)


def _read_all(ds: ParquetWindowDataset, window: str, world_size: int, skip: int = 0) -> list[list[int]]:
    out = []
    for r in range(world_size):
        ds.setup(r, world_size)
        out.append([i for b in ds.iter_window(window, skip) for i in row_ids(b)])
    return out


@pytest.mark.parametrize("sharding", ["rows", "row_groups"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_of_a_window_is_read_by_exactly_one_rank(tmp_path, sharding, shuffle) -> None:
    total = write_windows(str(tmp_path), [[13, 0, 22], [5]], row_group_size=4)
    ds = _ds(str(tmp_path), sharding=sharding, shuffle=shuffle, seed=3)
    assert list(ds.window_ids()) == ["hour=00", "hour=01"]
    seen: list[int] = []
    for w in ds.window_ids():
        for ws in (1, 2, 3):
            per_rank = _read_all(ds, w, ws)
            flat = sorted(i for r in per_rank for i in r)
            assert len(flat) == len(set(flat))
            if ws == 3:
                seen += flat
    assert sorted(seen) == list(range(total))


def test_row_sharding_splits_a_single_row_group_window_evenly(tmp_path) -> None:
    write_windows(str(tmp_path), [[10]], row_group_size=100)
    sizes = [len(r) for r in _read_all(_ds(str(tmp_path)), "hour=00", 3)]
    assert sizes == [3, 3, 4]


def test_skip_batches_resumes_at_the_same_rows_without_decoding_the_skipped_ones(tmp_path) -> None:
    write_windows(str(tmp_path), [[9, 14]], row_group_size=4)
    for shuffle in (False, True):
        ds = _ds(str(tmp_path), shuffle=shuffle, seed=1, batch_size=3)
        ds.setup(1, 2)
        full = [row_ids(b) for b in ds.iter_window("hour=00")]
        it = ds.iter_window("hour=00", skip_batches=2)
        assert it.rows_remaining() == sum(len(b) for b in full[2:])
        assert [row_ids(b) for b in it] == full[2:]
        assert it.rows_remaining() == 0


def test_shuffle_is_seeded_by_seed_and_epoch(tmp_path) -> None:
    write_windows(str(tmp_path), [[40]], row_group_size=8)
    def order(seed: int, epoch: int) -> list[int]:
        ds = _ds(str(tmp_path), shuffle=True, seed=seed)
        ds.set_epoch(epoch)
        return [i for b in ds.iter_window("hour=00") for i in row_ids(b)]
    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)
    assert sorted(order(1, 0)) == list(range(40))


def test_prefetch_thread_stops_when_the_iterator_is_closed_or_dropped(tmp_path) -> None:
    write_windows(str(tmp_path), [[200]], row_group_size=8)
    ds = _ds(str(tmp_path), prefetch_batches=2)
    before = threading.active_count()
    it = ds.iter_window("hour=00")
    next(it)
    time.sleep(0.2)
    assert it._prefetcher is not None and it._prefetcher.alive
    # Bounded: the producer is blocked after queue size (2) + the batch being put.
    assert it.rows_remaining() == 196
    it.close()
    assert not it._prefetcher.alive
    it2 = ds.iter_window("hour=00")
    next(it2)
    pf = it2._prefetcher
    assert pf is not None
    del it2
    gc.collect()
    deadline = time.monotonic() + 5
    while pf.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pf.alive and threading.active_count() <= before


def test_windows_come_from_globs_callables_and_csv_files(tmp_path) -> None:
    write_windows(str(tmp_path / "p"), [[6], [5]])
    ws = glob_windows({"a": str(tmp_path / "p/hour=01/*.parquet"), "missing": str(tmp_path / "nope/*"),
                       "b": str(tmp_path / "p/hour=00/*.parquet")})
    assert [w.id for w in ws] == ["a", "b"]  # the empty glob is skipped (and logged)
    ds = ParquetWindowDataset(lambda: ws, row_id_spec(), batch_size=4)
    assert [sorted(i for b in ds.iter_window(w) for i in row_ids(b)) for w in ds.window_ids()] == [
        [6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5]]
    csv_path = str(tmp_path / "w.csv")
    pacsv.write_csv(pq.read_table(ws[1].files[0]), csv_path)
    ds = ParquetWindowDataset([Window("csv", (csv_path,))], row_id_spec(), batch_size=4)
    ds.setup(1, 2)
    assert [row_ids(b) for b in ds.iter_window("csv")] == [[3, 4, 5]]


def test_empty_partitions_are_skipped_and_zero_row_windows_yield_nothing(tmp_path) -> None:
    write_windows(str(tmp_path), [[4], [0], [3]])
    os.makedirs(tmp_path / "hour=03")  # a partition without data files
    ds = _ds(str(tmp_path))
    assert list(ds.window_ids()) == ["hour=00", "hour=01", "hour=02"]
    assert list(ds.iter_window("hour=01")) == [] and ds.stats.empty_windows == 1


def test_streaming_windows_wait_for_new_partitions_until_the_end_marker(tmp_path) -> None:
    root = str(tmp_path)
    write_windows(root, [[3]])
    open(os.path.join(root, "hour=00", "_SUCCESS"), "w").close()
    def later() -> None:
        time.sleep(0.3)
        write_windows(root, [[], [2]], first_row_id=3)
        open(os.path.join(root, "hour=01", "_SUCCESS"), "w").close()
        time.sleep(0.2)
        open(os.path.join(root, "_END"), "w").close()
    t = threading.Thread(target=later)
    t.start()
    stream = StreamingWindows(lambda: partitioned_windows(root, ready_marker="_SUCCESS"),
                              end_marker=os.path.join(root, "_END"), poll_interval_s=0.05, timeout_s=10)
    ds = ParquetWindowDataset(stream, row_id_spec(), batch_size=4)
    assert list(ds.window_ids()) == ["hour=00", "hour=01"]
    t.join()
    assert [row_ids(b) for b in ds.iter_window("hour=01")] == [[3, 4]]
    quiet = StreamingWindows(lambda: [], end_marker=str(tmp_path / "never"), poll_interval_s=0.05, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no new window and no end marker"):
        list(quiet)


class _RecordingGang(FakeGang):
    def __init__(self, rank: int, broadcasts: list | None = None) -> None:  # type: ignore[type-arg]
        super().__init__(rank, 2, broadcasts=broadcasts)
        self.sent: list = []  # type: ignore[type-arg]

    def broadcast_object(self, obj, src=0):  # type: ignore[no-untyped-def]
        self.sent.append(obj)
        return super().broadcast_object(obj, src)


def test_rank_0_lists_for_every_rank_and_a_waiting_stream_sends_a_heartbeat_per_poll(tmp_path) -> None:
    root = str(tmp_path)
    write_windows(root, [[3]])
    checks = [0]

    def ended() -> bool:
        checks[0] += 1
        return checks[0] > 3  # three polls find nothing new, the fourth sees the end

    stream = StreamingWindows(lambda: partitioned_windows(root), end_marker=ended,
                              poll_interval_s=0.01, timeout_s=10)
    zero = _RecordingGang(rank=0)
    assert [w.id for w in agreed_windows(stream, zero)] == ["hour=00"]
    assert [m[0] for m in zero.sent] == ["window", "wait", "wait", "wait", "end"]
    # Rank 1 never lists: it receives rank 0's windows, even where its own view differs.
    rank0 = [Window("hour=07", ("/shared/a.parquet",))]
    one = _RecordingGang(rank=1, broadcasts=[("window", rank0[0]), ("wait", None), ("end", None)])
    assert list(agreed_windows(lambda: pytest.fail("rank 1 listed"), one)) == rank0
    failing = _RecordingGang(rank=1, broadcasts=[("error", "FileNotFoundError: no /data")])
    with pytest.raises(RuntimeError, match="rank 0 could not list the windows .*FileNotFoundError: no /data"):
        list(agreed_windows("/data", failing))


def test_state_dict_restores_the_epoch_and_refuses_another_configuration(tmp_path) -> None:
    write_windows(str(tmp_path), [[4]])
    a = _ds(str(tmp_path), shuffle=True, seed=5)
    a.setup(0, 2)
    a.set_epoch(3)
    state = a.state_dict()
    b = _ds(str(tmp_path), shuffle=True, seed=5)
    b.setup(0, 2)
    b.load_state_dict(state)
    assert b.epoch == 3 and a.epoch == 3
    c = _ds(str(tmp_path), shuffle=True, seed=5)
    c.setup(0, 4)
    with pytest.raises(ValueError, match=r"world_size: saved 2, now 4"):
        c.load_state_dict(state)
    # No state is shared between instances (RecIS kept offsets in class attributes).
    b.set_epoch(9)
    assert a.epoch == 3


def test_corrupt_files_raise_a_data_error_naming_the_file_or_are_skipped_and_counted(tmp_path) -> None:
    write_windows(str(tmp_path), [[5, 6]])
    bad = tmp_path / "hour=00" / "part-0.parquet"
    bad.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=rf"file {bad}: cannot read the file"):
        next(_ds(str(tmp_path)).iter_window("hour=00"))  # planning errors surface at the first fetch
    ds = _ds(str(tmp_path), on_corrupt="skip")
    assert sorted(i for b in ds.iter_window("hour=00") for i in row_ids(b)) == list(range(5, 11))
    assert ds.stats.corrupt_files_skipped == 1


def test_a_missing_or_mistyped_declared_column_names_the_file(tmp_path) -> None:
    write_windows(str(tmp_path), [[5]])
    f = str(tmp_path / "hour=00" / "part-0.parquet")
    pq.write_table(pq.read_table(f).drop_columns(["item"]), f)
    with pytest.raises(DataError, match=rf"file {f}, column 'item': the declared sparse id column is missing"):
        next(_ds(str(tmp_path)).iter_window("hour=00"))


def test_bad_values_name_the_file_row_group_and_row_they_came_from(tmp_path) -> None:
    write_windows(str(tmp_path), [[12]], row_group_size=5)
    f = str(tmp_path / "hour=00" / "part-0.parquet")
    t = pq.read_table(f)
    y = t["y"].to_pylist()
    y[7] = float("nan")
    pq.write_table(t.set_column(1, "y", pa.array(y, pa.float32())), f, row_group_size=5)
    ds = _ds(str(tmp_path), prefetch_batches=2)
    with pytest.raises(DataError, match=rf"file {f}, row group 1, row 2, column 'y': 1 label"):
        list(ds.iter_window("hour=00"))
    item = t["item"].to_pylist()
    item[11] = 1000
    pq.write_table(t.set_column(2, "item", pa.array(item)), f, row_group_size=5)
    with pytest.raises(DataError, match=r"row group 2, row 1, column 'item': id 1000 is outside"):
        list(_ds(str(tmp_path), shuffle=True).iter_window("hour=00"))


def test_padding_batch_has_the_shape_of_real_batches(tmp_path) -> None:
    write_windows(str(tmp_path), [[3]])
    ds = _ds(str(tmp_path))
    pad, real = ds.padding_batch(), next(ds.iter_window("hour=00"))
    assert pad is not None
    assert pad.dense.shape[1] == real.dense.shape[1] and pad.sparse.keys() == real.sparse.keys()


def test_feature_spec_without_sparse_features_is_allowed() -> None:
    assert FeatureSpec(labels=["y"]).columns() == ["y"]


def _set_labels(path: str, nan_rows: set[int], row_group_size: int) -> None:
    t = pq.read_table(path)
    y = [float("nan") if i in nan_rows else v for i, v in enumerate(t["y"].to_pylist())]
    pq.write_table(t.set_column(t.schema.get_field_index("y"), "y", pa.array(y, pa.float32())),
                   path, row_group_size=row_group_size)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_skip_batches_is_exact_when_whole_batches_of_nan_labels_were_dropped(tmp_path, shuffle, prefetch) -> None:
    # Batches 0 and 2 (of 4 rows) hold only NaN labels: they are dropped, never trained, so the
    # Trainer's count of trained batches is smaller than the batches of rows consumed.
    write_windows(str(tmp_path), [[30]], row_group_size=30)
    f = str(tmp_path / "hour=00" / "part-0.parquet")
    spec = row_id_spec()
    spec = FeatureSpec(labels=spec.labels, dense=spec.dense, sparse=spec.sparse, on_nan_label="drop")
    ds = ParquetWindowDataset(str(tmp_path), spec, batch_size=4, shuffle=shuffle, seed=5,
                              prefetch_batches=prefetch)
    order = [i for b in ds.iter_window("hour=00") for i in row_ids(b)]  # the rank's row order
    _set_labels(f, {*order[0:4], *order[8:12], order[13]}, 30)
    full = [row_ids(b) for b in ds.iter_window("hour=00")]
    assert len(full) == 6 and len(full[1]) == 3  # batches of rows 4-8, 12-16 (one dropped), ...
    for k in range(len(full) + 2):
        it = ds.iter_window("hour=00", skip_batches=k)
        assert [row_ids(b) for b in it] == full[k:], k
        assert it.rows_remaining() == 0


def test_skip_batches_is_exact_after_an_unreadable_row_group_was_skipped(tmp_path, monkeypatch) -> None:
    write_windows(str(tmp_path), [[10, 12]], row_group_size=10)
    bad = str(tmp_path / "hour=00" / "part-0.parquet")
    real = pq.ParquetFile.read_row_group

    def read_row_group(self, i, *args, **kw):  # type: ignore[no-untyped-def]
        if self.metadata.num_rows == 10 and i == 0:
            raise OSError(f"corrupt page in {bad}")
        return real(self, i, *args, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    ds = _ds(str(tmp_path), on_corrupt="skip", batch_size=4)
    full = [row_ids(b) for b in ds.iter_window("hour=00")]
    assert full == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]]
    for k in range(len(full) + 1):
        assert [row_ids(b) for b in ds.iter_window("hour=00", skip_batches=k)] == full[k:], k


def _rewrite(path: str, **columns: pa.Array) -> None:
    t = pq.read_table(path)
    for name, values in columns.items():
        t = t.set_column(t.schema.get_field_index(name), name, values)
    pq.write_table(t, path)


def test_an_id_column_that_turns_from_integers_to_strings_is_read_as_integers_or_refused_by_value(
        tmp_path) -> None:
    """Integer and string ids map to different rows: a later window whose integer id column is
    written as strings is read as the integers they write (``str(int)``'s form, as the serving
    Scorer reads a request's), and a value of any other form is refused naming the file, row
    and value, also after a resume (the first kind is part of the data state)."""
    write_windows(str(tmp_path), [[8], [8]])
    later = str(tmp_path / "hour=01" / "part-0.parquet")
    as_ints = [b.sparse["item"].values().tolist() for b in _ds(str(tmp_path)).iter_window("hour=01")]
    items = pq.read_table(later).column("item").to_pylist()
    _rewrite(later, item=pa.array([str(i) for i in items]))  # unconverted, row ids would become hashes
    ds = _ds(str(tmp_path))
    assert list(ds.window_ids()) == ["hour=00", "hour=01"]
    assert len(list(ds.iter_window("hour=00"))) == 2
    state = ds.state_dict()
    assert [b.sparse["item"].values().tolist() for b in ds.iter_window("hour=01")] == as_ints
    # "-0": str(int) never writes it (it would become 0, the id "0" wrote).
    for k, bad in ((5, f"0{items[5]}"), (3, "-0")):
        _rewrite(later, item=pa.array([str(i) if j != k else bad for j, i in enumerate(items)]))
        expected = (rf"file {later}, row group 0, row {k}, column 'item': the sparse id column holds "
                    rf"string ids, but held integer ids in window 'hour=00' \(file .*hour=00/part-0.parquet\), "
                    rf"and value '{bad}' is no integer written as str\(int\) writes it")
        fresh = _ds(str(tmp_path))
        assert len(list(fresh.iter_window("hour=00"))) == 2
        with pytest.raises(DataError, match=expected):
            list(fresh.iter_window("hour=01"))
    # A run resumed after hour=00 reads hour=01 as the integers hour=00 held, too.
    resumed = _ds(str(tmp_path))
    resumed.load_state_dict(state)
    with pytest.raises(DataError, match=expected):
        list(resumed.iter_window("hour=01"))


def test_integer_ids_in_a_column_first_read_as_strings_are_refused_by_value(tmp_path) -> None:
    """The reverse of the test above is refused, not converted: pyarrow's CSV reader reads an
    all-digit "02134" as 2134, so str(int) would train another id than the file wrote. The
    error names the file, row, value and the fix (keep the CSV column a string)."""
    first, later = str(tmp_path / "w0.csv"), str(tmp_path / "w1.csv")
    base = pa.table({"row_id": [0.0, 1.0], "y": [0.0, 1.0], "tag": [1, 2]})
    pacsv.write_csv(base.append_column("item", pa.array(["a7", "0213"])), first)
    pacsv.write_csv(base.append_column("item", pa.array(["0213", "0007"])), later)
    windows = [Window("w0", (first,)), Window("w1", (later,))]
    ds = ParquetWindowDataset(windows, row_id_spec(), batch_size=4)
    assert len(list(ds.iter_window("w0"))) == 1
    with pytest.raises(DataError, match=rf"file {later}, row group 0, row 0, column 'item': the "
                                        r"sparse id column holds integer ids \(value 213\), but held "
                                        r"string ids in window 'w0'.*csv_convert_options"):
        list(ds.iter_window("w1"))
    # The fix the error names: the column read as strings, "0213" the id window w0 trained.
    kept = ParquetWindowDataset(windows, row_id_spec(), batch_size=4, csv_convert_options=
                                pacsv.ConvertOptions(column_types={"item": pa.string()}))
    (b0,), (b1,) = list(kept.iter_window("w0")), list(kept.iter_window("w1"))
    assert b0.sparse["item"].values().tolist()[1] == b1.sparse["item"].values().tolist()[0]


def test_an_eval_dataset_following_the_train_dataset_reads_ids_as_the_kind_training_read(
        tmp_path) -> None:
    """An eval (or predict) window of strings beside integer training ids: with
    ``follow_id_kinds(train)`` (the Trainer calls it) the strings are read as the integers they
    write, as training reads them, not hashed as text (other rows); also after the train
    dataset is resumed (its record replaced)."""
    write_windows(str(tmp_path / "train"), [[8]])
    write_windows(str(tmp_path / "eval"), [[8]])
    eval_file = str(tmp_path / "eval" / "hour=00" / "part-0.parquet")
    ints = [b.sparse["item"].values().tolist() for b in _ds(str(tmp_path / "eval")).iter_window("hour=00")]
    items = pq.read_table(eval_file).column("item").to_pylist()
    _rewrite(eval_file, item=pa.array([str(i) for i in items]))
    train = _ds(str(tmp_path / "train"))
    assert len(list(train.iter_window("hour=00"))) == 2  # records 'item' as integer ids
    alone = _ds(str(tmp_path / "eval"))
    assert [b.sparse["item"].values().tolist() for b in alone.iter_window("hour=00")] != ints
    for source in (train, _ds(str(tmp_path / "train"))):
        if source is not train:
            source.load_state_dict(train.state_dict())  # a resumed train dataset
        ev = _ds(str(tmp_path / "eval"))
        ev.follow_id_kinds(source)
        assert [b.sparse["item"].values().tolist() for b in ev.iter_window("hour=00")] == ints
    _rewrite(eval_file, item=pa.array([f"0{i}" for i in items]))
    ev = _ds(str(tmp_path / "eval"))
    ev.follow_id_kinds(train)
    with pytest.raises(DataError, match=r"row 0, column 'item': the sparse id column holds string ids, "
                                        r"but held integer ids in window 'hour=00' \(file .*train"):
        list(ev.iter_window("hour=00"))


def test_files_of_one_window_with_different_column_types_read_alike_on_one_rank_and_on_two(
        tmp_path) -> None:
    write_windows(str(tmp_path), [[6, 6]], row_group_size=6)
    second = str(tmp_path / "hour=00" / "part-1.parquet")
    # int32 ids, bool labels and list ids beside the first file's int64 ids and float labels.
    _rewrite(second, item=pa.array([[i] for i in range(6, 12)], pa.list_(pa.int32())),
             y=pa.array([i % 3 == 0 for i in range(6, 12)], pa.bool_()))
    one = list(_ds(str(tmp_path), batch_size=12).iter_window("hour=00"))  # one chunk, two files
    assert len(one) == 1 and row_ids(one[0]) == list(range(12))
    assert one[0].sparse["item"].values().tolist() == list(range(12))
    assert one[0].sparse["item"].lengths().tolist() == [1] * 12
    assert one[0].labels.tolist() == [float(i % 3 == 0) for i in range(12)]
    ds = _ds(str(tmp_path), batch_size=12)
    ds.setup(1, 2)  # rank 1 of 2 reads the second file alone: the same values
    (alone,) = list(ds.iter_window("hour=00"))
    assert alone.sparse["item"].values().tolist() == list(range(6, 12))
    assert alone.labels.tolist() == one[0].labels.tolist()[6:]


def test_rows_that_cannot_be_combined_name_both_files() -> None:
    from recsys_trainer.data.parquet_files import concat_rows as _concat

    ints, strs = pa.table({"item": pa.array([1, 2])}), pa.table({"item": pa.array(["a", "b"])})
    with pytest.raises(DataError, match=r"file b.parquet: its rows cannot be combined with those of a.parquet"):
        _concat([ints, strs], ["a.parquet", "b.parquet"])


def _item_spec(**item: object) -> FeatureSpec:
    return FeatureSpec(labels=["y"], dense=["row_id"],
                       sparse=[SparseFeature(name="item", num_embeddings=100, **item),  # type: ignore[arg-type]
                               SparseFeature(name="tag", num_embeddings=50)])


def test_an_id_column_null_in_every_row_of_a_file_is_a_data_error_naming_the_file_and_column(
        tmp_path, caplog) -> None:
    write_windows(str(tmp_path), [[6, 6]], row_group_size=4)
    second = str(tmp_path / "hour=00" / "part-1.parquet")
    # What an upstream join that matched nothing (or a renamed source column) writes.
    _rewrite(second, item=pa.nulls(6, pa.int64()))
    expected = (rf"file {second}, column 'item': the id column has no value in any of the file's "
                r"6 rows \(every value is null\): sparse feature 'item' would train on no id in "
                r"any of them\. .*set SparseFeature\(name='item', on_all_null='warn'\)")
    with pytest.raises(DataError, match=expected):
        next(_ds(str(tmp_path)).iter_window("hour=00"))  # found from the footers, before any row
    # A null_id maps a missing value to an id; a whole file without one is still refused.
    with pytest.raises(DataError, match=r"column 'item': .* every row would take null_id 0\. "):
        next(ParquetWindowDataset(str(tmp_path), _item_spec(null_id=0), batch_size=4).iter_window("hour=00"))
    # on_all_null="warn": the file is read (its rows have no item id) and a warning names it.
    with caplog.at_level(logging.WARNING, logger="recsys_trainer.data"):
        (batch,) = ParquetWindowDataset(str(tmp_path), _item_spec(on_all_null="warn"),
                                        batch_size=12).iter_window("hour=00")
    assert batch.sparse["item"].lengths().tolist() == [1] * 6 + [0] * 6
    assert f"file {second}, column 'item': the id column has no value" in caplog.text
    # Nulls in some rows only are empty bags, as documented: read without a word.
    _rewrite(second, item=pa.array([None, 7, None, None, None, None], pa.int64()))
    assert sum(b.batch_size for b in _ds(str(tmp_path)).iter_window("hour=00")) == 12
    # pandas writes a column of None without a type: named as such.
    _rewrite(second, item=pa.nulls(6))
    with pytest.raises(DataError, match=rf"file {second}, column 'item': the declared sparse id column must be "
                                        r"an integer or string, or a list of them, but is null \(every value is null"):
        next(_ds(str(tmp_path)).iter_window("hour=00"))
    # A list column whose every list is null or empty gives no id either.
    _rewrite(second, item=pa.array([None, [], None, [], [], None], pa.list_(pa.int64())))
    with pytest.raises(DataError, match=rf"file {second}, column 'item': the id column has no value in "
                                        r"any of the file's 6 rows \(every list is null or empty"):
        next(_ds(str(tmp_path)).iter_window("hour=00"))
