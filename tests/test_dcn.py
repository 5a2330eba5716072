"""DCN-v2: its logits against a plain reference of the paper's formulas written here (full-rank
and low-rank mixture cross layers, stacked and parallel), the settings refused by name, and a
DCN with dynamic tables and a per-table optimizer trained, exported and scored as ``predict``
scores. Its plain export parity is in test_serving.py (kind ``dcn``), its two-rank run in
test_serving_dist.py."""

from __future__ import annotations

from typing import Any

import pytest
import serving_utils as su
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.criteo_synthetic import SPARSE_COLUMNS, criteo_features
from recsys_trainer.data.inputs import SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.dynamic import ID_SPACE, DynamicTable
from recsys_trainer.models import DCNClassifier
from recsys_trainer.serving import Scorer, export_for_serving

pytestmark = pytest.mark.timeout(300)

FEATURES = ["a", "b", "c"]


def _batch(b: int = 5, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (len(FEATURES) * b,), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=ids,
                                              lengths=torch.ones(len(FEATURES) * b, dtype=torch.int32))
    return Batch(dense=torch.rand(b, 4, generator=g) * 10, sparse=kjt,
                 labels=(torch.rand(b, generator=g) < 0.5).float())


def _reference(model: DCNClassifier, batch: Batch) -> torch.Tensor:
    """DCN-v2's forward from the model's parameters, formula by formula (Wang et al. 2021):
    x0 = [bottom MLP(log1p(dense)), e_1, ..., e_F]; x_{l+1} = x0 * (W_l x_l + b_l) + x_l, W_l
    full rank or a gated mixture of U_i g(C_i g(V_i x_l)); then the deep MLP after (stacked) or
    beside (parallel) the cross network, and one logit."""
    tables = {n[len("t_"):]: p.weight for n, p in
              model.sparse_arch.embedding_bag_collection.embedding_bags.items()}
    ids = batch.sparse.to_dict()
    emb = [tables[f][ids[f].values()] for f in FEATURES]  # one id per row
    x0 = torch.cat([model.dense_arch(torch.log1p(batch.dense)), *emb], dim=1)
    cross = model.cross
    x = x0
    for layer in range(len(cross.bias)):
        if hasattr(cross, "kernels"):  # full rank
            x = x0 * (x @ cross.kernels[layer].T + cross.bias[layer].squeeze(1)) + x
            continue
        experts = []
        for i in range(cross._num_experts):
            low = F.relu(x @ cross.V_kernels[layer][i].T)
            low = F.relu(low @ cross.C_kernels[layer][i].T)
            experts.append(x0 * (low @ cross.U_kernels[layer][i].T + cross.bias[layer].squeeze(1)))
        gates = torch.softmax(torch.cat([g(x) for g in cross.gates], dim=1), dim=1)
        x = sum(gates[:, i:i + 1] * e for i, e in enumerate(experts)) + x
    deep_in = x if model.structure == "stacked" else x0
    deep = deep_in
    for m in model.deep:
        deep = m(deep)
    out = deep if model.structure == "stacked" else torch.cat([x, deep], dim=1)
    return (out @ model.head.weight.T + model.head.bias).squeeze(1)


@pytest.mark.parametrize(("cross", "structure"), [("full", "stacked"), ("mixture", "parallel"),
                                                   ("mixture", "stacked")])
def test_dcn_logits_equal_the_papers_formulas_written_here(cross: str, structure: str) -> None:
    torch.manual_seed(0)
    model = DCNClassifier(FEATURES, 4, 20, 4, dense_arch=(8,), cross=cross,  # type: ignore[arg-type]
                          num_cross_layers=3, low_rank=2, num_experts=3, structure=structure,  # type: ignore[arg-type]
                          deep_arch=(6, 5), dense_log1p=True, table_device="cpu")
    batch = _batch()
    with torch.no_grad():
        loss, logits = model(batch)
        torch.testing.assert_close(logits, _reference(model, batch), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(loss)


def test_dcn_refuses_an_unknown_cross_a_parallel_model_without_deep_part_and_zero_layers() -> None:
    with pytest.raises(ValueError, match="`cross` must be 'full', 'low_rank' or 'mixture', but is 'diag'"):
        DCNClassifier(FEATURES, 4, cross="diag")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structure='parallel' puts a deep part beside"):
        DCNClassifier(FEATURES, 4, structure="parallel", deep_arch=())
    with pytest.raises(ValueError, match="`num_cross_layers` must be an int >= 1, but is 0"):
        DCNClassifier(FEATURES, 4, num_cross_layers=0)
    # A stacked model without a deep part is the cross network and the logit.
    model = DCNClassifier(FEATURES, 4, 20, 4, cross="low_rank", low_rank=2, deep_arch=(),
                          table_device="cpu")
    assert model(_batch())[1].shape == (5,)


def test_a_dcn_with_dynamic_tables_and_a_per_table_optimizer_scores_as_predict(tmp_path: Any) -> None:
    windows = su.write_data(str(tmp_path / "data"), "mixed")
    dynamic, hashed = SPARSE_COLUMNS[:3], SPARSE_COLUMNS[3:5]
    spec = FeatureSpec(labels=["label"], dense=criteo_features().dense,
                       sparse=[*(SparseFeature(name=c, num_embeddings=ID_SPACE) for c in dynamic),
                               *(SparseFeature(name=c, num_embeddings=su.NUM_EMB) for c in hashed)])

    def model() -> DCNClassifier:
        torch.manual_seed(0)
        return DCNClassifier([*dynamic, *hashed], 13, [ID_SPACE] * 3 + [su.NUM_EMB] * 2, 8,
                             dense_arch=(16, 8), cross="full", num_cross_layers=2, deep_arch=(16,),
                             dense_log1p=True,
                             dynamic=dict.fromkeys(dynamic, DynamicTable(num_slots=64, fallback_rows=4)))

    trainer = Trainer(
        model(), TrainingArguments(output_dir=str(tmp_path / "ckpt"), train_steps=6, log_steps=1000),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=32),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1),
        table_optimizers={"t_C4": SparseOptimizer("sgd", lr=0.5)}, add_logger_hook=False)
    # The tables are the DLRM's, t_<feature>: per-table optimizers find them by name.
    assert trainer.sparse_lrs() == {"t_C1": 0.1, "t_C2": 0.1, "t_C3": 0.1, "t_C4": 0.5, "t_C5": 0.1}
    trainer.train()
    pred = su.predicted(trainer, windows[-1], str(tmp_path / "pred"))
    art = str(tmp_path / "art")
    export_for_serving(trainer, art)
    # Unknown raw ids (an id no table held, nulls) read the default rows, as in training.
    assert su.max_diff(su.scored(art, windows[-1]), pred) <= 1e-6
    tables = Scorer(art).tables
    assert sorted(n for n, t in tables.items() if t.dynamic is not None) == [f"t_{c}" for c in dynamic]
