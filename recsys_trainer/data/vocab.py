"""Vocabularies: categorical ids (strings, small integers) mapped to table rows by a list.

A hashed id column (the default for strings) maps values to rows by a stable hash modulo the
table size, so distinct values share rows even in tables larger than the column's cardinality
(73 distinct strings hashed into 74 rows land on 45 of them). A vocabulary maps its entry ``i``
to row ``i + 1`` and every other value to row ``OOV_ROW`` (0), the out-of-vocabulary row::

    SparseFeature(name="genre", vocab=["Action", "Comedy", ...])          # a list: rows 1..n
    SparseFeature(name="country", vocab="s3://bucket/vocab/country.txt")  # a file, one per line
    SparseFeature(name="year", num_embeddings=128,                        # built from the data
                  vocab=VocabFromData(windows=1, min_count=5))

The table then needs ``len(vocab) + 1`` rows; ``num_embeddings`` is derived from a list or file
when left unset. A ``VocabFromData`` vocabulary is built when training starts, from the first
``windows`` training windows, and keeps the ``num_embeddings - 1`` most frequent values seen at
least ``min_count`` times. A null value has no id (an empty bag), as without a vocabulary;
``null_id=0`` sends nulls to the OOV row, ``null_id=len(vocab) + 1`` (with a table one row
larger) gives them a row of their own.

* ``Vocabulary``: a frozen, duplicate-free list of strings or integers and its vectorised lookup
  (``pyarrow.compute.index_in`` up to ``INDEX_IN_MAX_SIZE`` entries; above that a search in a
  sorted array, because ``index_in`` rebuilds a hash table of the whole vocabulary per call).
* ``VocabFromData``: how to build one from the data.
* ``check_vocab``: the validation ``SparseFeature`` / ``SequenceFeature`` run at construction.
* ``Vocabularies``: the Trainer's checkpoint component. It builds the ``VocabFromData``
  vocabularies once, identically on every rank (each rank counts its own rows of the first
  windows, the counts are all-gathered and merged the same way everywhere), hands them to every
  dataset (train, eval, predict), and saves them, so a resumed run, ``evaluate`` and ``predict``
  use the same mapping; a resume with another vocabulary configuration is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_trainer import storage
from recsys_trainer.data.columns import _is_str
from recsys_trainer.data.hashing import stable_hash_strings
from recsys_trainer.validation import check_int, fail

if TYPE_CHECKING:
    from recsys_trainer.distributed import Gang

logger = logging.getLogger("recsys_trainer.data")

OOV_ROW = 0
"""The row of every value outside the vocabulary."""

INDEX_IN_MAX_SIZE = 65_536
"""Vocabularies up to this size are looked up with ``pc.index_in``, larger ones by a sorted
search. Measured per 16,384 values (2-core host): ``index_in`` 0.1-0.2 ms up to 1,000 entries,
~4 ms at 64k strings, 150-260 ms at 1M; the sorted search 1-4 ms up to 64k, 8-12 ms at 1M."""

Kind: TypeAlias = Literal["string", "integer"]

_INT = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True, kw_only=True)
class VocabFromData:
    """A vocabulary built from the first training window(s) when training starts, then frozen
    and saved in checkpoints. The feature's ``num_embeddings`` (required) bounds it: at most
    ``num_embeddings - 1`` entries (row 0 is OOV), the most frequent first (ties: smallest value
    first). In YAML: ``vocab: {windows: 1, min_count: 5}``."""

    windows: int = 1
    """Count values over the first this many training windows (on a stream, training starts
    once they have appeared)."""
    min_count: int = 1
    """Keep values seen at least this many times (the others map to the OOV row)."""
    max_size: int | None = None
    """At most this many entries (None: as many as the table holds)."""
    name: str | None = None
    """Features whose ``VocabFromData`` have the same ``name`` share one vocabulary, counted over
    all their columns: needed when they read one table (e.g. the candidate item and the item
    history). None: the feature's own vocabulary."""

    def __post_init__(self) -> None:
        check_int("VocabFromData.windows", self.windows)
        check_int("VocabFromData.min_count", self.min_count)
        check_int("VocabFromData.max_size", self.max_size, allow_none=True)
        if self.name is not None and not (isinstance(self.name, str) and self.name):
            fail("VocabFromData.name", "a non-empty string or None", self.name)


