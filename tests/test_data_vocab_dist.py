"""Vocabularies built from the data on 2 real gloo ranks: each rank counts its own share of the
first window, both get the identical vocabulary of the whole window, and a resumed run restores
it bitwise from the checkpoint (not rebuilt from the data); a resume with another configuration
is refused on both ranks."""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
from dist_utils import run_distributed
from vocab_data import TAGS, expected_vocabulary, ids_by_row, make_trainer, write_vocab_windows

from recsys_trainer import LambdaHook
from recsys_trainer.data.inputs import SequenceFeature, SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.vocab import VocabFromData

pytestmark = pytest.mark.distributed


def _spec(min_count: int = 2) -> FeatureSpec:
    return FeatureSpec(
        labels=["y"], dense=["row_id"],
        sparse=[SparseFeature(name="genre", num_embeddings=16, vocab=VocabFromData(min_count=min_count)),
                SparseFeature(name="year", num_embeddings=16, vocab=VocabFromData()),
                SparseFeature(name="tags", num_embeddings=8, vocab=VocabFromData())],
        sequence=[SequenceFeature(name="item", num_embeddings=32, vocab=VocabFromData(name="items")),
                  SequenceFeature(name="hist", num_embeddings=32, max_len=5,
                                  vocab=VocabFromData(name="items"))])


def _worker(data: str, out: str) -> dict[str, Any]:
    decoded: dict[int, list[int]] = {}
    hook = LambdaHook(after_data=lambda t, b: decoded.update(ids_by_row(b, "genre")))

    def trainer(spec: FeatureSpec, **args: Any) -> Any:
        ds = ParquetWindowDataset(data, spec, batch_size=8, shuffle=True, seed=3)
        return make_trainer(spec, out, ds, hooks=[hook], **args)

    first = trainer(_spec(), train_steps=4, save_end=True)  # window 0: 32 rows per rank
    first.train()
    built = first.vocabularies.state_dict()
    dist.barrier()
    if dist.get_rank() == 0:
        # Window 0 now holds other values: rebuilding would give other vocabularies.
        for f in ("part-0.parquet", "part-1.parquet"):
            path = os.path.join(data, "hour=00", f)
            t = pq.read_table(path)
            t = t.set_column(t.schema.get_field_index("genre"), "genre",
                             pa.array(["other"] * t.num_rows, pa.string()))
            pq.write_table(t, path)
    dist.barrier()
    refused = ""
    try:
        trainer(_spec(min_count=1)).train()
    except ValueError as exc:
        refused = str(exc)
    second = trainer(_spec())
    second.train()
    return {"built": built, "resumed": second.vocabularies.state_dict(), "refused": refused,
            "steps": second.state.global_step, "decoded": decoded}


def test_a_vocabulary_built_from_the_first_window_is_identical_on_two_ranks_and_restored_on_resume(
        tmp_path) -> None:
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    total = write_vocab_windows(data, (64, 48, 48))
    want = {"genre": expected_vocabulary(data, ["genre"], min_count=2),
            "year": expected_vocabulary(data, ["year"]),
            "tags": expected_vocabulary(data, ["tags"]),
            "items": expected_vocabulary(data, ["item", "hist"])}
    r0, r1 = run_distributed(_worker, 2, timeout_s=300, args=(data, out))
    # Each rank read half of window 0; both hold the vocabulary of all of it, identically.
    assert r0["built"] == r1["built"]
    saved = r0["built"]["features"]
    for name in ("genre", "year", "tags"):
        assert saved[name]["values"] == want[name], name
    assert saved["item"]["values"] == saved["hist"]["values"] == want["items"]
    assert set(TAGS) >= set(want["tags"])
    # Restored bitwise from the checkpoint, although window 0 changed since.
    assert r0["resumed"] == r1["resumed"] == r0["built"]
    assert r0["steps"] == r1["steps"] > 4
    # A resume with another configuration is refused on both ranks, naming the feature.
    for r in (r0, r1):
        assert "cannot resume: the checkpoint maps feature 'genre' with a vocabulary built from " \
               "the data (VocabFromData(windows=1, min_count=2" in r["refused"], r["refused"]
    # Every row trained (both runs, both ranks) was decoded through that vocabulary.
    genre_of = {}
    for w in ("hour=01", "hour=02"):
        t = pq.read_table(os.path.join(data, w))
        genre_of.update(zip(t.column("row_id").to_pylist(), t.column("genre").to_pylist(), strict=True))
    decoded = {**r0["decoded"], **r1["decoded"]}
    assert len(decoded) == total
    for r, g in genre_of.items():
        assert decoded[r] == [want["genre"].index(g) + 1 if g in want["genre"] else 0]
    # One process resuming the 2-rank checkpoint gets the same vocabularies (they are not
    # per-rank state: restored at any world size), with no train data to build them from.
    evals = ParquetWindowDataset(data, _spec(), batch_size=8)
    scorer = make_trainer(evals.features, out, None, evals)
    scorer.resume(mode="scoring")
    assert scorer.vocabularies.state_dict() == r0["built"]
