"""Multi-task: the functional loss against a numpy reference, and MetricReportHook's per-task
metrics (auc/click, auc/like, ...) in train and eval, on 1 and 2 real ranks, against
torchmetrics on the rows the model really scored."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torchmetrics.functional.classification import binary_auroc
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.hooks.lambda_hook import LambdaHook
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.models import multi_task_bce_with_logits, weighted_bce_with_logits

TASKS = ["click", "like"]
ROWS = 40


# ---------------------------------------------------------------------------- the loss

def _np_loss(z: np.ndarray, y: np.ndarray, w: np.ndarray | None, tw: np.ndarray | None) -> float:
    bce = np.logaddexp(0, z) - y * z  # -y log s(z) - (1-y) log(1-s(z))
    w = np.ones(len(z)) if w is None else w
    per_task = (bce * w[:, None]).sum(0) / w.sum() if w.sum() > 0 else np.zeros(z.shape[1])
    return float((per_task * (np.ones(z.shape[1]) if tw is None else tw)).sum())


def test_multi_task_loss_is_the_task_weighted_sum_of_example_weighted_bce() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 3, generator=g, dtype=torch.float64)
    y = (torch.rand(64, 3, generator=g) < 0.3).double()
    w = torch.rand(64, generator=g, dtype=torch.float64)
    w[:10] = 0  # padding rows
    tw = [1.0, 0.5, 2.0]
    got = multi_task_bce_with_logits(z, y, w, tw)
    assert float(got) == pytest.approx(_np_loss(z.numpy(), y.numpy(), w.numpy(), np.array(tw)), rel=1e-12)
    assert float(multi_task_bce_with_logits(z, y, None)) == pytest.approx(
        _np_loss(z.numpy(), y.numpy(), None, None), rel=1e-12)
    # each task's term is the single-task loss of its column
    one = sum(float(weighted_bce_with_logits(z[:, t], y[:, t], w)) * tw[t] for t in range(3))
    assert float(got) == pytest.approx(one, rel=1e-12)


def test_multi_task_loss_of_an_all_padding_batch_is_zero_with_zero_gradients() -> None:
    z = torch.randn(8, 2, requires_grad=True)
    loss = multi_task_bce_with_logits(z, torch.ones(8, 2), torch.zeros(8))
    loss.backward()
    assert float(loss.detach()) == 0.0 and z.grad is not None and not bool(z.grad.any())


@pytest.mark.parametrize(("shapes", "message"), [
    (((8, 2), (8,), None, None), r"logits and labels of one shape \[B, T\], but they are \(8, 2\) and \(8,\)"),
    (((8, 2), (8, 2), (8, 1), None), r"example weights must be \[B\] = \[8\], but are \(8, 1\)"),
    (((8, 2), (8, 2), None, [1.0, 1.0, 1.0]), r"3 task weights for 2 tasks"),
])
def test_multi_task_loss_refuses_mismatched_shapes(shapes: Any, message: str) -> None:
    z, y, w, tw = shapes
    with pytest.raises(ValueError, match=message):
        multi_task_bce_with_logits(torch.zeros(z), torch.zeros(y), None if w is None else torch.ones(w), tw)


# ---------------------------------------------------------------------------- the metrics

class TwoTaskModel(nn.Module):
    """Shared embeddings, one logit per task; ``forward`` returns ``(loss, logits [B, 2])``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=ROWS, feature_names=[f])
            for f in ("user", "item")], device=torch.device("meta"))
        self.towers = nn.Linear(16, 2)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.towers(self.ebc(batch.sparse).values())
        return multi_task_bce_with_logits(logits, batch.labels, batch.weights), logits.detach()


def _write(root: str, hours: int, rows: int) -> None:
    """Clicks follow the user id, likes the item id (so the two tasks' AUCs differ)."""
    rng = np.random.default_rng(0)
    for h in range(hours):
        user, item = rng.integers(0, ROWS, rows), rng.integers(0, ROWS, rows)
        click = (rng.random(rows) < 1 / (1 + np.exp(-(user - ROWS / 2) / 5))).astype(np.float32)
        like = (rng.random(rows) < 1 / (1 + np.exp((item - ROWS / 2) / 5))).astype(np.float32)
        os.makedirs(os.path.join(root, f"hour={h:02d}"), exist_ok=True)
        pq.write_table(pa.table({"click": click, "like": like, "user": user, "item": item}),
                       os.path.join(root, f"hour={h:02d}", "part-0.parquet"), row_group_size=50)