class Vocabulary:
    """An ordered, duplicate-free list of ids (all strings or all integers): entry ``i`` is row
    ``i + 1``, anything else row ``OOV_ROW``. Immutable; lookups are thread-safe.

    A vocabulary read from a text file maps a string column by its lines and an integer column
    by the lines read as integers (each must then be one). Equal vocabularies (same entries in
    the same order, wherever they came from) map ids to the same rows and have the same
    ``digest``.
    """

    def __init__(self, values: Sequence[str] | Sequence[int], *, source: str,
                 kind: Kind | None = None, text: bool = False,
                 built_from: VocabFromData | None = None) -> None:
        vals: tuple[str | int, ...] = tuple(values)
        if kind is None and vals:
            kind = _kind_of_values(vals, source)
        self.values: tuple[str, ...] | tuple[int, ...] = vals  # type: ignore[assignment]
        self.kind: Kind | None = kind
        """``"string"`` or ``"integer"``; None only for an empty vocabulary built from columns
        that held no value."""
        self.source = source
        """Where it came from, for messages."""
        self.text = text
        """Read from a text file (lines may be read as integers for an integer column)."""
        self.built_from = built_from
        """The ``VocabFromData`` it was built by (None: given as a list or file)."""
        self.digest = hashlib.sha256(json.dumps(list(vals)).encode()).hexdigest()
        seen: dict[str | int, int] = {}
        for i, v in enumerate(vals):
            j = seen.setdefault(v, i)
            if j != i:
                raise ValueError(f"the vocabulary {source} holds {v!r} twice (entries {j} and {i}); "
                                 "every value must appear once.")
        self._lock = threading.Lock()
        self._lookups: dict[Kind, Callable[[pa.Array], np.ndarray]] = {}
        self._integers: np.ndarray | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_list(cls, values: Sequence[Any], where: str) -> Vocabulary:
        """A vocabulary given as a list (of strings, or of integers)."""
        vals = list(values)
        if not vals:
            raise ValueError(f"`vocab` of {where} is an empty list; give at least one value (or "
                             "leave `vocab` unset).")
        kind = _kind_of_values(vals, f"`vocab` of {where}")
        what = "strings" if kind == "string" else "integers"
        return cls(vals, kind=kind, source=f"given as a list of {len(vals)} {what}")

    @classmethod
    def from_file(cls, url: str | os.PathLike[str]) -> Vocabulary:
        """One value per line of a UTF-8 text file (a local path or a URL: ``s3://``, ...); a
        trailing newline is optional, ``\\r\\n`` line ends are accepted, nothing is stripped.
        An empty line or a repeated value is an error naming the line."""
        text = os.fspath(url)
        loc = storage.resolve(text)
        with storage.open_input_stream(loc) as f:
            raw = f.read()
        try:
            content = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"the vocabulary file {text} is not UTF-8 text ({exc}).") from None
        lines = content.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        lines = [line[:-1] if line.endswith("\r") else line for line in lines]
        if not lines:
            raise ValueError(f"the vocabulary file {text} is empty; write one value per line.")
        firsts: dict[str, int] = {}
        for i, line in enumerate(lines, start=1):
            if not line:
                raise ValueError(f"line {i} of the vocabulary file {text} is empty; write one "
                                 "value per line (remove empty lines).")
            j = firsts.setdefault(line, i)
            if j != i:
                raise ValueError(f"the vocabulary file {text} holds {line!r} twice (lines {j} "
                                 f"and {i}); every value must appear once.")
        return cls(lines, kind="string", text=True, source=f"file {text} ({len(lines)} lines)")

    def write(self, url: str | os.PathLike[str]) -> None:
        """Write the entries one per line (the format ``vocab="path"`` reads), atomically for a
        local path."""
        if any("\n" in str(v) or "\r" in str(v) or str(v) == "" for v in self.values):
            raise ValueError(f"the vocabulary {self.source} holds an empty value or a line break, "
                             "which a vocabulary file cannot hold.")
        data = "".join(f"{v}\n" for v in self.values).encode()
        loc = storage.resolve(url)
        tmp = loc.path + ".tmp" if loc.is_local else loc.path
        with storage.errors_named(loc.url, "write"):
            with loc.filesystem.open_output_stream(tmp) as f:
                f.write(data)
            if tmp != loc.path:
                loc.filesystem.move(tmp, loc.path)

    # ------------------------------------------------------------------ mapping

    def __len__(self) -> int:
        return len(self.values)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Vocabulary) and self.digest == other.digest
                and self.built_from == other.built_from)

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} {self.kind or 'no'} entries, {self.source})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_lock=None, _lookups={}, _integers=None)  # rebuilt on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def kind_problem(self, kind: Kind) -> str | None:
        """Why this vocabulary cannot map a column of ``kind`` ids (None: it can)."""
        if self.kind is None or self.kind == kind:
            return None
        if self.text and kind == "integer":
            bad = next(((i, v) for i, v in enumerate(self.values, 1) if not _INT.fullmatch(str(v))),
                       None)
            if bad is None:
                return None
            return (f"the column holds integers, but line {bad[0]} of the vocabulary {self.source} "
                    f"is {bad[1]!r}, not an integer; write the file's values as integers.")
        return (f"the column holds {kind} ids, but the vocabulary ({self.source}) holds "
                f"{self.kind}s; write the vocabulary's values as {kind}s.")

    def rows(self, values: pa.Array) -> np.ndarray:
        """Row of each value (int64): ``i + 1`` for entry ``i``, ``OOV_ROW`` for anything else.
        ``values`` holds no null; a column of the wrong kind raises ``ValueError``."""
        kind: Kind = "string" if _is_str(values.type) else "integer"
        lookup = self._lookups.get(kind)
        if lookup is None:
            problem = self.kind_problem(kind)
            if problem is not None:
                raise ValueError(problem)
            with self._lock:
                lookup = self._lookups.get(kind) or self._make_lookup(kind)
                self._lookups[kind] = lookup
        return lookup(values)

    def _entries(self, kind: Kind) -> pa.Array:
        if kind == "string":
            return pa.array([str(v) for v in self.values], pa.string())
        if self._integers is None:
            self._integers = np.array([int(v) for v in self.values], dtype=np.int64)
        return pa.array(self._integers)

    def _make_lookup(self, kind: Kind) -> Callable[[pa.Array], np.ndarray]:
        entries = self._entries(kind)
        if len(entries) == 0:
            return lambda values: np.full(len(values), OOV_ROW, dtype=np.int64)
        if kind == "integer":
            if len(entries) <= INDEX_IN_MAX_SIZE:
                return lambda values: _index_in(_as_int64(values), entries)
            ints = entries.to_numpy()
            order = np.argsort(ints, kind="stable")
            return lambda values: _sorted_rows(ints[order], order, _as_int64(values).to_numpy())
        if len(entries) <= INDEX_IN_MAX_SIZE:
            return lambda values: _index_in(_as_string(values), entries)
        hashes = stable_hash_strings(entries)
        order = np.argsort(hashes, kind="stable")
        ordered = hashes[order]
        if len(np.unique(ordered)) != len(ordered):  # two entries share a 64-bit hash
            return lambda values: _index_in(_as_string(values), entries)

        def lookup(values: pa.Array) -> np.ndarray:
            strings = _as_string(values)
            rows = _sorted_rows(ordered, order, stable_hash_strings(strings))
            # Equal hashes are candidates: the strings themselves decide (exact, no collision).
            found = rows != OOV_ROW
            cand = pa.array(np.where(found, rows - 1, 0))
            same = pc.equal(strings, entries.take(cand)).to_numpy(zero_copy_only=False)
            return np.where(same & found, rows, OOV_ROW)

        return lookup


