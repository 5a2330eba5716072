"""Checkpointing through the Trainer, in one process (world size 1): triggers, async saves,
idempotency, resume, rotation across restarts, crash leftovers, corrupt files, content,
save filters, model bank and export. The 2-rank tests live in test_checkpoint_dist.py and reuse
the builders below."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from recsys_trainer import Hook, SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    export_model_state_dict,
    layout,
    writer,
)
from recsys_trainer.checkpoint.export import read_full, saved_keys
from recsys_trainer.data.base import Segment, WindowedDataset
from recsys_trainer.data.generators.synthetic import PlantedSignal, synthetic_batches
from recsys_trainer.distributed import FakeGang
from recsys_trainer.hooks import SaveRequest
from recsys_trainer.models import DLRMClassifier
from recsys_trainer.storage import file_digest

pytestmark = pytest.mark.timeout(300)

FEATS = ["f0", "f1", "f2", "f3"]
NUM_DENSE = 4
ROWS = 200


class RowWindows(WindowedDataset):
    """Deterministic windows of global batches; rank r of n reads batches r, r+n, ... Each row's
    global id rides in ``dense[:, 0]`` (scaled by 1e-3) so tests can count rows read."""

    def __init__(self, num_windows: int = 2, batches_per_window: int = 8, batch_size: int = 16,
                 seed: int = 0) -> None:
        self.num_windows, self.bpw, self.bs, self.seed = num_windows, batches_per_window, batch_size, seed
        self.rank, self.world_size, self.epoch = 0, 1, 0
        self.signal = PlantedSignal.make(len(FEATS), NUM_DENSE, ROWS, seed=7, strength=1.5)

    def setup(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # row ids are unique per epoch: (epoch, row) -> epoch * 10000 + row

    def window_ids(self) -> Iterator[str]:
        yield from (f"w{i}" for i in range(self.num_windows))

    def _global(self, window_id: str) -> list[Batch]:
        w = int(window_id[1:])
        out = synthetic_batches(self.bpw, self.bs, FEATS, NUM_DENSE, ROWS,
                                seed=self.seed * 1000 + w, signal=self.signal)
        for i, b in enumerate(out):
            first = self.epoch * 10000 + (w * self.bpw + i) * self.bs
            b.dense[:, 0] = torch.arange(first, first + self.bs, dtype=torch.float32) * 1e-3
        return out

    exact_reshard = True

    def iter_window(self, window_id: str, skip_batches: int = 0, *,
                    earlier: Sequence[Segment] = ()) -> Iterator[Batch]:
        left = self._global(window_id)
        for seg in earlier:  # what each earlier part's ranks did not train, in batch order
            consumed = {i for r in range(seg.world_size)
                        for i in list(range(len(left)))[r::seg.world_size][:seg.batches]}
            left = [b for i, b in enumerate(left) if i not in consumed]
        mine = left[self.rank::self.world_size]
        return iter(mine[skip_batches:])


def row_ids(batch: Batch) -> list[int]:
    return [int(round(v * 1000)) for v in batch.dense[:, 0].tolist()]


class RowRecorder(Hook):
    """Records the ids of every trained row; has checkpointable state (a counter)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.counter = 0
        self.events: list[tuple[str, str]] = []

    def after_data(self, trainer: Trainer, batch: Batch) -> None:
        if trainer.state.mode == "train":
            self.rows.extend(row_ids(batch))
            self.counter += 1

    def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
        self.events.append(("saved", os.path.basename(path)))

    def after_load_checkpoint(self, trainer: Trainer, path: str) -> None:
        self.events.append(("loaded", os.path.basename(path)))

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counter = state["counter"]


def build(output_dir: str, ds: Any = None, hooks: list[Hook] | None = None,
          feats: list[str] | None = None, rows: list[int] | None = None,
          checkpointer: CheckpointManager | None = None, **args: Any) -> Trainer:
    """A tiny DLRM trainer with dense Adam + StepLR and fused row-wise Adagrad tables."""
    feats = feats or FEATS
    torch.manual_seed(0)
    model = DLRMClassifier(feats, NUM_DENSE, rows or ROWS, embedding_dim=8, dense_arch=(16,),
                           over_arch=(16, 1))
    args.setdefault("log_steps", 1000)
    args.setdefault("sharding_types", {f"t_{f}": "table_wise" for f in feats})
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=output_dir, **args),
        train_dataset=ds,
        hooks=hooks or [],
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2),
                          lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False,
        checkpointer=checkpointer,
    )


