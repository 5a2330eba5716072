"""Writing your own hook: per-window AUC to a CSV file (and to any callback you like).

A hook subclasses ``recsys_trainer.Hook`` and overrides only the events it needs; the Trainer
calls nothing else, so unused events cost nothing. ``MetricReportHook`` computes the metrics
(exactly, across ranks) and hands every report to all hooks' ``on_metrics``; this hook keeps the
per-window reports and writes them on rank 0.

    python examples/custom_hook.py --out /tmp/custom_hook_demo
"""

from __future__ import annotations

import argparse
import csv
import os
from collections.abc import Callable, Iterator

import torch

from recsys_trainer import (
    Hook,
    MetricReport,
    MetricReportHook,
    Trainer,
    TrainingArguments,
    seed_everything,
)
from recsys_trainer.batch import Batch
from recsys_trainer.data.base import WindowedDataset
from recsys_trainer.data.generators.synthetic import PlantedSignal, synthetic_batches
from recsys_trainer.models import DLRMClassifier


class WindowAucCsvHook(Hook):
    """Appends ``mode, window_id, step, auc, num_samples`` for every data window to a CSV file,
    and calls ``callback(report)`` if given (e.g. to push to your own dashboard)."""

    FIELDS = ("mode", "window_id", "step", "auc", "num_samples")

    def __init__(self, path: str, callback: Callable[[MetricReport], None] | None = None) -> None:
        self.path = path
        self.callback = callback

    def on_metrics(self, trainer: Trainer, report: MetricReport) -> None:
        # Every rank receives the same report; write once.
        if report.scope != "window" or not trainer.is_rank_zero:
            return
        new_file = not os.path.exists(self.path)
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new_file:
                w.writerow(self.FIELDS)
            w.writerow([report.mode, report.window_id, report.step, report.values["auc"],
                        int(report.values["num_samples"])])
        if self.callback is not None:
            self.callback(report)


class HourlyWindows(WindowedDataset):
    """A toy windowed stream: a few "hours" of planted-signal click data."""

    def __init__(self, hours: int, batches_per_hour: int, seed: int) -> None:
        sig = PlantedSignal.make(4, 4, 1000, seed=7, strength=1.5)
        self._data = {f"hour={h:02d}": synthetic_batches(batches_per_hour, 256, FEATURES, 4, 1000,
                                                         seed=seed + h, signal=sig)
                      for h in range(hours)}

    def window_ids(self) -> Iterator[str]:
        yield from self._data

    def iter_window(self, window_id: str, skip_batches: int = 0) -> Iterator[Batch]:
        return iter(self._data[window_id][skip_batches:])


FEATURES = ["f0", "f1", "f2", "f3"]


def main(out_dir: str, hours: int = 4) -> str:
    """Train hour h, evaluate hour h (held-out rows) for each hour; returns the CSV path."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "window_auc.csv")
    args = TrainingArguments(output_dir=out_dir, log_steps=10)
    seed_everything(args.seed)  # before the model: its dense layers are initialised when built
    trainer = Trainer(
        model=DLRMClassifier(FEATURES, 4, 1000, embedding_dim=8, dense_arch=(16,), over_arch=(16, 1)),
        args=args,
        train_dataset=HourlyWindows(hours, 6, seed=0),
        eval_dataset=HourlyWindows(hours, 2, seed=100),
        hooks=[MetricReportHook(), WindowAucCsvHook(csv_path)],
        dense_optimizers=(lambda params: torch.optim.Adam(params, lr=1e-2), None),
    )
    trainer.train_and_evaluate()
    return csv_path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="output/custom_hook_demo")
    p.add_argument("--hours", type=int, default=4)
    a = p.parse_args()
    path = main(a.out, a.hours)
    print(open(path).read())
