"""A vocabulary and its lookup: ``Vocabulary`` (ids -> table rows by a list) and
``VocabFromData`` (how one is built from the data).

A module of ``recsys_trainer.data.vocab`` (whose ``__init__`` re-exports every public name,
and documents vocabularies as a whole): this module is the leaf the feature checks, the building
and the checkpoint component import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recsys_trainer import storage
from recsys_trainer.data.columns import _is_str
from recsys_trainer.data.hashing import stable_hash_strings
from recsys_trainer.validation import check_int, fail

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
        with storage.errors_named(loc.url, "write"):
            storage.write_bytes(loc, data, durable=False)

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



__all__ = ["INDEX_IN_MAX_SIZE", "OOV_ROW", "Kind", "VocabFromData", "Vocabulary"]