def local(t: Any) -> torch.Tensor:
    """A tensor's local part (all local shards concatenated) for comparisons."""
    if isinstance(t, ShardedTensor):
        shards = t.local_shards()
        return torch.cat([s.tensor.reshape(-1) for s in shards]) if shards else torch.empty(0)
    return t.detach().reshape(-1)


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every tensor of the training state this rank holds: model, both optimizers, lr."""
    out = {f"model.{k}": local(v).clone() for k, v in trainer.model.state_dict().items()}
    for pk, entry in trainer.optimizer.state_dict()["state"].items():
        for sk, v in entry.items():
            out[f"optim.{pk}.{sk}"] = local(v).clone()
    out["lr"] = torch.tensor(trainer.dense_lr())
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"


def bitwise_verdict(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """"yes" when the two snapshots are bitwise equal, else what differs: picklable, for a
    spawned rank to report to the test."""
    try:
        assert_bitwise_equal(a, b)
    except AssertionError as e:
        return str(e)
    return "yes"


def committed_steps(output_dir: str) -> list[int]:
    return [i.step for i in layout.list_committed(output_dir)]


def manager(trainer: Trainer) -> CheckpointManager:
    return trainer.checkpointer


# ---------------------------------------------------------------------------- layout & triggers

def test_save_steps_writes_step_dirs_with_marker_index_and_all_files_listed(tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), save_steps=3, train_steps=7, max_to_keep=10).train()
    assert committed_steps(out) == [3, 6]
    ckpt = os.path.join(out, "step_00000006")
    manifest = layout.read_manifest(ckpt)
    assert manifest is not None and manifest["step"] == 6 and manifest["world_size"] == 1
    on_disk = set(os.listdir(ckpt)) - {layout.MARKER, "args.json"}
    assert on_disk == set(manifest["files"]), "the manifest must cover every data file"
    assert any(n.endswith(".distcp") for n in on_disk) and ".metadata" in on_disk
    index = json.load(open(os.path.join(out, layout.INDEX)))
    assert [c["step"] for c in index["checkpoints"]] == [3, 6] and index["latest"] == "step_00000006"
    assert json.load(open(os.path.join(ckpt, "args.json")))["save_steps"] == 3


def test_window_epoch_and_end_triggers_save_at_their_boundaries_and_final_step_once(tmp_path: Any) -> None:
    # 2 windows x 8 batches per epoch, 2 epochs: windows end at steps 8, 16, 24, 32.
    out = str(tmp_path / "w")
    rec = RowRecorder()
    build(out, RowWindows(), hooks=[rec], save_every_n_windows=3, train_epoch=2, max_to_keep=10).train()
    assert committed_steps(out) == [24]
    out = str(tmp_path / "e")
    build(out, RowWindows(), save_every_n_epochs=1, save_end=True, train_epoch=2, max_to_keep=10).train()
    assert committed_steps(out) == [16, 32]  # the end coincides with epoch 2: saved once
    out = str(tmp_path / "s")
    rec = RowRecorder()
    build(out, RowWindows(), hooks=[rec], save_steps=5, save_end=True, train_steps=10,
          max_to_keep=10).train()
    assert committed_steps(out) == [5, 10]
    assert [e for e in rec.events if e[0] == "saved"] == [("saved", "step_00000005"),
                                                          ("saved", "step_00000010")]


def test_save_concurrency_per_rank_sets_the_number_of_shard_files(tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), save_steps=2, train_steps=2, save_concurrency_per_rank=3).train()
    files = [n for n in os.listdir(os.path.join(out, "step_00000002")) if n.endswith(".distcp")]
    assert len(files) == 3


def _slow_writes(monkeypatch: Any, delay: float, log: list[tuple[str, int, float]]) -> None:
    """Make every checkpoint write take ``delay`` s longer and log start/end with concurrency."""
    real = CheckpointManager._write
    active = [0]
    lock = threading.Lock()

    def slow(self: CheckpointManager, path: str, *a: Any, **kw: Any) -> Any:
        with lock:
            active[0] += 1
            log.append(("start", active[0], time.perf_counter()))
        try:
            time.sleep(delay)
            return real(self, path, *a, **kw)
        finally:
            with lock:
                active[0] -= 1
                log.append(("end", active[0], time.perf_counter()))

    monkeypatch.setattr(CheckpointManager, "_write", slow)


def test_async_save_snapshots_the_step_while_the_loop_continues_one_save_in_flight(
        tmp_path: Any, monkeypatch: Any) -> None:
    log: list[tuple[str, int, float]] = []
    _slow_writes(monkeypatch, 0.3, log)
    at_step: dict[int, dict[str, torch.Tensor]] = {}
    steps_while_writing: list[int] = []

    class Capture(Hook):
        def after_step(self, trainer: Trainer, output: Any) -> None:
            at_step[trainer.state.global_step] = snapshot(trainer)
            if manager(trainer).in_flight:
                steps_while_writing.append(trainer.state.global_step)

    out = str(tmp_path)
    t = build(out, RowWindows(), hooks=[Capture()], save_steps=2, train_steps=8, max_to_keep=10)
    t.train()
    assert committed_steps(out) == [2, 4, 6, 8]
    assert max(n for kind, n, _ in log if kind == "start") == 1, "two saves were in flight at once"
    assert steps_while_writing, "the loop never ran while a save was being written"
    # The checkpoint holds the state of its own step, not of the steps run during the write.
    t2 = build(str(tmp_path / "other"), RowWindows())
    t2.load_checkpoint(os.path.join(out, "step_00000002"))
    assert_bitwise_equal(snapshot(t2), at_step[2])
    stats = manager(t).history
    assert [s.step for s in stats] == [2, 4, 6, 8]
    assert all(s.blocked_s < s.total_s for s in stats)


def test_an_exception_in_the_loop_drains_the_in_flight_save_before_propagating(
        tmp_path: Any, monkeypatch: Any) -> None:
    log: list[tuple[str, int, float]] = []
    _slow_writes(monkeypatch, 0.5, log)

    class Boom(Hook):
        def after_step(self, trainer: Trainer, output: Any) -> None:
            if trainer.state.global_step == 3:
                raise RuntimeError("boom")

    out = str(tmp_path)
    t = build(out, RowWindows(), hooks=[Boom()], save_steps=2, train_steps=8)
    with pytest.raises(RuntimeError, match="boom"):
        t.train()
    assert committed_steps(out) == [2]
    assert not manager(t).in_flight


def test_saving_the_same_step_twice_is_idempotent(tmp_path: Any) -> None:
    out = str(tmp_path)
    t = build(out, RowWindows(), train_steps=3)
    t.train()
    p1 = t.save_checkpoint()
    before = open(os.path.join(p1, layout.MARKER)).read()
    p2 = t.save_checkpoint()
    assert p1 == p2 and open(os.path.join(p1, layout.MARKER)).read() == before
    assert committed_steps(out) == [3]


# ---------------------------------------------------------------------------- components

def test_the_trainer_hands_its_state_to_the_checkpointer_as_named_stateful_components(
        tmp_path: Any) -> None:
    from torch.distributed.checkpoint.stateful import Stateful

    comps = build(str(tmp_path), RowWindows()).state_components()
    assert set(comps) == {"model", "dense_optimizer", "sparse_optimizer", "trainer_state", "rng",
                          "hooks", "non_finite", "lr_scheduler", "train_dataset", "vocabularies"}
    assert all(isinstance(c, Stateful) for c in comps.values())


def test_optimizer_state_initialises_lazily_made_state_and_loads_by_parameter_name(
        tmp_path: Any) -> None:
    trained = build(str(tmp_path / "a"), RowWindows(), train_steps=3)
    trained.train()
    fresh = build(str(tmp_path / "b"), RowWindows())
    dense = fresh.optimizer.dense_state
    params_before = [p.detach().clone() for p in fresh.dense_params]
    dense.init_state()  # Adam's moments exist now; the parameters did not move
    assert fresh.optimizer.dense.state
    assert all(torch.equal(p, b) for p, b in zip(fresh.dense_params, params_before, strict=True))
    saved = trained.optimizer.dense_state.state_dict()
    some = dict(list(saved["state"].items())[:2])
    dense.load_state_dict({"state": some, "param_groups": saved["param_groups"]})
    mine = dense.state_dict()
    for name, entry in mine["state"].items():
        same = all(torch.equal(entry[k], saved["state"][name][k]) for k in entry)
        assert same == (name in some), name  # the others keep their own state
    assert mine["param_groups"] == saved["param_groups"]
    with pytest.raises(ValueError, match="parameters this optimizer does not have"):
        dense.load_state_dict({"state": {"nope.weight": {}}})


# ---------------------------------------------------------------------------- collectives (FakeGang)
# The manager's control collectives go through its Gang: a FakeGang playing rank 0 of 2 scripts
# what the other rank reports, so the cross-rank failure handling runs in one process.

def _fake_rank0(out: str, **gang: Any) -> Trainer:
    t = build(out, RowWindows(), train_steps=2,
              checkpointer=CheckpointManager(out, gang=FakeGang(rank=0, world_size=2, **gang)))
    t.train()
    return t


def test_a_peer_that_cannot_prepare_the_directory_fails_the_save_on_this_rank_too(
        tmp_path: Any) -> None:
    t = _fake_rank0(str(tmp_path), peer_objects=[["PermissionError: denied"]])
    with pytest.raises(CheckpointError, match=r"rank 1: PermissionError: denied") as e:
        t.save_checkpoint()
    assert e.value.kind == "save_failed" and committed_steps(str(tmp_path)) == []


def test_a_peer_that_fails_to_write_its_files_leaves_the_checkpoint_uncommitted(
        tmp_path: Any) -> None:
    # First gather: the directory is ready everywhere; second: rank 1 could not write.
    t = _fake_rank0(str(tmp_path), peer_objects=[[None], [({}, "OSError: disk full")]])
    with pytest.raises(CheckpointError, match=r"committing .* failed: rank 1: OSError: disk full"):
        t.save_checkpoint()
    assert not layout.is_committed(os.path.join(str(tmp_path), "step_00000002"))


def test_ranks_that_see_different_checkpoints_refuse_to_resume(tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=2, save_steps=2).train()
    # This rank sees step 2; the other rank (scripted) sees step 4.
    t = build(out, RowWindows(), checkpointer=CheckpointManager(
        out, gang=FakeGang(rank=0, world_size=2, peer_max=[[4, -4, 0]])))
    with pytest.raises(CheckpointError, match="ranks disagree on the checkpoint to resume from"):
        t.resume()
    # The other rank sees an older step (0, none): this rank notices too, instead of loading
    # alone while the other raises.
    t = build(out, RowWindows(), checkpointer=CheckpointManager(
        out, gang=FakeGang(rank=0, world_size=2, peer_max=[[-1, 1, 0]])))
    with pytest.raises(CheckpointError, match=r"sees step 2, others between -1 and 2"):
        t.resume()


class LogCapture(logging.Handler):
    """The records of one logger (the project's loggers may not propagate to pytest's)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.logger = logging.getLogger(name)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> LogCapture:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.logger.removeHandler(self)


