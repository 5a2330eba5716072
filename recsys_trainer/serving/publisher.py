"""Moved to ``recsys_trainer.serving.exporting.publisher`` (the export side of serving lives
apart from the runtime). This path keeps working: it re-exports the module's public names."""

from recsys_trainer.serving.exporting.publisher import PARENT_CHECK_S, Publisher, worker_main

__all__ = ["PARENT_CHECK_S", "Publisher", "worker_main"]
