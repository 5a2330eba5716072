"""``Scorer``: load a serving artifact and score raw rows exactly as training scored them.

Rows (a ``pyarrow.Table`` / ``RecordBatch``, or a list or other iterable of dicts of raw column
values) go through the training code's own decoding (``FeatureSpec.decode_chunk``: every transform,
hash and vocabulary), then the embedding part (``tables.py``), then the exported dense
program (``torch.export``). Imports no torchrec, no FBGEMM and none of ``torch.distributed``'s
training machinery (a test checks ``sys.modules`` in a fresh interpreter).

Rows are scored as a model in training would see them at prediction time: label columns are
not needed (they are filled with 0, as ``predict`` documents; the bundled models' outputs do
not read them), passthrough columns are ignored. A missing input column is a ``DataError``
naming it; a bad value a ``DataError`` naming the column and row, as in training. An id column
sent as the other kind than training read (``id_kinds``) is converted where that is lossless
(``"79"`` for the integer 79) and refused otherwise (an integer for a string id: 7 may have
meant ``"007"``), as the training reader does for a later window.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import io
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sized
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load as load_safetensors

from recsys_trainer import storage
from recsys_trainer.data.chunk import DecodedChunk
from recsys_trainer.data.columns import IdKindError, conform_id_kinds
from recsys_trainer.data.errors import DataError
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving import program as dense_program
from recsys_trainer.serving.delta import apply_table_delta, read_delta
from recsys_trainer.serving.runtime.tables import FusedLookup, Table, padded_values

logger = logging.getLogger(__name__)

Rows: TypeAlias = pa.Table | pa.RecordBatch | Iterable[Mapping[str, Any]]


def check_program_archive(data: bytes, name: str) -> None:
    """Refuse a ``torch.export`` archive that would make ``torch.export.load`` unpickle.

    torch 2.13 stores a program's weights as raw bytes with a JSON description, but unpickles
    an entry marked ``use_pickle`` and falls back to ``torch.load(weights_only=False)`` for any
    pickled member that ``weights_only=True`` refuses. Our exports write neither (tensors only,
    no example inputs); an archive that has one is refused before ``torch.export.load`` sees it.
    """
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for member in z.namelist():
            if member.endswith("_config.json"):
                config = json.loads(z.read(member)).get("config", {})
                pickled = sorted(k for k, v in config.items() if v.get("use_pickle"))
                if pickled:
                    raise mf.ArtifactError(f"{name}: {member} marks {pickled[:3]} as pickled; a "
                                           "serving program holds plain tensors only.")
            elif member.endswith(".pt") and z.getinfo(member).file_size:  # empty: nothing to load
                try:
                    torch.load(io.BytesIO(z.read(member)), weights_only=True)
                except Exception as e:  # noqa: BLE001 - anything weights_only refuses
                    raise mf.ArtifactError(f"{name}: {member} is not a plain tensor file "
                                           f"(weights_only load refused it: {e}).") from None


def _runnable(ep: Any) -> Any:
    """The exported program as a callable, without the input-constraint check ``module()``
    hooks in front of it: that check evaluates the program's symbolic shape constraints with
    sympy on every call (about 4 ms, 6x the dense part's own work for one row, measured), and
    the scorer builds the program's inputs to its signature itself (one batch size ``B >= 1``
    for every input, the features and lengths the manifest names)."""
    return ep.module().forward


class Scorer:
    """Scores raw rows with an exported model (``export_for_serving``).

    ``path``: the artifact directory, a local path or a URL (``s3://...``; ``filesystem``
    for explicit credentials). ``verify``: check every file's size and sha256 against the
    manifest (default). ``aot_inductor``: run the AOTInductor-compiled program when the
    artifact has one (native code: only for artifacts you trust; needs a C++ toolchain-built
    package for this platform); default: the ``torch.export`` program.
    """

    def __init__(self, path: str | os.PathLike[str], *, filesystem: Any = None,
                 verify: bool = True, aot_inductor: bool = False) -> None:
        self.root = storage.resolve(os.fspath(path), filesystem)
        self.manifest: dict[str, Any] = mf.read_manifest(self.root, verify=False)
        """The manifest of the full export loaded. ``apply_delta`` leaves it as it is (its
        tables' row counts and hashes are the base's); ``step``, ``content_hash`` and
        ``applied_deltas`` say which state is scored."""
        self._verify = verify
        self._files: dict[str, Any] = self.manifest["files"]
        spec = mf.spec_from_json(self.manifest["features"], self._read)
        self.features: FeatureSpec = spec
        """The training ``FeatureSpec`` (passthrough columns included, as trained)."""
        # Decoding needs neither passthrough columns nor (real) labels; see the module docstring.
        self._decode_spec = dataclasses.replace(spec, passthrough=(), on_nan_label="error",
                                                label_range=None)
        self.id_kinds: dict[str, str] = _id_kinds(spec, self.manifest["features"])
        """``{id column: "integer" | "string"}``: the kind of ids each column held in training
        (recorded by the export; for older artifacts, what the features' vocabularies say). A
        request's column of the other kind is converted losslessly or refused (``_table``)."""
        self._null_types = _null_column_types(self._decode_spec, self.id_kinds)
        tensors = load_safetensors(self._read(mf.TABLES))
        self.tables: dict[str, Table] = {
            t["name"]: Table.from_manifest(t, tensors) for t in self.manifest["tables"]}
        self._pooled: dict[str, Table] = {}
        self._sequence: dict[str, Table] = {}
        self._index_tables()
        program = self.manifest["program"]
        self.output_names: list[str] = list(program["outputs"])
        self.activation: str = program["activation"]
        self._lengths = {s["feature"]: int(s["length"]) for s in program["inputs"]["sequences"]}
        self._values = {s["feature"] for s in program["inputs"]["sequences"] if s.get("values")}
        self._pooled_inputs = [p["feature"] for p in program["inputs"]["pooled"]]
        self.aot_inductor = False
        self._program = self._load_program(program, aot_inductor)
        self.step: int | None = self.manifest.get("step")
        self.content_hash: str = self.manifest["content_hash"]
        """Identifies the model state scored with: the full export's content hash, or after
        ``apply_delta`` the content hash of the full export the deltas reproduce."""
        self.applied_deltas: list[str] = []
        """The URLs of the deltas applied since the full export, in order."""

    # ------------------------------------------------------------------ loading

    def _index_tables(self) -> None:
        """Which table each feature reads, and the one-gather lookup of the plain ones."""
        self._pooled = {f: t for t in self.tables.values() if t.kind == "pooled" for f in t.features}
        self._sequence = {f: t for t in self.tables.values() if t.kind == "sequence"
                          for f in t.features}
        plain = [t for t in self.tables.values() if FusedLookup.eligible(t)]
        dims = {t.dim for t in plain}
        self._fused = FusedLookup(plain) if len(plain) > 1 and len(dims) == 1 else None
        # (decoded keys, the keys the fused lookup serves, their offsets): one tuple, replaced
        # whole, so that threads scoring at once never see one plan's keys with another's list.
        self._fused_keys: tuple[list[str], list[str], torch.Tensor] | None = None

    def _read(self, name: str) -> bytes:
        data = mf.read_file(self.root, name)
        meta = self._files.get(name)
        if self._verify and (meta is None or len(data) != meta["size"]
                             or mf.sha256_bytes(data) != meta["sha256"]):
            raise mf.ArtifactError(f"file {name!r} of the serving artifact {self.root.url!r} is "
                                   "corrupt or not listed in its manifest (size/sha256 differ).")
        return data

    def _load_program(self, program: Mapping[str, Any], aot_inductor: bool) -> Any:
        aoti = program.get("aot_inductor") or {}
        if aot_inductor:
            if not aoti.get("file"):
                raise mf.ArtifactError(
                    f"the serving artifact {self.root.url!r} has no AOTInductor package "
                    f"({aoti.get('error') or 'not built at export'}); score with the torch.export "
                    "program (aot_inductor=False).")
            data = self._read(aoti["file"])
            # AOTInductor loads from a local file only.
            with tempfile.NamedTemporaryFile(suffix=".pt2", delete=False) as f:
                f.write(data)
            try:
                runner = torch._inductor.aoti_load_package(f.name)  # type: ignore[attr-defined]
            finally:
                os.unlink(f.name)
            self.aot_inductor = True
            return runner
        data = self._read(program["file"])
        check_program_archive(data, f"{self.root.url}/{program['file']}")
        return _runnable(dense_program.load(data))

    # ------------------------------------------------------------------ scoring

    def score(self, rows: Rows, *, activation: str | None = None) -> np.ndarray:
        """Scores of ``rows``: float32 ``[B]`` (one output) or ``[B, T]`` (one column per name
        in ``output_names``); no rows (``[]``, a table of 0 rows, with or without columns):
        ``[0]`` / ``[0, T]``. ``activation``: ``"sigmoid"`` (probabilities of the bundled
        models' logits) or ``"none"``; default: the export's (as ``predict``'s)."""
        act = self.activation if activation is None else activation
        if act not in ("sigmoid", "none"):
            raise ValueError(f"`activation` must be 'sigmoid' or 'none', but is {act!r}.")
        width = len(self.output_names)
        if not isinstance(rows, pa.Table | pa.RecordBatch | Sized):
            # A generator or other one-pass iterable of dicts: counted and decoded from one list
            # (counting would otherwise consume it, or fail on len()).
            rows = list(rows)
        if _num_rows(rows) == 0:
            # Nothing to decode: an empty list has no columns to check, and an empty table's
            # columns give no row to score (the shape is what a caller indexing by output expects).
            return np.zeros((0,) if width == 1 else (0, width), dtype=np.float32)
        dense, pooled, sequences, lengths = self.inputs(rows)
        with torch.inference_mode():
            try:
                out = self._program(dense, pooled, sequences, lengths)
            except RuntimeError as e:
                named = self._one_id_error(e, lengths)
                if named is None:
                    raise
                raise named from None
            if act == "sigmoid":
                # Per output column (a strided view), as predict applies it: torch's vectorised
                # sigmoid (contiguous input) and its scalar loop (strided) differ in the last bit.
                out = torch.sigmoid(out) if out.dim() == 1 else torch.stack(
                    [torch.sigmoid(c) for c in out.unbind(1)], dim=1)
        return out.numpy()

    def inputs(self, rows: Rows) -> tuple[torch.Tensor, dict[str, torch.Tensor],
                                          dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The dense program's inputs for ``rows``: dense ``[B, D]``, pooled embeddings per
        feature ``[B, dim]``, padded sequences ``[B, L, dim]`` (a value feature's integers:
        ``[B, L]``) and their lengths ``[B]``."""
        table = self._table(rows)
        try:
            chunk = self._decode_spec.decode_chunk(table)
        except DataError as e:
            if e.file is not None:
                raise
            raise DataError(e.detail, column=e.column, row=e.row, file="the rows to score") from None
        return self._inputs_of(chunk)

    def _one_id_error(self, error: RuntimeError, lengths: Mapping[str, torch.Tensor],
                      ) -> DataError | None:
        """The program's assert that a sequence feature (a DIN candidate) has exactly one id per
        row, as a ``DataError`` naming the feature, its column and the first such row (the
        assert itself can only carry a fixed message); None for any other error."""
        for f, lens in lengths.items():
            if f"{f!r}" not in str(error) or "exactly one id per row" not in str(error):
                continue
            bad = torch.nonzero(lens != 1)
            if not len(bad):
                continue
            row = int(bad[0, 0])
            source = next(q.source for q in self._decode_spec.sequence if q.name == f)
            return DataError(
                f"the model reads exactly one id per row of sequence feature {f!r} (its "
                f"candidate), but this row has {int(lens[row])} (a null or an empty list gives "
                "none); send one id, or give the feature a null_id in training.",
                column=source, row=row, file="the rows to score")
        return None

    def _inputs_of(self, chunk: DecodedChunk) -> tuple[torch.Tensor, dict[str, torch.Tensor],
                                                       dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The program's inputs from decoded rows: the embedding lookups."""
        pooled: dict[str, torch.Tensor] = {}
        matrix = chunk.id_matrix() if self._fused is not None else None
        if matrix is not None:
            keys, offsets = self._fused_plan(chunk.keys)
            if keys:
                rows = self._fused.rows(matrix[[chunk.keys.index(k) for k in keys]]  # type: ignore[union-attr]
                                        if len(keys) < len(chunk.keys) else matrix, offsets)
                pooled.update(zip(keys, rows.unbind(0), strict=True))
        ids = chunk.id_arrays()
        for f in self._pooled_inputs:
            if f not in pooled:
                pooled[f] = self._pooled[f].pool(*ids[f])
        sequences: dict[str, torch.Tensor] = {}
        lengths: dict[str, torch.Tensor] = {}
        for f, (vals, lens) in chunk.sequence_arrays().items():
            if f in self._values:
                sequences[f], lengths[f] = padded_values(vals, lens, self._lengths[f], f)
            elif f in self._lengths:
                sequences[f], lengths[f] = self._sequence[f].padded(vals, lens, self._lengths[f], f)
        return torch.from_numpy(chunk.dense), pooled, sequences, lengths

    def _fused_plan(self, keys: list[str]) -> tuple[list[str], torch.Tensor]:
        """The decoded keys the fused lookup serves (in the decoded order) and their offsets."""
        plan = self._fused_keys
        if plan is None or plan[0] != keys:
            assert self._fused is not None
            mine = [k for k in keys if k in self._pooled and k in self._pooled_inputs
                    and self._pooled[k].name in self._fused.offset]
            offsets = torch.tensor([self._fused.offset[self._pooled[k].name] for k in mine],
                                   dtype=torch.int64)
            plan = self._fused_keys = (keys, mine, offsets)
        return plan[1], plan[2]

    def _table(self, rows: Rows) -> pa.Table:
        spec = self._decode_spec
        if isinstance(rows, pa.RecordBatch):
            table = pa.Table.from_batches([rows])
        elif isinstance(rows, pa.Table):
            table = rows
        else:
            table = self._from_pylist(list(rows))
        table = self._conform_id_kinds(self._typed_nulls(table))
        n = table.num_rows
        for label in spec.labels:
            zeros = pa.array(np.zeros(n, dtype=np.float32))
            i = table.schema.get_field_index(label)
            table = table.append_column(label, zeros) if i < 0 else table.set_column(i, label, zeros)
        if spec.weight_column and spec.weight_column not in table.schema.names:
            table = table.append_column(spec.weight_column, pa.array(np.ones(n, dtype=np.float32)))
        spec.check_schema(table.schema, "the rows to score")
        return table

    def _conform_id_kinds(self, table: pa.Table) -> pa.Table:
        """Id columns sent as the other kind than training read: integers and strings hash to
        different rows, so ``"79"`` for an id trained as ``79`` would score another row silently.
        Integers written as strings (``str(int)``'s form) become integers (``conform_id_kinds``, as
        the training reader converts a later window's); anything else is a ``DataError`` naming the
        column, row and value. Integers for ids trained as strings are always refused: 7 cannot say
        whether it meant "7" or "007"."""
        try:
            return conform_id_kinds(table, self.id_kinds)
        except IdKindError as exc:
            if exc.want == "string":
                raise DataError(
                    f"the id column held string ids in training, but value {exc.value} is an "
                    "integer: it cannot be turned back into the string it came from (7 may "
                    "have been \"7\" or \"007\", different ids), so it is refused rather "
                    "than scored as another row; send the ids as strings, as trained.",
                    column=exc.column, row=exc.row, file="the rows to score") from None
            raise DataError(
                f"the id column held {exc.want} ids in training, but value {exc.value} is a string "
                "that is no integer written as str(int) writes it (no '+', '-0', leading "
                "zeros or spaces); send the integer id, as trained (a string would hash to "
                "another row).", column=exc.column, row=exc.row, file="the rows to score") from None

    def _from_pylist(self, rows: list[Mapping[str, Any]]) -> pa.Table:
        """Dicts -> a table (``_typed_nulls`` then types the columns without a typed value)."""
        # Every key of any row (from_pylist would take the first row's keys only); a key a
        # row lacks is a null there.
        keys = list(dict.fromkeys(k for r in rows for k in r))
        columns: dict[str, pa.Array] = {}
        for k in keys:
            try:
                columns[k] = pa.array([r.get(k) for r in rows])
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:  # mixed types: name the column
                raise DataError(f"its values do not make one column ({e}); give every row the "
                                "same type (as a file's column has).", column=k,
                                file="the rows to score") from None
        return pa.Table.from_pydict(columns)

    def _typed_nulls(self, table: pa.Table) -> pa.Table:
        """A column without one typed value (all None, or lists that are all empty or None:
        pyarrow infers ``null`` / ``list<null>``, from dicts or in a table built from them) gets
        the type training read it as, so a null or an empty list is what training makes of it
        (the row as it would be in a file), not a type error."""
        spec = self._decode_spec
        id_type = self._null_types
        # A weight column of a multi-hot feature: a list exactly when its id column is one.
        weight_of = {s.weight_column: s.source for s in spec.sparse if s.weight_column}
        sequences = {s.source for s in spec.sequence if s.max_len > 1}
        # Id columns first: a weight column follows the type its id column ends up with.
        order = sorted(range(table.num_columns), key=lambda i: table.schema[i].name in weight_of)
        for i in order:
            f = table.schema.field(i)
            listed = pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
            if not (pa.types.is_null(f.type) or (listed and pa.types.is_null(f.type.value_type))):
                continue
            elem = id_type.get(f.name, pa.float32() if f.name in weight_of else pa.float64())
            if f.name in weight_of and weight_of[f.name] in table.schema.names:
                ids = table.schema.field(weight_of[f.name]).type
                listed = listed or pa.types.is_list(ids) or pa.types.is_large_list(ids)
            typ = pa.list_(elem) if listed or f.name in sequences else elem
            table = table.set_column(i, f.name, table.column(i).cast(typ))
        return table

    # ------------------------------------------------------------------ deltas

    def copy(self) -> Scorer:
        """An independent copy to bring forward with ``apply_delta`` while this one goes on
        scoring in other threads (``apply_delta`` writes plain tables' rows in place, so it must
        never run on a scorer that is serving). The copy's tables are its own tensors; the
        program, feature spec and manifest, which ``apply_delta`` replaces rather than changes,
        are shared. Costs one copy of the tables' memory."""
        new = _copy.copy(self)
        new.tables = {
            name: dataclasses.replace(
                t, features=list(t.features),
                weight=None if t.weight is None else t.weight.clone(),
                dynamic=None if t.dynamic is None else dataclasses.replace(t.dynamic))
            for name, t in self.tables.items()}
        new.applied_deltas = list(self.applied_deltas)
        new._index_tables()
        return new

    def apply_delta(self, path: str | os.PathLike[str], *, filesystem: Any = None) -> None:
        """Bring the scorer to the state of a delta export (``export_delta``): changed rows of
        plain tables, new/changed/evicted ids and default rows of dynamic tables, and the dense
        program if it changed. Deltas apply in order: one whose base is not this scorer's
        current state is refused (``ArtifactError``), and nothing is changed then. Not while
        the scorer scores in another thread (plain tables' rows are written in place): bring a
        ``copy()`` forward and swap it in, as ``Follower`` does."""
        root = storage.resolve(os.fspath(path), filesystem)
        delta = read_delta(root, self._verify)
        meta = delta.manifest
        if meta["base"]["content_hash"] != self.content_hash:
            raise mf.ArtifactError(
                f"the delta {root.url!r} goes from the export {meta['base']['content_hash'][:12]} "
                f"(step {meta['base']['step']}) to step {meta['target']['step']}, but this scorer "
                f"holds {self.content_hash[:12]} (step {self.step}); apply deltas in order, "
                "starting from the full export they were taken against.")
        if meta["features_sha256"] != self.manifest["features_sha256"]:
            raise mf.ArtifactError(f"the delta {root.url!r} was exported with another feature "
                                   "spec; load a full export instead.")
        # The program before the tables: apply_table_delta writes plain tables' rows in place,
        # so everything that can fail (a missing or refused file) must have run by then.
        program = None
        if meta["program"] is not None:
            data = delta.read(meta["program"]["file"])
            check_program_archive(data, f"{root.url}/{meta['program']['file']}")
            program = _runnable(dense_program.load(data))
        tables = apply_table_delta(self.tables, delta)
        # Everything read and built: now switch (a failure above leaves the scorer as it was).
        self.tables = tables
        self._index_tables()
        if program is not None:
            if self.aot_inductor:
                # Deltas carry the torch.export program only (export_delta builds no package).
                logger.warning("the delta %s changes the dense part: scoring with its torch.export "
                               "program from now on, not the AOTInductor package.", root.url)
                self.aot_inductor = False
            self._program = program
        self.step, self.content_hash = meta["target"]["step"], meta["target"]["content_hash"]
        self.applied_deltas.append(root.url)


def _num_rows(rows: pa.Table | pa.RecordBatch | Sized) -> int:
    return rows.num_rows if isinstance(rows, pa.Table | pa.RecordBatch) else len(rows)


def _id_kinds(spec: FeatureSpec, features_json: Mapping[str, Any]) -> dict[str, str]:
    """The kind of ids each id column held in training: the export's record (``id_kinds`` of
    the features JSON), else (an older artifact, or a column no file recorded) what a
    vocabulary reading it holds. Bucketized columns are read as numbers: none."""
    kinds = dict(features_json.get("id_kinds") or {})
    for s in spec.id_features:
        kind = getattr(s.vocab, "kind", None)
        if s.boundaries is None and kind in ("integer", "string"):
            for c in s.sources:
                kinds.setdefault(c, kind)
    return kinds


def _null_column_types(spec: FeatureSpec, kinds: Mapping[str, str]) -> dict[str, pa.DataType]:
    """The type an id column of dicts without one typed value (all None) is given: decided per
    column, over every feature reading it (a column a vocabulary and a cross share must be of
    the vocabulary's kind, whichever feature comes last), so it decodes as a null in a file of
    the training schema: the kind recorded in training, else a vocabulary's kind, else a number
    for a bucketized column, else an integer."""
    types: dict[str, pa.DataType] = {}
    for s in spec.id_features:
        for c in s.sources:
            if c in kinds:
                types[c] = pa.string() if kinds[c] == "string" else pa.int64()
            elif s.boundaries is not None:
                types.setdefault(c, pa.float64())
            else:
                types.setdefault(c, pa.int64())
    return types


__all__ = ["Rows", "Scorer", "check_program_archive"]
