"""Message formats: a message's bytes -> its rows (an Arrow table), and the rows' event times.

* ``"arrow"``: an Arrow IPC stream per message (the schema travels in every message), or, with
  ``schema=`` given once, a bare IPC record batch message (``RecordBatch.serialize()``);
* ``"json"``: one JSON object per message (UTF-8), a row; a key the object lacks is a null;
* a callable ``bytes -> pyarrow.RecordBatch`` (or ``Table``): anything else (Avro, Protobuf).

Decoded rows are normalized so that a message decodes to the same values whatever it is
decoded with (the owner of a partition decodes messages in whatever groups arrive, a rank
reading a span again in others): the spec's numeric columns as float64, its id columns of
no type (every value null) as int64, and, for JSON, the spec's columns a message lacks as
nulls. Then the file readers' schema rules apply (``FeatureSpec.check_schema``: a declared
column missing or of the wrong type is a ``DataError``); a message without the time column
(``time_column``: an Arrow schema without it, a JSON object without the key) is one too.

A message that cannot be decoded is reported as a ``Corrupt`` (the source's ``on_corrupt``
decides: stop, or skip it, count it and write its offset to the dead-letter file).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from recsys_trainer.data.columns import conform_id_kinds
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.spec import FeatureSpec

Decoder = Callable[[bytes], Any]
"""A user decoder: a message's bytes -> ``pyarrow.RecordBatch`` or ``pyarrow.Table``."""

FormatName = Literal["arrow", "json"]

TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}

MAX_EVENT_TIME_S = 253402300800.0
"""Event times are within this many seconds of the epoch (years 1 to 9999, what a window's
id, its UTC start, can name)."""


class EventTimeError(ValueError):
    """A row's event time that is no time (``row``: its row in the table decoded)."""

    def __init__(self, message: str, row: int) -> None:
        super().__init__(message)
        self.row = row


@dataclass(frozen=True)
class Corrupt:
    """A message that could not be decoded, and why."""

    error: str


@dataclass
class DecodedBatch:
    """Messages decoded together: their rows (``table``, in message order), each message's row
    count (``rows``; 0 for a message that cannot be decoded), and why those could not
    (``corrupt``: message index -> error)."""

    table: pa.Table
    rows: np.ndarray
    corrupt: dict[int, str]