def _spec() -> FeatureSpec:
    return FeatureSpec(labels=TASKS, sparse=[SparseFeature(name="user", num_embeddings=ROWS),
                                             SparseFeature(name="item", num_embeddings=ROWS)])


def _run(data: str, out: str, tasks: list[str] | None, pipeline: str = "none",
         more_hooks: tuple[Any, ...] = ()) -> dict[str, Any]:
    windows = partitioned_windows(data)
    rows: list[dict[str, Any]] = []

    def record(mode: str) -> Any:
        def fn(trainer: Trainer, output: Any) -> None:
            if output.is_padding:
                return
            for mb in output.micro_batches:
                rows.append({"mode": mode, "step": trainer.state.global_step,
                             "p": torch.sigmoid(mb.outputs).double(), "y": mb.batch.labels.double()})
        return fn

    hook = MetricReportHook(every=4, per_window=False, tasks=tasks,
                            metrics=["auc", "logloss", "ne", "calibration", "ctr"])
    trainer = Trainer(
        TwoTaskModel(),
        TrainingArguments(output_dir=out, log_steps=1000, pipeline=pipeline),
        train_dataset=ParquetWindowDataset(windows[:2], _spec(), batch_size=32),
        eval_dataset=ParquetWindowDataset(windows[2:], _spec(), batch_size=48),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=0.05), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        hooks=[hook, LambdaHook(after_step=record("train"), after_eval_step=record("eval")), *more_hooks],
        add_logger_hook=False)
    trainer.train()
    final = trainer.evaluate()
    reports = [{"mode": r.mode, "scope": r.scope, "step": r.step, "values": r.values} for r in hook.reports]
    return {"rows": rows, "reports": reports, "final": final, "tasks": hook.tasks}


def _reference(sel: list[dict[str, Any]], t: int) -> dict[str, float]:
    p = torch.cat([r["p"][:, t] for r in sel])
    y = torch.cat([r["y"][:, t] for r in sel])
    pc = p.clamp(1e-12, 1 - 1e-12)
    logloss = float(-(y * pc.log() + (1 - y) * (1 - pc).log()).mean())
    ctr = float(y.mean())
    base = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    return {"auc": float(binary_auroc(p, y.long())), "logloss": logloss, "ne": logloss / base,
            "calibration": float(p.sum() / y.sum()), "ctr": ctr, "num_samples": float(len(p))}


def _check(results: list[dict[str, Any]]) -> None:
    assert all(r["reports"] == results[0]["reports"] for r in results), "ranks report identical values"
    assert results[0]["tasks"] == tuple(TASKS)
    rows = [row for r in results for row in r["rows"]]
    reports = results[0]["reports"]
    train = [r for r in reports if r["mode"] == "train"]
    ev = [r for r in reports if r["mode"] == "eval"]
    assert train and len(ev) == 1
    assert set(ev[0]["values"]) == {"num_samples", "weight_sum"} | {
        f"{m}/{t}" for m in ("auc", "logloss", "ne", "calibration", "ctr") for t in TASKS}
    prev = 0
    checked = []
    for rep in train + ev:
        if rep["mode"] == "train":
            sel = [x for x in rows if x["mode"] == "train" and prev < x["step"] <= rep["step"]]
            prev = rep["step"]
        else:
            sel = [x for x in rows if x["mode"] == "eval"]
        for t, task in enumerate(TASKS):
            ref = _reference(sel, t)
            assert rep["values"]["num_samples"] == ref["num_samples"]
            for k in ("auc", "logloss", "ne", "calibration", "ctr"):
                assert rep["values"][f"{k}/{task}"] == pytest.approx(ref[k], rel=1e-6), (rep["mode"], k, task)
            checked.append(ref["auc"])
    # The planted signals make the two tasks' AUCs different (the test could catch a mix-up).
    assert abs(ev[0]["values"]["auc/click"] - ev[0]["values"]["auc/like"]) > 0.02
    for r in results:
        assert r["final"]["auc/click"] == ev[0]["values"]["auc/click"]
        assert "auc" not in r["final"]


@pytest.fixture(scope="module")
def two_task_data(tmp_path_factory: Any) -> str:
    root = str(tmp_path_factory.mktemp("two_task"))
    _write(root, hours=3, rows=300)
    return root


def test_per_task_metrics_in_train_and_eval_match_torchmetrics_on_the_scored_rows(
        two_task_data: str, tmp_path: Any) -> None:
    _check([_run(two_task_data, str(tmp_path), None)])


