"""Render a run's curves from its JSON-lines metrics log (``JsonlMetricsHook``) to PNG files.

    python -m recsys_trainer.plot output/metrics.jsonl --out curves.png [--windows windows.png]

``curves.png``: train and eval loss, then one panel per metric (AUC, GAUC, NE, log loss,
calibration, CTR) with the train intervals and the evaluations against the global step.
``windows.png`` (windowed runs): AUC per data window, train and eval, in window order.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from recsys_trainer.hooks.jsonl import read_jsonl
from recsys_trainer.metrics import METRIC_NAMES


def _series(records: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not math.isnan(v) and r.get(x) is not None:
            xs.append(float(r[x]))
            ys.append(float(v))
    return xs, ys


def plot_curves(records: list[dict[str, Any]], out: str) -> list[str]:
    """Loss and metric curves to ``out``; returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("type") == "train"]
    evals = [r for r in records if r.get("type") == "eval"]
    train_m = [r for r in records if r.get("type") == "metrics" and r.get("mode") == "train"
               and r.get("scope") == "interval"]
    eval_m = [r for r in records if r.get("type") == "metrics" and r.get("scope") == "eval"]
    panels: list[tuple[str, list[tuple[str, tuple[list[float], list[float]]]]]] = [
        ("loss", [("train", _series(train, "loss")), ("eval", _series(evals, "loss"))])
    ]
    keys = {k for r in train_m + eval_m for k in r}
    for name in METRIC_NAMES:
        # One line per mode, and per task for multi-task logs ("auc/click", "auc/like").
        tasks = sorted(k[len(name):] for k in keys if k == name or k.startswith(name + "/"))
        lines = [(f"{mode}{task.replace('/', ' ')}", _series(rs, name + task))
                 for task in tasks for mode, rs in (("train", train_m), ("eval", eval_m))]
        if any(xs for _, (xs, _) in lines):
            panels.append((name, lines))
    if not any(xs for _, lines in panels for _, (xs, _) in lines):
        raise ValueError("the log holds no loss or metric values to plot (is it a JsonlMetricsHook log?)")
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels, strict=False):
        for label, (xs, ys) in lines:
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel whose series are all empty has none
            ax.legend()
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [t for t, _ in panels]


def plot_windows(records: list[dict[str, Any]], out: str, metric: str = "auc") -> int:
    """Per-window ``metric`` (train and eval) to ``out``; returns the number of windows drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    win = [r for r in records if r.get("type") == "metrics" and r.get("scope") == "window"]
    if not win:
        raise ValueError("the log holds no per-window metrics (run MetricReportHook on windowed data)")
    fig, ax = plt.subplots(figsize=(10, 4))
    count = 0
    for mode in ("train", "eval"):
        rs = [r for r in win if r.get("mode") == mode]
        xs, ys = _series(rs, metric, x="window_index")
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{mode} {metric}")
            count = max(count, len(rs))
            # Label a few ticks with the window ids so the x axis reads as time.
            step = max(1, len(rs) // 12)
            ticks = rs[::step]
            ax.set_xticks([float(r["window_index"]) for r in ticks])
            ax.set_xticklabels([str(r.get("window_id")) for r in ticks], rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("window")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per window")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return count


def _window_metric(value: str) -> str:
    if value.split("/")[0] not in METRIC_NAMES:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not one of {', '.join(METRIC_NAMES)} (or name/task for a multi-task run)")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recsys_trainer.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="metrics.jsonl written by JsonlMetricsHook")
    p.add_argument("--out", default="curves.png", help="PNG for loss and metric curves")
    p.add_argument("--windows", default=None, help="PNG for the per-window plot (windowed runs)")
    p.add_argument("--window-metric", default="auc", type=_window_metric,
                   help=f"one of {', '.join(METRIC_NAMES)}; multi-task: name/task (auc/click)")
    a = p.parse_args(argv)
    try:
        records = read_jsonl(a.log)
        panels = plot_curves(records, a.out)
        print(f"wrote {a.out} ({', '.join(panels)})")
        if a.windows:
            n = plot_windows(records, a.windows, a.window_metric)
            print(f"wrote {a.windows} ({n} windows)")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
