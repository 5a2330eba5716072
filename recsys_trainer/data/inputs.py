"""The declared inputs: ``DenseFeature``, ``SparseFeature`` and ``SequenceFeature``.

Each names its source column(s) and the transforms that turn a raw value into a model input
(a float, or an id in ``[0, num_embeddings)``), and is validated when constructed.
``FeatureSpec`` (``spec.py``) gathers them; ``decode.py`` applies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from recsys_trainer.data.vocab import VocabArg, check_vocab


@dataclass(frozen=True, kw_only=True)
class DenseFeature:
    """A numeric column read as one float32 dense input.

    Transforms run on the reader thread, in this order: nulls -> ``fill_value`` (and NaN/Inf per
    ``on_non_finite``), then ``clip``, then ``log1p``, then ``standardize``.
    """

    column: str
    fill_value: float = 0.0
    """Replaces nulls (and NaN/Inf when ``on_non_finite="fill"``); a raw value (transformed
    like the others)."""
    on_non_finite: Literal["fill", "error"] = "fill"
    """NaN/Inf values: replace by ``fill_value``, or raise ``DataError``."""
    clip: tuple[float | None, float | None] | None = None
    """``(low, high)``: values are clipped to it (None: that side unbounded)."""
    log1p: bool = False
    """``log(1 + x)``; a value <= -1 (after ``clip``) raises ``DataError``: clip it first."""
    standardize: tuple[float, float] | None = None
    """``(mean, std)``: ``(x - mean) / std`` (std > 0), e.g. the training set's statistics."""

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"a dense feature's `column` must be a non-empty string, but is {self.column!r}.")
        if not _finite(self.fill_value):
            raise ValueError(f"`fill_value` of dense feature {self.column!r} must be a finite number, "
                             f"but is {self.fill_value!r}.")
        if self.on_non_finite not in ("fill", "error"):
            raise ValueError(f"`on_non_finite` of dense feature {self.column!r} must be 'fill' or "
                             f"'error', but is {self.on_non_finite!r}.")
        if self.clip is not None:
            c = self.clip
            if not (isinstance(c, Sequence) and len(c) == 2 and all(x is None or _finite(x) for x in c)
                    and (c[0] is None or c[1] is None or c[0] <= c[1])):
                raise ValueError(f"`clip` of dense feature {self.column!r} must be (low, high) with "
                                 f"finite numbers or None and low <= high, but is {c!r}.")
            object.__setattr__(self, "clip", tuple(None if x is None else float(x) for x in c))
        if self.log1p not in (True, False):
            raise ValueError(f"`log1p` of dense feature {self.column!r} must be True or False, "
                             f"but is {self.log1p!r}.")
        if self.standardize is not None:
            s = self.standardize
            if not (isinstance(s, Sequence) and len(s) == 2 and all(_finite(x) for x in s) and s[1] > 0):
                raise ValueError(f"`standardize` of dense feature {self.column!r} must be (mean, std) "
                                 f"with finite numbers and std > 0, but is {s!r}.")
            object.__setattr__(self, "standardize", (float(s[0]), float(s[1])))

    @property
    def transformed(self) -> bool:
        return self.clip is not None or self.log1p or self.standardize is not None


