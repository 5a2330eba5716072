"""A serving export of a model trained on 2 ranks (the export merges the shards): the Scorer
gives ``predict``'s scores (unknown ids of dynamic tables routed to the default row of the
shard that owns them), and deltas between its checkpoints reproduce full exports."""

from __future__ import annotations

import os
from typing import Any

import pytest
import serving_utils as su
from dist_utils import run_distributed

pytestmark = pytest.mark.distributed
KINDS = ("dynamic", "mixed_fp16", "dlrm")  # mixed_fp16: hashed and dynamic tables, fp16 and fp32


def _train_predict_export(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from recsys_trainer.serving import export_for_serving

    out: dict[str, Any] = {}
    for kind in KINDS:
        r = os.path.join(root, kind)
        windows = [os.path.join(r, "data", f"hour={h:02d}", "part-0.parquet") for h in range(2)]
        trainer = su.make_trainer(kind, r, windows, steps=6, save_steps=3)
        trainer.train()
        pred = su.predicted(trainer, windows[-1], os.path.join(r, "pred"))
        export_for_serving(trainer, os.path.join(r, "art"))  # every rank calls it
        if dist.get_rank() == 0:
            out[kind] = {"diff": su.max_diff(su.scored(os.path.join(r, "art"), windows[-1]), pred),
                         "step": trainer.state.global_step, "rows": len(pred)}
            su.check_delta(r, kind, windows[-1], 3, trainer.state.global_step)
        dist.barrier()
    return out


def test_an_export_of_two_ranks_scores_as_predict_and_its_deltas_reproduce_full_exports(tmp_path) -> None:
    for kind in KINDS:
        su.write_data(str(tmp_path / kind / "data"), kind, rows=400)
    r0 = run_distributed(_train_predict_export, 2, 400, args=(str(tmp_path),))[0]
    for kind in KINDS:
        assert r0[kind]["step"] == 6 and r0[kind]["rows"] == 403, (kind, r0[kind])
        assert r0[kind]["diff"] <= 1e-6, (kind, r0[kind])
