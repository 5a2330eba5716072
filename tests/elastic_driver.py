"""One worker of the elastic job tests/test_elastic.py runs: several torchrun agents on
127.0.0.1 standing in for nodes (``--nnodes=MIN:MAX``, c10d rendezvous), one worker each::

    python -m torch.distributed.run --nnodes=1:2 --nproc_per_node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=JOB --max-restarts=3 tests/elastic_driver.py ROOT

``ROOT/config.json`` says what to train: a model of tests/serving_utils.py (``kind``) on the
parquet windows of ``ROOT/data`` (a partitioned directory, or with ``stream`` a stream that
waits for ``_SUCCESS`` markers and ends at ``_END``), ``train`` or ``train_and_evaluate``
(eval windows in ``ROOT/eval``, paired by id), ``save_steps``, ``accum``, ``shuffle``, a
``PublishHook`` to ``ROOT/published`` with ``publish``, and ``pace_s`` of sleep per step so the
test can change the cluster while a window is half trained.

What the test reads afterwards:

- ``records/step_NNNNNN.rankR.json``: the ``row_id``s rank R trained in that step (and the world
  size and window). A worker that resumes (rank 0, before its first step) deletes the records of
  steps after the one it resumed from: those were trained by a run whose model state was lost
  with it (no committed checkpoint holds them), so what is left is exactly what the final model
  was trained on, step by step.
- ``progress.json``: the last step (step, world size, window, batches in the window), after
  every step.
- ``starts.jsonl``: one line per worker start (time, rank, world size, the step it resumed
  from), ``first_steps.jsonl`` one line per worker at its first step (for recovery times).
- ``evals.jsonl`` (``train_and_evaluate``): the rows each evaluation counted.

``die`` (``{"rank": R, "at_save_of_step": N}``): in the first world of two ranks, rank R's node
dies while it writes its files of step N's checkpoint (its agent and then the worker are
SIGKILLed from the save's writer thread, after DCP wrote the shards and before the rank's
extra-state file): a node lost during an asynchronous save. ``died.json`` says when.

``hold`` (``{"window_index": W, "batches": B}``): at world size 1, after the step that reaches
``B`` batches of train window ``W``, the worker waits (up to 120 s) for the stop signal its
agent sends when a node joins: the join then lands in the middle of that window however slowly
the new node starts.

``kafka`` (``{"bootstrap": ..., "topic": ..., "window_s": S, "partitions": [...]}``): train from
that topic instead (tests/test_kafka_elastic.py): a ``KafkaWindowDataset`` of windows of ``S``
s of the rows' ``ts`` column, ending at the log's end when the job first started.
``crash`` (``{"rank": R, "at_step": N}``): in the first attempt (``TORCHELASTIC_RESTART_COUNT``
0), rank R SIGKILLs itself after step N: torchrun (``--max-restarts``) restarts the workers.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a worker's start-up is part of a recovery

import dataclasses  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving_utils as su  # noqa: E402
import torch  # noqa: E402

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments  # noqa: E402
from recsys_trainer.checkpoint import contents  # noqa: E402
from recsys_trainer.checkpoint.manager import CheckpointManager  # noqa: E402
from recsys_trainer.data.parquet import ParquetWindowDataset  # noqa: E402
from recsys_trainer.data.windows import StreamingWindows, partitioned_windows  # noqa: E402
from recsys_trainer.hooks.base import Hook, StepOutput  # noqa: E402
from recsys_trainer.hooks.publish import PublishHook  # noqa: E402


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps(record) + "\n")


def die_during_save(root: str, step: int) -> None:
    """Kill this node (agent, then this worker) from the writer thread of the save of ``step``,
    between DCP's shards and this rank's extra-state file (see ``die``). Wraps
    ``CheckpointManager._write``, the seam the manager keeps for tests, so that only that step's
    save dies (an earlier save may still be in flight when the step is reached)."""
    write, name = CheckpointManager._write, contents.extra_file_name

    def die(rank: int) -> str:
        with open(os.path.join(root, "died.json"), "w") as f:
            json.dump({"time": time.time(), "step": step}, f)
        os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun agent
        os.kill(os.getpid(), signal.SIGKILL)
        return name(rank)

    def write_or_die(self: CheckpointManager, loc: Any, tensors: Any, extra: bytes,
                     base: dict[str, Any]) -> dict[str, Any]:
        if base["step"] == step:
            contents.extra_file_name = die  # type: ignore[assignment]
        return write(self, loc, tensors, extra, base)

    CheckpointManager._write = write_or_die  # type: ignore[method-assign]


class HoldForJoin(Hook):
    """Waits for the agent's stop signal at a step in the middle of a window (see ``hold``)."""

    def __init__(self, window_index: int, batches: int) -> None:
        self.window_index, self.batches, self.held = window_index, batches, False

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        st = trainer.state
        if (self.held or trainer.world_size != 1 or st.window_index != self.window_index
                or st.batches_in_window < self.batches):
            return
        self.held = True
        deadline = time.monotonic() + 120
        # The signal handler only records the signal (acted on at the next fetch): ask it.
        while not trainer._preemption_watcher.requested and time.monotonic() < deadline:
            time.sleep(0.05)


