"""Retrieval: losses against hand-written softmaxes, the streaming frequency sketch, the exact
full-corpus metrics against a brute-force numpy ranking, the models' input checks and padding,
and the synthetic log's oracle against a brute-force ranking of the whole corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer.batch import Batch
from recsys_trainer.data.generators.interactions_synthetic import (
    InteractionSignal,
    interaction_features,
    oracle_ranks,
    write_dataset,
)
from recsys_trainer.models import SASRecModel, TwoTowerModel
from recsys_trainer.retrieval.frequency import ItemFrequencyEstimator
from recsys_trainer.retrieval.losses import (
    expected_candidate_log_q,
    in_batch_softmax_loss,
    sampled_softmax_loss,
)
from recsys_trainer.retrieval.metrics import Jagged, full_corpus_metrics, sharded_top_k


def _manual_softmax(logits: np.ndarray, pos: np.ndarray, masked: np.ndarray) -> np.ndarray:
    z = np.where(masked, -np.inf, logits)
    z = z - z.max(1, keepdims=True)
    return -(z[np.arange(len(pos)), pos] - np.log(np.exp(z).sum(1)))


def test_in_batch_softmax_with_log_q_masks_repeats_and_padding_rows_and_matches_a_manual_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    q, items = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    ids = torch.tensor([3, 7, 3, 9, 4])  # item 3 twice: an accidental hit for rows 0 and 2
    w = torch.tensor([1.0, 2.0, 1.0, 0.0, 1.0])  # row 3 is padding: no loss, no negative
    log_q = torch.tensor([0.5, -1.0, 0.5, 2.0, 0.0])
    loss = in_batch_softmax_loss(q, items, ids, w, temperature=0.5, item_log_q=log_q)
    logits = (q @ items.t()).numpy() / 0.5 - log_q.numpy()[None, :]
    masked = (ids.numpy()[None, :] == ids.numpy()[:, None]) | (w.numpy()[None, :] == 0)
    np.fill_diagonal(masked, False)
    per_row = _manual_softmax(logits, np.arange(5), masked)
    wn = w.numpy()
    expected = (per_row * wn)[wn > 0].sum() / wn.sum()
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # Without accidental-hit removal only the padding candidate is masked.
    plain = in_batch_softmax_loss(q, items, ids, w, temperature=0.5, item_log_q=log_q,
                                  remove_accidental_hits=False)
    pad_only = np.repeat(w.numpy()[None, :] == 0, 5, axis=0)
    np.fill_diagonal(pad_only, False)
    per_row = _manual_softmax(logits, np.arange(5), pad_only)
    assert float(plain) == pytest.approx((per_row * wn)[wn > 0].sum() / wn.sum(), rel=1e-5)
    # More candidates than queries (another rank's items around this rank's, positives at an
    # offset): the query weights are not candidate weights, only accidental hits are masked.
    wider = in_batch_softmax_loss(q[1:4], items, ids, w[1:4], temperature=0.5, positive_offset=1,
                                  item_log_q=log_q)
    hits = ids.numpy()[None, :] == ids.numpy()[1:4, None]
    hits[np.arange(3), np.arange(1, 4)] = False
    per_row = _manual_softmax(logits[1:4], np.arange(1, 4), hits)
    w3 = wn[1:4]
    assert float(wider) == pytest.approx((per_row * w3)[w3 > 0].sum() / w3.sum(), rel=1e-5)
    # The padding row changes nothing: the same loss without it.
    keep = torch.tensor([0, 1, 2, 4])
    alone = in_batch_softmax_loss(q[keep], items[keep], ids[keep], w[keep], temperature=0.5,
                                  item_log_q=log_q[keep])
    assert float(alone) == pytest.approx(float(loss), rel=1e-6)
    # An all-padding batch costs exactly 0, with finite gradients.
    q.requires_grad_(True)
    zero = in_batch_softmax_loss(q, items, ids, torch.zeros(5), temperature=0.5)
    zero.backward()
    assert float(zero.detach()) == 0.0 and q.grad is not None and torch.isfinite(q.grad).all()


def test_mixed_negatives_and_sampled_softmax_match_manual_softmaxes() -> None:
    g = torch.Generator().manual_seed(1)
    q, items, negs = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(3, 6, generator=g)
    ids, neg_ids = torch.tensor([1, 2, 3, 4]), torch.tensor([2, 10, 11])  # negative 2 hits row 1
    lq, nlq = torch.randn(4, generator=g), torch.randn(3, generator=g)
    mixed = in_batch_softmax_loss(q, items, ids, None, item_log_q=lq, negatives=negs,
                                  negative_ids=neg_ids, negative_log_q=nlq)
    cand = torch.cat([items, negs]).numpy()
    cand_ids = np.r_[ids.numpy(), neg_ids.numpy()]
    logits = q.numpy() @ cand.T - np.r_[lq.numpy(), nlq.numpy()][None, :]
    masked = cand_ids[None, :] == ids.numpy()[:, None]
    masked[np.arange(4), np.arange(4)] = False
    assert float(mixed) == pytest.approx(_manual_softmax(logits, np.arange(4), masked).mean(), rel=1e-5)

    sampled = sampled_softmax_loss(q, items, ids, negs, neg_ids, torch.tensor([1.0, 1.0, 0.0, 1.0]),
                                   temperature=0.2, positive_log_q=lq, negative_log_q=nlq)
    logits = np.c_[(q * items).sum(1).numpy()[:, None] / 0.2 - lq.numpy()[:, None],
                   q.numpy() @ negs.numpy().T / 0.2 - nlq.numpy()[None, :]]
    masked = np.c_[np.zeros((4, 1), bool), neg_ids.numpy()[None, :] == ids.numpy()[:, None]]
    per_row = _manual_softmax(logits, np.zeros(4, int), masked)
    assert float(sampled) == pytest.approx(per_row[[0, 1, 3]].mean(), rel=1e-5)


def test_the_softmax_losses_gradients_equal_finite_differences_with_masks_log_q_and_padding() -> None:
    # The losses compute their gradient by hand (one matrix, no autograd copies of it): check it
    # against finite differences in float64, with accidental hits, padding candidates, logQ
    # terms, another rank's candidate before this rank's rows and shared negatives.
    g = torch.Generator().manual_seed(3)
    q, items, negs = (torch.randn(n, 4, generator=g, dtype=torch.float64).requires_grad_(True) for n in (5, 7, 3))
    ids = torch.tensor([3, 3, 7, 3, 9, 4, 8])  # candidate 0 (another rank's) hits rows 0 and 2
    w = torch.tensor([1.0, 2.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    item_w = torch.tensor([1.0, 1.0, 2.0, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)  # this rank's at 1..5
    neg_ids = torch.tensor([7, 11, 3])
    lq, nlq = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, it, ng: in_batch_softmax_loss(q, it, ids, w, temperature=0.5, positive_offset=1,
                                                item_weights=item_w, item_log_q=lq, negatives=ng,
                                                negative_ids=neg_ids, negative_log_q=nlq),
        (q, items, negs))
    pos_ids = ids[1:6]
    for hits in (True, False):  # without hit removal, the padding negative alone is masked
        def sampled(q: torch.Tensor, p: torch.Tensor, ng: torch.Tensor, hits: bool = hits) -> torch.Tensor:
            return sampled_softmax_loss(q, p, pos_ids, ng, neg_ids, w, temperature=0.5, positive_log_q=lq[:5],
                                        negative_log_q=nlq, negative_weights=torch.tensor([1.0, 0.0, 1.0]),
                                        remove_accidental_hits=hits)

        assert torch.autograd.gradcheck(sampled, (q, items[:5], negs))


def test_the_softmax_losses_of_an_empty_batch_or_an_empty_negative_set_are_zero_with_zero_gradients() -> None:
    # A rank whose batch has no rows (no candidates either without cross-rank negatives), and a
    # sampled softmax with no negatives (the positive alone: probability 1), cost exactly 0.
    q0, it0 = torch.zeros(0, 4, requires_grad=True), torch.zeros(0, 4, requires_grad=True)
    empty = in_batch_softmax_loss(q0, it0, torch.zeros(0, dtype=torch.int64), None, temperature=0.1,
                                  item_log_q=torch.zeros(0))
    empty.backward()
    assert float(empty.detach()) == 0.0 and q0.grad is not None and q0.grad.shape == (0, 4)
    q, pos = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    alone = sampled_softmax_loss(q, pos, torch.tensor([1, 2, 3]), torch.zeros(0, 4),
                                 torch.zeros(0, dtype=torch.int64), None, temperature=0.1,
                                 positive_log_q=torch.randn(3), negative_log_q=torch.zeros(0))
    alone.backward()
    assert float(alone.detach()) == 0.0
    assert q.grad is not None and torch.equal(q.grad, torch.zeros(3, 4))


def test_a_second_derivative_through_the_softmax_losses_is_refused_not_silently_wrong() -> None:
    # The hand-written backward reuses the forward's exp matrix (made without a graph): with
    # create_graph=True its ops would record a derivative missing that dependence.
    q, items = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    loss = in_batch_softmax_loss(q, items, torch.tensor([1, 2, 1]), None, temperature=0.5)
    with pytest.raises(RuntimeError, match="differentiable once: backward with create_graph=True"):
        torch.autograd.grad(loss, q, create_graph=True)
    (g,) = torch.autograd.grad(in_batch_softmax_loss(q, items, torch.tensor([1, 2, 1]), None,
                                                     temperature=0.5), q)
    assert torch.isfinite(g).all()  # a first derivative is as before


def test_the_log_q_term_is_the_log_expected_count_of_each_item_in_the_candidate_set() -> None:
    p = torch.tensor([0.5, 0.1, 0.0], dtype=torch.float64)
    out = expected_candidate_log_q(p, 100, num_uniform=50, corpus_size=10)
    assert torch.allclose(out, torch.log(torch.tensor([55.0, 15.0, 5.0])))


def test_frequency_sketch_counts_exactly_decays_by_its_half_life_and_resumes_bitwise() -> None:
    est = ItemFrequencyEstimator(10, half_life_steps=None)
    est.update(torch.tensor([1, 1, 2, 5]))
    est.update(torch.tensor([1, 5]))
    assert est.probability(torch.tensor([1, 2, 5, 7])).tolist() == [0.5, pytest.approx(1 / 6), pytest.approx(2 / 6), 0.0]
    decayed = ItemFrequencyEstimator(10, half_life_steps=2.0)
    decayed.update(torch.tensor([3]))
    decayed.update(torch.tensor([4]))
    decayed.update(torch.tensor([4]))
    # item 3 was counted 2 updates ago (weight 1/2), item 4 at weights 1/sqrt(2) and 1
    p3, p4 = decayed.probability(torch.tensor([3, 4])).tolist()
    assert p3 / p4 == pytest.approx(0.5 / (1 + 2 ** -0.5))
    # Count-min with hashed ids: never below the true count, equal where buckets do not collide.
    sketch = ItemFrequencyEstimator(64, num_hashes=3, half_life_steps=None, seed=1)
    ids = torch.randint(0, 10**12, (200,), generator=torch.Generator().manual_seed(3))
    stream = torch.cat([ids[:20].repeat(5), ids])
    sketch.update(stream)
    true = torch.tensor([(stream == i).sum() for i in ids[:20]], dtype=torch.float64) / len(stream)
    est_p = sketch.probability(ids[:20])
    assert (est_p >= true - 1e-12).all() and (est_p <= true * 3).all()
    # The state is the module's buffers: a copy restored from them continues identically.
    copy = ItemFrequencyEstimator(64, num_hashes=3, half_life_steps=None, seed=1)
    copy.load_state_dict(sketch.state_dict())
    for s in (sketch, copy):
        s.update(ids[:7])
    assert torch.equal(sketch.counts, copy.counts) and torch.equal(sketch.total, copy.total)
    with pytest.raises(ValueError, match="num_buckets"):
        ItemFrequencyEstimator(0)


class _TableModel(torch.nn.Module):
    """A fixed item table as a RetrievalModel (the metric code needs only ``item_embeddings``)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.num_items = table.shape[0]
        self.calls = 0

    def item_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.table[ids]


