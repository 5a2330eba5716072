"""The newcomer's online loop (docs/online.md "Try it: train, publish, serve"): the stream
writer (recsys_trainer/data/generators/stream_writer.py) lands windows, ``_SUCCESS`` last, with its
planted change; examples/train_online.py --land trains on them on 2 ranks under torchrun and
publishes; a Follower of the location serves the job's final step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys_trainer import storage
from recsys_trainer.data.generators.stream_writer import (
    END_MARKER,
    StreamConfig,
    StreamWriter,
    stream_windows,
)
from recsys_trainer.serving import published as pub
from recsys_trainer.serving.runtime.follow import Follower

REPO = Path(__file__).resolve().parents[1]


class _Checked(StreamWriter):
    """A writer that checks, as it writes ``_SUCCESS``, that the window's data and truth are
    there already, and records what it writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[str] = []

    def _put(self, loc: storage.Location, data: bytes) -> None:
        name = loc.path.rsplit("/", 1)[1]
        if name == "_SUCCESS":
            part = loc.path.rsplit("/", 1)[0]
            for f in ("part-0.parquet", "_signal.json"):
                info = loc.filesystem.get_file_info(f"{part}/{f}")
                assert info.size, f"_SUCCESS before {f} in {part}"
        self.writes.append(loc.path[len(self.root.path):].lstrip("/"))
        super()._put(loc, data)


@pytest.mark.timeout(60)
def test_the_writer_lands_windows_success_last_with_the_shift_planted_deterministically(
        tmp_path: Path) -> None:
    out = str(tmp_path / "stream")
    cfg = StreamConfig(rows_per_window=4000, shift_at=2, shift_strength=4.0)
    assert stream_windows(out).discover() == []  # no root yet: no windows, no error
    writer = _Checked(out, cfg)
    slept: list[float] = []
    clock = iter(float(i) for i in range(100))
    truths = list(writer.run(2, every_s=5.0, sleep=slept.append, clock=lambda: next(clock)))
    assert [t["window"] for t in truths] == ["dt=2026-11-20/hour=00", "dt=2026-11-20/hour=01"]
    assert len(slept) == 1 and slept[0] > 0  # the second window waits for its slot
    assert writer.writes == ["dt=2026-11-20/hour=00/_signal.json", "dt=2026-11-20/hour=00/_SUCCESS",
                             "_signal.json", "dt=2026-11-20/hour=01/_signal.json",
                             "dt=2026-11-20/hour=01/_SUCCESS", "_signal.json", END_MARKER]
    assert [w.id for w in stream_windows(out).discover()] == [t["window"] for t in truths]
    # Restarted on the same root for 4 windows: the landed ones are skipped, the rest land,
    # and the root's _signal.json lists all four.
    os.remove(os.path.join(out, END_MARKER))
    again = _Checked(out, cfg)
    rest = list(again.run(4, every_s=0.0))
    assert [t["index"] for t in rest] == [2, 3]
    meta = json.loads((tmp_path / "stream" / "_signal.json").read_text())
    assert [t["index"] for t in meta["windows"]] == [0, 1, 2, 3]
    assert meta["shift"]["column"] == "C10" and meta["shift"]["value"] == writer.shift_value
    assert [t["shifted"] for t in meta["windows"]] == [False, False, True, True]
    # The shift is planted: the value's clicks jump from the shift on, the rest stay.
    before = [t["shift_ctr"] for t in meta["windows"][:2]]
    after = [t["shift_ctr"] for t in meta["windows"][2:]]
    assert min(after) > max(before) + 0.3, (before, after)
    assert all(t["shift_rows"] > 50 for t in meta["windows"])
    table = pq.read_table(tmp_path / "stream" / "dt=2026-11-20" / "hour=03" / "part-0.parquet")
    hit = table.column("C10").to_numpy(zero_copy_only=False) == writer.shift_value
    labels = table.column("label").to_numpy()
    assert labels[hit].mean() > labels[~hit].mean() + 0.3
    assert table.column("row_id").to_numpy()[0] == 3 * 4000
    # Deterministic per seed and window: a fresh writer draws the same rows.
    assert StreamWriter(str(tmp_path / "other"), cfg).generate(3)[0].equals(table)
    assert not StreamWriter(str(tmp_path / "other"), StreamConfig(
        rows_per_window=4000, shift_at=2, shift_strength=4.0, seed=1)).generate(3)[0].equals(table)


