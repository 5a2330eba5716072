"""A multi-task MMoE on click and a rare second label, against a DLRM trained on that label alone.

    python examples/train_multitask.py                                  (one process)
    torchrun --standalone --nproc_per_node=2 examples/train_multitask.py

The dataset is the one of ``train_din.py`` (written with ``--behaviour`` if missing): besides
``label`` (click) each row has ``like``, a rare label (~7%: a click the user also liked) whose
probability reuses the click's hidden categorical scores. Both models see the 26 categoricals
and the candidate ``item`` (no history), train on hour t and evaluate on hour t+1:

- ``mmoe``: ``models.MMoEClassifier`` on ``labels=["label", "like"]`` (4 experts, one
  gate and tower per task; ``--num-experts 1`` is shared-bottom), per-task eval metrics
  (``auc/label``, ``auc/like``);
- ``dlrm``: ``models.DLRMClassifier`` on ``labels=["like"]`` only: it learns the shared scores
  from the like positives alone, ~4x fewer than the click positives the MMoE also learns from.

At the end it prints the eval like-AUC of both, the margin and the oracle AUC of each label.
"""

from __future__ import annotations

from torch import nn
from train_din import common_arguments, fit, prepare, report

from recsys_trainer import seed_everything, setup_logging, shutdown
from recsys_trainer.data.generators.criteo_synthetic import SPARSE_COLUMNS, behaviour_features
from recsys_trainer.models import DLRMClassifier, MMoEClassifier


def main() -> None:
    p = common_arguments(__doc__, "output/train_multitask")
    p.add_argument("--models", nargs="+", choices=["mmoe", "dlrm"], default=["mmoe", "dlrm"])
    p.add_argument("--num-experts", type=int, default=4)
    a = p.parse_args()
    setup_logging()
    meta, windows = prepare(a)
    features = [*SPARSE_COLUMNS, "item"]
    like_auc: dict[str, list[float]] = {}
    trainer = None
    for name in a.models:
        seed_everything(0)  # args.seed in fit(): the towers are initialised before the Trainer
        model: nn.Module
        if name == "mmoe":
            labels = ["label", "like"]
            model = MMoEClassifier(features, 13, labels, num_embeddings=a.num_embeddings,
                                   embedding_dim=16, dense_arch=(64, 16),
                                   num_experts=a.num_experts, expert_arch=(64, 32),
                                   tower_arch=(16,), dense_log1p=True,
                                   prior_rates=[meta["ctr"], meta["like_rate"]])
        else:
            labels = ["like"]
            model = DLRMClassifier(features, 13, a.num_embeddings, 16, dense_arch=(64, 16),
                                   over_arch=(64, 32, 1), dense_log1p=True,
                                   prior_ctr=meta["like_rate"])
        spec = behaviour_features(a.num_embeddings, num_items=meta["num_items"], labels=labels,
                                  sequence=False)
        trainer, evals = fit(name, model, spec, windows, a)
        like_auc[name] = [e["auc/like" if name == "mmoe" else "auc"] for e in evals]
        if name == "mmoe" and trainer.is_rank_zero and evals:
            print(f"mmoe eval click AUC {evals[-1]['auc/label']:.4f} "
                  f"(oracle {meta['oracle_auc_per_label']['label']:.4f})")
    if trainer is not None:
        report("like-AUC", like_auc, meta["oracle_auc_per_label"]["like"], trainer)
    shutdown()


if __name__ == "__main__":
    main()