def _shards(ckpt: str) -> list[str]:
    return sorted(os.path.join(ckpt, n) for n in os.listdir(ckpt) if n.endswith(".distcp"))


def test_auto_resume_falls_back_past_a_checkpoint_missing_a_shard_and_moves_it_aside(
        tmp_path: Any) -> None:
    out = str(tmp_path / "out")
    build(out, RowWindows(), train_steps=6, save_steps=2, max_to_keep=10).train()
    # What a run resumed from step 4 by its path ends with.
    ref = build(str(tmp_path / "ref"), RowWindows(), train_steps=10,
                resume_from=os.path.join(out, "step_00000004"))
    ref.train()
    bad = os.path.join(out, "step_00000006")
    lost = _shards(bad)[0]
    os.remove(lost)  # committed, then a file lost: the manifest still lists it
    rec = RowRecorder()
    with LogCapture("recsys_trainer.checkpoint.manager") as log:
        t = build(out, RowWindows(), hooks=[rec], train_steps=10, save_steps=2, max_to_keep=2)
        t.train()
    assert rec.events[0] == ("loaded", "step_00000004")
    assert_bitwise_equal(snapshot(t), snapshot(ref))
    moved = [n for n in os.listdir(out) if n.startswith("step_00000006" + layout.QUARANTINE_INFIX)]
    assert len(moved) == 1, os.listdir(out)
    kept = os.path.join(out, moved[0])
    warning = next(m for m in log.messages if "fails verification" in m)
    assert bad in warning and os.path.basename(lost) in warning and "is missing" in warning
    assert kept in warning
    # Kept for inspection, whole but for the lost file, with the reason; never listed again.
    assert set(os.listdir(kept)) >= {"COMMITTED", ".metadata", "rank_00000.pt", "UNVERIFIED.txt"}
    assert os.path.basename(lost) in open(os.path.join(kept, "UNVERIFIED.txt")).read()
    # This run saved 6 again itself; rotation (max_to_keep=2) kept the checkpoint it resumed
    # from, so the directory never holds only checkpoints newer than the last good one.
    assert committed_steps(out) == [4, 8, 10]
    # An explicit path stays strict, and says what to do.
    with pytest.raises(CheckpointError, match=r"is missing: its COMMITTED manifest lists it") as e:
        build(str(tmp_path / "strict"), RowWindows(), train_steps=12, resume_from=kept).train()
    assert e.value.path == os.path.join(kept, os.path.basename(lost)) and e.value.kind == "corrupt"
    assert "Load an older one by its path" in str(e.value) and "resume_from='auto'" in str(e.value)
    with pytest.raises(CheckpointError, match=r"is missing: its COMMITTED manifest lists it"):
        build(str(tmp_path / "strict"), RowWindows(), resume_from=kept).resume(mode="scoring")