@pytest.mark.timeout(60)
def test_the_writer_lands_windows_on_s3(s3_server: Any) -> None:
    fs = s3_server.filesystem()
    url = s3_server.url("online_example/stream")
    writer = StreamWriter(url, StreamConfig(rows_per_window=500), filesystem=fs)
    list(writer.run(2, every_s=0.0))
    windows = stream_windows(url, filesystem=fs).discover()
    assert [w.id for w in windows] == ["dt=2026-11-20/hour=00", "dt=2026-11-20/hour=01"]
    assert storage.exists(f"{url}/{END_MARKER}", fs)
    with fs.open_input_file(windows[1].files[0].split("://", 1)[1]) as f:
        assert pq.read_table(f).num_rows == 500


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_train_online_lands_trains_on_2_ranks_publishes_and_a_follower_serves_its_last_step(
        tmp_path: Path) -> None:
    """docs/online.md's first command, small: --land starts the writer (3 windows), 2 ranks train
    on them as they land and publish each; the location's LATEST chain loads in a Follower,
    whose step is the job's final step, and it scores the stream's rows."""
    stream, location = tmp_path / "stream", tmp_path / "published"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max_restarts=0", str(REPO / "examples" / "train_online.py"), "--land",
           "--stream", str(stream), "--publish", str(location),
           "--output", str(tmp_path / "ckpt"), "--windows", "3", "--every-s", "1",
           "--rows-per-window", "2000", "--batch-size", "256", "--num-embeddings", "1000",
           "--poll-s", "0.2", "--timeout-s", "60"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    m = re.search(r"train_online: final step (\d+), LATEST sequence (\d+) step (\d+)", p.stdout)
    assert m, p.stdout[-3000:]
    final, latest_step = int(m.group(1)), int(m.group(3))
    assert final > 0 and latest_step == final
    assert len(re.findall(r"^window dt=2026-11-20/hour=0\d: train AUC", p.stdout, re.M)) == 3
    assert (stream / END_MARKER).exists()
    pointer = pub.read_pointer(str(location))
    assert pointer is not None and pointer.step == final
    assert pointer.window == "dt=2026-11-20/hour=02"
    follower = Follower(str(location))
    assert follower.poll_once()
    served = follower.served
    assert served is not None and served.step == final and follower.last_error is None
    assert served.content_hash == pointer.content_hash
    rows = pq.read_table(stream / "dt=2026-11-20" / "hour=02" / "part-0.parquet").slice(0, 64)
    scores = follower.score(rows)
    assert scores.shape[0] == 64 and np.isfinite(scores).all()
    assert ((scores > 0) & (scores < 1)).all()


@pytest.mark.timeout(60)
def test_the_online_config_names_the_publish_hook_and_a_stream_dataset(tmp_path: Path) -> None:
    """examples/configs/online_publish.yaml loads: ``publish`` is a built-in hook name (a
    PublishHook with the config's arguments) and the data section's factory reads the stream."""
    from recsys_trainer.config import load_config
    from recsys_trainer.data.windows import StreamingWindows
    from recsys_trainer.hooks.publish import PublishHook

    cfg = load_config(str(REPO / "examples" / "configs" / "online_publish.yaml"),
                      [("data.root", str(tmp_path / "stream")),
                       ("hooks.1.location", str(tmp_path / "published"))])
    hooks = [h.build(i) for i, h in enumerate(cfg.hooks)]
    publish = hooks[1]
    assert isinstance(publish, PublishHook)
    assert (publish.location, publish.every_n_windows, publish.full_every,
            publish.keep_bases) == (str(tmp_path / "published"), 1, 10, 3)
    dataset = cfg.data.build("train")
    assert isinstance(dataset.windows, StreamingWindows)
    assert [f.column for f in dataset.features.dense][:2] == ["I1", "I2"]
    assert all(f.log1p for f in dataset.features.dense)
