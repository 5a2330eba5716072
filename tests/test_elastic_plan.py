"""An elastic resume's data position, on one process: the rows no earlier rank consumed.

A window trained at world size W0 for b0 batches per rank, then (after a node was lost or added)
at W1 for b1 batches, ... and finished at the last world size must have trained every row of
the window exactly once. Each rank here is a ``ParquetWindowDataset`` set up as that rank, as
the Trainer would after a resume (``iter_window(..., earlier=segments)``).
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_utils import row_id_spec, row_ids, write_windows

from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.checkpoint.layout import CheckpointInfo
from recsys_trainer.checkpoint.loading import remap_position
from recsys_trainer.data.base import IterableAsWindow, Segment
from recsys_trainer.data.batch_check import BatchCheck
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.parquet import ParquetWindowDataset


def _ds(root: str, **kw: Any) -> ParquetWindowDataset:
    kw.setdefault("batch_size", 4)
    kw.setdefault("prefetch_batches", 0)
    return ParquetWindowDataset(root, kw.pop("spec", row_id_spec()), **kw)


def _batches(ds: ParquetWindowDataset, window: str, rank: int, world_size: int,
             earlier: list[Segment], skip: int = 0) -> list[list[int]]:
    ds.setup(rank, world_size)
    return [row_ids(b) for b in ds.iter_window(window, skip, earlier=earlier)]


def _train_window(ds: ParquetWindowDataset, window: str, plan: list[tuple[int, int | None]],
                  ) -> list[int]:
    """Row ids trained in ``window`` when it is trained at ``plan[i] = (world size, batches per
    rank)``, the last part to its end (batches None). Every rank of a part trains the same
    number of batches, as the ranks' agreement at each fetch makes them."""
    trained: list[int] = []
    earlier: list[Segment] = []
    for world_size, batches in plan:
        per_rank = [_batches(ds, window, r, world_size, earlier) for r in range(world_size)]
        if batches is None:  # the last part: each rank reads to the end of its share
            trained += [i for b in per_rank for batch in b for i in batch]
            break
        assert all(len(b) >= batches for b in per_rank), "a mid-window part had data on every rank"
        trained += [i for b in per_rank for batch in b[:batches] for i in batch]
        earlier.append(Segment(world_size, batches))
    return trained


def _window_rows(ds: ParquetWindowDataset, window: str) -> list[int]:
    return sorted(i for b in _batches(ds, window, 0, 1, []) for i in b)


def _random_case(tmp_path: Any, case: int) -> int:
    """Train one random window across random world-size changes; returns how many changes."""
    rng = random.Random(case)
    root = str(tmp_path / f"case{case}")
    files = [rng.choice([0, 1, 5, 13, 22, 40]) for _ in range(rng.randint(1, 4))]
    if sum(files) < 8:
        files.append(17)
    write_windows(root, [files], row_group_size=rng.choice([3, 4, 8, 100]))
    ds = _ds(root, batch_size=rng.choice([1, 2, 3, 4, 5]),
             sharding=rng.choice(["rows", "row_groups"]), shuffle=rng.random() < 0.5,
             seed=rng.randint(0, 9))
    window = next(iter(ds.window_ids()))
    plan: list[tuple[int, int | None]] = []
    earlier: list[Segment] = []
    for _ in range(rng.randint(1, 3)):  # one to three changes of world size inside the window
        w = rng.choice([s for s in (1, 2, 3) if not plan or s != plan[-1][0]])
        shortest = min(len(_batches(ds, window, r, w, earlier)) for r in range(w))
        if shortest == 0:
            break
        b = rng.randint(1, shortest)
        plan.append((w, b))
        earlier.append(Segment(w, b))
    changes = len(plan)
    plan.append((rng.choice([1, 2, 3]), None))
    trained = _train_window(ds, window, plan)
    assert sorted(trained) == _window_rows(ds, window), (case, plan)
    return changes


def test_a_window_trained_across_world_size_changes_trains_every_row_exactly_once(
        tmp_path: Any) -> None:
    # Random layouts (files, row groups, empty files, uneven shares), batch sizes, sharding,
    # shuffle, and one to three changes of world size among 1, 2 and 3 inside the window.
    changes = [_random_case(tmp_path, case) for case in range(40)]
    assert sum(c >= 1 for c in changes) >= 30 and max(changes) == 3