def test_auto_resume_with_no_checkpoint_that_verifies_is_an_error_not_a_fresh_start(
        tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=2, save_steps=2).train()
    shard = _shards(os.path.join(out, "step_00000002"))[0]
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"no committed checkpoint in .* verifies.*step 2 "
                                              r"\(rank 0: .*CRC32"):
        build(out, RowWindows(), train_steps=3, save_steps=2).train()
    # Nothing to fall back to: nothing is moved aside, so a restart meets the same error
    # instead of an output_dir that looks empty.
    assert committed_steps(out) == [2]
    assert not [n for n in os.listdir(out) if layout.QUARANTINE_INFIX in n]


def test_a_checkpoint_that_fails_verification_on_another_rank_is_skipped_on_every_rank(
        tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=4, save_steps=2, max_to_keep=5).train()
    # This rank (0 of 2) verifies step 4; the other rank reports a bad file in it.
    peer = ("checkpoint step 4: file 'x/__1_0.distcp' fails its CRC32 check", "x/__1_0.distcp",
            "corrupt")
    rec = RowRecorder()
    t = build(out, RowWindows(), hooks=[rec], checkpointer=CheckpointManager(
        out, reshard_data_position="restart_window",  # the checkpoints have world size 1
        gang=FakeGang(rank=0, world_size=2, peer_max=[[4, -4, 1]], peer_objects=[[peer]])))
    with LogCapture("recsys_trainer.checkpoint.manager") as log:
        t.resume()
    assert rec.events == [("loaded", "step_00000002")] and t.state.global_step == 2
    assert any("rank 1: checkpoint step 4: file 'x/__1_0.distcp' fails its CRC32" in m
               for m in log.messages)


# ---------------------------------------------------------------------------- resume & rotation

def test_resume_from_newest_checkpoint_is_bitwise_identical_and_reads_each_row_once(tmp_path: Any) -> None:
    full_rec = RowRecorder()
    full = build(str(tmp_path / "full"), RowWindows(), hooks=[full_rec], train_steps=13)
    full.train()
    out = str(tmp_path / "cut")
    first = RowRecorder()
    build(out, RowWindows(), hooks=[first], train_steps=5, save_steps=5).train()
    second = RowRecorder()
    resumed = build(out, RowWindows(), hooks=[second], train_steps=13)
    resumed.train()
    assert ("loaded", "step_00000005") in second.events
    assert resumed.state.global_step == 13
    assert_bitwise_equal(snapshot(resumed), snapshot(full))
    assert sorted(first.rows + second.rows) == sorted(full_rec.rows)
    assert len(set(first.rows + second.rows)) == len(first.rows + second.rows)
    assert second.counter == full_rec.counter, "hook state was not restored"


def test_a_run_with_eval_data_resumes_a_checkpoint_saved_without_any(tmp_path: Any) -> None:
    """Eval data added mid-project: ``run: train`` saved no eval-dataset state (an empty entry),
    and a ``train_and_evaluate`` with a parquet eval dataset resumes from it in full. The empty
    entry used to reach the dataset: "ParquetWindowDataset state keys differ: missing [...]"."""
    from data_utils import row_id_spec, row_ids, write_windows

    from recsys_trainer.data.parquet import ParquetWindowDataset
    from recsys_trainer.hooks.lambda_hook import LambdaHook

    write_windows(str(tmp_path / "train"), [[8], [8], [8]])
    write_windows(str(tmp_path / "eval"), [[4], [4], [4]], first_row_id=100)
    spec, out = row_id_spec(), str(tmp_path / "out")
    trained: list[int] = []
    evaluated: list[int] = []

    def rows(t: Trainer, batch: Batch) -> None:
        (trained if t.state.mode == "train" else evaluated).extend(row_ids(batch))

    def trainer(with_eval: bool, **args: Any) -> Trainer:
        torch.manual_seed(0)
        model = DLRMClassifier(spec.sparse_names, spec.num_dense, [s.num_embeddings for s in spec.sparse],
                               embedding_dim=4, dense_arch=(4,), over_arch=(4, 1))
        return Trainer(
            model, TrainingArguments(output_dir=out, log_steps=1000, **args),
            train_dataset=ParquetWindowDataset(str(tmp_path / "train"), spec, batch_size=4),
            eval_dataset=ParquetWindowDataset(str(tmp_path / "eval"), spec, batch_size=4) if with_eval else None,
            sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.05),
            hooks=[LambdaHook(after_data=rows)], add_logger_hook=False)

    trainer(False, train_steps=3, save_steps=3).train()
    assert committed_steps(out) == [3]
    resumed = trainer(True, save_end=True)
    resumed.train_and_evaluate()
    assert resumed.state.global_step == 6 and committed_steps(out) == [3, 6]
    assert sorted(trained) == list(range(24))  # every train row once over both runs
    # Windows 1 and 2 were trained (and evaluated) after the resume; window 0's pair was not.
    assert sorted(evaluated) == list(range(104, 112))
    # A dataset the checkpoint holds, configured otherwise: the error says which one, and how
    # to score the model instead (a scoring restore takes no dataset state).
    changed = trainer(True)
    changed.eval_dataset.batch_size = 8  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"cannot restore `eval_dataset` from the checkpoint: "
                                         r"cannot resume this dataset .*\(batch_size: saved 4, now 8\)") as e:
        changed.resume()
    assert "resume(mode='scoring')" in str(e.value)
    scorer = trainer(True)
    scorer.eval_dataset.batch_size = 8  # type: ignore[union-attr]
    scorer.resume(mode="scoring")
    assert scorer.state.global_step == 6