def brute_force_metrics(queries: np.ndarray, corpus: np.ndarray, targets: list[list[int]],
                        exclude: list[list[int]] | None, ks: list[int]) -> dict[str, float]:
    """Recall/NDCG/HitRate@k by ranking the whole corpus for each query, in float64 numpy."""
    scores = queries.astype(np.float64) @ corpus.astype(np.float64).T
    out = {f"{m}@{k}": 0.0 for k in ks for m in ("recall", "ndcg", "hitrate")}
    n = 0
    for i, tgt in enumerate(targets):
        t = set(tgt)
        if not t:
            continue
        n += 1
        s = scores[i].copy()
        if exclude is not None:
            s[list(exclude[i])] = -np.inf
        order = [j for j in np.argsort(-s, kind="stable") if np.isfinite(s[j])]
        for k in ks:
            top = order[:k]
            hits = [r for r, j in enumerate(top) if j in t]
            out[f"recall@{k}"] += len(hits) / len(t)
            out[f"hitrate@{k}"] += float(bool(hits))
            idcg = sum(1 / np.log2(r + 2) for r in range(min(len(t), k)))
            out[f"ndcg@{k}"] += sum(1 / np.log2(r + 2) for r in hits) / idcg
    return {name: v / n for name, v in out.items()} | {"num_queries": float(n)}


