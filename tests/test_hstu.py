"""HSTU: the layer against a plain reference written here, causality, jagged rows equal to the
batch padded to its longest (values and gradients), a row computed alike whatever else is in
its batch, the retrieval model's served query equal to the trained one bitwise, the event
times learnt (it beats the best time-blind ranking on a log whose next item needs them), the
ranking model trained window by window on two tasks, and the input errors named.

The serving parity of ``HSTURankingModel`` against ``predict`` is in test_serving.py (kind
``hstu``), its two-rank run in test_serving_dist.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import serving_utils as su
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_trainer import SparseOptimizer, Trainer, TrainingArguments
from recsys_trainer.batch import Batch
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.generators.sequences_synthetic import (
    SequenceSignal,
    sequence_features,
    write_dataset,
)
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.windows import partitioned_windows
from recsys_trainer.hooks.metrics import MetricReportHook
from recsys_trainer.hooks.retrieval_metrics import RetrievalMetricHook
from recsys_trainer.models import HSTUEncoder, HSTULayer, HSTURankingModel, HSTURetrievalModel
from recsys_trainer.models.hstu_layer import TIME_BOUNDARIES
from recsys_trainer.models.jagged import bucket_lengths
from recsys_trainer.serving import Scorer

pytestmark = pytest.mark.timeout(300)

D, HEADS = 8, 2


def _reference_layer(layer: HSTULayer, x: torch.Tensor, tau: torch.Tensor, theta: torch.Tensor,
                     ) -> torch.Tensor:
    """The HSTU layer of the paper, one row and one query at a time, in plain loops."""
    h, a, v = layer.num_heads, layer.attention_dim, layer.linear_dim
    out = torch.empty_like(x)
    for r in range(x.shape[0]):
        for n in range(x.shape[1]):
            proj = [F.silu(layer.uvqk(F.layer_norm(x[r, i], (x.shape[2],), layer.input_norm.weight,
                                                    layer.input_norm.bias))) for i in range(n + 1)]
            u = proj[n][: h * v]
            heads = []
            for head in range(h):
                q = proj[n][2 * h * v + head * a: 2 * h * v + (head + 1) * a]
                acc = torch.zeros(v)
                for m in range(n + 1):
                    k = proj[m][2 * h * v + h * a + head * a: 2 * h * v + h * a + (head + 1) * a]
                    val = proj[m][h * v + head * v: h * v + (head + 1) * v]
                    dt = int(theta[r, n] - tau[r, m])
                    bucket = sum(1 for b in sorted(set(round(2 ** (k2 / 2)) for k2 in range(64))) if b <= dt)
                    assert layer.time_bias is not None
                    score = (q @ k) / math.sqrt(a) + layer.position_bias[n - m] + layer.time_bias[bucket]
                    acc = acc + F.silu(score) * val
                heads.append(acc / (n + 1))
            attn = torch.cat(heads)
            gated = u * F.layer_norm(attn, (h * v,), layer.output_norm.weight, layer.output_norm.bias)
            out[r, n] = x[r, n] + layer.output(gated)
    return out


def _rows(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat tokens ``[N, D]`` of rows of ``lengths`` tokens, and their times ``tau``, ``theta``."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    tokens = torch.randn(n, D, generator=g)
    tau = torch.randint(1_000_000, 2_000_000, (n,), generator=g)
    theta = tau + torch.randint(0, 100_000, (n,), generator=g)
    return tokens, tau, theta


def test_the_hstu_layer_equals_a_plain_reference_written_here() -> None:
    torch.manual_seed(0)
    layer = HSTULayer(D, HEADS, attention_dim=3, linear_dim=5, max_positions=7, time_bias=True,
                      dropout=0.0)
    with torch.no_grad():  # non-trivial biases, so that a wrong index shows
        layer.position_bias.normal_(0, 0.5)
        assert layer.time_bias is not None
        layer.time_bias.normal_(0, 0.5)
    x = torch.randn(2, 6, D)
    tau = torch.randint(0, 10**6, (2, 6))
    theta = tau + torch.randint(0, 10**6, (2, 6))
    enc = HSTUEncoder(D, num_layers=1, num_heads=HEADS, attention_dim=3, linear_dim=5, max_tokens=7,
                      time_bias=True, dropout=0.0)
    enc.layers[0] = layer
    with torch.no_grad():
        got = enc(x, tau, theta)
        want = _reference_layer(layer, x, tau, theta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The time buckets: half-octaves of the unit, 0 below 1.
    assert TIME_BOUNDARIES[:8] == (1, 2, 3, 4, 6, 8, 11, 16)


def test_no_position_sees_the_future() -> None:
    torch.manual_seed(0)
    enc = HSTUEncoder(D, num_layers=2, num_heads=HEADS, attention_dim=None, linear_dim=None,
                      max_tokens=12, time_bias=True, dropout=0.0).eval()
    x = torch.randn(3, 12, D)
    tau = torch.randint(0, 10**6, (3, 12))
    theta = tau + 5
    with torch.no_grad():
        before = enc(x, tau, theta)
        for p in (0, 5, 10):
            x2, tau2, theta2 = x.clone(), tau.clone(), theta.clone()
            x2[:, p + 1:] = torch.randn_like(x2[:, p + 1:])
            tau2[:, p + 1:] += 12345
            theta2[:, p + 1:] += 777
            after = enc(x2, tau2, theta2)
            assert torch.equal(after[:, : p + 1], before[:, : p + 1]), p
            assert not torch.equal(after[:, p + 1:], before[:, p + 1:])


def test_length_buckets_give_what_the_batch_padded_to_its_longest_gives_values_and_gradients() -> None:
    torch.manual_seed(0)
    lengths = [1, 3, 9, 17, 40, 2, 8]
    enc = HSTUEncoder(D, num_layers=2, num_heads=HEADS, attention_dim=None, linear_dim=None,
                      max_tokens=41, time_bias=True, dropout=0.0)
    tokens, tau, theta = _rows(lengths)
    counts = torch.tensor(lengths)
    assert bucket_lengths(41) == [8, 16, 32, 41]
    results = {}
    for policy in ("length", "padded"):
        enc.zero_grad()
        t = tokens.clone().requires_grad_(True)
        out = enc.run(t, counts, tau, theta, policy)  # type: ignore[arg-type]
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        results[policy] = (out.detach(), t.grad, [p.grad.clone() for p in enc.parameters()])
    (a, ga, pa_), (b, gb, pb) = results["length"], results["padded"]
    assert a.shape == (sum(lengths), D)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    for x, y in zip(pa_, pb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    # A row's result is its own, bitwise, whatever else shares its bucket: the row of 17 alone.
    alone = enc.run(tokens[13:30], torch.tensor([17]), tau[13:30], theta[13:30], "length")
    assert torch.equal(alone.detach(), a[13:30])


@pytest.fixture(scope="module")
def timed_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sequences")
    signal = SequenceSignal.make(num_items=300, num_clusters=10, max_len=20)
    return str(root), write_dataset(root, hours=3, rows_per_hour=4000, signal=signal, ks=(10,))


def test_serving_computes_each_row_once_at_its_own_bucket_length_not_every_row_at_every_length() -> None:
    """The serving program's padded batch costs what training's buckets cost: each row runs at
    the bucket length training gives it (the shortest bucket >= its tokens), and only there (a
    batch of short histories served under max_len=1000 took 2.3 s and 1.4 GiB for 32 rows when
    every row ran at every length; now 15 ms, docs/serving.md)."""
    from recsys_trainer.models.jagged import by_static_buckets

    counts = torch.tensor([3, 1001, 9, 8, 40, 1])
    seen: list[tuple[int, list[int]]] = []

    def fn(x: torch.Tensor, c: torch.Tensor, extras: Any) -> torch.Tensor:
        seen.append((x.shape[1], c.tolist()))
        return x

    x = torch.zeros(6, 1001, 2)
    runs = by_static_buckets(fn, x, counts, [])
    ran = {int(r): length for length, _, rows in runs for r in rows}
    assert ran == {0: 8, 1: 1001, 2: 16, 3: 8, 4: 64, 5: 8}
    assert sum(len(c) for _, c in seen) == len(counts)  # each row once


def test_the_timed_log_writes_histories_oldest_first_before_their_target_and_an_honest_ceiling(
        timed_log) -> None:
    import pyarrow.parquet as pq

    root, meta = timed_log
    table = pq.read_table(partitioned_windows(root)[0].files[0])
    for hist, times, ts in zip(table.column("hist_item").to_pylist()[:500],
                               table.column("hist_ts").to_pylist()[:500],
                               table.column("ts").to_pylist()[:500], strict=True):
        assert len(hist) == len(times) <= meta["max_len"]
        assert times == sorted(times) and all(t <= ts for t in times)
    # The oracle knows the times; without them the best ranking is worse (the signal needs them).
    assert meta["oracle"]["recall@10"] > meta["oracle_without_time"]["recall@10"] + 0.03


def _retrieval_trainer(root: str, meta: dict[str, Any], out: str, *, times: bool = True,
                       hooks: Any = (), **args: Any) -> Trainer:
    torch.manual_seed(0)
    spec = sequence_features(meta, times=times)
    model = HSTURetrievalModel(
        num_items=meta["num_items"], max_len=meta["max_len"], embedding_dim=16, num_heads=2,
        num_layers=1, dropout=0.0, num_uniform_negatives=32,
        time_feature="hist_ts" if times else None, query_time_feature="ts" if times else None)
    windows = partitioned_windows(root)
    return Trainer(
        model, TrainingArguments(output_dir=out, log_steps=10**6, **args),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=128, shuffle=True, seed=1),
        eval_dataset=ParquetWindowDataset(windows[-1:], spec, batch_size=1024),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=5e-3), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1), hooks=list(hooks),
        add_logger_hook=False)


def test_hstu_retrieval_serves_the_query_it_trains_bitwise_times_included(timed_log, tmp_path) -> None:
    root, meta = timed_log
    trainer = _retrieval_trainer(root, meta, str(tmp_path / "t"), train_steps=2)
    trainer.train()
    trained, rows = su.export_query_and_rows(trainer, str(tmp_path / "art"))
    query = trained.numpy()
    scorer = Scorer(str(tmp_path / "art"))
    program = scorer.manifest["program"]["inputs"]["sequences"]
    assert {s["feature"]: s.get("values", False) for s in program} == {
        "hist_item": False, "hist_ts": True, "ts": True}
    # Bitwise for the batch trained on (each row at its own bucket's length, as trained); a row
    # scored alone differs in the last bits only (measured 1.1e-8: a GEMM of one row's tokens
    # takes another kernel than one of many rows').
    assert np.array_equal(scorer.score(rows.slice(0, len(query))), query)
    alone = np.concatenate([scorer.score(rows.slice(i, 1)) for i in range(0, 40)])
    assert np.abs(alone - query[:40]).max() <= 1e-6
    # The time is read: the same history asked a week later is another query.
    later = rows.slice(0, 4).to_pylist()
    for r in later:
        r["ts"] += 7 * 86400
    assert not np.array_equal(scorer.score(later), query[:4])
    # A request without its time is refused, naming the column and row, as training refuses it.
    later[1]["ts"] = None
    with pytest.raises(DataError, match=r"row 1, column 'ts': the model reads exactly one id per "
                                        r"row of sequence feature 'ts'"):
        scorer.score(later)


def test_hstu_retrieval_learns_the_event_times_beyond_the_best_time_blind_ranking(timed_log, tmp_path) -> None:
    root, meta = timed_log
    hook = RetrievalMetricHook(k=[10], log=False)
    trainer = _retrieval_trainer(root, meta, str(tmp_path / "t"), hooks=[hook], train_epoch=6)
    trainer.train()
    got = trainer.evaluate()["recall@10"]
    blind, oracle = meta["oracle_without_time"]["recall@10"], meta["oracle"]["recall@10"]
    # Measured: 0.659 (0.584 with the same layers without the times); the oracle 0.695, without
    # the times 0.634: the best any ranking blind to the times can reach on average.
    assert blind < got < oracle, (got, blind, oracle)


def test_hstu_ranking_trains_window_by_window_on_two_tasks_through_the_pipeline(tmp_path) -> None:
    windows = su.write_data(str(tmp_path / "data"), "hstu", hours=3, rows=400)
    spec, model = su.spec_and_model("hstu")
    metrics = MetricReportHook(metrics=["auc"], per_window=True)
    trainer = Trainer(
        # Through TorchRec's pipeline: the forward traces (its lookups, then one fx leaf).
        model, TrainingArguments(output_dir=str(tmp_path / "out"), log_steps=10**6,
                                 pipeline="sparse_dist"),
        train_dataset=ParquetWindowDataset(windows[:-1], spec, batch_size=64),
        eval_dataset=ParquetWindowDataset(windows[1:], spec, batch_size=128),
        dense_optimizers=(lambda p: torch.optim.Adam(p, lr=1e-2), None),
        sparse_optimizer=SparseOptimizer("rowwise_adagrad", lr=0.1), hooks=[metrics],
        add_logger_hook=False)
    trainer.train_and_evaluate()
    evals = [r for r in metrics.reports if r.scope == "eval"]
    # Train on hour t, evaluate on hour t + 1: two pairs, each task's AUC reported.
    assert len(evals) == 2, evals
    for r in evals:
        assert {"auc/label", "auc/like"} <= set(r.values), r.values


def _batch(hist: list[list[int]], times: list[list[int]] | None, query: list[int] | None) -> Batch:
    keys, values, lengths = ["item", "hist_item"], [], []
    cand = [1] * len(hist)
    values += cand
    lengths += [1] * len(hist)
    for h in hist:
        values += h
        lengths.append(len(h))
    if times is not None and query is not None:
        keys += ["hist_ts", "ts"]
        for t in times:
            values += t
            lengths.append(len(t))
        values += query
        lengths += [1] * len(query)
    seq = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values),
                                              lengths=torch.tensor(lengths))
    b = len(hist)
    return Batch(dense=torch.zeros(b, 0), sparse=KeyedJaggedTensor.empty(), labels=torch.ones(b),
                 sequence=seq)


def test_hstu_names_misaligned_times_a_long_history_and_missing_time_features() -> None:
    model = HSTURetrievalModel(num_items=50, max_len=4, embedding_dim=8, num_uniform_negatives=4,
                               table_device="cpu")
    with pytest.raises(ValueError, match=r"HSTURetrievalModel's 'hist_ts' holds one time per "
                                         r"history item; at fault: batch row 1 \(1 values, needs 2\)"):
        model(_batch([[1, 2], [3, 4]], [[10, 20], [30]], [40, 50]))
    # Every row at fault is named with its count, not the first one only.
    with pytest.raises(ValueError, match=r"'hist_item' history must hold at most the model's "
                                         r"max_len=4 ids; at fault: batch rows 0 \(5 ids\), 2 \(6 ids\)\."):
        model(_batch([[1, 2, 3, 4, 5], [1], [1, 2, 3, 4, 5, 6]], [[1, 2, 3, 4, 5], [1], [1] * 6],
                     [9, 9, 9]))
    with pytest.raises(ValueError, match=r"batch.sequence has keys \['item', 'hist_item'\], but "
                                         r"HSTURetrievalModel reads \['item', 'hist_item', 'hist_ts', "
                                         r"'ts'\] in this order \(the batch lacks \['hist_ts', 'ts'\]\)"):
        model(_batch([[1, 2]], None, None))
    with pytest.raises(ValueError, match="give both `time_feature`"):
        HSTURetrievalModel(num_items=50, time_feature=None)
    # Rows without history (only BOS) and rows at max_len train.
    loss, out = model(_batch([[], [1, 2, 3, 4]], [[], [1, 2, 3, 4]], [5, 6]))
    assert torch.isfinite(loss) and out["query"].shape == (2, 8)


def test_hstu_retrieval_with_times_trains_and_serves_a_batch_whose_histories_are_all_empty() -> None:
    """A batch of new users only (no history, so no history time at all): a window's last small
    batch, or a batch of new users to score. It trains, and its query is the served one."""
    torch.manual_seed(0)
    model = HSTURetrievalModel(num_items=50, max_len=4, embedding_dim=D, num_uniform_negatives=4,
                               table_device="cpu")
    batch = _batch([[], [], []], [[], [], []], [40, 50, 1_000])
    loss, _ = model(batch)
    loss.backward()
    assert torch.isfinite(loss) and model.bos.grad is not None
    model.eval()
    with torch.no_grad():
        _, out = model(batch)
        b, length = 3, model.max_len
        served = model.serving_logits(
            torch.zeros(b, 0), {},
            {"hist_item": torch.zeros(b, length, D), "hist_ts": torch.zeros(b, length, dtype=torch.int64),
             "ts": torch.tensor([[40], [50], [1_000]])},
            {"hist_item": torch.zeros(b, dtype=torch.int64), "hist_ts": torch.zeros(b, dtype=torch.int64),
             "ts": torch.ones(b, dtype=torch.int64)})
    torch.testing.assert_close(served, out["query"], rtol=0, atol=1e-6)


def _keyed_batch(keys_rows: list[tuple[str, list[list[int]]]]) -> Batch:
    """A batch whose ``batch.sequence`` has these keys, in this order, with these rows."""
    values, lengths = [], []
    for _, rows in keys_rows:
        for r in rows:
            values += r
            lengths.append(len(r))
    seq = KeyedJaggedTensor.from_lengths_sync(keys=[k for k, _ in keys_rows],
                                              values=torch.tensor(values, dtype=torch.int64),
                                              lengths=torch.tensor(lengths))
    b = len(keys_rows[0][1])
    return Batch(dense=torch.zeros(b, 0), sparse=KeyedJaggedTensor.empty(), labels=torch.ones(b),
                 sequence=seq)


def test_hstu_ranking_names_missing_or_misordered_sequence_keys_and_its_own_name() -> None:
    """A spec without the time features, or with the sequence features in another order, is
    named with the keys and the FeatureSpec that fixes it (was a bare KeyError inside torchrec);
    a bad row names HSTURankingModel (the shared check said DIN)."""
    model = HSTURankingModel(num_items=50, max_len=4, embedding_dim=8, table_device="cpu")
    good = [("item", [[1], [2]]), ("hist_item", [[1, 2], [3]]), ("hist_ts", [[10, 20], [30]]),
            ("ts", [[40], [50]])]
    order = r"in the order \['item', 'hist_item', 'hist_ts', 'ts'\]"
    with pytest.raises(ValueError, match=r"HSTURankingModel reads .* \(the batch lacks "
                                         r"\['hist_ts', 'ts'\]\): declare FeatureSpec\(sequence=\[\.\.\.\]\) "
                                         + order):
        model(_keyed_batch(good[:2]))
    for keys in ([*good[2:], *good[:2]], [good[1], good[0], *good[2:]]):
        with pytest.raises(ValueError, match=r"\(the batch has them in another order\).*" + order):
            model(_keyed_batch(keys))
    with pytest.raises(ValueError, match=r"^HSTURankingModel's candidate feature 'item' .* at "
                                         r"fault: batch row 1 \(0 ids\)") as e:
        model(_keyed_batch([("item", [[1], []]), *good[1:]]))
    assert "DIN" not in str(e.value)
    with pytest.raises(ValueError, match=r"HSTURankingModel's 'ts' holds one query time per row; "
                                         r"at fault: batch row 1 \(0 values, needs 1\)"):
        model(_keyed_batch([*good[:3], ("ts", [[40], []])]))
    loss, logits = model(_keyed_batch(good))
    assert torch.isfinite(loss) and logits.shape == (2,)


@pytest.mark.parametrize("loss", ["sampled", "full"])
def test_hstu_retrieval_trains_with_the_sampled_and_the_full_softmax(loss: str) -> None:
    torch.manual_seed(0)
    model = HSTURetrievalModel(num_items=30, max_len=4, embedding_dim=8, table_device="cpu",
                               loss=loss, num_uniform_negatives=5 if loss == "sampled" else 0)  # type: ignore[arg-type]
    value, out = model(_batch([[1, 2], [3], []], [[10, 20], [30], []], [40, 50, 60]))
    value.backward()
    assert torch.isfinite(value) and out["query"].shape == (3, 8)
    assert model.bos.grad is not None and model.encoder.layers[0].time_bias.grad is not None
