"""The custom-hook example runs and its hook writes one CSV row per window and mode."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "custom_hook.py"


def test_custom_hook_example_writes_per_window_auc_csv(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("custom_hook_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = mod.main(str(tmp_path), hours=3)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["window_id"]) for r in rows] == [
        (m, f"hour={h:02d}") for h in range(3) for m in ("train", "eval")]
    assert [int(r["num_samples"]) for r in rows] == [6 * 256, 2 * 256] * 3
    aucs = [float(r["auc"]) for r in rows]
    assert all(0.0 < a < 1.0 and not math.isnan(a) for a in aucs)
    # The planted signal is learnable: the last eval window beats chance clearly.
    assert aucs[-1] > 0.6


def test_custom_hook_forwards_window_reports_to_a_user_callback(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("custom_hook_example2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from recsys_trainer import MetricReport

    got: list[MetricReport] = []
    hook = mod.WindowAucCsvHook(str(tmp_path / "w.csv"), callback=got.append)

    class _T:
        is_rank_zero = True

    hook.on_metrics(_T(), MetricReport("eval", "window", 5, {"auc": 0.7, "num_samples": 10.0}, "w1", 0))
    hook.on_metrics(_T(), MetricReport("train", "interval", 5, {"auc": 0.6, "num_samples": 3.0}))
    assert [r.window_id for r in got] == ["w1"]
    assert (tmp_path / "w.csv").read_text().splitlines()[1] == "eval,w1,5,0.7,10"
