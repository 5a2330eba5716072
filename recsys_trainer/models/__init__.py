"""The bundled models, one module per family, and the pieces they share.

Ranking (``forward(batch)`` returns ``(loss, logits)``): ``DLRMClassifier`` (``dlrm``),
``DCNClassifier`` (``dcn``: DCN-v2's cross network), ``DINClassifier`` (``din``: target
attention over a behaviour sequence), ``MMoEClassifier`` (``mmoe``: multi-task experts) and
``HSTURankingModel`` (``hstu``: the candidate after the history, multi-task heads).
Retrieval (``forward(batch)`` returns ``(loss, outputs)`` with the query embedding):
``TwoTowerModel`` (``two_tower``), ``SASRecModel`` (``sasrec``) and ``HSTURetrievalModel``
(``hstu``); what they share is ``retrieval_base``, the plumbing they call (losses, candidates,
metrics, the item export) is ``recsys_trainer.retrieval``'s.

Shared pieces: ``blocks`` (MLPs, towers, multi-task heads, the tables and their
initialisers), ``losses`` (the ranking losses and their label check), ``jagged`` (histories by
length bucket), ``hstu_layer`` (the HSTU layer), ``checks`` (the sequence ranking models' batch
checks). Import any of these names from ``recsys_trainer.models``; the modules are the layout,
not the interface.
"""

from recsys_trainer.models.blocks import (
    TableInit,
    TaskHeads,
    init_last_bias,
    make_tables,
    mlp,
    normal_init,
    stack_pooled,
    tower,
    uniform_init,
)
from recsys_trainer.models.checks import check_sequence_lengths, check_value_feature
from recsys_trainer.models.dcn import DCNClassifier
from recsys_trainer.models.din import DINClassifier, TargetAttention
from recsys_trainer.models.dlrm import DLRMClassifier
from recsys_trainer.models.hstu import HSTURankingModel, HSTURetrievalModel
from recsys_trainer.models.hstu_layer import HSTUEncoder, HSTULayer
from recsys_trainer.models.losses import (
    BINARY_LABELS,
    BinaryClassifier,
    check_binary_labels,
    check_task_shapes,
    multi_task_bce_with_logits,
    weighted_bce_with_logits,
)
from recsys_trainer.models.mmoe import MMoEClassifier
from recsys_trainer.models.retrieval_base import LossKind, RetrievalBase, RetrievalOptions
from recsys_trainer.models.sasrec import SASRecModel
from recsys_trainer.models.two_tower import TwoTowerModel

__all__ = [
    "BINARY_LABELS",
    "BinaryClassifier",
    "DCNClassifier",
    "DINClassifier",
    "DLRMClassifier",
    "HSTUEncoder",
    "HSTULayer",
    "HSTURankingModel",
    "HSTURetrievalModel",
    "LossKind",
    "MMoEClassifier",
    "RetrievalBase",
    "RetrievalOptions",
    "SASRecModel",
    "TableInit",
    "TargetAttention",
    "TaskHeads",
    "TwoTowerModel",
    "check_binary_labels",
    "check_sequence_lengths",
    "check_value_feature",
    "check_task_shapes",
    "init_last_bias",
    "make_tables",
    "mlp",
    "multi_task_bce_with_logits",
    "normal_init",
    "stack_pooled",
    "tower",
    "uniform_init",
    "weighted_bce_with_logits",
]