def test_full_corpus_metrics_equal_a_brute_force_ranking_with_exclusions_and_several_targets() -> None:
    rng = np.random.default_rng(0)
    corpus = rng.normal(size=(300, 8)).astype(np.float32)
    queries = rng.normal(size=(37, 8)).astype(np.float32)
    targets = [list(rng.choice(300, size=rng.integers(0, 4), replace=True)) for _ in range(37)]
    history = [list(rng.choice(300, size=rng.integers(0, 30), replace=False)) for _ in range(37)]
    ks = [1, 5, 20]

    def jag(rows: list[list[int]]) -> Jagged:
        return Jagged(torch.tensor([len(r) for r in rows]), torch.tensor([i for r in rows for i in r], dtype=torch.int64))

    model = _TableModel(torch.from_numpy(corpus))
    # Small chunks: several item-tower calls and score blocks must merge to the same top K.
    got = full_corpus_metrics(model, torch.from_numpy(queries), jag(targets), ks, exclude=jag(history),
                              query_chunk_size=8, corpus_chunk_size=64)
    expected = brute_force_metrics(queries, corpus, targets, history, ks)
    assert model.calls == 5
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == pytest.approx(expected[name], abs=1e-12), name
    # Recall and hit rate differ with several targets; without exclusions the top 5 differs.
    assert got["recall@5"] != got["hitrate@5"]
    plain = full_corpus_metrics(model, torch.from_numpy(queries), jag(targets), ks)
    assert plain == pytest.approx(brute_force_metrics(queries, corpus, targets, None, ks))
    top_scores, top_ids = sharded_top_k(torch.from_numpy(queries), torch.from_numpy(corpus), 0, 5)
    brute = np.argsort(-(queries @ corpus.T), axis=1, kind="stable")[:, :5]
    assert np.array_equal(top_ids.numpy(), brute)


def _tt_batch(items: list[int], hist: list[list[int]], weights: list[float] | None = None,
              keys: tuple[str, ...] = ("item", "hist_item", "item_cat"), users: list[int] | None = None,
              item_cats: list[int] | None = None, hist_cats: list[list[int]] | None = None) -> Batch:
    """A batch of ``items`` with histories ``hist``; categories ``id % 3`` unless given."""
    b = len(items)
    per_key = {"item": ([[i] for i in items]), "hist_item": hist,
               "item_cat": [[c] for c in (item_cats or [i % 3 for i in items])],
               "hist_item_cat": hist_cats if hist_cats is not None else [[h % 3 for h in r] for r in hist]}
    lists = [per_key[k] for k in keys]
    return Batch(
        dense=torch.zeros(b, 0),
        sparse=KeyedJaggedTensor.from_lengths_sync(
            keys=["user_id"], values=torch.tensor(users) if users is not None else torch.arange(b),
            lengths=torch.ones(b, dtype=torch.int32)),
        labels=torch.ones(b),
        weights=None if weights is None else torch.tensor(weights),
        sequence=KeyedJaggedTensor.from_lengths_sync(
            keys=list(keys), values=torch.tensor([i for rows in lists for r in rows for i in r], dtype=torch.int64),
            lengths=torch.tensor([len(r) for rows in lists for r in rows], dtype=torch.int32)))


def _two_tower(**kw: object) -> TwoTowerModel:
    torch.manual_seed(0)
    catalog = {"item_id": np.arange(20), "item_cat": np.arange(20) % 3}
    return TwoTowerModel(["user_id"], num_items=20, user_num_embeddings=10, max_len=4,
                         item_side_features={"item_cat": 3}, item_catalog=catalog, embedding_dim=8,
                         tower_dims=(16, 8), table_device="cpu", **kw)  # type: ignore[arg-type]