def test_resume_from_an_explicit_path_and_none_starts_fresh(tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=4, save_steps=2, max_to_keep=10).train()
    t = build(str(tmp_path / "elsewhere"), RowWindows(), train_steps=5,
              resume_from=os.path.join(out, "step_00000002"))
    t.train()
    assert t.state.global_step == 5
    fresh = build(out, RowWindows(), train_steps=1, resume_from=None)
    fresh.train()
    assert fresh.state.global_step == 1
    with pytest.raises(CheckpointError, match="does not exist"):
        build(out, RowWindows(), train_steps=1, resume_from=str(tmp_path / "nope")).train()


def test_rotation_keeps_the_newest_from_disk_across_restarts_and_the_resumed_one(tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=6, save_steps=1, max_to_keep=2).train()
    assert committed_steps(out) == [5, 6]
    # A restart: the rotation state comes from disk; the checkpoint resumed from is protected.
    build(out, RowWindows(), train_steps=9, save_steps=1, max_to_keep=2).train()
    assert committed_steps(out) == [6, 8, 9]
    index = json.load(open(os.path.join(out, layout.INDEX)))
    assert [c["step"] for c in index["checkpoints"]] == [6, 8, 9]


def test_rotation_never_deletes_the_checkpoint_just_committed_when_newer_steps_exist(
        tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=6, save_steps=3, max_to_keep=5).train()
    assert committed_steps(out) == [3, 6]
    # Roll back to step 3 by hand, train one step, save: step 6 is newer on disk, but the step
    # just saved is this run's latest state.
    t = build(out, RowWindows(), train_steps=4, max_to_keep=1, resume_from=None)
    t.load_checkpoint(os.path.join(out, "step_00000003"))
    t.train()
    assert t.save_checkpoint() == os.path.join(out, "step_00000004")
    assert committed_steps(out) == [4, 6]


def test_saving_next_to_newer_checkpoints_of_another_run_is_refused_at_the_start(
        tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=6, save_steps=3, max_to_keep=5).train()
    # A roll-back (or a fresh start) that saves into the same dir: its step-6 save would be
    # skipped as "already committed", and a crash after it would resume the other run's step 6.
    for resume in (os.path.join(out, "step_00000003"), None):
        with pytest.raises(CheckpointError, match=r"steps \[6\]|steps \[3, 6\]") as e:
            build(out, RowWindows(), train_steps=9, save_steps=3, resume_from=resume).train()
        assert e.value.kind == "mismatch"
    assert committed_steps(out) == [3, 6]
    # "auto" resumes from the newest: nothing foreign.
    t = build(out, RowWindows(), train_steps=9, save_steps=3)
    t.train()
    assert committed_steps(out) == [3, 6, 9]

def test_rotation_policy_orders_numerically_and_protects_newest_keep_best_and_periodic() -> None:
    def info(step: int, t: float = 0.0, keep: bool = False, loss: float | None = None) -> layout.CheckpointInfo:
        return layout.CheckpointInfo(step, f"/x/step_{step}", t, 1, keep=keep,
                                     metrics={} if loss is None else {"loss": loss})

    infos = [info(9), info(10), info(100), info(11)]
    gone = layout.select_to_delete(infos, layout.RetentionPolicy(max_to_keep=2))
    assert [i.step for i in gone] == [9, 10]  # numeric, not lexicographic
    infos = [info(1, loss=0.1), info(2, keep=True), info(3, loss=0.5), info(4), info(5)]
    gone = layout.select_to_delete(infos, layout.RetentionPolicy(1, keep_best_metric="loss"), {4})
    assert [i.step for i in gone] == [3]
    hours = [info(s, t=s * 1800.0) for s in range(1, 7)]  # one every half hour
    gone = layout.select_to_delete(hours, layout.RetentionPolicy(1, keep_every_n_hours=1.0))
    assert [i.step for i in gone] == [2, 4]


def test_a_failed_delete_is_logged_not_raised(tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    def fail(path: str, *a: Any, **kw: Any) -> None:
        raise PermissionError(f"denied: {path}")

    monkeypatch.setattr(layout.shutil, "rmtree", fail)
    assert layout.remove_checkpoint(str(tmp_path)) is False
    assert "could not delete checkpoint" in caplog.text


def test_an_incomplete_checkpoint_is_never_loaded_and_is_cleaned_up(tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=2, save_steps=2).train()
    # What a crash mid-save leaves: data and even DCP's .metadata, but no commit marker.
    junk = os.path.join(out, "step_00000099")
    os.makedirs(junk)
    for name in (".metadata", "__0_0.distcp", "rank_00000.pt"):
        open(os.path.join(junk, name), "wb").write(b"partial")
    with pytest.raises(CheckpointError, match="no COMMITTED marker"):
        build(str(tmp_path / "x"), RowWindows()).load_checkpoint(junk)
    rec = RowRecorder()
    t = build(out, RowWindows(), hooks=[rec], train_steps=3)
    t.train()
    assert ("loaded", "step_00000002") in rec.events
    assert not os.path.exists(junk)


def test_a_truncated_or_corrupt_shard_raises_a_checkpoint_error_naming_the_file(tmp_path: Any) -> None:
    out = str(tmp_path)
    t = build(out, RowWindows(), train_steps=2, save_steps=2)
    t.train()
    ckpt = os.path.join(out, "step_00000002")
    shard = os.path.join(ckpt, sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0])
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated") as e:
        t.load_checkpoint(ckpt)
    assert e.value.path == shard and shard in str(e.value)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(flipped))
    with pytest.raises(CheckpointError, match="CRC32") as e:
        t.load_checkpoint(ckpt)
    assert e.value.path == shard