def _index_in(values: pa.Array, entries: pa.Array) -> np.ndarray:
    idx = pc.index_in(values, value_set=entries).fill_null(-1)
    rows = idx.to_numpy(zero_copy_only=False).astype(np.int64)
    rows += 1  # entry i -> row i + 1; not found (-1) -> OOV_ROW
    return rows


def _sorted_rows(ordered: np.ndarray, order: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Rows of ``keys`` by binary search in ``ordered`` (= entries[order]); OOV where absent."""
    pos = np.searchsorted(ordered, keys)
    np.minimum(pos, len(ordered) - 1, out=pos)
    hit = ordered[pos] == keys
    return np.where(hit, order[pos].astype(np.int64) + 1, OOV_ROW)


def _as_int64(values: pa.Array) -> pa.Array:
    return values if values.type == pa.int64() else pa.array(
        values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False))


def _as_string(values: pa.Array) -> pa.Array:
    return values.cast(pa.string()) if pa.types.is_string_view(values.type) else values


def _kind_of_values(values: Sequence[Any], where: str) -> Kind:
    if values and all(isinstance(v, str) for v in values):
        return "string"
    if values and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "integer"
    odd = next((v for v in values if not isinstance(v, str | int) or isinstance(v, bool)),
               values[0] if values else None)
    raise ValueError(f"{where} must hold only strings or only integers, but holds {odd!r} "
                     f"({type(odd).__name__}) among {len(values)} values.")


VocabArg: TypeAlias = (Sequence[str] | Sequence[int] | str | os.PathLike[str] | Mapping[str, Any]
                       | VocabFromData | Vocabulary | None)
"""What ``SparseFeature(vocab=...)`` takes: a list, a file path or URL, ``VocabFromData`` (or a
mapping of its fields, as YAML writes it), a ``Vocabulary``, or None."""


# ---------------------------------------------------------------------- feature validation


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


# ---------------------------------------------------------------------- the Trainer's component


class IdFeatureLike(Protocol):
    """What ``Vocabularies`` reads of a ``SparseFeature`` / ``SequenceFeature``."""

    @property
    def name(self) -> str: ...
    @property
    def vocab(self) -> object: ...
    @property
    def num_embeddings(self) -> int: ...
    @property
    def null_id(self) -> int | None: ...
    @property
    def sources(self) -> tuple[str, ...]: ...


class SpecLike(Protocol):
    @property
    def id_features(self) -> Sequence[IdFeatureLike]: ...


class VocabDataset(Protocol):
    """What ``Vocabularies`` needs of a dataset (``WindowedDataset`` provides it)."""

    @property
    def features(self) -> SpecLike | None: ...
    def window_ids(self) -> Iterator[str]: ...
    def read_columns(self, window_id: str, columns: Sequence[str]) -> Iterator[pa.Table]: ...
    def set_vocabularies(self, vocabularies: Mapping[str, Vocabulary]) -> None: ...


@dataclass(frozen=True)
class _Config:
    """How one feature maps ids: a fixed vocabulary, one built from the data, or none."""

    vocab: Vocabulary | VocabFromData | None
    capacity: int = 0
    """Most entries of a ``VocabFromData`` vocabulary."""

    @staticmethod
    def of(f: IdFeatureLike) -> _Config:
        v = f.vocab
        if isinstance(v, Vocabulary) and v.built_from is not None:
            v = v.built_from  # already installed: its configuration is how it was built
        if isinstance(v, VocabFromData):
            return _Config(v, vocabulary_capacity(v, f.num_embeddings, f.null_id))
        return _Config(v if isinstance(v, Vocabulary) else None)

    def same(self, other: _Config) -> bool:
        a, b = self.vocab, other.vocab
        if isinstance(a, Vocabulary) and isinstance(b, Vocabulary):
            return a.digest == b.digest
        return a == b and self.capacity == other.capacity

    def text(self) -> str:
        v = self.vocab
        if isinstance(v, VocabFromData):
            return f"a vocabulary built from the data ({v!r}, at most {self.capacity} values)"
        if isinstance(v, Vocabulary):
            return f"the vocabulary {v.source} ({len(v)} values, sha256 {v.digest[:12]})"
        return "no vocabulary (ids hashed or range-checked)"

    def saved(self, built: Vocabulary | None) -> dict[str, Any] | None:
        v = self.vocab
        if v is None:
            return None
        values = v if isinstance(v, Vocabulary) else built
        return {
            "from_data": dataclasses.asdict(v) if isinstance(v, VocabFromData) else None,
            "capacity": self.capacity,
            "source": None if values is None else values.source,
            "kind": None if values is None else values.kind,
            "values": None if values is None else list(values.values),
        }

    @staticmethod
    def from_saved(saved: Mapping[str, Any] | None) -> tuple[_Config, Vocabulary | None]:
        if saved is None:
            return _Config(None), None
        values = saved["values"]
        if saved["from_data"] is not None:
            cfg = VocabFromData(**saved["from_data"])
            built = None if values is None else Vocabulary(
                values, kind=saved["kind"], source=saved["source"], built_from=cfg)
            return _Config(cfg, int(saved["capacity"])), built
        fixed = Vocabulary(values, kind=saved["kind"], source=saved["source"])
        return _Config(fixed), None


class Vocabularies:
    """The vocabularies of a Trainer's datasets, as one checkpoint component (``Stateful``).

    ``attach(dataset)`` records how each of its id features maps ids (and refuses a feature
    mapped differently by another dataset or the restored checkpoint); ``build(train_dataset)``
    builds the pending ``VocabFromData`` vocabularies from its first windows, the same on every
    rank; every attached dataset then decodes with them. ``state_dict`` holds every id feature's
    configuration and vocabulary (the same on every rank); ``load_state_dict`` restores them
    after checking they match this run's configuration.
    """

    needed_for_scoring = True
    """A scoring restore (``resume(mode="scoring")``: ``run: evaluate`` / ``run: predict``)
    loads it with the model: the model's rows mean the values of these vocabularies."""

    def __init__(self, gang: Gang) -> None:
        self._gang = gang
        self._configs: dict[str, _Config] = {}
        self._origin: dict[str, str] = {}
        """Where each configuration came from, for messages."""
        self._sources: dict[str, tuple[str, ...]] = {}
        self._built: dict[str, Vocabulary] = {}
        """``VocabFromData`` features' vocabularies, built or restored."""
        self._datasets: list[VocabDataset] = []

    def __getitem__(self, feature: str) -> Vocabulary:
        """The vocabulary feature ``feature`` decodes with (KeyError if it has none yet)."""
        v = self._built.get(feature)
        if v is None:
            cfg = self._configs.get(feature)
            if cfg is None or not isinstance(cfg.vocab, Vocabulary):
                raise KeyError(f"feature {feature!r} has no vocabulary"
                               + (" yet (built when training starts)" if cfg is not None
                                  and isinstance(cfg.vocab, VocabFromData) else ""))
            v = cfg.vocab
        return v

    @property
    def pending(self) -> list[str]:
        """Features whose vocabulary is still to be built from the data."""
        return [n for n, c in self._configs.items()
                if isinstance(c.vocab, VocabFromData) and n not in self._built]

    def attach(self, dataset: VocabDataset, what: str = "a dataset") -> None:
        """Record ``dataset``'s id features and decode it with the vocabularies known so far."""
        spec = dataset.features
        if spec is None:
            return
        for f in spec.id_features:
            cfg = _Config.of(f)
            if f.name in self._configs:
                known = self._configs[f.name]
                if not known.same(cfg):
                    raise ValueError(
                        f"id feature {f.name!r} is mapped with {known.text()} by "
                        f"{self._origin[f.name]}, but with {cfg.text()} by {what}: every dataset "
                        "of a Trainer (train, eval, predict) and the checkpoint it resumes must "
                        "map ids to the same rows; declare the same `vocab` everywhere.")
            else:
                self._configs[f.name] = cfg
                self._origin[f.name] = what
            self._sources.setdefault(f.name, tuple(f.sources))
        self._share()
        if not any(d is dataset for d in self._datasets):
            self._datasets.append(dataset)
        self._install(dataset)

    def build(self, dataset: VocabDataset | None) -> None:
        """Build the pending ``VocabFromData`` vocabularies from ``dataset``'s first windows (all
        ranks call this together); a no-op when none is pending."""
        groups = {key: names for key, names in self._groups().items()
                  if any(n not in self._built for n in names)}
        if not groups:
            return
        names = sorted(n for ns in groups.values() for n in ns)
        unread = [n for n in names if not self._sources.get(n)]
        if unread:
            raise ValueError(f"feature(s) {unread} take their vocabulary from the data, but no "
                             "dataset of this Trainer declares them: nothing says which columns "
                             "to count.")
        if dataset is None:
            raise ValueError(
                f"feature(s) {names} take their vocabulary from the data (VocabFromData), built "
                "from the first training window(s), but this Trainer has no train_dataset and no "
                "restored checkpoint holds them: resume from a checkpoint of the training run "
                "(args.resume_from) first, give the Trainer its train_dataset, or give the "
                "vocabularies as lists or files.")
        cfgs = {key: self._configs[ns[0]] for key, ns in groups.items()}
        depth = {key: cfg.vocab.windows for key, cfg in cfgs.items()
                 if isinstance(cfg.vocab, VocabFromData)}
        windows = list(itertools.islice(dataset.window_ids(), max(depth.values())))
        columns = {key: sorted({c for n in ns for c in self._sources.get(n, ())})
                   for key, ns in groups.items()}
        payload: tuple[str, Any]
        try:
            payload = ("ok", _count_windows(dataset, windows, depth, columns))
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, after the gather
            payload = ("error", f"{type(exc).__name__}: {exc}")
            local_error: Exception | None = exc
        else:
            local_error = None
        gathered = self._gang.all_gather_object(payload)
        failed = [(r, p[1]) for r, p in enumerate(gathered) if p[0] == "error"]
        if failed:
            rank, message = failed[0]
            raise ValueError(
                f"building the vocabularies of feature(s) {names} from train window(s) {windows} "
                f"failed on rank {rank}: {message}") from local_error
        for key, ns in groups.items():
            cfg = cfgs[key]
            assert isinstance(cfg.vocab, VocabFromData)
            used = windows[:cfg.vocab.windows]
            vocab = _merge_and_freeze([p[1][key] for p in gathered], cfg.vocab, cfg.capacity, used,
                                      ns)
            if len(used) < cfg.vocab.windows:
                logger.warning("the vocabulary of %s asked for %d window(s), but the train data "
                               "has %d", ns, cfg.vocab.windows, len(used))
            if self._gang.rank == 0:
                logger.info("vocabulary of %s: %d values, %s", ns, len(vocab), vocab.source)
            for n in ns:
                self._built[n] = vocab
        for ds in self._datasets:
            self._install(ds)

    def _groups(self) -> dict[tuple[str, str], list[str]]:
        """``VocabFromData`` features by the vocabulary they share; refuses a shared vocabulary
        declared differently by its features."""
        out: dict[tuple[str, str], list[str]] = {}
        for n, c in self._configs.items():
            if isinstance(c.vocab, VocabFromData):
                key = ("shared", c.vocab.name) if c.vocab.name else ("feature", n)
                out.setdefault(key, []).append(n)
        for key, ns in out.items():
            first = self._configs[ns[0]]
            for n in ns[1:]:
                if not self._configs[n].same(first):
                    raise ValueError(
                        f"features {ns[0]!r} and {n!r} share the vocabulary {key[1]!r} "
                        f"(VocabFromData(name={key[1]!r})) but declare it differently: "
                        f"{first.text()} vs {self._configs[n].text()}; give them the same "
                        "VocabFromData and num_embeddings (and null_id).")
        return out

    def _share(self) -> None:
        """A feature that joins a shared vocabulary already built (or restored) gets it too;
        refuses a shared vocabulary declared differently by its features."""
        for ns in self._groups().values():
            have = next((self._built[n] for n in ns if n in self._built), None)
            if have is not None:
                for n in ns:
                    self._built.setdefault(n, have)

    def _install(self, dataset: VocabDataset) -> None:
        spec = dataset.features
        if spec is None:
            return
        mine = {f.name: self._built[f.name] for f in spec.id_features
                if f.name in self._built and f.vocab is not self._built[f.name]}
        if mine:
            dataset.set_vocabularies(mine)

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "features": {
            n: c.saved(self._built.get(n)) for n, c in sorted(self._configs.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"version", "features"} or state["version"] != 1:
            raise ValueError(f"vocabularies state must be {{'version': 1, 'features': ...}}, but "
                             f"has keys {sorted(state)} (version {state.get('version')!r}).")
        for n, saved in state["features"].items():
            cfg, built = _Config.from_saved(saved)
            if n in self._configs:
                mine = self._configs[n]
                if not mine.same(cfg):
                    raise ValueError(
                        f"cannot resume: the checkpoint maps feature {n!r} with {cfg.text()}, but "
                        f"this run ({self._origin[n]}) with {mine.text()}; its table's rows would "
                        "mean other values. Resume with the checkpoint's vocab configuration, or "
                        "start a new run in a new output_dir.")
            else:
                self._configs[n] = cfg
                self._origin[n] = "the restored checkpoint"
            if built is not None:
                self._built[n] = built
        self._share()
        for ds in self._datasets:
            self._install(ds)


def saved_vocabulary(saved: Mapping[str, Any] | None) -> Vocabulary | None:
    """The ``Vocabulary`` one feature's entry of a checkpoint's ``vocabularies`` state decodes
    with (None for a feature mapped by hashing). Used to export a checkpoint's vocabularies."""
    cfg, built = _Config.from_saved(saved)
    vocab = built if built is not None else cfg.vocab
    return vocab if isinstance(vocab, Vocabulary) else None


def _count_windows(dataset: VocabDataset, windows: list[str], depth: Mapping[Any, int],
                   columns: Mapping[Any, list[str]]) -> dict[Any, tuple[pa.Array, pa.Array, Kind | None]]:
    """This rank's value counts per vocabulary over its share of the first windows."""
    parts: dict[Any, list[tuple[pa.Array, pa.Array]]] = {key: [] for key in columns}
    kinds: dict[Any, Kind | None] = {key: None for key in columns}
    for i, window in enumerate(windows):
        keys = [k for k in columns if i < depth[k]]
        needed = sorted({c for k in keys for c in columns[k]})
        if not needed:
            continue
        for table in dataset.read_columns(window, needed):
            for k in keys:
                for c in columns[k]:
                    values, counts, kind = _value_counts(table.column(c))
                    if kinds[k] is not None and kind != kinds[k]:
                        raise ValueError(f"column {c!r} holds {kind} ids, but the other columns "
                                         f"of its vocabulary hold {kinds[k]} ids; one vocabulary "
                                         "maps one kind.")
                    kinds[k] = kind
                    parts[k].append((values, counts))
    return {k: (*_sum_counts(parts[k], kinds[k]), kinds[k]) for k in columns}


def _value_counts(col: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, pa.Array, Kind]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = arr.flatten()
    if _is_str(arr.type):
        kind: Kind = "string"
        arr = arr.cast(pa.string()) if arr.type != pa.string() else arr
    elif pa.types.is_integer(arr.type):
        kind = "integer"
        arr = arr.cast(pa.int64()) if arr.type != pa.int64() else arr
    else:
        raise ValueError(f"a vocabulary maps integer or string ids, but a column holds {arr.type}.")
    vc = pc.value_counts(arr.drop_null())
    return vc.field("values"), vc.field("counts"), kind


def _sum_counts(parts: Sequence[tuple[pa.Array, pa.Array]], kind: Kind | None) -> tuple[pa.Array, pa.Array]:
    typ = pa.string() if kind == "string" else pa.int64()
    if not parts:
        return pa.array([], typ), pa.array([], pa.int64())
    t = pa.table({"value": pa.concat_arrays([p[0] for p in parts]),
                  "count": pa.concat_arrays([p[1] for p in parts])})
    g = t.group_by("value").aggregate([("count", "sum")])
    return g.column("value").combine_chunks(), g.column("count_sum").combine_chunks()


def _merge_and_freeze(per_rank: Sequence[tuple[pa.Array, pa.Array, Kind | None]], cfg: VocabFromData,
                      capacity: int, windows: list[str], features: list[str]) -> Vocabulary:
    """Every rank's counts (in rank order) -> the frozen vocabulary: values seen at least
    ``min_count`` times, most frequent first, ties by value; a pure function of its input, so
    every rank that merges the same gathered counts gets the same vocabulary."""
    kinds = {k for _, _, k in per_rank if k is not None}
    if len(kinds) > 1:
        raise ValueError(f"the columns of {features} hold integer ids on some ranks and strings on "
                         "others; write them with one type in every file.")
    kind: Kind | None = kinds.pop() if kinds else None
    # A rank that read no value of the columns has no kind (and nothing to add).
    values, counts = _sum_counts([(v, c) for v, c, k in per_rank if k is not None], kind)
    distinct = len(values)
    table = pa.table({"value": values, "count": counts})
    table = table.filter(pc.greater_equal(table.column("count"), cfg.min_count))
    frequent = table.num_rows
    order = pc.sort_indices(table, sort_keys=[("count", "descending"), ("value", "ascending")])
    kept = table.take(order).slice(0, capacity).column("value").to_pylist()
    source = (f"built from train window(s) {windows}: {distinct} distinct values, {frequent} seen "
              f">= {cfg.min_count} times, {len(kept)} kept (at most {capacity})")
    if not kept:
        logger.warning("the vocabulary of %s built from window(s) %s is empty (%d distinct "
                       "values, none seen %d times): every id maps to the OOV row", features,
                       windows, distinct, cfg.min_count)
    return Vocabulary(kept, kind=kind, source=source, built_from=cfg)


__all__ = [
    "INDEX_IN_MAX_SIZE",
    "OOV_ROW",
    "VocabArg",
    "VocabDataset",
    "VocabFromData",
    "Vocabularies",
    "Vocabulary",
    "check_tables_share_vocabularies",
    "check_vocab",
    "column_problem",
    "lookup_rows",
    "saved_vocabulary",
    "vocabulary_capacity",
]
