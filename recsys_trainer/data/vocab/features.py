"""The feature side of vocabularies: what ``SparseFeature(vocab=...)`` takes, its validation at
construction, and the decoder's and planner's calls (rows of a column, a column's kind).

``recsys_trainer.data.vocab`` re-exports every public name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa

from recsys_trainer import storage
from recsys_trainer.data.vocab.lookup import OOV_ROW, VocabFromData, Vocabulary

VocabArg: TypeAlias = (Sequence[str] | Sequence[int] | str | os.PathLike[str] | Mapping[str, Any]
                       | VocabFromData | Vocabulary | None)
"""What ``SparseFeature(vocab=...)`` takes: a list, a file path or URL, ``VocabFromData`` (or a
mapping of its fields, as YAML writes it), a ``Vocabulary``, or None."""


def check_vocab(vocab: object, *, where: str, num_embeddings: int, hash: bool | None,
                on_out_of_range: str, transforms: Sequence[str],
                null_id: int | None) -> tuple[Vocabulary | VocabFromData | None, int]:
    """Validate a feature's ``vocab`` and ``num_embeddings`` together; returns the vocabulary in
    its normal form and the table size (derived from a list or file when 0). ``where`` names
    the feature ("sparse feature 'genre'"); errors name the field, the value and the fix."""
    if vocab is None:
        if num_embeddings == 0:  # also the default: not given
            raise ValueError(f"`num_embeddings` of {where} must be an int >= 1, but is 0. Set it to "
                             "the rows of its table (only a `vocab` list or file can derive it).")
        return None, num_embeddings
    v = _normalize(vocab, where)
    if hash is True:
        raise ValueError(f"{where} has a `vocab`, which maps ids to rows without hashing; "
                         "`hash=True` does not apply (leave `hash` unset).")
    if on_out_of_range != "error":
        raise ValueError(f"{where} has a `vocab`: values outside it take the OOV row {OOV_ROW}, so "
                         f"`on_out_of_range={on_out_of_range!r}` does not apply (leave it unset).")
    if transforms:
        raise ValueError(f"{where} sets `vocab` and `{transforms[0]}`; a vocabulary maps the "
                         f"column's own values to rows, so use one of them (a cross is always "
                         "hashed).")
    if num_embeddings != 0 and not (isinstance(num_embeddings, int) and num_embeddings >= 1):
        return v, num_embeddings  # the caller's own check names the bad value
    if isinstance(v, VocabFromData):
        if num_embeddings == 0:
            raise ValueError(f"{where} builds its vocabulary from the data (VocabFromData), so its "
                             "table size must be given: set `num_embeddings` (the vocabulary keeps "
                             "at most num_embeddings - 1 values, the most frequent; row 0 is OOV).")
        if vocabulary_capacity(v, num_embeddings, null_id) < 1:
            raise ValueError(f"{where} leaves no row for its vocabulary (num_embeddings "
                             f"{num_embeddings}, null_id {null_id}): row 0 is OOV and the "
                             "vocabulary's rows lie below a null_id >= 1; raise num_embeddings, or "
                             "use null_id=0.")
        return v, num_embeddings
    need = len(v) + 1
    if num_embeddings == 0:
        num_embeddings = need
    elif num_embeddings < need:
        raise ValueError(f"{where} has a vocabulary of {len(v)} values ({v.source}), which needs "
                         f"{need} rows (row {OOV_ROW} is OOV), but `num_embeddings` is "
                         f"{num_embeddings}; set it to {need}, or leave it unset.")
    if null_id is not None and 1 <= null_id <= len(v):
        raise ValueError(f"`null_id` {null_id} of {where} is the row of vocabulary value "
                         f"{v.values[null_id - 1]!r}; use 0 (nulls share the OOV row) or a row above "
                         f"the vocabulary's ({need}, with num_embeddings >= {need + 1}).")
    return v, num_embeddings


def _normalize(vocab: object, where: str) -> Vocabulary | VocabFromData:
    if isinstance(vocab, Vocabulary | VocabFromData):
        return vocab
    if isinstance(vocab, str | os.PathLike):
        if not os.fspath(vocab):
            raise ValueError(f"`vocab` of {where} is an empty path; name a vocabulary file.")
        try:
            return Vocabulary.from_file(vocab)
        except OSError as exc:  # StorageError: names the URL and the cause
            if storage.classify(exc) == "not_found":
                raise ValueError(f"`vocab` of {where} names the file {os.fspath(vocab)!r}, which "
                                 "does not exist; give a path or URL of a text file with one value "
                                 "per line.") from None
            raise ValueError(f"`vocab` of {where}: {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"`vocab` of {where}: {exc}") from None
    if isinstance(vocab, Mapping):
        allowed = [f.name for f in dataclasses.fields(VocabFromData)]
        unknown = sorted(str(k) for k in vocab if k not in allowed)
        if unknown:
            raise ValueError(f"`vocab` of {where} is a mapping (a VocabFromData) with unknown "
                             f"key(s) {unknown}; allowed: {allowed}.")
        try:
            return VocabFromData(**vocab)
        except ValueError as exc:
            raise ValueError(f"`vocab` of {where}: {exc}") from None
    if isinstance(vocab, Sequence) and not isinstance(vocab, bytes):
        return Vocabulary.from_list(vocab, where)
    raise ValueError(f"`vocab` of {where} must be a list of values, a file path or URL, "
                     f"VocabFromData(...) or None, but is {vocab!r}.")


def vocabulary_capacity(cfg: VocabFromData, num_embeddings: int, null_id: int | None) -> int:
    """Most entries a ``VocabFromData`` vocabulary of this feature may keep: the rows between
    the OOV row and the table's end (or a null_id row >= 1), capped by ``max_size``."""
    top = null_id if null_id else num_embeddings
    cap = top - 1
    return cap if cfg.max_size is None else min(cap, cfg.max_size)