@dataclass(frozen=True, kw_only=True)
class _IdFeature:
    """What ``SparseFeature`` and ``SequenceFeature`` share: where ids come from and how a raw
    value becomes a row of ``[0, num_embeddings)``.

    At most one transform: ``boundaries`` (bucketize a numeric column), ``div``/``mod`` (integer
    arithmetic, ``div`` first; the result is then hashed if ``hash=True`` or checked), ``cross``
    (several columns into one hashed id), ``vocab`` (a vocabulary: entry i -> row i + 1, others
    -> row 0), or none (ids as they are, strings hashed).
    """

    name: str
    """The KJT key (the embedding table's feature name)."""
    num_embeddings: int = 0
    """Size of the table: every id reaching the model is in ``[0, num_embeddings)``. Required,
    except with a ``vocab`` list or file (then 0, the default, means ``len(vocab) + 1``)."""
    column: str | None = None
    """Source column (default: ``name``; must be None with ``cross``)."""
    hash: bool | None = None
    """Hash ids into ``[0, num_embeddings)``. None: hash strings, check integers. False: never
    hash (a string column then needs a ``vocab``)."""
    on_out_of_range: Literal["error", "hash"] = "error"
    """Unhashed integer ids < 0 or >= num_embeddings: raise ``DataError``, or hash them."""
    boundaries: Sequence[float] | None = None
    """Bucketize a numeric column: the id is the number of boundaries <= the value, so
    ``len(boundaries) + 1`` ids (``(-inf, b0)`` is 0, ``[b0, b1)`` is 1, ...). Strictly
    increasing; a NaN value raises ``DataError`` (null values take ``null_id``)."""
    div: int | None = None
    """Integer ids floor-divided by this (e.g. a timestamp in seconds -> hours)."""
    mod: int | None = None
    """Integer ids modulo this (after ``div``), into ``[0, mod)`` (negative ids too)."""
    cross: Sequence[str] | None = None
    """Two or more scalar id columns (integers or strings) crossed into one id: the stable hash
    of the combination, modulo ``num_embeddings``. A row with a null in any of them takes
    ``null_id`` (or has no id)."""
    null_id: int | None = None
    """The id a null value (a null scalar, or a null element inside a list) gets; None: a null
    scalar has no id (an empty bag) and a null inside a list is an error. Not hashed."""
    on_all_null: Literal["error", "warn"] = "error"
    """A file in which an id column holds no value in any row (every value null; for a list
    column, every list null or empty): raise ``DataError`` naming the file and column (usually
    the data changed upstream: a renamed, dropped or unjoined column written as nulls), or log a
    warning and read the file (its rows get ``null_id``, or no id). The reader checks each
    file's footer statistics (files written without statistics are not checked)."""
    vocab: VocabArg = None
    """Map ids through a vocabulary: a list of values, a text file (path or URL, one value per
    line) or ``VocabFromData(...)`` (built from the first training windows, checkpointed; in
    YAML a mapping of its fields). Entry i is row i + 1; every other value row 0 (OOV). No other
    transform applies. See ``recsys_trainer.data.vocab``."""

    def __post_init__(self) -> None:
        kind = type(self).__name__.replace("Feature", "").lower()
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a {kind} feature's `name` must be a non-empty string, but is {self.name!r}.")
        vocab, n = check_vocab(
            self.vocab, where=f"{kind} feature {self.name!r}", num_embeddings=self.num_embeddings,
            hash=self.hash, on_out_of_range=self.on_out_of_range, null_id=self.null_id,
            transforms=[k for k in ("boundaries", "div", "mod", "cross") if getattr(self, k) is not None])
        object.__setattr__(self, "vocab", vocab)
        object.__setattr__(self, "num_embeddings", n)
        if not _is_pos_int(n):
            raise ValueError(f"`num_embeddings` of {kind} feature {self.name!r} must be an int >= 1, but is {n!r}.")
        if self.hash not in (None, True, False):
            raise ValueError(f"`hash` of {kind} feature {self.name!r} must be None, True or False, "
                             f"but is {self.hash!r}.")
        if self.on_out_of_range not in ("error", "hash"):
            raise ValueError(f"`on_out_of_range` of {kind} feature {self.name!r} must be 'error' or "
                             f"'hash', but is {self.on_out_of_range!r}.")
        where = f"{kind} feature {self.name!r}"
        transforms = [k for k in ("boundaries", "div", "mod", "cross") if getattr(self, k) is not None]
        if len(transforms) > 1 and set(transforms) != {"div", "mod"}:
            raise ValueError(f"{where} sets {' and '.join(transforms)}; use one transform per feature "
                             "(only div and mod combine: div first).")
        if self.boundaries is not None:
            b = self.boundaries
            if isinstance(b, str | bytes) or not isinstance(b, Sequence) or not b \
                    or not all(_finite(x) for x in b):
                raise ValueError(f"`boundaries` of {where} must be a non-empty list of finite "
                                 f"numbers, but is {b!r}.")
            b = tuple(float(x) for x in b)
            bad = [i for i in range(1, len(b)) if not b[i - 1] < b[i]]
            if bad:
                i = bad[0]
                raise ValueError(f"`boundaries` of {where} must be strictly increasing, but "
                                 f"boundaries[{i - 1}] = {b[i - 1]:g} >= boundaries[{i}] = {b[i]:g}; "
                                 "sort them (and drop repeats).")
            object.__setattr__(self, "boundaries", b)
            if self.hash:
                raise ValueError(f"{where} bucketizes (`boundaries`); `hash=True` does not apply.")
            if n < len(b) + 1:
                raise ValueError(f"{where} bucketizes into {len(b) + 1} ids (len(boundaries) + 1), "
                                 f"but `num_embeddings` is {n}; set it to {len(b) + 1}.")
        for key in ("div", "mod"):
            v = getattr(self, key)
            if v is not None and not _is_pos_int(v):
                raise ValueError(f"`{key}` of {where} must be an int >= 1, but is {v!r}.")
        if self.mod is not None:
            if self.hash:
                raise ValueError(f"{where} sets `mod` and `hash=True`; use one of them.")
            if n < self.mod:
                raise ValueError(f"{where} takes ids modulo {self.mod}, which gives {self.mod} ids, "
                                 f"but `num_embeddings` is {n}; set it to {self.mod}.")
        if self.cross is not None:
            c = self.cross
            if isinstance(c, str) or not isinstance(c, Sequence) or len(c) < 2 \
                    or not all(isinstance(x, str) and x for x in c) or len(set(c)) != len(c):
                raise ValueError(f"`cross` of {where} must list two or more distinct column names, "
                                 f"but is {c!r}.")
            object.__setattr__(self, "cross", tuple(c))
            if self.column is not None:
                raise ValueError(f"{where} crosses columns {list(c)}; leave `column` unset.")
            if self.hash is False:
                raise ValueError(f"{where} crosses columns, which is always hashed; `hash=False` "
                                 "does not apply.")
        if self.on_all_null not in ("error", "warn"):
            raise ValueError(f"`on_all_null` of {where} must be 'error' or 'warn', but is "
                             f"{self.on_all_null!r}.")
        if self.null_id is not None and not (isinstance(self.null_id, int) and not isinstance(
                self.null_id, bool) and 0 <= self.null_id < n):
            raise ValueError(f"`null_id` of {where} must be None or an int in [0, {n}), but is "
                             f"{self.null_id!r}.")

    @property
    def source(self) -> str:
        """The id column (the first crossed column for a cross)."""
        return self.cross[0] if self.cross else (self.column or self.name)

    @property
    def sources(self) -> tuple[str, ...]:
        """Every column the ids are computed from."""
        return tuple(self.cross) if self.cross else (self.column or self.name,)