def test_2_to_1_resumes_on_exactly_the_rows_the_two_ranks_left(tmp_path: Any) -> None:
    write_windows(str(tmp_path), [[13, 22]], row_group_size=4)  # 35 rows: shares of 17 and 18
    ds = _ds(str(tmp_path))
    before = [_batches(ds, "hour=00", r, 2, []) for r in range(2)]
    consumed = {i for share in before for batch in share[:3] for i in batch}
    after = [i for b in _batches(ds, "hour=00", 0, 1, [Segment(2, 3)]) for i in b]
    assert sorted(after) == sorted(set(range(35)) - consumed)
    # In window order: what rank 0 left of its share, then what rank 1 left of its share.
    assert after == list(range(12, 17)) + list(range(29, 35))
    # A resume of that resume (same world size) skips its own batches as before.
    assert [i for b in _batches(ds, "hour=00", 0, 1, [Segment(2, 3)], skip=2) for i in b] == after[8:]


def test_shuffled_windows_reshard_exactly_and_reproducibly(tmp_path: Any) -> None:
    write_windows(str(tmp_path), [[40, 21]], row_group_size=8)
    ds = _ds(str(tmp_path), shuffle=True, seed=5)
    first = _train_window(ds, "hour=00", [(3, 2), (2, None)])
    again = _train_window(ds, "hour=00", [(3, 2), (2, None)])
    assert first == again  # deterministic: every rank computes the same plan
    assert sorted(first) == list(range(61))


def test_dropped_rows_are_counted_by_reading_the_old_batches_again(tmp_path: Any) -> None:
    ids = np.arange(30, dtype=np.int64)
    labels = np.where(ids % 4 == 1, np.nan, (ids % 3 == 0).astype(np.float32))
    os.makedirs(tmp_path / "hour=00")
    pq.write_table(pa.table({"row_id": ids, "y": labels, "item": ids % 100,
                             "tag": pa.array([f"t{i % 7}" for i in ids])}),
                   tmp_path / "hour=00" / "a.parquet", row_group_size=7)
    spec = dataclasses.replace(row_id_spec(), on_nan_label="drop")
    ds = _ds(str(tmp_path), spec=spec, batch_size=3)
    trained = _train_window(ds, "hour=00", [(2, 2), (1, 1), (3, None)])
    assert sorted(trained) == [int(i) for i in ids if i % 4 != 1]


def _corrupt_row_group(path: Any, row_group: int) -> None:
    """Overwrite the first data page of ``row_group`` (its rows become unreadable)."""
    offset = pq.ParquetFile(path).metadata.row_group(row_group).column(0).data_page_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * 12)


def test_unreadable_row_groups_skipped_before_or_after_a_change_leave_every_readable_row_once(
        tmp_path: Any) -> None:
    # 40 rows, row groups of 4; groups 1 and 6 (rows 4-7, 24-27) unreadable, on_corrupt="skip".
    write_windows(str(tmp_path), [[40]], row_group_size=4)
    path = tmp_path / "hour=00" / "part-0.parquet"
    _corrupt_row_group(path, 1)
    _corrupt_row_group(path, 6)
    readable = [i for i in range(40) if not 4 <= i < 8 and not 24 <= i < 28]
    for batch_size in (2, 3, 5):
        ds = _ds(str(tmp_path), batch_size=batch_size, on_corrupt="skip")
        for plan in ([(1, 1), (2, None)], [(1, 3), (2, 1), (3, None)], [(2, 2), (1, None)],
                     [(3, 1), (2, 1), (1, None)]):
            assert sorted(_train_window(ds, "hour=00", plan)) == readable, (batch_size, plan)


def _agreed_train(ds: ParquetWindowDataset, window: str, plan: list[tuple[int, int | None]],
                  ) -> list[int]:
    """``_train_window``, but the last part as the Trainer runs it: every rank trains as many
    batches as the rank that runs out first (the ranks agree at each fetch)."""
    earlier = [Segment(w, b) for w, b in plan[:-1] if b is not None]
    trained = _train_window(ds, window, [*plan[:-1], (plan[-1][0], 0)])
    last = [_batches(ds, window, r, plan[-1][0], earlier) for r in range(plan[-1][0])]
    agreed = min(len(b) for b in last)
    return trained + [i for b in last for batch in b[:agreed] for i in batch]


