"""``Follower`` (recsys_trainer/serving/runtime/follow.py) on a published location built by hand from
real exports (tests/follow_utils.py): base -> delta -> delta scoring exactly as the full
exports, atomic swaps under concurrent scoring, a missing or corrupt delta (the next base is
loaded), an unreadable base or pointer (the last good model stays, with a named error)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time

import follow_utils as fu
import numpy as np
import pytest

from recsys_trainer.serving import Scorer
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.runtime.follow import Follower, FollowError, NoModelError, follow


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> fu.Chain:
    return fu.build_chain(str(tmp_path_factory.mktemp("chain")))


@pytest.mark.timeout(60)
def test_the_follower_moves_base_delta_delta_scoring_as_the_full_export_at_each_step(
        chain: fu.Chain, tmp_path, caplog) -> None:
    loc = chain.fresh_location(str(tmp_path / "pub"))
    f = Follower(loc, poll_s=60)
    assert not f.poll_once() and f.served is None and f.last_error is None  # nothing published
    with pytest.raises(NoModelError, match="no model is served yet"):
        f.score(chain.rows)

    chain.point(loc, 1, "bases/b0", (), 1)
    assert f.poll_once()
    first = f.served
    assert first is not None and (first.step, first.sequence, first.window) == (1, 1, "hour=01")
    assert first.content_hash == chain.hashes[1] and first.window_time == 1.7e9 + 1
    assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1), chain.expected[1])

    caplog.set_level(logging.INFO, logger="recsys_trainer.serving.runtime.follow")
    chain.point(loc, 2, "bases/b0", ("deltas/d1",), 3)
    assert f.poll_once()
    second = f.served
    assert second is not None and second.step == 3 and second.content_hash == chain.hashes[3]
    assert second.deltas == ("deltas/d1",) and "+1 delta(s)" in caplog.text  # incremental
    assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1), chain.expected[3])
    # The swapped-out scorer was never touched: the delta went onto a copy.
    assert np.array_equal(first.scorer.score(chain.rows).reshape(len(chain.rows), -1),
                          chain.expected[1])

    chain.point(loc, 3, "bases/b0", ("deltas/d1", "deltas/d2"), 5)
    assert f.poll_once()
    third = f.served
    assert third is not None and (third.step, third.sequence) == (5, 3)
    assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1), chain.expected[5])
    assert np.array_equal(second.scorer.score(chain.rows).reshape(len(chain.rows), -1),
                          chain.expected[3])
    assert not f.poll_once() and f.served is third  # nothing new: nothing reloaded
    # The same state republished (a new sequence): what is said of it moves, the model stays.
    chain.point(loc, 4, "bases/b0", ("deltas/d1", "deltas/d2"), 5, window="hour=09")
    assert not f.poll_once()
    fourth = f.served
    assert fourth is not None and fourth.scorer is third.scorer
    assert (fourth.sequence, fourth.window, fourth.loaded_at) == (4, "hour=09", third.loaded_at)
    assert f.last_error is None


@pytest.mark.timeout(60)
def test_scoring_threads_during_swaps_never_fail_and_always_get_the_old_or_the_new_model(
        chain: fu.Chain, tmp_path) -> None:
    loc = chain.fresh_location(str(tmp_path / "pub"))
    chain.point(loc, 1, "bases/b0", (), 1)
    f = Follower(loc, poll_s=60)
    assert f.poll_once()
    rows = chain.rows
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[tuple[int | None, int | None]] = []

    def scoring() -> None:
        while not stop.is_set():
            try:
                scores, served = f.score_with_model(rows)
                seen.append((chain.step_of(scores), served.step))
            except BaseException as e:  # noqa: BLE001 - collected, asserted below
                errors.append(e)
                return

    threads = [threading.Thread(target=scoring) for _ in range(2)]
    for t in threads:
        t.start()
    states = [("bases/b0", ("deltas/d1",), 3), ("bases/b0", ("deltas/d1", "deltas/d2"), 5),
              ("bases/b0", (), 1)]  # the last one: a full reload of the base
    seq = 1
    try:
        for _ in range(2):
            for base, deltas, step in states:
                seq += 1
                chain.point(loc, seq, base, deltas, step)
                assert f.poll_once()
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert f.swaps == 7 and len(seen) > 14
    # Every score is exactly one full export's, and the one of the state it says it came from.
    assert all(got == said for got, said in seen), [s for s in seen if s[0] != s[1]][:5]
    assert {s for s, _ in seen} == {1, 3, 5}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_a_missing_or_corrupt_delta_keeps_the_last_good_model_then_the_next_base_is_loaded(
        chain: fu.Chain, tmp_path, caplog, damage: str) -> None:
    loc = chain.fresh_location(str(tmp_path / "pub"))
    chain.point(loc, 1, "bases/b0", ("deltas/d1",), 3)
    f = Follower(loc, poll_s=60, retry_s=0)
    assert f.poll_once() and f.served is not None and f.served.step == 3
    d2 = os.path.join(loc, "deltas", "d2")
    if damage == "deleted":
        chain.point(loc, 2, "bases/b0", ("deltas/d1", "deltas/d2"), 5)
        shutil.rmtree(d2)
    else:
        with open(os.path.join(d2, "delta.safetensors"), "r+b") as fh:
            fh.seek(100)
            fh.write(b"\xff\xfe\xfd\xfc")
        chain.point(loc, 2, "bases/b0", ("deltas/d1", "deltas/d2"), 5)
    assert not f.poll_once()
    error = f.last_error
    assert isinstance(error, FollowError) and error.kind == "delta" and error.sequence == 2
    assert "deltas/d2" in str(error) and "until the training job publishes a new base" in str(error)
    assert "the delta deltas/d2" in caplog.text and "loading the pointer's base bases/b0" in caplog.text
    # Never a wrong model: still the last good one, scoring exactly as before.
    assert f.served is not None and f.served.step == 3 and f.served.sequence == 1
    assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1), chain.expected[3])
    # The training job publishes a new base: it is loaded, the error is gone.
    fu.add_base(chain, loc, "b1", 5)
    chain.point(loc, 3, "bases/b1", (), 5)
    assert f.poll_once()
    assert f.served is not None and (f.served.step, f.served.base) == (5, "bases/b1")
    assert f.last_error is None
    assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1), chain.expected[5])


@pytest.mark.timeout(60)
def test_an_unreadable_base_or_a_corrupt_pointer_keeps_the_last_good_model_with_a_named_error(
        chain: fu.Chain, tmp_path) -> None:
    loc = chain.fresh_location(str(tmp_path / "pub"))
    chain.point(loc, 1, "bases/b0", ("deltas/d1",), 3)
    f = Follower(loc, poll_s=60, retry_s=0)
    assert f.poll_once()
    # A base whose tables are corrupt (committed, so the pointer check passes).
    ref = fu.add_base(chain, loc, "b1", 5)
    with open(os.path.join(loc, ref, "tables.safetensors"), "r+b") as fh:
        fh.seek(200)
        fh.write(b"\x00\x01\x02\x03")
    chain.point(loc, 2, ref, (), 5)
    assert not f.poll_once()
    error = f.last_error
    assert error is not None and error.kind == "base" and "bases/b1" in str(error)
    assert "serving the last good model (sequence 1, step 3)" in str(error)
    assert f.served is not None and f.served.step == 3
    assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1), chain.expected[3])
    # A base that is not there at all (a pointer written without the check).
    chain.point(loc, 3, "bases/gone", (), 5, check=False)
    assert not f.poll_once()
    assert f.last_error is not None and f.last_error.kind == "base"
    assert "bases/gone" in str(f.last_error) and f.served.step == 3
    # A corrupt pointer.
    with open(os.path.join(loc, "LATEST"), "w") as fh:
        fh.write('{"format": "recsys_trainer.pub')
    assert not f.poll_once()
    assert f.last_error is not None and f.last_error.kind == "pointer"
    assert "LATEST" in str(f.last_error) and f.served.step == 3
    # Fixed by the next publish: followed, the error cleared.
    chain.point(loc, 4, "bases/b0", ("deltas/d1", "deltas/d2"), 5)
    assert f.poll_once() and f.last_error is None and f.served.step == 5
    json_error = FollowError("x", kind="base", sequence=2).to_json()
    assert json_error["kind"] == "base" and json_error["error"] == "FollowError"


@pytest.mark.timeout(60)
def test_follow_polls_in_a_background_thread_until_stopped(chain: fu.Chain,
                                                                   tmp_path) -> None:
    loc = chain.fresh_location(str(tmp_path / "pub"))
    chain.point(loc, 1, "bases/b0", (), 1)
    f = follow(loc, poll_s=0.05)
    try:
        assert f.served is not None and f.served.step == 1  # polled once before returning
        chain.point(loc, 2, "bases/b0", ("deltas/d1",), 3)
        deadline = time.monotonic() + 20
        while f.served.step != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert f.served.step == 3
        assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1),
                              chain.expected[3])
    finally:
        f.stop()
    assert f._thread is None
    chain.point(loc, 3, "bases/b0", ("deltas/d1", "deltas/d2"), 5)
    time.sleep(0.2)
    assert f.served.step == 3  # stopped: no more polls


@pytest.mark.timeout(30)
def test_a_scorer_copy_takes_a_delta_while_the_original_is_unchanged(chain: fu.Chain) -> None:
    original = Scorer(chain.full[1])
    copy = original.copy()
    copy.apply_delta(os.path.join(chain.pub, "deltas", "d1"))
    n = len(chain.rows)
    assert np.array_equal(copy.score(chain.rows).reshape(n, -1), chain.expected[3])
    assert np.array_equal(original.score(chain.rows).reshape(n, -1), chain.expected[1])
    assert original.step == 1 and original.applied_deltas == [] and len(copy.applied_deltas) == 1


@pytest.mark.timeout(90)
def test_the_follower_follows_a_location_on_the_s3_server(chain: fu.Chain, request) -> None:
    from s3_server import upload_dir

    from recsys_trainer import storage

    server = request.getfixturevalue("s3_server")
    fs = server.filesystem()
    prefix = f"follow/{request.node.name}"
    upload_dir(fs, chain.pub, f"{server.bucket}/{prefix}")
    url = server.url(prefix)
    loc = storage.resolve(url, fs)
    chain.point(loc, 1, "bases/b0", (), 1)
    f = Follower(url, filesystem=fs, poll_s=60)
    assert f.poll_once() and f.served is not None and f.served.step == 1
    chain.point(loc, 2, "bases/b0", ("deltas/d1",), 3)
    assert f.poll_once() and f.served.step == 3 and f.served.deltas == ("deltas/d1",)
    assert np.array_equal(f.score(chain.rows).reshape(len(chain.rows), -1), chain.expected[3])
    # Credentials the store refuses: a named storage error, no model.
    denied = Follower(url, filesystem=server.filesystem("nobody", "wrong"), poll_s=60)
    assert not denied.poll_once() and denied.served is None
    assert denied.last_error is not None and denied.last_error.kind == "storage"
    assert url in str(denied.last_error)


@pytest.mark.timeout(60)
def test_an_older_pointer_is_never_followed_back_but_a_location_started_over_is(
        chain: fu.Chain, tmp_path) -> None:
    loc = chain.fresh_location(str(tmp_path / "pub"))
    chain.point(loc, 5, "bases/b0", ("deltas/d1",), 3)
    f = Follower(loc)
    assert f.poll_once() and f.served is not None and f.served.sequence == 5
    # A stale publisher (its job restarted meanwhile) writes an older sequence, published
    # before the served one: the follower keeps the newer model.
    stale = pub.Pointer(sequence=4, base="bases/b0", deltas=(), step=1,
                        content_hash=chain.hashes[1], window="hour=01", window_time=1.7e9 + 1,
                        published_at=f.served.published_at - 10)
    pub.write_pointer(loc, stale)
    assert not f.poll_once() and f.served.sequence == 5 and f.served.step == 3
    # A location started over (sequence 1 again, published later): followed.
    chain.point(loc, 1, "bases/b0", (), 1)
    assert f.poll_once() and f.served.sequence == 1 and f.served.step == 1