def lookup_rows(vocab: object, values: pa.Array, feature: str) -> np.ndarray:
    """The decoder's call: rows of a feature's (null-free) values through its vocabulary (the
    normal form ``check_vocab`` returned)."""
    if not isinstance(vocab, Vocabulary | VocabFromData):
        raise TypeError(f"feature {feature!r}: `vocab` is {vocab!r}, not in normal form; build "
                        "the feature through SparseFeature/SequenceFeature.")
    if isinstance(vocab, VocabFromData):
        raise ValueError(
            f"feature {feature!r} takes its vocabulary from the data ({vocab!r}), which the Trainer "
            "builds from the first training window(s) when training starts (or restores from a "
            "checkpoint); it has not been built, so its ids cannot be decoded yet. Decode through "
            "a Trainer (train, or resume before evaluate/predict), or give the vocabulary as a "
            "list or file.")
    try:
        return vocab.rows(values)
    except ValueError as exc:
        raise ValueError(f"feature {feature!r}: {exc}") from None


def column_problem(vocab: object, hash: bool | None, kind: str, feature: str) -> str | None:
    """Why a feature cannot map a column of ``kind`` ids (checked when a file is planned), or
    None: ``hash=False`` on strings without a vocabulary, or a vocabulary of the other kind."""
    if vocab is None:
        if hash is False and kind == "string":
            return (f"feature {feature!r} sets hash=False (by the spec, or by a model whose ids "
                    "are table rows), but its column holds strings, which only a hash or a "
                    "vocabulary maps to rows; give it a vocabulary (vocab=[...], a file, or "
                    "VocabFromData(...)), or, where its ids need not be rows, hash=True.")
        return None
    if isinstance(vocab, Vocabulary):
        problem = vocab.kind_problem("string" if kind == "string" else "integer")
        return None if problem is None else f"feature {feature!r}: {problem}"
    return None


def check_tables_share_vocabularies(feature_tables: Sequence[tuple[str, str]],
                                    vocabs: Mapping[str, object]) -> None:
    """Features read by one table must map ids to its rows the same way: the same fixed
    vocabulary, or ``VocabFromData`` with the same ``name`` (one vocabulary counted over all
    their columns), or none at all. ``feature_tables``: ``(feature, table)`` pairs;
    ``vocabs``: each feature's ``vocab``."""
    by_table: dict[str, list[str]] = {}
    for feature, table in feature_tables:
        if feature in vocabs and feature not in by_table.setdefault(table, []):
            by_table[table].append(feature)
    for table, features in by_table.items():
        ident = {f: _identity(vocabs[f], f) for f in features}
        if len(set(ident.values())) > 1:
            what = ", ".join(f"{f!r}: {_short(vocabs[f])}" for f in features)
            raise ValueError(
                f"table {table!r} is read by features {features}, which map ids to its rows in "
                f"different ways ({what}); rows would mean different values. Give them one "
                "vocabulary: the same list or file, or VocabFromData(name=...) with the same name "
                "(counted over all their columns), or none.")


def _identity(vocab: object, feature: str) -> tuple[str, str]:
    if isinstance(vocab, Vocabulary) and vocab.built_from is not None:
        vocab = vocab.built_from
    if isinstance(vocab, VocabFromData):
        return ("from_data", vocab.name) if vocab.name else ("own", feature)
    if isinstance(vocab, Vocabulary):
        return ("fixed", vocab.digest)
    return ("none", "")


def _short(vocab: object) -> str:
    if isinstance(vocab, Vocabulary) and vocab.built_from is not None:
        vocab = vocab.built_from
    if isinstance(vocab, VocabFromData):
        return f"built from the data ({vocab!r})"
    if isinstance(vocab, Vocabulary):
        return f"vocabulary {vocab.source}"
    return "no vocabulary"



__all__ = [
    "VocabArg",
    "check_tables_share_vocabularies",
    "check_vocab",
    "column_problem",
    "lookup_rows",
    "vocabulary_capacity",
]