def test_manifest_crc32s_computed_while_writing_match_the_files_on_disk(tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=4, save_steps=2, save_concurrency_per_rank=2).train()
    for step in (2, 4):
        ckpt = os.path.join(out, f"step_{step:08d}")
        files = layout.read_manifest(ckpt)["files"]  # type: ignore[index]
        on_disk = {n for n in os.listdir(ckpt) if n not in ("COMMITTED", "args.json")}
        assert set(files) == on_disk
        for name, meta in files.items():
            assert file_digest(os.path.join(ckpt, name)) == (meta["size"], meta["crc32"]), name


def test_async_staging_buffers_are_allocated_at_train_start_and_reused_by_every_save(
        tmp_path: Any, monkeypatch: Any) -> None:
    ptrs: list[set[int]] = []
    real = writer.StagingBuffers.stage

    def stage(self: writer.StagingBuffers, state: dict[str, Any]) -> dict[str, Any]:
        staged = real(self, state)
        ptrs.append({t.data_ptr() for _, t in writer.iter_leaves(staged) if t.numel()})
        return staged

    monkeypatch.setattr(writer.StagingBuffers, "stage", stage)
    out = str(tmp_path)
    t = build(out, RowWindows(), train_steps=6, save_steps=2, max_to_keep=10)
    t.train()
    staging = manager(t)._staging
    assert staging.prepared_s is not None, "the buffers were not pre-allocated at train start"
    assert len(ptrs) == 3 and ptrs[0] == ptrs[1] == ptrs[2]
    # A run that never saves asynchronously allocates nothing.
    t2 = build(str(tmp_path / "sync"), RowWindows(), train_steps=2, save_steps=2, async_save=False)
    t2.train()
    assert manager(t2)._staging.prepared_s is None and manager(t2)._staging.nbytes == 0