def test_two_tower_ignores_padding_rows_names_bad_inputs_and_embeds_items_like_its_item_tower() -> None:
    model = _two_tower(num_uniform_negatives=4)
    batch = _tt_batch([1, 2, 3], [[4, 5], [], [6, 7, 8, 9]])
    loss, out = model(batch)
    assert torch.isfinite(loss) and out["query"].shape == (3, 8) and out["target"].tolist() == [1, 2, 3]
    assert out["history_lengths"].tolist() == [2, 0, 4] and out["history_ids"].tolist() == [4, 5, 6, 7, 8, 9]
    padded_loss, _ = model(batch.as_padding())
    assert float(padded_loss.detach()) == 0.0
    # The item tower on a batch's candidates equals item_embeddings() on their ids (catalog).
    model.eval()
    _, out = model(batch)
    seq = model.items(batch.sequence)
    items = model._item_vectors({k: seq[k] for k in model.sequence_keys}, slice(0, 3))
    assert torch.allclose(items, model.item_embeddings(torch.tensor([1, 2, 3])), atol=1e-6)
    with pytest.raises(ValueError, match=r"in the order \['item', 'hist_item', 'item_cat'\]"):
        model(_tt_batch([1], [[2]], keys=("hist_item", "item", "item_cat")))
    with pytest.raises(ValueError, match=r"at most the model's max_len=4 ids; at fault: batch row \d+ \(5 ids\)"):
        model(_tt_batch([1], [[2, 3, 4, 5, 6]]))
    with pytest.raises(ValueError, match="need `item_catalog`"):
        TwoTowerModel(["u"], num_items=5, item_side_features={"c": 2}, table_device="cpu")
    with pytest.raises(ValueError, match="every item id in \\[0, 20\\) exactly once"):
        TwoTowerModel(["u"], num_items=20, item_side_features={"item_cat": 3}, table_device="cpu",
                      item_catalog={"item_id": np.arange(19), "item_cat": np.zeros(19, int)})
    with pytest.raises(ValueError, match="num_uniform_negatives"):
        _two_tower(loss="sampled")
    # Cross-rank negatives in one process (no group): the early-launched gather hands back the
    # local rows, so the loss and every gradient are the plain in-batch ones.
    plain, crossed = _two_tower(num_uniform_negatives=4), _two_tower(num_uniform_negatives=4, cross_rank_negatives=True)
    crossed.load_state_dict(plain.state_dict())
    grads = []
    for m in (plain, crossed):
        torch.manual_seed(1)  # the same uniform negatives
        loss, _ = m(batch)
        loss.backward()
        grads.append((float(loss.detach()), [p.grad.clone() for p in m.user_tower.parameters() if p.grad is not None]))
    assert grads[0][0] == grads[1][0] and len(grads[0][1]) == 4
    assert all(torch.equal(x, y) for x, y in zip(grads[0][1], grads[1][1], strict=True))


def test_both_models_take_each_shared_option_by_name_as_their_callers_and_configs_see_it() -> None:
    import inspect

    from recsys_trainer.component import ComponentSpec
    from recsys_trainer.models import RetrievalBase, RetrievalOptions

    base = inspect.signature(RetrievalBase.__init__).parameters
    for cls in (TwoTowerModel, SASRecModel):
        params = inspect.signature(cls).parameters
        assert not [p for p in params.values() if p.kind is p.VAR_KEYWORD]
        for name, typed in RetrievalOptions.__annotations__.items():
            # One declaration: the option's default is the base's, its type the TypedDict's.
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
            assert params[name].default == base[name].default
            assert typed.__forward_arg__ == base[name].annotation == params[name].annotation
    tt = TwoTowerModel(["u"], num_items=5, temperature=0.2, max_len=3, embedding_dim=8,
                       loss="sampled", num_uniform_negatives=2, table_device="cpu")
    assert (tt.temperature, tt.max_len, tt.loss_kind, tt.num_uniform_negatives) == (0.2, 3, "sampled", 2)
    assert tt.user_tower[-1].out_features == 32 and tt.user_tower[0][0].in_features == 8 * 2
    sas = SASRecModel(num_items=5, loss="full", embedding_dim=8, num_heads=4, table_device="cpu")
    assert (sas.loss_kind, sas.num_uniform_negatives, sas.max_len) == ("full", 0, 50)
    with pytest.raises(TypeError, match=r"^TwoTowerModel.__init__\(\) got an unexpected keyword argument 'tempreature'$"):
        TwoTowerModel(["u"], num_items=5, tempreature=0.2)  # type: ignore[call-arg]
    # A config's `model:` section: an option is a key the model takes, a misspelt one is named.
    path = "recsys_trainer.models.SASRecModel"
    ComponentSpec.from_mapping("model", {"class": path, "num_items": 5, "temperature": 0.1}).check()
    with pytest.raises(ValueError, match=r"unknown argument `model.tempreature` for .*SASRecModel .*"
                                         r"its arguments: num_items, .*, temperature, "):
        ComponentSpec.from_mapping("model", {"class": path, "num_items": 5, "tempreature": 0.1}).check()


def test_sasrec_queries_see_only_the_past_and_padding_rows_cost_nothing() -> None:
    torch.manual_seed(0)
    model = SASRecModel(num_items=20, max_len=5, embedding_dim=8, num_uniform_negatives=3,
                        dropout=0.0, table_device="cpu")
    batch = _tt_batch([1, 2], [[3, 4, 5], [6]], keys=("item", "hist_item"))
    loss, out = model(batch)
    assert torch.isfinite(loss) and out["query"].shape == (2, 8)
    assert float(model(batch.as_padding())[0].detach()) == 0.0
    model.eval()
    # Causal: the query after [3, 4] is the same whatever follows it in a longer history.
    short = model(_tt_batch([1], [[3, 4]], keys=("item", "hist_item")))[1]["query"]
    hist = model.items(_tt_batch([1], [[3, 4, 9]], keys=("item", "hist_item")).sequence)["hist_item"]
    full = model.encode(hist.to_padded_dense(5), torch.tensor([3]))
    assert torch.allclose(F.normalize(model.final_norm.weight.new_tensor(0.0) + full[0, 2], dim=-1),
                          short[0], atol=1e-5)


