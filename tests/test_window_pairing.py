"""``train_and_evaluate`` pairs train window i with eval window i: an hour without traffic in one
listing must not shift the pairs after it (issue 19, item 1), on 1 and on 2 real ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from data_utils import row_id_spec, row_ids, write_windows

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.data.base import WindowPairing, WindowPairingError
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.hooks.lambda_hook import LambdaHook
from recsys_trainer.models import DLRMClassifier


def _write(root: str, eval_hour_01: str) -> None:
    """Train hours 00-02 (8 rows each, ids 0-23); eval hours 00 and 02 (4 rows each, ids 100-107)
    and an eval hour 01 without data files: holding only ``_SUCCESS`` ("marked") or nothing."""
    write_windows(os.path.join(root, "train"), [[8], [8], [8]])
    write_windows(os.path.join(root, "eval"), [[4], [], [4]], first_row_id=100)
    if eval_hour_01 == "marked":
        open(os.path.join(root, "eval", "hour=01", "_SUCCESS"), "w").close()


def _run(root: str, train: Any = None, eval_: Any = None) -> dict[str, Any]:
    """train_and_evaluate on ``root``'s train and eval partitions (or the given sources); returns
    which eval window followed which train window, the rows each evaluation saw, or the error."""
    spec = row_id_spec()
    torch.manual_seed(0)
    model = DLRMClassifier(spec.sparse_names, spec.num_dense, [s.num_embeddings for s in spec.sparse],
                           embedding_dim=4, dense_arch=(4,), over_arch=(4, 1))
    pairs: list[tuple[str, str]] = []
    evaluated: list[list[int]] = []
    trained: list[str] = []

    def window(t: Trainer, w: str) -> None:
        if t.state.mode == "train":
            trained.append(w)
        else:
            pairs.append((trained[-1], w))
            evaluated.append([])

    def rows(t: Trainer, out: Any) -> None:
        if not out.is_padding:
            evaluated[-1].extend(i for mb in out.micro_batches for i in row_ids(mb.batch))

    hook = LambdaHook(before_window=window, after_eval_step=rows)
    trainer = Trainer(
        model, TrainingArguments(output_dir=os.path.join(root, "out"), log_steps=1000),
        train_dataset=ParquetWindowDataset(train or os.path.join(root, "train"), spec, batch_size=4),
        eval_dataset=ParquetWindowDataset(eval_ or os.path.join(root, "eval"), spec, batch_size=4),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05), hooks=[hook],
        add_logger_hook=False)
    try:
        trainer.train_and_evaluate()
    except WindowPairingError as exc:
        return {"pairs": pairs, "rows": evaluated, "trained": trained, "error": str(exc),
                "step": trainer.state.global_step}
    return {"pairs": pairs, "rows": evaluated, "trained": trained, "error": None,
            "step": trainer.state.global_step}


SAME_HOURS = [("hour=00", "hour=00"), ("hour=01", "hour=01"), ("hour=02", "hour=02")]


def test_an_eval_hour_holding_only_success_is_evaluated_as_0_rows_and_keeps_the_pairs(tmp_path) -> None:
    _write(str(tmp_path), "marked")
    out = _run(str(tmp_path))
    # Before: hour 01 was dropped from the eval listing, so train hour 01 was evaluated on eval
    # hour 02 and train hour 02 never, with exit 0.
    assert out["error"] is None
    assert out["pairs"] == SAME_HOURS
    assert [sorted(r) for r in out["rows"]] == [[100, 101, 102, 103], [], [104, 105, 106, 107]]


def test_an_eval_hour_missing_from_the_listing_is_a_pairing_error_before_the_wrong_pair(tmp_path) -> None:
    _write(str(tmp_path), "bare")  # hour=01 is an empty directory: skipped, as it may be in writing
    out = _run(str(tmp_path))
    assert out["error"] is not None and "train window 'hour=01' (pair 2) meets eval window 'hour=02'" in out["error"]
    assert out["pairs"] == SAME_HOURS[:1]  # hour 01 was neither trained nor evaluated on hour 02
    assert out["trained"] == ["hour=00"] and out["step"] == 2


def test_train_t_evaluate_t_plus_1_from_one_listing_keeps_an_empty_hour_in_its_place(tmp_path) -> None:
    root = str(tmp_path / "eval")
    write_windows(root, [[4], [], [4], [4]], first_row_id=100)
    open(os.path.join(root, "hour=01", "_SUCCESS"), "w").close()
    windows = partitioned_windows(root)
    assert [w.id for w in windows] == ["hour=00", "hour=01", "hour=02", "hour=03"]
    assert windows[1].files == ()
    out = _run(str(tmp_path), train=windows[:-1], eval_=windows[1:])
    assert out["error"] is None
    assert out["pairs"] == [("hour=00", "hour=01"), ("hour=01", "hour=02"), ("hour=02", "hour=03")]
    assert [len(r) for r in out["rows"]] == [0, 4, 4]


def test_pairs_of_t_and_t_plus_1_from_two_listings_that_drift_apart_are_an_error() -> None:
    pairing = WindowPairing()
    pairing.check("hour=00", "hour=01")
    pairing.check("hour=01", "hour=03")  # the eval listing lacks hour=02 ...
    with pytest.raises(WindowPairingError, match=r"train window 'hour=01' \(pair 2\) was evaluated on "
                                                 r"eval window 'hour=03', but the train window after it "
                                                 r"is 'hour=02'"):
        pairing.check("hour=02", "hour=04")  # ... which shows when train hour 02 comes up
    ran_out = WindowPairing()
    for t, e in [("hour=00", "hour=00"), ("hour=01", "hour=01")]:
        ran_out.check(t, e)
    with pytest.raises(WindowPairingError, match=r"'hour=02' \(pair 3\) meets no eval window"):
        ran_out.check("hour=02", None)
    unrelated = WindowPairing()  # ids that name other things pair by position, unchecked
    for t, e in [("s0", "obd"), ("s1", "synthetic"), ("s2", None)]:
        unrelated.check(t, e)


def test_a_drift_between_two_t_and_t_plus_1_listings_is_an_error_before_the_wrong_pair_is_evaluated(
        tmp_path) -> None:
    write_windows(str(tmp_path / "train"), [[8], [8], [8]])
    write_windows(str(tmp_path / "eval"), [[4]] * 5, first_row_id=100)
    listing = partitioned_windows(str(tmp_path / "eval"))
    # Train hours 00-02, evaluated on the next hour from another listing, which lacks hour 02.
    out = _run(str(tmp_path), eval_=[w for w in listing if w.id != "hour=02"][1:])
    assert out["error"] is not None and (
        "train window 'hour=01' (pair 2) would be evaluated on eval window 'hour=03', but the "
        "train window after it is 'hour=02'") in out["error"]
    # Before: train hour 01 was evaluated on hour 03 (metrics reported), then the error came.
    assert out["pairs"] == [("hour=00", "hour=01")]
    assert out["trained"] == ["hour=00", "hour=01"]
    whole = _run(str(tmp_path), eval_=listing[1:4])
    assert whole["error"] is None
    assert whole["pairs"] == [("hour=00", "hour=01"), ("hour=01", "hour=02"), ("hour=02", "hour=03")]


def _two_rank_worker(root: str) -> dict[str, Any]:
    return {"marked": _run(os.path.join(root, "marked")), "bare": _run(os.path.join(root, "bare"))}


@pytest.mark.distributed
def test_two_ranks_pair_rank_0s_listing_of_an_empty_eval_hour_the_same_way(tmp_path) -> None:
    from dist_utils import run_distributed

    for case in ("marked", "bare"):
        _write(str(tmp_path / case), case)
    r0, r1 = run_distributed(_two_rank_worker, 2, timeout_s=180, args=(str(tmp_path),))
    for r in (r0, r1):
        assert r["marked"]["error"] is None and r["marked"]["pairs"] == SAME_HOURS
        assert "meets eval window 'hour=02'" in r["bare"]["error"]
        assert r["bare"]["trained"] == ["hour=00"]
    # Every eval row once over both ranks; hour 01 is 0 rows on each.
    per_window = [sorted(a + b) for a, b in zip(r0["marked"]["rows"], r1["marked"]["rows"], strict=True)]
    assert per_window == [[100, 101, 102, 103], [], [104, 105, 106, 107]]
    assert r0["bare"]["step"] == r1["bare"]["step"] == 1
