"""One rank of the streaming training job the online fault tests run under ``torchrun``
(tests/test_online_faults.py)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=1 \
        tests/online_fault_driver.py CONFIG.json

The DLRM of tests/serving_utils.py trains over the windows of ``data`` as the test lands them
(``_SUCCESS`` markers; ``_END`` ends the stream), with a ``PublishHook`` publishing every
window to ``location`` (a path, or an ``s3://`` URL of the test's S3 server: ``s3`` holds its
endpoint and keys). Checkpoints are saved synchronously, so a window's publish has been
handed to the publisher process when the window's resume point returns (the ``PublishHook``
hands it over in ``after_save_checkpoint``, which the ``CheckpointHook`` fires at that point).

``kill_window`` (first attempt only, rank 0): once the checkpoint of that train window has
committed (its ``after_save_checkpoint``, after the ``PublishHook``'s), rank 0 watches ``location/deltas`` for the delta the publisher is now writing; as soon as a new delta
directory holds its manifest (the first file an artifact writes) but no ``COMMITTED`` marker, it SIGKILLs the publisher process, then
itself (a machine dying mid-publish). What it saw is written to ``killed.json`` first. A delta
already committed when first seen (the poller was descheduled) is let be, and the next train
window's delta is caught instead.

At the end of training rank 0 writes its publish records to ``records.<attempt>.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyarrow.fs as pafs  # noqa: E402
import serving_utils as su  # noqa: E402
import torch  # noqa: E402

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments  # noqa: E402
from recsys_trainer.data.parquet import ParquetWindowDataset  # noqa: E402
from recsys_trainer.data.windows import StreamingWindows, partitioned_windows  # noqa: E402
from recsys_trainer.hooks.base import Hook, ResumePoint  # noqa: E402
from recsys_trainer.hooks.publish import PublishHook  # noqa: E402


class KillMidPublish(Hook):
    """Rank 0, first attempt: SIGKILL the publisher and this rank while the delta of train
    window ``at`` is being written to the (local) location."""

    def __init__(self, location: str, publish: PublishHook, at: int, out: str) -> None:
        self.deltas = os.path.join(location, "deltas")
        self.publish, self.at, self.out = publish, at, out
        self.windows = 0
        self.point: ResumePoint | None = None

    def after_window(self, trainer: Trainer, window_id: str) -> None:
        if trainer.state.mode == "train":
            self.windows += 1

    def on_resume_point(self, trainer: Trainer, point: ResumePoint) -> None:
        self.point = point

    def after_save_checkpoint(self, trainer: Trainer, path: str) -> None:
        # The window's save, made by the CheckpointHook at the end of its resume point: the
        # PublishHook (before this hook) has handed the checkpoint over.
        if self.point != "window" or self.windows != self.at:
            return
        pid = self.publish.publisher_pid
        assert pid is not None, "no publisher process"
        listed = set(os.listdir(self.deltas)) if os.path.isdir(self.deltas) else set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for name in sorted(set(os.listdir(self.deltas)) - listed
                               if os.path.isdir(self.deltas) else ()):
                where = os.path.join(self.deltas, name)
                files = sorted(os.listdir(where)) if os.path.isdir(where) else []
                if "manifest.json" not in files:
                    continue  # wait for its first file (the manifest, written first) to land
                if "COMMITTED" in files:
                    # Committed before this poll saw it (a descheduled poller): training goes
                    # on, and the next window's delta is the one to catch.
                    self.at += 1
                    return
                os.kill(pid, signal.SIGKILL)
                files = sorted(os.listdir(where))  # what the killed writer left
                with open(self.out + ".tmp", "w") as f:
                    json.dump({"delta": f"deltas/{name}", "files": files,
                               "step": trainer.state.global_step}, f)
                os.replace(self.out + ".tmp", self.out)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0005)
        raise RuntimeError(f"no delta appeared under {self.deltas} in 120 s")


def main() -> None:
    cfg: dict[str, Any] = json.load(open(sys.argv[1]))
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} attempt{attempt} %(levelname)s "
                               "%(name)s: %(message)s", force=True)
    data = cfg["data"]
    stream = StreamingWindows(lambda: partitioned_windows(data, ready_marker="_SUCCESS"),
                              end_marker=os.path.join(data, "_END"), poll_interval_s=0.05,
                              timeout_s=cfg.get("stream_timeout_s", 300))
    fs = None
    if cfg.get("s3"):
        s3 = cfg["s3"]
        fs = pafs.S3FileSystem(access_key=s3["access_key"], secret_key=s3["secret_key"],
                               endpoint_override=s3["host_port"], scheme="http",
                               region="us-east-1", connect_timeout=1, request_timeout=3,
                               retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    publish = PublishHook(cfg["location"], every_n_windows=1, full_every=10, filesystem=fs,
                          staging_dir=os.path.join(cfg["root"], f"stage{attempt}"))
    hooks: list[Hook] = [publish]
    if cfg.get("kill_window") and attempt == 0 and rank == 0:
        hooks.append(KillMidPublish(cfg["location"], publish, cfg["kill_window"],
                                    os.path.join(cfg["root"], "killed.json")))
    spec, model = su.spec_and_model("dlrm")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=os.path.join(cfg["root"], "ckpt"), log_steps=1000,
                               seed=0, max_to_keep=3, async_save=False),
        train_dataset=ParquetWindowDataset(stream, spec, batch_size=32),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        add_logger_hook=False, hooks=hooks,
    )
    trainer.train()
    if rank == 0:
        records = [{"kind": r.kind, "sequence": r.sequence, "ref": r.ref, "step": r.step,
                    "error": r.error} for r in publish.records]
        with open(os.path.join(cfg["root"], f"records.{attempt}.json"), "w") as f:
            json.dump(records, f)


if __name__ == "__main__":
    main()