class RowLog(Hook):
    """Records the rows of every trained step (see the module docstring)."""

    def __init__(self, root: str, pace_s: float, crash_at: int | None = None) -> None:
        self.root, self.pace_s, self.crash_at = root, pace_s, crash_at
        self.records = os.path.join(root, "records")
        self.first = True

    def before_train(self, trainer: Trainer) -> None:
        st = trainer.state
        _append(os.path.join(self.root, "starts.jsonl"), {
            "time": time.time(), "process_started": STARTED, "rank": trainer.rank, "world_size": trainer.world_size,
            "resumed_step": st.global_step, "window_index": st.window_index,
            "segments": st.window_segments, "pid": os.getpid()})
        if trainer.rank == 0:
            # Other ranks cannot pass a step before rank 0 takes part in it: no race.
            os.makedirs(self.records, exist_ok=True)
            for path in glob.glob(os.path.join(self.records, "step_*.json")):
                if int(os.path.basename(path)[5:11]) > st.global_step:
                    os.remove(path)

    def after_step(self, trainer: Trainer, output: StepOutput) -> None:
        st = trainer.state
        if self.first:
            self.first = False
            _append(os.path.join(self.root, "first_steps.jsonl"), {
                "time": time.time(), "rank": trainer.rank, "world_size": trainer.world_size,
                "step": st.global_step})
        rows = [int(r) for m in output.micro_batches for r in m.batch.passthrough["row_id"]]
        tmp = os.path.join(self.records, f".step_{st.global_step:06d}.rank{trainer.rank}.tmp")
        with open(tmp, "w") as f:
            json.dump({"rows": rows, "world_size": trainer.world_size, "window": st.window_id}, f)
        os.replace(tmp, os.path.join(self.records,
                                     f"step_{st.global_step:06d}.rank{trainer.rank}.json"))
        if trainer.rank == 0:
            tmp = os.path.join(self.root, ".progress.tmp")
            with open(tmp, "w") as f:
                json.dump({"step": st.global_step, "world_size": trainer.world_size,
                           "window_index": st.window_index,
                           "batches_in_window": st.batches_in_window}, f)
            os.replace(tmp, os.path.join(self.root, "progress.json"))
        if st.global_step == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.pace_s)

    def after_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if trainer.rank == 0:
            _append(os.path.join(self.root, "evals.jsonl"), {
                "step": trainer.state.global_step, "window": trainer.state.window_id,
                "world_size": trainer.world_size, "rows": metrics["num_samples"]})


def _kafka(cfg: dict[str, Any], spec: Any) -> Any:
    from recsys_trainer.data.kafka import KafkaWindowDataset

    k = cfg["kafka"]
    return KafkaWindowDataset(
        spec, bootstrap_servers=k["bootstrap"], topic=k["topic"], partitions=k.get("partitions"),
        time_column="ts", window_s=k.get("window_s", 10.0), batch_size=cfg["batch_size"],
        end_offsets="log_end", idle_timeout_s=1.0, poll_interval_s=0.05, broker_timeout_s=60)


def _windows(path: str, cfg: dict[str, Any]) -> Any:
    if not cfg.get("stream"):
        return path
    return StreamingWindows(lambda: partitioned_windows(path, ready_marker="_SUCCESS"),
                            end_marker=os.path.join(path, "_END"), poll_interval_s=0.2,
                            timeout_s=300)


def main() -> None:
    root = sys.argv[1]
    with open(os.path.join(root, "config.json")) as f:
        cfg = json.load(f)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank" + os.environ["RANK"]
                        + " %(name)s %(levelname)s %(message)s")
    spec, model = su.spec_and_model(cfg["kind"])
    spec = dataclasses.replace(spec, passthrough=["row_id"])
    read = {"batch_size": cfg["batch_size"], "shuffle": cfg.get("shuffle", False), "seed": 3}
    train = _kafka(cfg, spec) if cfg.get("kafka") else \
        ParquetWindowDataset(_windows(os.path.join(root, "data"), cfg), spec, **read)
    evaluate = cfg.get("mode") == "train_and_evaluate"
    eval_ds = ParquetWindowDataset(os.path.join(root, "eval"), spec, batch_size=64) \
        if evaluate else None
    crash = cfg.get("crash")
    crash_at = crash["at_step"] if (crash and int(os.environ["RANK"]) == crash["rank"] and
                                    os.environ["TORCHELASTIC_RESTART_COUNT"] == "0") else None
    hooks: list[Hook] = [RowLog(root, cfg.get("pace_s", 0.0), crash_at)]
    die = cfg.get("die")
    if (die and int(os.environ["RANK"]) == die["rank"] and os.environ["WORLD_SIZE"] == "2"
            and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
        die_during_save(root, die["at_save_of_step"])
    if cfg.get("hold"):
        hooks.append(HoldForJoin(cfg["hold"]["window_index"], cfg["hold"]["batches"]))
    if cfg.get("publish"):
        hooks.append(PublishHook(os.path.join(root, "published"), every_n_windows=1,
                                 staging_dir=os.path.join(root, f"stage{os.environ['RANK']}")))
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=os.path.join(root, "ckpt"), save_steps=cfg["save_steps"], max_to_keep=3,
            gradient_accumulation_steps=cfg.get("accum", 1), log_steps=1000, seed=0,
            preemption_grace_s=30, collective_timeout_s=60),
        train_dataset=train, eval_dataset=eval_ds, hooks=hooks,
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1))
    if evaluate:
        trainer.train_and_evaluate()
    else:
        trainer.train()


if __name__ == "__main__":
    main()
