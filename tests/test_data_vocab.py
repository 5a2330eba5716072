"""Vocabularies (``SparseFeature(vocab=...)``): collisions gone, OOV and nulls, lists, files,
integer columns, sequences, ``hash=False`` on strings, and ``VocabFromData`` built by the Trainer
from the first window, shared by eval/predict, checkpointed, restored and exported (one
process; the 2-rank build and resume are in test_data_vocab_dist.py)."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from vocab_data import (
    NEW_ITEM,
    TAGS,
    expected_vocabulary,
    ids_by_row,
    make_trainer,
    write_vocab_windows,
)

from recsys_trainer import LambdaHook, Trainer
from recsys_trainer.checkpoint.export import export_vocabularies
from recsys_trainer.config import ConfigError, load_config
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.inputs import SequenceFeature, SparseFeature
from recsys_trainer.data.parquet import ParquetWindowDataset
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.vocab import VocabFromData, Vocabulary
from recsys_trainer.data.vocab import lookup as vocab_lookup

pytestmark = pytest.mark.timeout(300)


def _decode(feature: SparseFeature | SequenceFeature, values: list[Any] | pa.Array) -> list[list[int]]:
    """Per row, the ids ``feature`` decodes ``values`` (its column) into."""
    col = values if isinstance(values, pa.Array) else pa.array(values)
    seq = isinstance(feature, SequenceFeature)
    spec = FeatureSpec(labels=["label"], **{"sequence" if seq else "sparse": [feature]})
    b = spec.decode(pa.table({"label": [0.0] * len(col), feature.source: col}))
    kjt = b.sequence if seq else b.sparse
    assert kjt is not None
    jt = kjt[feature.name]
    out, pos = [], 0
    values_ = jt.values().tolist()
    for n in jt.lengths().tolist():
        out.append(values_[pos:pos + n])
        pos += n
    return out


# ---------------------------------------------------------------------- mapping


def test_73_distinct_strings_get_73_distinct_rows_where_hashing_the_same_table_collides() -> None:
    years = [str(1950 + i) for i in range(73)]
    hashed = _decode(SparseFeature(name="year", num_embeddings=74), years)
    assert len({r[0] for r in hashed}) < 60  # the issue: 73 values land on 45 rows of 74
    feature = SparseFeature(name="year", vocab=years)
    assert feature.num_embeddings == 74  # derived: 73 values + the OOV row
    rows = _decode(feature, [*years, "1800", "1950"])
    assert rows == [[i + 1] for i in range(73)] + [[0], [1]]  # entry i -> row i + 1, else 0


def test_values_outside_the_vocabulary_take_row_0_and_nulls_follow_null_id() -> None:
    genres = ["drama", "comedy", "horror"]
    values = ["comedy", None, "western", "drama"]
    # Default: a null has no id (an empty bag), as without a vocabulary.
    assert _decode(SparseFeature(name="g", vocab=genres), values) == [[2], [], [0], [1]]
    # null_id=0: nulls share the OOV row; null_id=len+1 (one more row): a row of their own.
    assert _decode(SparseFeature(name="g", vocab=genres, null_id=0), values) == [[2], [0], [0], [1]]
    own = SparseFeature(name="g", vocab=genres, num_embeddings=5, null_id=4)
    assert _decode(own, values) == [[2], [4], [0], [1]]
    # Inside a list, a null is an error without null_id (as without a vocabulary).
    lists = pa.array([["drama", None]], pa.list_(pa.string()))
    with pytest.raises(DataError, match="a list of ids contains a null element"):
        _decode(SparseFeature(name="g", vocab=genres), lists)
    assert _decode(SparseFeature(name="g", vocab=genres, null_id=0), lists) == [[1, 0]]


def test_integer_list_and_sequence_columns_map_through_their_vocabularies() -> None:
    years = SparseFeature(name="year", vocab=[2001, 1999, 2024])
    assert _decode(years, pa.array([1999, 2024, 2000], pa.int32())) == [[2], [3], [0]]
    tags = SparseFeature(name="tags", vocab=TAGS[:3])
    multi_hot = pa.array([["tag_2", "tag_0", "nope"], [], None, ["tag_1"]], pa.list_(pa.string()))
    assert _decode(tags, multi_hot) == [[3, 1, 0], [], [], [2]]
    # A behaviour sequence keeps its last max_len ids, each mapped through the vocabulary.
    hist = SequenceFeature(name="hist", vocab=[7, 8, 9], max_len=3)
    assert _decode(hist, pa.array([[9, 1, 8, 7, 7], [8]], pa.list_(pa.int64()))) == [[8 - 6, 1, 1], [2]]
    # Large string / string_view columns map like plain strings.
    for typ in (pa.large_string(), pa.string_view()):
        assert _decode(tags, pa.array(["tag_1", "x"], typ)) == [[2], [0]]


def test_a_vocabulary_file_maps_like_the_list_and_reads_integers_for_an_integer_column(tmp_path) -> None:
    path = tmp_path / "genres.txt"
    path.write_bytes(b"drama\r\ncomedy\r\nhorror\r\n")  # CRLF line ends are accepted
    from_file = SparseFeature(name="g", vocab=str(path))
    from_list = SparseFeature(name="g", vocab=["drama", "comedy", "horror"])
    assert from_file.num_embeddings == 4 and from_file.vocab.digest == from_list.vocab.digest
    assert _decode(from_file, ["horror", "x"]) == _decode(from_list, ["horror", "x"]) == [[3], [0]]
    years = tmp_path / "years.txt"
    years.write_text("1999\n2001")  # no final newline
    assert _decode(SparseFeature(name="yr", vocab=f"file://{years}"), [2001, 5]) == [[2], [0]]
    # A spec crosses process boundaries (spawned reader processes): pickled, it maps the same.
    assert _decode(pickle.loads(pickle.dumps(from_file)), ["horror", "x"]) == [[3], [0]]
    # A line that is not an integer cannot map an integer column: named when decoded.
    with pytest.raises(ValueError, match=r"line 1 of the vocabulary file .*genres.txt .* is 'drama', not an integer"):
        _decode(from_file, [1])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"vocab": ["a", "b"], "hash": True},
     "sparse feature 'f' has a `vocab`, which maps ids to rows without hashing; `hash=True` does not apply"),
    ({"vocab": ["a"], "num_embeddings": 1},
     "sparse feature 'f' has a vocabulary of 1 values (given as a list of 1 strings), which needs 2 rows"),
    ({"vocab": ["a", "b", "a"]}, "holds 'a' twice (entries 0 and 2)"),
    ({"vocab": ["a", 1]}, "`vocab` of sparse feature 'f' must hold only strings or only integers"),
    ({"vocab": []}, "`vocab` of sparse feature 'f' is an empty list"),
    ({"vocab": [True]}, "must hold only strings or only integers, but holds True"),
    ({"vocab": ["a"], "boundaries": [1.0]}, "sparse feature 'f' sets `vocab` and `boundaries`"),
    ({"vocab": ["a"], "cross": ["a", "b"], "column": None}, "sets `vocab` and `cross`"),
    ({"vocab": [1, 2], "mod": 3}, "sets `vocab` and `mod`"),
    ({"vocab": ["a"], "on_out_of_range": "hash"}, "`on_out_of_range='hash'` does not apply"),
    ({"vocab": ["a", "b"], "null_id": 2}, "`null_id` 2 of sparse feature 'f' is the row of vocabulary value 'b'"),
    ({"vocab": VocabFromData()}, "sparse feature 'f' builds its vocabulary from the data (VocabFromData), so its table size must be given"),
    ({"vocab": VocabFromData(), "num_embeddings": 5, "null_id": 1}, "leaves no row for its vocabulary"),
    ({"vocab": {"windows": 1, "min_cnt": 2}, "num_embeddings": 5}, "unknown key(s) ['min_cnt']"),
    ({"vocab": {"windows": 0}, "num_embeddings": 5}, "`VocabFromData.windows` must be an int >= 1, but is 0."),
    ({"vocab": "/no/such/vocab.txt"}, "names the file '/no/such/vocab.txt', which does not exist"),
    ({"vocab": 3}, "`vocab` of sparse feature 'f' must be a list of values, a file path or URL"),
    ({}, "`num_embeddings` of sparse feature 'f' must be an int >= 1, but is 0."),
])
def test_bad_vocabulary_declarations_are_refused_naming_the_feature(kwargs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError) as e:
        SparseFeature(name="f", **kwargs)
    assert message in str(e.value)


def test_bad_vocabulary_files_are_refused_naming_the_line(tmp_path) -> None:
    for content, message in [("a\n\nb\n", "line 2 of the vocabulary file"),
                             ("a\nb\na\n", "holds 'a' twice (lines 1 and 3)"),
                             ("", "is empty; write one value per line")]:
        path = tmp_path / "v.txt"
        path.write_text(content)
        with pytest.raises(ValueError, match=re.escape(message)):
            SparseFeature(name="f", vocab=str(path))


def test_hash_false_on_a_string_column_is_refused_when_planned_and_when_decoded(tmp_path) -> None:
    feature = SparseFeature(name="genre", hash=False, num_embeddings=100)
    # Before, the strings were hashed anyway: hash=False was silently ignored.
    with pytest.raises(DataError, match=r"feature .genre. sets hash=False \(by the spec, or by a model whose ids are table rows\), but its column holds strings"):
        _decode(feature, ["drama"])
    write_vocab_windows(str(tmp_path), (16,), files_per_window=1)
    ds = ParquetWindowDataset(str(tmp_path), FeatureSpec(labels=["y"], sparse=[feature]), batch_size=4)
    with pytest.raises(DataError, match=r"hour=00/part-0.parquet, column 'genre': feature 'genre' sets "
                                        r"hash=False .*give it a vocabulary \(vocab=\[...\]"):
        next(ds.iter_window(next(ds.window_ids())))
    # Honoured with a vocabulary; integer ids with hash=False stay range-checked.
    assert _decode(SparseFeature(name="genre", hash=False, vocab=["drama"]), ["drama"]) == [[1]]
    assert _decode(SparseFeature(name="i", hash=False, num_embeddings=10), [3]) == [[3]]


def test_a_vocabulary_of_the_other_kind_is_a_data_error_naming_file_and_column(tmp_path) -> None:
    write_vocab_windows(str(tmp_path), (16,), files_per_window=1)
    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="year", vocab=["1990", "1991"])])
    ds = ParquetWindowDataset(str(tmp_path), spec, batch_size=4)
    with pytest.raises(DataError, match=r"column 'year': feature 'year': the column holds integer ids, "
                                        r"but the vocabulary \(given as a list of 2 strings\) holds strings"):
        next(ds.iter_window(next(ds.window_ids())))


def test_large_vocabularies_are_looked_up_by_sorted_search_with_the_same_rows(monkeypatch) -> None:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in rng.permutation(500)]
    ints = [int(x) for x in rng.permutation(10_000)[:500]]
    probe_w = [words[i] if i < 500 else f"x{i}" for i in rng.integers(0, 700, 2000)]
    probe_i = [ints[i] if i < 500 else 20_000 + i for i in rng.integers(0, 700, 2000)]
    small = (_decode(SparseFeature(name="w", vocab=words), probe_w),
             _decode(SparseFeature(name="i", vocab=ints), probe_i))
    monkeypatch.setattr(vocab_lookup, "INDEX_IN_MAX_SIZE", 16)  # read where the lookup is made
    large = (_decode(SparseFeature(name="w", vocab=words), probe_w),
             _decode(SparseFeature(name="i", vocab=ints), probe_i))
    assert large == small
    assert small[0] == [[words.index(w) + 1] if w in words else [0] for w in probe_w]


def test_a_vocabulary_from_data_cannot_decode_before_it_is_built() -> None:
    feature = SparseFeature(name="genre", num_embeddings=16, vocab=VocabFromData())
    with pytest.raises(ValueError, match=r"feature 'genre' takes its vocabulary from the data .* it has "
                                         r"not been built"):
        _decode(feature, ["drama"])


# ---------------------------------------------------------------------- built by the Trainer


def _vocab_spec(min_count: int = 2, genre_rows: int = 8, **genre: Any) -> FeatureSpec:
    return FeatureSpec(
        labels=["y"], dense=["row_id"],
        sparse=[SparseFeature(name="genre", num_embeddings=genre_rows,
                              vocab=VocabFromData(min_count=min_count, **genre)),
                SparseFeature(name="year", num_embeddings=16, vocab=VocabFromData()),
                SparseFeature(name="tags", vocab=TAGS)])


def test_vocab_from_data_is_built_from_the_first_window_and_used_by_train_and_eval(tmp_path) -> None:
    data = str(tmp_path / "data")
    write_vocab_windows(data)
    train = ParquetWindowDataset(data, _vocab_spec(), batch_size=8, shuffle=True)
    evals = ParquetWindowDataset(data, _vocab_spec(), batch_size=8)
    seen: dict[str, dict[int, list[int]]] = {"train": {}, "eval": {}}
    hook = LambdaHook(after_data=lambda t, b: [
        seen[t.state.mode].setdefault(f"{k}", {}).update(ids_by_row(b, k)) for k in ("genre", "year")])
    seen = {"train": {}, "eval": {}}
    trainer = make_trainer(train.features, str(tmp_path / "out"), train, evals, hooks=[hook])
    trainer.train_and_evaluate()
    genre = trainer.vocabularies["genre"]
    # min_count=2 drops 'rare' (and any value seen once); 7 rows of 8 hold values (row 0 is OOV).
    assert list(genre.values) == expected_vocabulary(data, ["genre"], min_count=2, capacity=7)
    assert list(trainer.vocabularies["year"].values) == expected_vocabulary(data, ["year"])
    assert "rare" not in genre.values and genre.built_from == VocabFromData(min_count=2)
    # Every dataset decodes with it: genre_new and 2024 (not in window 0) are OOV in eval too.
    table = pq.read_table(data)
    rows = dict(zip(table.column("row_id").to_pylist(), table.column("genre").to_pylist(), strict=True))
    years = dict(zip(table.column("row_id").to_pylist(), table.column("year").to_pylist(), strict=True))
    for mode in ("train", "eval"):
        assert len(seen[mode]["genre"]) == len(rows)
        for r, ids in seen[mode]["genre"].items():
            want = genre.values.index(rows[r]) + 1 if rows[r] in genre.values else 0
            assert ids == [want], (mode, r, rows[r])
        assert all(ids == [0] for r, ids in seen[mode]["year"].items() if years[r] == 2024)
    assert any(rows[r] == "genre_new" for r in seen["eval"]["genre"])


def test_a_resumed_run_restores_the_vocabulary_and_a_changed_configuration_is_refused(tmp_path) -> None:
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    write_vocab_windows(data)

    def trainer(spec: FeatureSpec, **args: Any) -> Trainer:
        ds = ParquetWindowDataset(data, spec, batch_size=8)
        return make_trainer(spec, out, ds, save_every_n_windows=1, **args)

    first = trainer(_vocab_spec(), train_steps=8, save_end=True)  # window 0 is 8 batches
    first.train()
    built = first.vocabularies.state_dict()
    # Window 0 now holds other genres: a rebuild would give another vocabulary.
    t = pq.read_table(os.path.join(data, "hour=00", "part-0.parquet"))
    t = t.set_column(t.schema.get_field_index("genre"), "genre",
                     pa.array(["other"] * t.num_rows, pa.string()))
    pq.write_table(t, os.path.join(data, "hour=00", "part-0.parquet"))
    second = trainer(_vocab_spec())
    second.train()
    assert second.vocabularies.state_dict() == built
    assert second.state.global_step > 8

    # Another configuration than the checkpoint's is refused, naming the feature.
    for spec, now in [(_vocab_spec(min_count=3), "min_count=3"),
                      (FeatureSpec(labels=["y"], dense=["row_id"], sparse=[
                          SparseFeature(name="genre", num_embeddings=8),
                          *_vocab_spec().sparse[1:]]), "no vocabulary")]:
        with pytest.raises(ValueError, match=rf"cannot resume: the checkpoint maps feature 'genre' with "
                                             rf"a vocabulary built from the data .* but this run .*{now}"):
            trainer(spec).train()

    # evaluate/predict from the checkpoint decode with its vocabulary (no train data given),
    # and an export gives files that map ids to the same rows in a new run.
    genre_values = built["features"]["genre"]["values"]
    evals = ParquetWindowDataset(data, _vocab_spec(), batch_size=8)
    decoded: dict[int, list[int]] = {}
    scorer = make_trainer(evals.features, out, None, evals,
                          hooks=[LambdaHook(after_data=lambda t, b: decoded.update(ids_by_row(b, "genre")))])
    scorer.resume(mode="scoring")  # the model and what it needs: its vocabularies
    scorer.evaluate()
    table = pq.read_table(data)
    for r, g in zip(table.column("row_id").to_pylist(), table.column("genre").to_pylist(), strict=True):
        assert decoded[r] == [genre_values.index(g) + 1 if g in genre_values else 0]
    # predict decodes a dataset it was just given with the checkpoint's vocabularies too.
    summary = scorer.predict(ParquetWindowDataset(data, _vocab_spec(), batch_size=8),
                             str(tmp_path / "scores"))
    assert summary.rows_written == table.num_rows
    exported = export_vocabularies(out, str(tmp_path / "vocab"))
    assert sorted(exported) == ["genre", "tags", "year"]
    again = SparseFeature(name="genre", vocab=str(tmp_path / "vocab" / "genre.txt"))
    assert list(again.vocab.values) == genre_values


def test_datasets_mapping_a_feature_differently_are_refused_when_the_trainer_is_built(tmp_path) -> None:
    data = str(tmp_path / "data")
    write_vocab_windows(data, (16,), files_per_window=1)
    train = ParquetWindowDataset(data, _vocab_spec(), batch_size=8)
    other = FeatureSpec(labels=["y"], dense=["row_id"],
                        sparse=[*_vocab_spec().sparse[:2], SparseFeature(name="tags", vocab=TAGS[:5],
                                                                         num_embeddings=7)])
    evals = ParquetWindowDataset(data, other, batch_size=8)
    with pytest.raises(ValueError, match=r"id feature 'tags' is mapped with the vocabulary given as a list of 6 "
                                         r"strings .* by train_dataset, but with the vocabulary given as a "
                                         r"list of 5 strings .* by eval_dataset"):
        make_trainer(train.features, str(tmp_path / "out"), train, evals)


def test_features_sharing_a_table_share_one_vocabulary_counted_over_all_their_columns(tmp_path) -> None:
    data = str(tmp_path / "data")
    write_vocab_windows(data)

    def spec(hist_vocab: Any) -> FeatureSpec:
        return FeatureSpec(labels=["y"], dense=["row_id"], sparse=[SparseFeature(name="tags", vocab=TAGS)],
                           sequence=[SequenceFeature(name="item", num_embeddings=32,
                                                     vocab=VocabFromData(name="items")),
                                     SequenceFeature(name="hist", num_embeddings=32, max_len=5,
                                                     vocab=hist_vocab)])

    # Each its own vocabulary, one table: the same row would mean two items. Refused.
    with pytest.raises(ValueError, match=r"table 't_item' is read by features \['item', 'hist'\], which map "
                                         r"ids to its rows in different ways"):
        make_trainer(spec(VocabFromData()), str(tmp_path / "out"),
                     ParquetWindowDataset(data, spec(VocabFromData()), batch_size=8))
    shared = spec(VocabFromData(name="items"))
    seen: dict[int, list[int]] = {}
    trainer = make_trainer(shared, str(tmp_path / "out"), ParquetWindowDataset(data, shared, batch_size=8),
                           hooks=[LambdaHook(after_data=lambda t, b: seen.update(ids_by_row(b, "item")))],
                           train_steps=12)
    trainer.train()
    items = trainer.vocabularies["item"]
    assert items is trainer.vocabularies["hist"]
    assert list(items.values) == expected_vocabulary(data, ["item", "hist"])
    assert NEW_ITEM not in items.values
    table = pq.read_table(data)
    item_of = dict(zip(table.column("row_id").to_pylist(), table.column("item").to_pylist(), strict=True))
    assert all(ids == [items.values.index(item_of[r]) + 1 if item_of[r] in items.values else 0]
               for r, ids in seen.items())


def test_vocab_is_settable_from_yaml(tmp_path) -> None:
    data = str(tmp_path / "data")
    write_vocab_windows(data, (16,), files_per_window=1)
    (tmp_path / "tags.txt").write_text("\n".join(TAGS) + "\n")
    cfg = {"run": "train", "args": {"output_dir": str(tmp_path / "out")},
           "data": {"kind": "parquet", "train": data, "features": {
               "labels": ["y"], "dense": ["row_id"],
               "sparse": [{"name": "genre", "num_embeddings": 12, "vocab": {"min_count": 2}},
                          {"name": "year", "vocab": [1990, 1991, 1992]},
                          {"name": "tags", "vocab": str(tmp_path / "tags.txt")}]}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    loaded = load_config(str(path))
    sparse = loaded.data.feature_spec().sparse
    assert sparse[0].vocab == VocabFromData(min_count=2)
    assert isinstance(sparse[1].vocab, Vocabulary) and sparse[1].num_embeddings == 4
    assert sparse[2].num_embeddings == len(TAGS) + 1
    assert loaded.model.num_embeddings == [12, 4, len(TAGS) + 1]  # the model's tables follow
    cfg["data"]["features"]["sparse"][0]["vocab"] = {"min_cnt": 2}
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"`vocab` of sparse feature 'genre' is a mapping \(a VocabFromData\) "
                                          r"with unknown key\(s\) \['min_cnt'\]"):
        load_config(str(path))


# ---------------------------------------------------------------------- the build, rank by rank


class _Columns:
    """A dataset of one window whose rows (this rank's share) are ``table``."""

    def __init__(self, spec: FeatureSpec, table: pa.Table | Exception) -> None:
        self.features = spec
        self.table = table
        self.installed: dict[str, Vocabulary] = {}

    def window_ids(self) -> Any:
        yield from ("w0", "w1")

    def read_columns(self, window_id: str, columns: Any) -> Any:
        if isinstance(self.table, Exception):
            raise self.table
        yield self.table.select(list(columns)) if window_id == "w0" else pa.table(
            {c: pa.array(["late"] * 5) for c in columns})

    def set_vocabularies(self, vocabularies: Any) -> None:
        self.installed.update(vocabularies)


def test_each_rank_counts_its_rows_and_the_merged_counts_decide_the_vocabulary() -> None:
    from recsys_trainer.data.vocab import Vocabularies
    from recsys_trainer.distributed import FakeGang

    spec = FeatureSpec(labels=["y"], sparse=[SparseFeature(name="g", num_embeddings=4,
                                                           vocab=VocabFromData(min_count=2))])
    mine = pa.table({"g": ["a", "b", "b", None, "c"]})
    # Rank 1 saw c twice and d once: c (3 in all) beats b (2); a and d (1 each) fall below
    # min_count; 'late' (window w1) is never counted (windows=1).
    peer = ("ok", {("feature", "g"): (pa.array(["c", "d"]), pa.array([2, 1], pa.int64()), "string")})
    vocabs = Vocabularies(FakeGang(rank=0, world_size=2, peer_objects=[[peer]]))
    ds = _Columns(spec, mine)
    vocabs.attach(ds)
    vocabs.build(ds)
    assert list(vocabs["g"].values) == ["c", "b"]
    assert ds.installed["g"] is vocabs["g"]
    # A rank that cannot read makes every rank raise, naming it (after the gather, no hang).
    failing = Vocabularies(FakeGang(rank=0, world_size=2, peer_objects=[[
        ("error", "DataError: file x.parquet: cannot read the file")]]))
    failing.attach(ds)
    with pytest.raises(ValueError, match=r"building the vocabularies of feature\(s\) \['g'\] from train "
                                         r"window\(s\) \['w0'\] failed on rank 1: DataError: file x.parquet"):
        failing.build(ds)
    broken = _Columns(spec, OSError("disk gone"))
    local = Vocabularies(FakeGang(rank=1, world_size=2, peer_objects=[[peer]]))
    local.attach(broken)
    with pytest.raises(ValueError, match=r"failed on rank 1: OSError: disk gone"):
        local.build(broken)


def test_padding_batches_decode_through_string_and_integer_vocabularies(tmp_path) -> None:
    # A rank with no eval rows pads with a batch decoded from one made-up row: its ids must be
    # of the kind each vocabulary maps (a string vocabulary refuses integer ids).
    (tmp_path / "g.txt").write_text("drama\ncomedy\n")
    spec = FeatureSpec(labels=["y"], dense=["row_id"],
                       sparse=[SparseFeature(name="genre", vocab=["drama", "comedy"]),
                               SparseFeature(name="year", vocab=[1990, 1991]),
                               SparseFeature(name="g2", column="genre2", vocab=str(tmp_path / "g.txt"))],
                       sequence=[SequenceFeature(name="hist", vocab=TAGS, max_len=3)])
    ds = ParquetWindowDataset(str(tmp_path), spec, batch_size=4)
    pad = ds.padding_batch()
    assert pad is not None and pad.batch_size == 1
    assert pad.sparse.values().tolist() == [0, 0, 0] and pad.sequence is not None
    assert pad.sequence["hist"].values().tolist() == [0]