def test_sasrec_user_and_side_features_reach_its_queries_and_candidates_and_padding_stays_free() -> None:
    torch.manual_seed(0)
    catalog = {"item_id": np.arange(20), "item_cat": np.arange(20) % 3}
    model = SASRecModel(num_items=20, max_len=5, embedding_dim=8, num_uniform_negatives=3, dropout=0.0,
                        user_features=["user_id"], user_num_embeddings=10,
                        item_side_features={"item_cat": 3}, item_catalog=catalog, table_device="cpu")
    keys = ("item", "hist_item", "item_cat", "hist_item_cat")
    assert model.sequence_keys == list(keys) and set(model.row_id_features) == set(keys)
    assert model.serving_sequence_lengths() == {"hist_item": 5, "hist_item_cat": 5}
    batch = _tt_batch([1, 2], [[3, 4, 5], [6]], keys=keys)
    loss, out = model(batch)
    assert torch.isfinite(loss) and out["query"].shape == (2, 8)
    assert float(model(batch.as_padding())[0].detach()) == 0.0
    model.eval()

    def query(**kw: object) -> torch.Tensor:
        return model(_tt_batch([1], [[3, 4]], keys=keys, **kw))[1]["query"]  # type: ignore[arg-type]

    def loss_of(**kw: object) -> float:
        return float(model(_tt_batch([1, 2], [[3, 4], [5]], keys=keys, **kw))[0].detach())  # type: ignore[arg-type]

    base = query(users=[0])
    # The user's id reaches the query (through the projection), and so do the history items'
    # categories: the same item ids with other categories are another history.
    assert not torch.allclose(base, query(users=[1]), atol=1e-4)
    assert not torch.allclose(base, query(users=[0], hist_cats=[[0, 2]]), atol=1e-4)
    assert torch.allclose(base, query(users=[0], hist_cats=[[0, 1]]), atol=1e-6)  # = id % 3
    # The candidate's category reaches the loss (its vector is the item's plus its category's).
    assert loss_of(item_cats=[1, 2]) != pytest.approx(loss_of(item_cats=[0, 0]), abs=1e-5)
    # The corpus: item row + category row at the catalog's id, normalised.
    ids = torch.tensor([0, 4, 17])
    item_rows = model.items.embeddings["t_item"].weight[ids]
    cat_rows = model.items.embeddings["t_item_cat"].weight[ids % 3]
    assert torch.allclose(model.item_embeddings(ids), F.normalize(item_rows + cat_rows, dim=-1), atol=1e-6)
    # A history side feature is one id per history item.
    with pytest.raises(ValueError, match=r"at fault: batch row 0 \(1 'hist_item_cat' ids, 2 'hist_item' items\)"):
        model(_tt_batch([1], [[3, 4]], keys=keys, hist_cats=[[0]]))
    with pytest.raises(ValueError, match=r"in the order \['item', 'hist_item', 'item_cat', 'hist_item_cat'\]"):
        model(_tt_batch([1], [[3, 4]], keys=("item", "hist_item", "item_cat")))
    with pytest.raises(ValueError, match="have no history key"):
        SASRecModel(num_items=20, item_side_features={"item_cat": 3}, item_catalog=catalog,
                    history_side_features={}, table_device="cpu")
    with pytest.raises(ValueError, match="need `item_catalog`"):
        SASRecModel(num_items=20, item_side_features={"item_cat": 3}, table_device="cpu")


def test_the_oracle_rank_of_every_event_equals_a_brute_force_ranking_of_the_corpus(tmp_path: Path) -> None:
    signal = InteractionSignal.make(num_users=200, num_items=400, num_clusters=8, max_len=6)
    meta = write_dataset(tmp_path, hours=2, rows_per_hour=1500, signal=signal, ks=(5,))
    assert set(meta["per_window"]) == {"dt=2026-11-20/hour=00", "dt=2026-11-20/hour=01"}
    table = pq.read_table(next(tmp_path.glob("dt=*/hour=01/part-0.parquet")))
    users, items = table.column("user_id").to_numpy(), table.column("item").to_numpy()
    hist = table.column("hist_item").combine_chunks()
    lengths, ids = np.diff(hist.offsets.to_numpy()), hist.flatten().to_numpy()
    # Each row's history is the user's previous items, most recent last.
    seen: dict[int, list[int]] = {}
    for t in pq.read_table(next(tmp_path.glob("dt=*/hour=00/part-0.parquet"))).to_pylist() + table.to_pylist():
        assert t["hist_item"] == seen.get(t["user_id"], [])[-6:]
        seen.setdefault(t["user_id"], []).append(t["item"])
    offsets = np.r_[0, np.cumsum(lengths)]
    last = np.where(lengths > 0, ids[np.maximum(offsets[1:] - 1, 0)], -1)
    p = signal.next_item_probability(users, last)
    assert np.allclose(p.sum(1), 1.0)
    for exclude in (False, True):
        q = p.copy()
        if exclude:
            q[np.repeat(np.arange(len(q)), lengths), ids] = -1.0
        target = q[np.arange(len(q)), items]
        brute = np.where(target < 0, signal.num_items, (q > target[:, None] * (1 + 1e-9)).sum(1))
        assert np.array_equal(oracle_ranks(signal, users, items, lengths, ids, exclude), brute)
    key = "oracle_exclude_history" if False else "oracle"
    ranks = oracle_ranks(signal, users, items, lengths, ids)
    assert meta["per_window"]["dt=2026-11-20/hour=01"][key]["recall@5"] == pytest.approx((ranks < 5).mean())
    catalog = pq.read_table(tmp_path / "_items.parquet")
    assert catalog.column("item_id").to_pylist() == list(range(400))
    assert json.loads((tmp_path / "_signal.json").read_text())["num_items"] == 400
    spec = interaction_features(meta)
    assert [q.name for q in spec.sequence] == ["item", "hist_item", "item_cat"]


