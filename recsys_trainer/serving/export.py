"""Moved to ``recsys_trainer.serving.exporting.export`` (the export side of serving lives apart
from the runtime). This path keeps working: it re-exports the module's public names."""

from recsys_trainer.serving.exporting.export import (
    ExportOptions,
    ExportSummary,
    build,
    export_delta,
    export_for_serving,
    fallback_rows_per_shard,
)

__all__ = ["ExportOptions", "ExportSummary", "build", "export_delta", "export_for_serving",
           "fallback_rows_per_shard"]
