"""Serving: a trained model as a portable artifact, and a scorer that reads it.

``Scorer`` (``runtime/scorer.py``) loads an artifact and scores raw rows through the training
code's own decoding; it imports no torchrec, FBGEMM or ``torch.distributed`` training machinery,
nor does the rest of ``runtime/`` (what ``recsys-serve`` runs).
``export_for_serving`` / ``export_delta`` (``exporting/export.py``) write artifacts from a
checkpoint or a live ``Trainer``; they need the training stack, as does the rest of
``exporting/`` (what the training job runs to export and publish), and are imported on first
use (PEP 562), so ``import recsys_trainer.serving`` stays light. The formats both sides share
are the modules here: the artifact's (``manifest.py`` and docs/serving.md), deltas
(``delta.py``), dynamic tables' routing (``routing.py``), quantized tables (``quantize.py``) and
the published location (``published.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recsys_trainer.lazy import lazy_attributes
from recsys_trainer.serving.manifest import ArtifactError
from recsys_trainer.serving.runtime.scorer import Scorer

if TYPE_CHECKING:
    from recsys_trainer.serving.exporting.export import (
        ExportSummary,
        export_delta,
        export_for_serving,
    )

_LAZY = {"ExportSummary": "recsys_trainer.serving.exporting.export",
         "export_delta": "recsys_trainer.serving.exporting.export",
         "export_for_serving": "recsys_trainer.serving.exporting.export"}

__all__ = ["ArtifactError", "ExportSummary", "Scorer", "export_delta", "export_for_serving"]


__getattr__, __dir__ = lazy_attributes("recsys_trainer.serving", _LAZY)
