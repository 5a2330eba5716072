"""A rank's share of a closed window, read and decoded into batches: rows the rank read itself
(its partitions, held in memory by their owner's reading thread) or from the broker by offset
(``client.SpanReader``), decoded through the ``FeatureSpec`` (the path the parquet reader
takes: ``unify_columns``, ``decode_chunk``), cut into the planned batch sizes
(``windowing.share``), with zero-weight padding where a rank has no row left."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from recsys_trainer.batch import Batch
from recsys_trainer.data.columns import IdKindError, conform_id_kinds
from recsys_trainer.data.errors import DataError, _RowError
from recsys_trainer.data.kafka.client import SpanReader, where
from recsys_trainer.data.kafka.windowing import Bucket, Clock, Share, WindowPlan
from recsys_trainer.data.prefetch import BatchStream
from recsys_trainer.data.spec import FeatureSpec

_CHUNK_ROWS = 16384
"""Rows decoded at once (whole batches)."""


class ShareReader:
    """Reads shares of windows for one rank (see the module docstring).

    Args:
        features: the dataset's spec (read when a share is decoded: vocabularies set later
            apply).
        buckets: ``(window, partition) -> Bucket``: the rows this rank's reading thread kept.
        spans: makes the ``SpanReader`` for the others (called once, when first needed).
        kinds: the id kinds the ranks agreed (``columns.conform_id_kinds``).
    """

    def __init__(self, topic: str, batch_size: int, prefetch_batches: int, rank: int,
                 clock: Clock, features: Callable[[], FeatureSpec],
                 buckets: dict[tuple[int, int], Bucket], spans: Callable[[], SpanReader],
                 kinds: Callable[[], dict[str, str]]) -> None:
        self.topic, self.batch_size, self.prefetch_batches = topic, batch_size, prefetch_batches
        self.rank, self.clock = rank, clock
        self._features, self._buckets, self._make_spans, self._kinds = (
            features, buckets, spans, kinds)
        self._spans: SpanReader | None = None

    def close(self) -> None:
        if self._spans is not None:
            self._spans.close()
            self._spans = None

    def iterator(self, plan: WindowPlan, sh: Share) -> KafkaWindowIterator:
        return KafkaWindowIterator(self, plan, sh)

    def rows(self, plan: WindowPlan, intervals: list[tuple[int, int, int]]) -> Iterator[Rows]:
        """The rows of this rank's intervals, in order (each table with its partition and its
        rows' offsets): from memory when this rank read them, else from the broker."""
        for p, a, b in intervals:
            bucket = self._buckets.get((plan.number, p))
            if bucket is not None and bucket.cached:
                pos = 0
                for part in bucket.parts:
                    lo, hi = max(a - pos, 0), min(b - pos, part.rows)
                    if lo < hi:
                        offsets = np.repeat(part.offsets, part.counts)[lo:hi]
                        yield Rows(part.table.slice(lo, hi - lo), p, offsets)
                    pos += part.rows
                    if pos >= b:
                        break
                continue
            if self._spans is None:
                self._spans = self._make_spans()
            for table, offsets in self._spans.rows(plan.number, p, plan.spans[p], a, b):
                yield Rows(table, p, offsets)

    def batches(self, plan: WindowPlan, sh: Share) -> Iterator[tuple[Batch, int]]:
        """(batch, its rows) for the share: the planned sizes, a 0 (or a batch whose every row
        was dropped for a NaN label) as a zero-weight padding batch."""
        sizes = sh.sizes
        source = self.rows(plan, sh.intervals)
        held: list[Rows] = []
        i = 0
        while i < len(sizes):
            j, need = i, 0
            while j < len(sizes) and (j == i or need + sizes[j] <= _CHUNK_ROWS):
                need += sizes[j]
                j += 1
            tables, got = [], 0
            while got < need:
                t = held.pop(0) if held else next(source, None)
                if t is None:
                    raise DataError(f"{self.topic}: window "
                                    f"{self.clock.name(plan.number)}: rank {self.rank} found "
                                    f"{got} of the {need} rows it planned to read.")
                if got + t.num_rows > need:
                    held.insert(0, t.slice(need - got, t.num_rows))
                    t = t.slice(0, need - got)
                tables.append(t)
                got += t.num_rows
            decoded = self.decode(tables, plan) if need else None
            lo = 0
            for n in sizes[i:j]:
                batch = decoded.batch(lo, lo + n) if (decoded is not None and n) else None
                lo += n
                if batch is None or batch.batch_size == 0:
                    yield self._features().padding_batch().as_padding(), n
                else:
                    yield batch, n
            i = j

    def decode(self, tables: list[Rows], plan: WindowPlan) -> Any:
        spec = self._features()
        try:
            kinds = self._kinds()
            parts = [conform_id_kinds(t.table, kinds) for t in tables]
            parts = spec.unify_columns(parts)
            table = parts[0] if len(parts) == 1 else pa.concat_tables(
                parts, promote_options="permissive")
            return spec.decode_chunk(table, self.batch_size)
        except (_RowError, IdKindError) as exc:
            raise DataError(f"window {self.clock.name(plan.number)}: {exc.detail}",
                            file=self._where(tables, exc.row), column=exc.column) from None
        except pa.ArrowException as exc:
            raise DataError(f"{self.topic}: window {self.clock.name(plan.number)}: its "
                            f"rows cannot be combined ({exc}); write each column with one "
                            "type.") from None


    def _where(self, tables: list[Rows], row: int | None) -> str:
        """The message holding row ``row`` of ``tables`` together (``topic[partition]@offset``)."""
        if row is not None:
            for t in tables:
                if row < t.num_rows:
                    return where(self.topic, t.partition, int(t.offsets[row]))
                row -= t.num_rows
        return f"{self.topic} (rank {self.rank}'s share)"


@dataclass(frozen=True)
class Rows:
    """Rows of one partition (``table``), with each row's message offset."""

    table: pa.Table
    partition: int
    offsets: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.table.num_rows)

    def slice(self, start: int, stop: int) -> Rows:
        return Rows(self.table.slice(start, stop - start), self.partition,
                    self.offsets[start:stop])


class KafkaWindowIterator(BatchStream):
    """This rank's batches of one window, decoded ahead on a background thread
    (``BatchStream``)."""

    def __init__(self, reader: ShareReader, plan: WindowPlan, sh: Share) -> None:
        self.window_id = reader.clock.name(plan.number)
        super().__init__(lambda: reader.batches(plan, sh), sum(sh.sizes),
                         reader.prefetch_batches if sh.sizes else 0,
                         name=f"kafka-{self.window_id}")