@dataclass(frozen=True, kw_only=True)
class SparseFeature(_IdFeature):
    """An id column (int or string, scalar or ``list<>``) read as one key of ``Batch.sparse``
    (pooled by an ``EmbeddingBagCollection``)."""

    weight_column: str | None = None
    """Optional per-id float weights (same shape as the ids: scalar or list of equal lengths);
    they become the KJT's weights, which a table with ``is_weighted=True`` pools by."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_column is not None and self.cross is not None:
            raise ValueError(f"sparse feature {self.name!r} crosses columns; it takes no `weight_column`.")


@dataclass(frozen=True, kw_only=True)
class SequenceFeature(_IdFeature):
    """Ids read as one key of ``Batch.sequence`` (unpooled, for an ``EmbeddingCollection``).

    A ``list<>`` column is a behaviour sequence, assumed in time order (oldest first): rows
    longer than ``max_len`` keep their *last* ``max_len`` ids (the most recent). A scalar column
    gives one id per row (e.g. the candidate item, which can share the history's table:
    ``EmbeddingConfig(feature_names=["item", "hist_item"])``); it needs ``max_len=1``.
    Transforms (``hash``, ``mod``, ``boundaries``, ...) apply as for ``SparseFeature``.
    """

    max_len: int = 1
    """Most ids per row (the most recent ones are kept). Above 1 the column must be a list."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_pos_int(self.max_len):
            raise ValueError(f"`max_len` of sequence feature {self.name!r} must be an int >= 1, "
                             f"but is {self.max_len!r}.")


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and bool(np.isfinite(x))


def _is_pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1