def test_recent_items_give_the_two_tower_the_order_of_the_history_and_the_mean_alone_does_not() -> None:
    forward, backward = _tt_batch([1], [[4, 5, 6]]), _tt_batch([1], [[6, 5, 4]])
    for recent, same in ((0, True), (1, False)):
        model = _two_tower(recent_items=recent).eval()
        a, b = model(forward)[1]["query"], model(backward)[1]["query"]
        assert torch.allclose(a, b, atol=1e-6) == same, recent
    with pytest.raises(ValueError, match="recent_items"):
        _two_tower(recent_items=5)  # more than max_len=4


def test_the_metric_hook_names_what_a_model_lacks_for_full_corpus_evaluation() -> None:
    from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
    from recsys_trainer.retrieval.protocol import find_retrieval_model

    with pytest.raises(TypeError, match=r"need a model with `num_items` and `item_embeddings\(ids\)"):
        find_retrieval_model(torch.nn.Linear(2, 2))
    model = _two_tower()
    assert find_retrieval_model(model) is model
    hook = RetrievalMetricHook(k=[5])
    batch = _tt_batch([1], [[2]])
    with pytest.raises(TypeError, match=r"outputs\['query'\] \[B, D\] and outputs\['target'\]"):
        hook._take(batch, torch.zeros(1))
    with pytest.raises(ValueError, match="`k` must be a list of ints >= 1"):
        RetrievalMetricHook(k=[0])
    with pytest.raises(ValueError, match="`user_fn` and `time_fn` go together"):
        RetrievalMetricHook(user_fn=lambda b: b.labels)


def test_a_cut_off_above_the_corpus_size_is_refused_before_the_evaluation_pass() -> None:
    from types import SimpleNamespace

    from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook

    # A top K holding the whole corpus reads recall 1.0 whatever the model: refuse it, naming K.
    corpus = torch.randn(20, 4)
    with pytest.raises(ValueError, match=r"k=\[21\] exceed the item corpus of 20 items"):
        full_corpus_metrics(_TableModel(corpus), torch.randn(3, 4), Jagged.one_per_row(torch.tensor([1, 2, 3])),
                            [5, 21])
    assert full_corpus_metrics(_TableModel(corpus), torch.randn(3, 4),
                               Jagged.one_per_row(torch.tensor([1, 2, 3])), [20])["recall@20"] == 1.0
    hook = RetrievalMetricHook(k=[10, 50])
    with pytest.raises(ValueError, match=r"k=\[50\] exceed the item corpus of 20 items"):
        hook.before_evaluate(SimpleNamespace(model=_two_tower()))  # type: ignore[arg-type]


def test_an_item_catalog_without_a_side_feature_column_is_named(tmp_path: Path) -> None:
    import pyarrow as pa

    path = tmp_path / "_items.parquet"
    pq.write_table(pa.table({"item_id": np.arange(20)}), path)
    with pytest.raises(ValueError, match=r"_items.parquet' lacks column\(s\) \['item_cat'\]; it has \['item_id'\]"):
        TwoTowerModel(["u"], num_items=20, item_side_features={"item_cat": 3}, item_catalog=str(path),
                      table_device="cpu")


