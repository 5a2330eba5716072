"""Moved to ``recsys_trainer.serving.runtime.scorer`` (the serving runtime lives apart from the
export side). This path keeps working: it re-exports the module's public names."""

from recsys_trainer.serving.runtime.scorer import (
    DynamicRows,
    Rows,
    Scorer,
    Table,
    check_program_archive,
)

__all__ = ["DynamicRows", "Rows", "Scorer", "Table", "check_program_archive"]
