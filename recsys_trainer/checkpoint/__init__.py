"""Checkpoints: per-rank concurrent, async, atomically committed, rotated, resumable.

See ``docs/checkpoint.md`` for the layout and the guarantees. ``ModelBankSource`` lives in
``recsys_trainer.args`` (beside ``TrainingArguments``) and is re-exported here.
"""

from recsys_trainer.args import ModelBankSource
from recsys_trainer.checkpoint.errors import CheckpointError
from recsys_trainer.checkpoint.export import export_model_state_dict, export_vocabularies
from recsys_trainer.checkpoint.layout import CheckpointInfo, latest_committed, list_committed
from recsys_trainer.checkpoint.manager import CheckpointManager
from recsys_trainer.checkpoint.rotation import RetentionPolicy, select_to_delete
from recsys_trainer.checkpoint.save_pipeline import SaveStats

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "ModelBankSource",
    "RetentionPolicy",
    "SaveStats",
    "export_model_state_dict",
    "export_vocabularies",
    "latest_committed",
    "list_committed",
    "select_to_delete",
]