def test_the_filtered_protocol_excludes_each_users_earlier_items_as_a_numpy_reference() -> None:
    from types import SimpleNamespace

    from recsys_trainer.distributed import FakeGang
    from recsys_trainer.hooks.base import MicroBatchOutput, StepOutput
    from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook

    rng = np.random.default_rng(3)
    n_items, ks = 12, [1, 3]
    corpus = rng.normal(size=(n_items, 4)).astype(np.float32)
    # (user, time, target, history): training rows, then evaluation rows. User 0's eval rows
    # share time 10 (one basket); user 1 repeats item 5; the histories stand for the model's
    # last-max_len window, so user 0's older items (3, 4, 7) are known only from training rows.
    train = [(0, 1, 3, [7]), (0, 2, 4, [7, 3]), (1, 1, 5, []), (1, 3, 6, [5]), (2, 2, 8, [2])]
    evals = [(0, 10, 11, [3, 4]), (0, 10, 2, [3, 4]), (0, 12, 9, [1, 2]), (1, 11, 5, [5, 6]),
             (2, 9, 0, [2, 8]), (2, 13, 11, [8, 0]), (0, 10, 6, [3, 4])]
    queries = rng.normal(size=(len(evals), 4)).astype(np.float32)
    # User 0's query at time 12 ranks item 3 (seen in training, out of its history) first and
    # its target 9 second: only the filtered protocol puts 9 first.
    queries[2] = corpus[3]
    # Its query at time 10 ranks 6 and 2 (the same basket) above its target 11.
    queries[0] = corpus[6]

    def step(rows: list[tuple[int, int, int, list[int]]], q: np.ndarray) -> StepOutput:
        batch = SimpleNamespace(weights=None, user=torch.tensor([r[0] for r in rows]),
                                time=torch.tensor([float(r[1]) for r in rows]))
        outputs = {"query": torch.from_numpy(q), "target": torch.tensor([r[2] for r in rows]),
                   "history_lengths": torch.tensor([len(r[3]) for r in rows]),
                   "history_ids": torch.tensor([i for r in rows for i in r[3]], dtype=torch.int64)}
        return StepOutput(0, torch.zeros(()), [MicroBatchOutput(batch, torch.zeros(()), outputs)])  # type: ignore[arg-type]

    def run(**kw: object) -> dict[str, float]:
        hook = RetrievalMetricHook(k=ks, log=False, user_fn=lambda b: b.user, time_fn=lambda b: b.time, **kw)  # type: ignore[arg-type]
        trainer = SimpleNamespace(model=_TableModel(torch.from_numpy(corpus)), gang=FakeGang(),
                                  device=torch.device("cpu"), process_group=None, rank=0,
                                  is_rank_zero=False, state=SimpleNamespace(global_step=1),
                                  hooks=SimpleNamespace(fire=lambda *a: None))
        hook.after_step(trainer, step(train[:3], np.zeros((3, 4), np.float32)))  # type: ignore[arg-type]
        hook.after_step(trainer, step(train[3:], np.zeros((2, 4), np.float32)))  # type: ignore[arg-type]
        hook.before_evaluate(trainer)  # type: ignore[arg-type]
        hook.after_eval_step(trainer, step(evals[:4], queries[:4]))  # type: ignore[arg-type]
        hook.after_eval_step(trainer, step(evals[4:], queries[4:]))  # type: ignore[arg-type]
        metrics: dict[str, float] = {}
        hook.after_evaluate(trainer, metrics)  # type: ignore[arg-type]
        return metrics

    def seen(u: int, t: int, targets: set[int], same_time: bool) -> list[int]:
        out = set()
        for ru, rt, item, hist in train + evals:
            if ru != u:
                continue
            if rt < t or (same_time and rt == t and item not in targets):
                out.add(item)
            if rt <= t:
                out.update(hist)
        return sorted(out)

    per_row = {"exclude": "seen", "per_user": False}
    got = {}
    for same_time in (False, True):
        want = brute_force_metrics(queries, corpus, [[r[2]] for r in evals],
                                   [seen(r[0], r[1], {r[2]}, same_time) for r in evals], ks)
        got[same_time] = run(**per_row, exclude_same_time=same_time)
        assert got[same_time] == pytest.approx(want, abs=1e-12), same_time
    assert got[True] != got[False]  # user 0's basket at time 10 matters too
    # Per user: the earliest row's query, all the user's targets, the items seen before it.
    first = {u: min((i for i, r in enumerate(evals) if r[0] == u), key=lambda i: evals[i][1]) for u in (0, 1, 2)}
    tsets = {u: sorted({r[2] for r in evals if r[0] == u}) for u in first}
    want = brute_force_metrics(queries[list(first.values())], corpus, list(tsets.values()),
                               [seen(u, evals[i][1], set(tsets[u]), True) for u, i in first.items()], ks)
    assert run(exclude="seen", exclude_same_time=True) == pytest.approx(want, abs=1e-12)
    # The current definitions, by name: the row's history, or nothing.
    hist = run(exclude="history", per_user=False)
    assert hist == pytest.approx(brute_force_metrics(queries, corpus, [[r[2]] for r in evals],
                                                     [r[3] for r in evals], ks), abs=1e-12)
    assert run(exclude_history=True, per_user=False) == hist
    assert run(per_user=False) == pytest.approx(
        brute_force_metrics(queries, corpus, [[r[2]] for r in evals], None, ks), abs=1e-12)
    filtered = run(**per_row)
    assert filtered["hitrate@1"] > hist["hitrate@1"]  # the older items matter on this case
    with pytest.raises(ValueError, match="give `user_fn` and `time_fn`"):
        RetrievalMetricHook(exclude="seen")
    with pytest.raises(ValueError, match="refines exclude='seen'"):
        RetrievalMetricHook(exclude_history=True, exclude_same_time=True)


def test_the_full_softmax_scores_every_item_and_sasrec_evaluates_its_last_position_only() -> None:
    # Two-tower: each row's query against the whole corpus, the plain cross-entropy.
    model = _two_tower(loss="full")
    batch = _tt_batch([1, 2, 2, 7], [[3, 4], [6], [], [1, 2, 3]], weights=[1.0, 2.0, 1.0, 0.0])
    loss, out = model(batch)
    corpus = model.item_embeddings(torch.arange(20))
    per_row = F.cross_entropy(out["query"] @ corpus.t() / model.temperature, out["target"], reduction="none")
    w = batch.weights
    assert w is not None
    assert float(loss.detach()) == pytest.approx(float((per_row * w).sum().detach() / w.sum()), rel=1e-5)
    assert float(model(batch.as_padding())[0].detach()) == 0.0
    with pytest.raises(ValueError, match="loss='full' already scores every item"):
        _two_tower(loss="full", cross_rank_negatives=True)
    # A uniform sample beside the full softmax is refused, not silently ignored.
    with pytest.raises(ValueError, match=r"`num_uniform_negatives` \(8\) would be ignored"):
        _two_tower(loss="full", num_uniform_negatives=8)
    with pytest.raises(ValueError, match=r"`num_uniform_negatives` \(128\) would be ignored"):
        SASRecModel(num_items=20, max_len=5, embedding_dim=8, loss="full", num_uniform_negatives=128,
                    table_device="cpu")
    # SASRec's default sample: 256, none with the full softmax.
    assert SASRecModel(num_items=20, max_len=5, embedding_dim=8, table_device="cpu").num_uniform_negatives == 256
    assert SASRecModel(num_items=20, max_len=5, embedding_dim=8, loss="full",
                       table_device="cpu").num_uniform_negatives == 0
    # SASRec in evaluation with eval_positions=1: the loss is that of the ranked query alone.
    torch.manual_seed(0)
    sas = SASRecModel(num_items=20, max_len=5, embedding_dim=8, dropout=0.0, loss="full",
                      train_positions=3, eval_positions=1, table_device="cpu")
    batch = _tt_batch([1, 2], [[3, 4, 5], [6]], keys=("item", "hist_item"))
    train_loss = float(sas(batch)[0].detach())
    sas.eval()
    loss, out = sas(batch)
    corpus = sas.item_embeddings(torch.arange(20))
    expected = F.cross_entropy(out["query"] @ corpus.t() / sas.temperature, out["target"])
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    sas.eval_positions = sas.train_positions  # the default: as in training
    assert float(sas(batch)[0].detach()) == pytest.approx(train_loss, rel=1e-5)