class MessageFormat:
    """Decodes messages of one source (see the module docstring).

    Args:
        spec: the dataset's ``FeatureSpec`` (its columns are the ones read).
        format: ``"arrow"``, ``"json"``, or a callable decoder.
        schema: for ``"arrow"``, the schema of bare record batch messages; for ``"json"``, the
            columns' types (default: inferred, then normalized).
        time_column: the column holding each row's event time (a timestamp, or a number in
            ``time_unit``s since the epoch); None: the message's timestamp. A row whose
            event time is null takes the message's timestamp; a message without the column
            (a JSON object without the key) is a ``DataError`` naming it.
    """

    def __init__(self, spec: FeatureSpec, format: FormatName | Decoder, *,
                 schema: pa.Schema | None = None, time_column: str | None = None,
                 time_unit: str = "s", max_ahead_s: float | None = None) -> None:
        self.spec = spec
        self.format = format
        self.schema = schema
        self.time_column = time_column
        self.time_scale = TIME_UNITS[time_unit]
        self._unit = time_unit
        self.max_ahead_s = max_ahead_s
        self.columns = list(dict.fromkeys(
            [*spec.columns(), *([time_column] if time_column else [])]))
        numeric = {*spec.labels, *(d.column for d in spec.dense_features)}
        numeric.update(c for c in (spec.weight_column, *(s.weight_column for s in spec.sparse))
                       if c)
        numeric.update(s.source for s in spec.id_features if s.boundaries is not None)
        self._numeric = numeric
        self._ids = {c for s in spec.id_features if s.boundaries is None for c in s.sources}

    # ------------------------------------------------------------------ decoding

    def decode(self, values: Sequence[bytes | None],
               name: Callable[[int], str] = str) -> DecodedBatch:
        """The rows of messages read together (one table, in message order), with each
        message's row count (0 for one that cannot be decoded: ``corrupt`` says why). Every
        schema met is checked by the files' rules (``FeatureSpec.check_schema``; a
        ``DataError`` naming the message ``name(i)``)."""
        if self.format == "json":
            return self._json_many(values, name)
        return self._join([self._one(v) for v in values], name)

    def _one(self, value: bytes | None) -> pa.Table | Corrupt:
        if value is None:
            return Corrupt("the message has no value (a tombstone)")
        try:
            if callable(self.format):
                got = self.format(value)
                if isinstance(got, pa.RecordBatch):
                    got = pa.Table.from_batches([got])
                if not isinstance(got, pa.Table):
                    return Corrupt(f"the decoder returned {type(got).__name__}, not a "
                                   "pyarrow.RecordBatch or Table")
                table = got
            elif self.schema is not None:
                batch = pa.ipc.read_record_batch(pa.py_buffer(value), self.schema)
                table = pa.Table.from_batches([batch])
            else:
                table = pa.ipc.open_stream(pa.py_buffer(value)).read_all()
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the message's
            return Corrupt(f"{type(exc).__name__}: {exc}")
        return self._normalize(table, fill_missing=False)

    def _join(self, got: list[pa.Table | Corrupt], name: Callable[[int], str]) -> DecodedBatch:
        """Per-message tables (checked by the schema rules) as one batch."""
        rows = np.zeros(len(got), dtype=np.int64)
        corrupt: dict[int, str] = {}
        tables: list[pa.Table] = []
        checked: list[pa.Schema] = []
        for i, t in enumerate(got):
            if isinstance(t, Corrupt):
                corrupt[i] = t.error
                continue
            if not any(t.schema.equals(s) for s in checked):
                self.spec.check_schema(t.schema, name(i))
                self._check_time_column(t.schema.names, name(i))
                checked.append(t.schema)
            rows[i] = t.num_rows
            tables.append(t)
        if not tables:
            return DecodedBatch(pa.table({}), rows, corrupt)
        if len(tables) > 1 and len(checked) > 1:
            # Messages of two id kinds (integers in one, strings in another) are joined as
            # the first's (what the reader does across windows: columns.conform_id_kinds).
            kinds = self.spec.id_kinds(tables[0].schema)
            tables = [conform_id_kinds(t, kinds) for t in tables]
        table = tables[0] if len(tables) == 1 else pa.concat_tables(
            tables, promote_options="permissive")
        return DecodedBatch(table, rows, corrupt)

    def _json_many(self, values: Sequence[bytes | None],
                   name: Callable[[int], str]) -> DecodedBatch:
        """Messages of one JSON object each, parsed together when they all parse (the fast
        path), else one by one."""
        if values and all(v and b"\n" not in v for v in values):
            try:
                table = self._json(b"\n".join(values))  # type: ignore[arg-type]
            except (pa.ArrowException, ValueError):
                table = None
            if table is not None and table.num_rows == len(values):
                self._check_time_column(table.column_names, name(0))
                if self.time_column is not None and table.column(self.time_column).null_count:
                    table = None  # a message without the key, or a null: one by one below
            if table is not None and table.num_rows == len(values):
                table = self._normalize(table, fill_missing=True)
                try:
                    self.spec.check_schema(table.schema, name(0))
                    return DecodedBatch(table, np.ones(len(values), dtype=np.int64), {})
                except DataError:
                    pass  # one by one below: the error names the message that breaks the rules
        out: list[pa.Table | Corrupt] = []
        for i, v in enumerate(values):
            if not v:
                out.append(Corrupt("the message is empty (a JSON message holds one object)"))
                continue
            try:
                obj = json.loads(v)
                if not isinstance(obj, dict):
                    raise ValueError("the message is JSON, but not one object")
                table = self._json(v.replace(b"\n", b" "))
            except (pa.ArrowException, ValueError) as exc:
                out.append(Corrupt(f"{type(exc).__name__}: {exc}"))
                continue
            if table.num_rows != 1:
                out.append(Corrupt(f"the message holds {table.num_rows} rows; a JSON message "
                                   "is one object"))
                continue
            self._check_time_column(list(obj), name(i))
            out.append(self._normalize(table, fill_missing=True))
        return self._join(out, name)

    def _check_time_column(self, names: Sequence[str], message: str) -> None:
        """A message must hold the time column (a null in it takes the message's timestamp):
        one without it is a producer's or a setting's mistake, never windowed silently by
        the time the broker stamped."""
        if self.time_column is not None and self.time_column not in names:
            raise DataError(
                f"the message has no time column {self.time_column!r} (its columns: "
                f"{sorted(names)}): set time_column to the column of the rows' event time, or "
                "None to window by the messages' timestamps.", file=message,
                column=self.time_column)

    def _json(self, data: bytes) -> pa.Table:
        parse = pajson.ParseOptions(explicit_schema=self.schema,
                                    unexpected_field_behavior="ignore") \
            if self.schema is not None else pajson.ParseOptions(unexpected_field_behavior="infer")
        return pajson.read_json(io.BytesIO(data), parse_options=parse,
                                read_options=pajson.ReadOptions(use_threads=False))

    def _normalize(self, table: pa.Table, *, fill_missing: bool) -> pa.Table:
        names = set(table.column_names)
        cols: dict[str, pa.ChunkedArray | pa.Array] = {}
        for c in self.columns:
            if c not in names:
                if fill_missing:
                    cols[c] = pa.nulls(table.num_rows, pa.float64() if c in self._numeric
                                       else pa.int64() if c in self._ids else pa.null())
                continue
            col = table.column(c)
            t = col.type
            if c in self._numeric and (pa.types.is_integer(t) or pa.types.is_floating(t)
                                       or pa.types.is_null(t) or pa.types.is_boolean(t)):
                col = col.cast(pa.float64())
            elif c in self._numeric and pa.types.is_list(t) and (
                    pa.types.is_integer(t.value_type) or pa.types.is_null(t.value_type)):
                col = col.cast(pa.list_(pa.float64()))
            elif c in self._ids and pa.types.is_null(t):
                col = col.cast(pa.int64())
            elif c in self._ids and pa.types.is_list(t) and pa.types.is_null(t.value_type):
                col = col.cast(pa.list_(pa.int64()))
            elif pa.types.is_integer(t) and t != pa.int64() and c in self._ids:
                col = col.cast(pa.int64())
            cols[c] = col
        return pa.table(cols) if cols else table.select([])

    # ------------------------------------------------------------------ event time

    def event_times(self, table: pa.Table, message_ms: np.ndarray) -> np.ndarray:
        """Each row's event time in seconds since the epoch (float64); ``message_ms``: each
        row's message timestamp (milliseconds), the time of a row without one, or of a row
        more than ``max_ahead_s`` ahead of it (``ahead``)."""
        return self.times_and_ahead(table, message_ms)[0]

    def times_and_ahead(self, table: pa.Table,
                        message_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``event_times``, and which rows were more than ``max_ahead_s`` ahead of their
        message's timestamp (they take it: a rule of the message alone, so that every reader
        of the log windows them alike)."""
        fallback = np.asarray(message_ms, dtype=np.float64) / 1000.0
        if self.time_column is None or self.time_column not in table.column_names:
            return fallback.copy(), np.zeros(len(fallback), dtype=bool)
        col = table.column(self.time_column)
        if pa.types.is_timestamp(col.type):
            scale = TIME_UNITS[col.type.unit]
            raw = pc.cast(col, pa.int64())
        elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or \
                pa.types.is_null(col.type):
            scale, raw = self.time_scale, pc.cast(col, pa.float64())
        else:
            raise TypeError(f"the time column {self.time_column!r} must hold timestamps or "
                            f"numbers, but is {col.type}")
        t = raw.to_numpy(zero_copy_only=False).astype(np.float64) * scale
        nulls = np.asarray(col.is_null().to_numpy(zero_copy_only=False))
        if nulls.any():
            t[nulls] = fallback[nulls]
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(t) < MAX_EVENT_TIME_S)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            value = raw[row].as_py()
            hint = next((f": the values look like {u}, set time_unit={u!r}"
                         for u in ("ms", "us", "ns")
                         if np.abs(t[row]) * TIME_UNITS[u] < MAX_EVENT_TIME_S), "")
            raise EventTimeError(
                f"the time column {self.time_column!r} holds {value!r}, which in "
                f"time_unit={self._unit!r} is no time between the years 1 and 9999{hint}.", row)
        ahead = np.zeros(len(t), dtype=bool)
        if self.max_ahead_s is not None:
            ahead = t - fallback > self.max_ahead_s
            t[ahead] = fallback[ahead]
        return t, ahead