def test_staging_a_sharded_table_placed_on_another_device_rebuilds_it_on_the_host(
        tmp_path: Any) -> None:
    """The async save's copy to the host of a table that lives on a GPU (metadata placement
    ``cuda:0``): on an H100 the rebuilt ShardedTensor kept the GPU placement and every first
    save failed ("Local shard tensor device does not match with local Shard's placement").
    Here the placement is set to ``cuda:0`` over a CPU shard, the same mismatch without a GPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard

    from recsys_trainer.distributed import init_distributed

    init_distributed("cpu")
    table = torch.arange(24, dtype=torch.float32).view(6, 4)

    def sharded(t: torch.Tensor) -> ShardedTensor:
        return ShardedTensor._init_from_local_shards(
            [Shard.from_tensor_and_offsets(t, [0, 0], 0)], list(t.shape))

    on_gpu = sharded(table.clone())
    for m in [*(s.metadata for s in on_gpu.local_shards()), *on_gpu.metadata().shards_metadata]:
        m.placement._device = torch.device("cuda", 0)  # type: ignore[union-attr]
    staged = writer.StagingBuffers().stage({"model": {"t": on_gpu}})["model"]["t"]
    assert isinstance(staged, ShardedTensor)
    shard = staged.local_shards()[0]
    assert shard.tensor.device.type == "cpu" and torch.equal(shard.tensor, table)
    assert shard.metadata.placement.device().type == "cpu"  # type: ignore[union-attr]
    assert [m.placement.device().type for m in staged.metadata().shards_metadata] == ["cpu"]  # type: ignore[union-attr]
    assert staged.metadata().shards_metadata[0].shard_offsets == [0, 0]
    # What DCP writes from the staged copy loads back into a host table.
    dcp.save({"t": staged}, checkpoint_id=str(tmp_path / "ckpt"))
    back = sharded(torch.zeros(6, 4))
    dcp.load({"t": back}, checkpoint_id=str(tmp_path / "ckpt"))
    assert torch.equal(back.local_shards()[0].tensor, table)


def test_exact_views_alias_the_live_memory_so_dcp_does_not_clone() -> None:
    fused = torch.arange(60, dtype=torch.float32)
    table = fused[20:40].view(5, 4)  # a table inside a fused buffer (as FBGEMM's TBE keeps them)
    state = {"model": {"t": table, "whole": fused, "n": 3}}
    exact = writer.exact_views(state)
    t = exact["model"]["t"]
    assert t.data_ptr() == table.data_ptr() and t.untyped_storage().nbytes() == t.nbytes
    assert torch.equal(t, table) and exact["model"]["n"] == 3
    assert exact["model"]["whole"].data_ptr() == fused.data_ptr()  # already exact: as is


# ---------------------------------------------------------------------------- content & filters

def test_checkpoint_restores_counters_lr_schedule_rng_and_hook_state(tmp_path: Any) -> None:
    out = str(tmp_path)
    rec = RowRecorder()
    t = build(out, RowWindows(), hooks=[rec], train_steps=7)
    t.train()
    t.non_finite.num_skipped = 2  # the non-finite guard's count is part of the state too
    t.save_checkpoint()
    expected_rand = torch.rand(3)  # the RNG state right after the save
    other_rec = RowRecorder()
    t2 = build(str(tmp_path / "b"), RowWindows(), hooks=[other_rec])
    t2.load_checkpoint(os.path.join(out, "step_00000007"))
    assert torch.equal(torch.rand(3), expected_rand)
    assert t2.state.state_dict() == t.state.state_dict()
    assert t2.dense_lr() == t.dense_lr() == pytest.approx(1e-2 * 0.25)
    assert t2.lr_scheduler is not None and t.lr_scheduler is not None
    assert t2.lr_scheduler.state_dict() == t.lr_scheduler.state_dict()
    assert other_rec.counter == rec.counter == 7
    assert other_rec.events == [("loaded", "step_00000007")]
    assert t2.non_finite.num_skipped == 2


def test_params_not_save_and_save_filter_fn_leave_parameters_and_their_state_out(tmp_path: Any) -> None:
    out = str(tmp_path)
    t = build(out, RowWindows(), train_steps=2, params_not_save=["t_f1"],
              save_filter_fn=lambda name: "over_arch" not in name)
    t.train()
    ckpt = t.save_checkpoint()
    keys = saved_keys(ckpt)
    assert not [k for k in keys if "t_f1" in k or "over_arch" in k]
    assert [k for k in keys if "t_f0" in k] and [k for k in keys if "dense_arch" in k]
    # Loading keeps this run's values for what was not saved (and is not an error).
    t2 = build(str(tmp_path / "b"), RowWindows(), params_not_save=["t_f1"],
               save_filter_fn=lambda name: "over_arch" not in name)
    before = snapshot(t2)
    t2.load_checkpoint(ckpt)
    after, trained = snapshot(t2), snapshot(t)
    for k in after:
        if "t_f1" in k or "over_arch" in k:
            if k.startswith("model."):
                assert torch.equal(after[k], before[k]), k
        elif k != "lr":
            assert torch.equal(after[k], trained[k]), k
    # Without the filters the same checkpoint is incomplete for this model: a clear error.
    with pytest.raises(CheckpointError, match="lacks"):
        build(str(tmp_path / "c"), RowWindows()).load_checkpoint(ckpt)



def test_loading_a_checkpoint_with_entries_the_trainer_lacks_is_an_error_naming_them(
        tmp_path: Any) -> None:
    out = str(tmp_path)
    build(out, RowWindows(), train_steps=2, save_steps=2).train()
    # The model dropped feature f3: its table (and its optimizer state) would be ignored.
    t = build(str(tmp_path / "fewer"), RowWindows(), feats=FEATS[:3])
    with pytest.raises(CheckpointError, match="does not have") as e:
        t.load_checkpoint(os.path.join(out, "step_00000002"))
    assert "t_f3" in str(e.value) and e.value.kind == "mismatch"


class _SaveAtEveryWindow(Hook):
    """What a PublishHook(every_n_windows=1) does: asks for a save at each window's resume
    point (the CheckpointHook, always last, makes it there); stops the run after ``stop_after``
    windows."""

    def __init__(self, stop_after: int) -> None:
        self.stop_after = stop_after

    def on_resume_point(self, trainer: Trainer, point: str) -> None:  # type: ignore[override]
        if point == "window":
            trainer.request_save("test: every window")
            if trainer.state.windows_done == self.stop_after:
                trainer.request_stop("test: stop after a window")


def test_a_resumed_run_saves_after_the_same_windows_as_one_never_stopped(tmp_path: Any) -> None:
    whole = str(tmp_path / "whole")
    build(whole, RowWindows(num_windows=4), save_every_n_windows=2, max_to_keep=10).train()
    assert committed_steps(whole) == [16, 32]  # after windows 2 and 4 (8 steps each)
    # Stopped after window 1 by a hook that also saved at each window: its checkpoint counts the
    # windows as the run does (it counted one less: the CheckpointHook, last, counted the window
    # after that save, and the resumed run then saved after window 3, step 24, not 2 and 4).
    out = str(tmp_path / "resumed")
    build(out, RowWindows(num_windows=4), hooks=[_SaveAtEveryWindow(stop_after=1)],
          save_every_n_windows=2, max_to_keep=10).train()
    assert committed_steps(out) == [8]
    resumed = build(out, RowWindows(num_windows=4), save_every_n_windows=2, max_to_keep=10)
    resumed.train()
    assert resumed.state.windows_done == 4
    assert committed_steps(out) == [8, 16, 32]


class _AskAtWindows(Hook):
    """Asks for a save at each window's resume point (``trainer.request_save``), as a
    ``PublishHook`` does; notes what each request said when asked, and each commit it hears."""

    def __init__(self) -> None:
        self.asked: list[tuple[SaveRequest, bool]] = []
        self.commits: list[tuple[str, list[bool]]] = []

    def on_resume_point(self, trainer: Trainer, point: str) -> None:  # type: ignore[override]
        if point == "window":
            saved = trainer.request_save("test: every window")
            self.asked.append((saved, saved.committed))

    def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
        mine = [s.committed for s, _ in self.asked if s.path == path]
        self.commits.append((os.path.basename(path), mine))


def test_a_save_a_hook_asks_for_is_made_once_by_the_checkpoint_hook_and_marked_at_its_commit(
        tmp_path: Any) -> None:
    # No save period: each window's save is the request's, made asynchronously at the end of
    # that resume point; its commit marks the request before any hook hears of it.
    out = str(tmp_path / "asked")
    asker = _AskAtWindows()
    build(out, RowWindows(num_windows=2), hooks=[asker], max_to_keep=10).train()
    assert committed_steps(out) == [8, 16]
    assert [(os.path.basename(s.path), s.step, was) for s, was in asker.asked] == [
        ("step_00000008", 8, False), ("step_00000016", 16, False)]
    assert asker.commits == [("step_00000008", [True]), ("step_00000016", [True])]
    assert all(s.committed and s.blocked_s > 0 for s, _ in asker.asked)
    # The step is saved already (a synchronous save_steps save at the step's resume point, just
    # before the window's): the request says so at once, and no second save or commit follows.
    out = str(tmp_path / "saved")
    asker = _AskAtWindows()
    build(out, RowWindows(num_windows=2), hooks=[asker], save_steps=8, async_save=False,
          max_to_keep=10).train()
    assert committed_steps(out) == [8, 16]
    assert [was for _, was in asker.asked] == [True, True]
    assert [name for name, _ in asker.commits] == ["step_00000008", "step_00000016"]


def test_model_bank_warm_starts_selected_parts_with_name_map_and_resized_tables(
        tmp_path: Any, caplog: Any) -> None:
    src_dir = str(tmp_path / "src")
    src = build(src_dir, RowWindows(), train_steps=4, save_end=True)
    src.train()
    src_model = export_model_state_dict(os.path.join(src_dir, "step_00000004"))
    bank = [{
        "path": src_dir,  # an output dir: its newest committed checkpoint
        "include": {"tables": ["*"], "dense": ["*dense_arch*"], "counters": ["*"]},
        "exclude": {"tables": ["*t_f2*"]},
        "name_map": {"t_f3": "t_x3"},
    }]
    feats = ["f0", "f1", "f2", "x3"]
    t = build(str(tmp_path / "dst"), RowWindows(), feats=feats, rows=[ROWS, 300, ROWS, ROWS],
              model_bank=bank, train_steps=4)
    init = {k: v.clone() for k, v in
            ((k, local(v).view(v.size())) for k, v in t.model.state_dict().items())}
    t.resume()
    now = {k: local(v).view(v.size()) for k, v in t.model.state_dict().items()}
    p = "dlrm.sparse_arch.embedding_bag_collection.embedding_bags."
    assert torch.equal(now[p + "t_f0.weight"], src_model[p + "t_f0.weight"])
    assert torch.equal(now[p + "t_x3.weight"], src_model[p + "t_f3.weight"])  # renamed
    assert torch.equal(now[p + "t_f2.weight"], init[p + "t_f2.weight"])  # excluded
    resized = now[p + "t_f1.weight"]
    assert torch.equal(resized[:ROWS], src_model[p + "t_f1.weight"])
    assert torch.equal(resized[ROWS:], init[p + "t_f1.weight"][ROWS:])
    assert "t_f1.weight has 200 rows" in caplog.text
    dense = "dlrm.dense_arch.model._mlp.0._linear.weight"
    over = "dlrm.over_arch.model.1.weight"
    assert torch.equal(now[dense], src_model[dense]) and torch.equal(now[over], init[over])
    assert t.state.global_step == 4 and t.state.window_index == 0  # counters yes, data no
    assert not t.optimizer.dense.state, "optimizer state was not selected"


def test_model_bank_rejects_unknown_components_and_shape_mismatches(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="unknown components"):
        TrainingArguments(model_bank=[{"path": "x", "include": {"weights": ["*"]}}])
    src_dir = str(tmp_path / "src")
    build(src_dir, RowWindows(), train_steps=1, save_end=True).train()
    t = build(str(tmp_path / "dst"), RowWindows(), rows=[ROWS, ROWS, ROWS, ROWS],
              model_bank=[{"path": src_dir, "include": {"dense": ["*"]},
                           "name_map": {"dense_arch.model._mlp.0": "over_arch.model.0._mlp.0"}}])
    with pytest.raises(CheckpointError, match="has shape"):
        t.resume()


_EXPORT_CHECK = """
import sys, torch
import torch.distributed as dist
from recsys_trainer.checkpoint import export_model_state_dict
sd = export_model_state_dict(sys.argv[1], sys.argv[2])
assert not dist.is_initialized()
again = torch.load(sys.argv[2], weights_only=True)
assert sd.keys() == again.keys() and all(torch.equal(sd[k], again[k]) for k in sd)
print(len(sd))
"""


def test_export_gives_a_merged_model_state_dict_loadable_without_torch_distributed(tmp_path: Any) -> None:
    out = str(tmp_path)
    t = build(out, RowWindows(), train_steps=3, save_end=True)
    t.train()
    dst = str(tmp_path / "model.pt")
    proc = subprocess.run([sys.executable, "-c", _EXPORT_CHECK, os.path.join(out, "step_00000003"), dst],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sd = torch.load(dst, weights_only=True)
    live = t.model.state_dict()
    assert sd.keys() == live.keys()
    for k, v in live.items():
        assert torch.equal(sd[k], local(v).view(v.size())), k
    full = read_full(os.path.join(out, "step_00000003"),
                     {k for k in saved_keys(os.path.join(out, "step_00000003")) if k.startswith("optim.")})
    assert full, "optimizer state is in the checkpoint but not in the export"


def test_an_exported_file_is_fsynced_before_it_is_renamed_into_place(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the fsync a power loss after the rename can leave an empty or partial file under
    # the final name (a delta's base, a served state dict), replacing the previous one.
    from recsys_trainer.checkpoint.export import save_file

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", os.path.abspath(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    out = str(tmp_path / "sub" / "model.pt")
    save_file({"w": torch.arange(4.0)}, out)
    tmp = os.path.abspath(out + ".tmp")
    assert ("fsync", tmp) in events and ("replace", tmp) in events
    assert events.index(("fsync", tmp)) < events.index(("replace", tmp))
    assert ("fsync", str(tmp_path / "sub")) in events[events.index(("replace", tmp)):]
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(4.0))


def test_the_output_dir_lock_is_exclusive_names_its_holder_and_is_released(tmp_path: Any) -> None:
    from recsys_trainer.checkpoint.lock import OutputDirLock

    first, second = OutputDirLock(str(tmp_path)), OutputDirLock(str(tmp_path))
    assert first.acquire(world_size=2) is None and first.held
    holder = second.acquire(world_size=1)
    assert holder is not None and holder.startswith(f"the job whose rank 0 is pid {os.getpid()} on host ")
    assert "2 rank(s), started " in holder and not second.held
    first.release()
    assert second.acquire(world_size=1) is None  # the file stays; the OS lock is what counts
    second.release()
    # A run that saves holds the lock only while it trains.
    t = build(str(tmp_path), RowWindows(), train_steps=2, save_steps=1)
    t.train()
    assert OutputDirLock(str(tmp_path)).acquire(world_size=1) is None