@pytest.mark.parametrize("sharding", ["rows", "row_groups"])
def test_what_old_ranks_left_is_cut_by_rows_so_the_new_ranks_run_out_together(
        tmp_path: Any, sharding: str) -> None:
    # 4 row groups of 8 rows, batch 4: 2 ranks train 1 batch each, then 3 ranks the rest. Dealt
    # as whole pieces the rest (two half-read groups, two whole ones) gave the 3 ranks 3, 1 and 2
    # batches, and training stopped at 1: 12 rows never trained. Cut by rows it loses none here.
    write_windows(str(tmp_path), [[32]], row_group_size=8)
    ds = _ds(str(tmp_path), batch_size=4, sharding=sharding)
    trained = _agreed_train(ds, "hour=00", [(2, 1), (3, None)])
    assert sorted(trained) == list(range(32))
    # Whatever the layout, the new ranks' batch counts differ by at most one.
    for plan in ([(2, 1), (3, None)], [(3, 1), (2, 2), (4, None)]):
        earlier = [Segment(w, b) for w, b in plan[:-1] if b is not None]
        counts = [len(_batches(ds, "hour=00", r, plan[-1][0], earlier)) for r in range(plan[-1][0])]
        assert max(counts) - min(counts) <= 1, (plan, counts)


def _info(world_size: int) -> CheckpointInfo:
    return CheckpointInfo(step=18, path="/ckpt/step_18", commit_time=0.0, world_size=world_size)


def _position(batches: int, segments: list[list[int]] | None = None) -> dict[str, Any]:
    return {"window_index": 0, "window_id": "hour=00", "batches_in_window": batches,
            "window_segments": segments or [], "rows_unread": 7}


def test_remap_records_each_world_size_change_as_an_earlier_segment(tmp_path: Any) -> None:
    ds = _ds(str(tmp_path))
    ts = remap_position(_position(18), _info(2), world_size=1, policy="exact", train_dataset=ds)
    assert (ts["window_segments"], ts["batches_in_window"], ts["rows_unread"]) == ([[2, 18]], 0, 0)
    # A second change in the same window appends; one before any batch at the new size does not.
    ts = remap_position({**ts, "batches_in_window": 5}, _info(1), world_size=3, policy="exact",
                        train_dataset=ds)
    assert ts["window_segments"] == [[2, 18], [1, 5]]
    ts = remap_position(ts, _info(3), world_size=2, policy="exact", train_dataset=ds)
    assert ts["window_segments"] == [[2, 18], [1, 5]] and ts["batches_in_window"] == 0
    # A window boundary needs nothing.
    assert remap_position(_position(0), _info(2), world_size=1, policy="error")["window_index"] == 0


def test_remap_policies_other_than_exact(tmp_path: Any) -> None:
    pos = _position(4, [[3, 2]])
    with pytest.raises(CheckpointError, match="restart_window") as e:
        remap_position(pos, _info(2), world_size=1, policy="error")
    assert e.value.kind == "reshard"
    assert "2 batches per rank at world size 3, then 4 batches per rank at world size 2" in str(e.value)
    restart = remap_position(pos, _info(2), world_size=1, policy="restart_window")
    assert (restart["window_index"], restart["batches_in_window"], restart["window_segments"]) == (0, 0, [])
    skip = remap_position(pos, _info(2), world_size=1, policy="next_window")
    assert (skip["window_index"], skip["batches_in_window"], skip["window_segments"]) == (1, 0, [])


def test_a_malformed_segment_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"`Segment.world_size` must be an int >= 1, but is 0"):
        Segment(0, 5)
    with pytest.raises(ValueError, match=r"`Segment.batches` must be an int >= 0, but is -1"):
        Segment(2, -1)


def test_earlier_parts_reaching_a_dataset_without_exact_reshard_are_refused_by_name() -> None:
    # A checkpoint's segments, resumed with a dataset class that cannot remap (changed since).
    check = BatchCheck([])
    with pytest.raises(DataError, match=r"\(IterableAsWindow\) cannot tell which rows"):
        check.batches(IterableAsWindow([]), "all", 0, earlier=[Segment(2, 3)])


def test_exact_remap_refuses_a_dataset_that_cannot_tell_which_rows_were_consumed() -> None:
    with pytest.raises(CheckpointError, match=r"\(IterableAsWindow\) cannot tell which rows") as e:
        remap_position(_position(3), _info(2), world_size=1, policy="exact",
                       train_dataset=IterableAsWindow([]))
    assert "reshard_data_position='restart_window'" in str(e.value)