def test_the_seen_record_is_bounded_by_distinct_pairs_and_survives_a_checkpoint(tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """exclude='seen' keeps one entry per distinct (user, item), not per training row (a
    repeated stream does not grow it), checkpoints it as the hook's state (a save/load gives
    the same metrics), and the default hook has neither per-step work nor state."""
    from types import SimpleNamespace

    from recsys_trainer.distributed import FakeGang
    from recsys_trainer.hooks.base import MicroBatchOutput, StepOutput
    from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook

    rng = np.random.default_rng(5)
    corpus = rng.normal(size=(10, 4)).astype(np.float32)
    train = [(0, 1, 3, [7]), (0, 2, 4, [7, 3]), (1, 1, 5, []), (1, 3, 6, [5]), (2, 2, 8, [2])]
    evals = [(0, 10, 1, [3, 4]), (1, 11, 2, [5, 6]), (2, 9, 0, [2, 8])]
    queries = rng.normal(size=(len(evals), 4)).astype(np.float32)
    queries[0] = corpus[3]  # user 0's top item is 3, seen in training only

    def step(rows: list[tuple[int, int, int, list[int]]], q: np.ndarray,
             weights: list[float] | None = None) -> StepOutput:
        batch = SimpleNamespace(weights=None if weights is None else torch.tensor(weights),
                                user=torch.tensor([r[0] for r in rows]),
                                time=torch.tensor([float(r[1]) for r in rows]))
        outputs = {"query": torch.from_numpy(q), "target": torch.tensor([r[2] for r in rows]),
                   "history_lengths": torch.tensor([len(r[3]) for r in rows]),
                   "history_ids": torch.tensor([i for r in rows for i in r[3]], dtype=torch.int64)}
        return StepOutput(0, torch.zeros(()), [MicroBatchOutput(batch, torch.zeros(()), outputs)])  # type: ignore[arg-type]

    trainer = SimpleNamespace(model=_TableModel(torch.from_numpy(corpus)), gang=FakeGang(),
                              device=torch.device("cpu"), process_group=None, rank=0,
                              is_rank_zero=False, state=SimpleNamespace(global_step=1),
                              hooks=SimpleNamespace(fire=lambda *a: None))

    def hook() -> RetrievalMetricHook:
        return RetrievalMetricHook(k=[1, 3], log=False, user_fn=lambda b: b.user,  # type: ignore[attr-defined]
                                   time_fn=lambda b: b.time, exclude="seen", per_user=False)  # type: ignore[attr-defined]

    def evaluate(h: RetrievalMetricHook) -> dict[str, float]:
        h.before_evaluate(trainer)  # type: ignore[arg-type]
        h.after_eval_step(trainer, step(evals, queries))  # type: ignore[arg-type]
        metrics: dict[str, float] = {}
        h.after_evaluate(trainer, metrics)  # type: ignore[arg-type]
        return metrics

    pairs = {(u, i) for u, _, t, hist in train for i in [t, *hist]}
    once, many = hook(), hook()
    once.after_step(trainer, step(train, np.zeros((5, 4), np.float32)))  # type: ignore[arg-type]
    for _ in range(50):  # the same rows again and again, and a padding row that does not count
        many.after_step(trainer, step([*train, (9, 1, 9, [9])], np.zeros((6, 4), np.float32),  # type: ignore[arg-type]
                                      [1.0] * 5 + [0.0]))
    assert once.seen_record_size() == many.seen_record_size() == len(pairs)
    want = evaluate(once)
    assert evaluate(many) == want
    assert many.seen_record_size() == len(pairs)  # the evaluation's rows did not join it

    # A checkpoint round trip (the per-rank extra state is a torch.save file).
    torch.save({"hook": many.state_dict()}, tmp_path / "hooks.pt")
    restored = hook()
    restored.load_state_dict(torch.load(tmp_path / "hooks.pt", weights_only=False)["hook"])
    assert restored.seen_record_size() == len(pairs)
    with caplog.at_level("WARNING", logger="recsys_trainer"):
        assert evaluate(restored) == want
        assert "restarts" not in caplog.text
        # A resume whose checkpoint held no record says so at its first evaluation.
        assert evaluate(hook())["hitrate@1"] <= want["hitrate@1"]
        assert "seen-record starts at step 1" in caplog.text and "restarts" in caplog.text
        caplog.clear()
        # Also when the resumed process trains first: its record starts at that step.
        late = hook()
        late.after_step(trainer, StepOutput(7, torch.zeros(()), step(train, np.zeros((5, 4), np.float32)).micro_batches))  # type: ignore[arg-type]
        evaluate(late)
        assert "seen-record starts at step 6" in caplog.text

    # The default: no training-step event handled, nothing checkpointed.
    default = RetrievalMetricHook(k=[1], log=False)
    assert "after_step" not in (default.handled_events() or set())
    assert default.state_dict() == {}
    assert "after_step" in (hook().handled_events() or set())