@pytest.mark.distributed
def test_per_task_metrics_over_2_ranks_match_torchmetrics_on_all_ranks_rows(
        two_task_data: str, tmp_path: Any) -> None:
    _check(run_distributed(_run, world_size=2, timeout_s=240, args=(two_task_data, str(tmp_path), None)))


def test_explicit_task_names_override_the_feature_spec_and_one_task_keeps_plain_names(
        two_task_data: str, tmp_path: Any) -> None:
    from helpers import batches, make_trainer

    r = _run(two_task_data, str(tmp_path / "a"), ["ctr", "cvr"])
    assert r["tasks"] == ("ctr", "cvr") and "auc/cvr" in r["final"]
    hook = MetricReportHook(metrics=["auc"])
    trainer = make_trainer(batches(3), batches(2, seed=1), [hook], output_dir=str(tmp_path / "b"))
    trainer.train()
    assert hook.tasks is None and set(trainer.evaluate()) >= {"auc"}
    assert not any("/" in k for rep in hook.reports for k in rep.values)


def test_early_stopping_monitors_one_tasks_metric_and_names_them_when_given_the_plain_name(
        two_task_data: str, tmp_path: Any) -> None:
    from recsys_trainer.hooks import EarlyStoppingHook

    stopper = EarlyStoppingHook(metric="auc/like", patience=1)
    r = _run(two_task_data, str(tmp_path / "a"), None, more_hooks=(stopper,))
    assert stopper.best == r["final"]["auc/like"]
    with pytest.raises(KeyError, match=r"metric 'auc' is not in the evaluation metrics .* with several "
                                       r"tasks each metric is reported per task: monitor one of "
                                       r"\['auc/click', 'auc/like'\]"):
        _run(two_task_data, str(tmp_path / "b"), None, more_hooks=(EarlyStoppingHook(metric="auc"),))


def test_keep_best_metric_given_a_plain_name_on_a_multi_task_run_warns_naming_the_per_task_ones(
        tmp_path: Any, caplog: Any) -> None:
    import logging

    from recsys_trainer.checkpoint import CheckpointManager

    manager = CheckpointManager(str(tmp_path), keep_best_metric="auc", keep_best_mode="max")
    evaluation = {"auc/click": 0.7, "auc/like": 0.8, "num_samples": 10.0}
    with caplog.at_level(logging.WARNING):
        manager.record_metrics(evaluation)
        manager.record_metrics(evaluation)
    warnings = [r.getMessage() for r in caplog.records if "keep_best_metric" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per run
    assert "keep_best_metric 'auc' is not in the evaluation metrics" in warnings[0]
    assert "use one of ['auc/click', 'auc/like']" in warnings[0]
    caplog.clear()
    named = CheckpointManager(str(tmp_path / "b"), keep_best_metric="auc/like", keep_best_mode="max")
    with caplog.at_level(logging.WARNING):
        named.record_metrics(evaluation)
    assert "keep_best_metric" not in caplog.text


def test_predictions_with_another_number_of_tasks_are_refused_naming_the_tasks(
        two_task_data: str, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"reports 3 tasks \(a, b, c\), but the predictions have "
                                         r"shape \(32, 2\), not \[B, 3\]"):
        _run(two_task_data, str(tmp_path), ["a", "b", "c"])


def test_the_multi_task_loss_traces_under_the_torchrec_pipeline_and_matches_the_plain_loop(
        two_task_data: str, tmp_path: Any) -> None:
    plain = _run(two_task_data, str(tmp_path / "plain"), None)
    piped = _run(two_task_data, str(tmp_path / "piped"), None, pipeline="sparse_dist")
    assert piped["final"] == plain["final"] and "auc/like" in piped["final"]


def test_plots_draw_each_tasks_metric_from_a_multi_task_log(tmp_path: Any) -> None:
    from recsys_trainer.plot import main, plot_curves

    records: list[dict[str, Any]] = []
    for i in range(3):
        for mode, scope in (("train", "interval"), ("eval", "eval"), ("eval", "window")):
            records.append({"type": "metrics", "mode": mode, "scope": scope, "step": i, "window_index": i,
                            "window_id": f"h{i}", "auc/click": 0.6 + i / 100, "auc/like": 0.7})
    assert plot_curves(records, str(tmp_path / "c.png")) == ["loss", "auc"]
    log = tmp_path / "m.jsonl"
    import json
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(log), "--out", str(tmp_path / "c.png"), "--windows", str(tmp_path / "w.png"),
                 "--window-metric", "auc/like"]) == 0
    assert (tmp_path / "w.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main([str(log), "--window-metric", "auk/click"])
