"""The serving artifact's contract: file names, the manifest (JSON) and the ``FeatureSpec`` as
JSON, exactly, with every transform.

An artifact is one directory::

    manifest.json        what everything is (this module writes and reads it)
    tables.safetensors   embedding tables, dynamic tables' id maps and default rows
    vocab/<name>.json    each vocabulary: {"kind": "string" | "integer", "values": [...]}
    dense.pt2            the dense part as a torch.export program (no pickles, see scorer)
    dense_aoti.pt2       optional: the same program compiled by AOTInductor (native code)
    COMMITTED            written last; a directory without it is never loaded

``manifest.json`` holds the schema version, the versions that wrote it, the step and source,
the feature spec, labels and output names, the tables (name, kind, rows, dim, pooling,
features, tensors, quantization, dynamic routing), the dense program's inputs, and the size
and sha256 of every file; ``content_hash`` is the sha256 of those per-file hashes, so two
artifacts with the same content hash hold the same bytes. A server in another language reads
this file and the safetensors files; nothing else is needed to find a tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from recsys_trainer import storage
from recsys_trainer.data.inputs import DenseFeature, SequenceFeature, SparseFeature, _IdFeature
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.vocab import VocabFromData, Vocabulary
from recsys_trainer.table_dtypes import TORCH_DTYPES

SCHEMA_VERSION = 3
"""Bumped when a reader of the previous version would misread an artifact: 2 adds tables
stored in half precision (a table entry's ``dtype``, ``fp16`` or ``bf16``; rows are read in
float32); 3 adds the program's value inputs (a ``program.inputs.sequences`` entry with
``"values": true`` and no ``dim``: raw integers the program reads, such as HSTU's event times,
looked up in no table). An artifact is written as the oldest version that reads it
(``schema_version_of``)."""
READABLE_VERSIONS = (1, 2, 3)
TABLE_DTYPES = tuple(TORCH_DTYPES)
"""How a table's unquantized rows are stored (a table entry's ``dtype``; absent: fp32)."""


def schema_version_of(tables: Sequence[Mapping[str, Any]],
                      sequence_inputs: Sequence[Mapping[str, Any]]) -> int:
    """The oldest schema version that can read an artifact (or delta) of ``tables`` whose
    program reads ``sequence_inputs`` (the manifest's ``program.inputs.sequences``): 3 once
    the program reads value features, 2 once a table is stored in half precision, else 1."""
    if any(q.get("values", False) for q in sequence_inputs):
        return 3
    return 2 if any(t.get("dtype", "fp32") != "fp32" for t in tables) else 1


MANIFEST = "manifest.json"
MARKER = "COMMITTED"
TABLES = "tables.safetensors"
PROGRAM = "dense.pt2"
AOTI_PROGRAM = "dense_aoti.pt2"
VOCAB_DIR = "vocab"
ID_HASH = "recsys_trainer.stable_hash/1"
"""The string/integer hash ids are taken modulo a table's rows with (``data/hashing.py``;
it has no salt). Part of the contract: a server in another language must implement it."""


class ArtifactError(ValueError):
    """A serving artifact that cannot be used: missing, uncommitted, corrupt, or of another
    schema version. The message names the artifact (and file)."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_hash(files: Mapping[str, Mapping[str, Any]]) -> str:
    """sha256 over the sorted ``name:sha256`` lines of the artifact's files."""
    lines = "".join(f"{name}:{files[name]['sha256']}\n" for name in sorted(files))
    return sha256_bytes(lines.encode())


# ------------------------------------------------------------------------ spec <-> JSON

def _vocab_file(feature: str) -> str:
    return f"{VOCAB_DIR}/{feature}.json"


def vocab_to_json(vocab: Vocabulary) -> bytes:
    """A vocabulary file's bytes: its kind and its entries in order (entry i is row i + 1)."""
    return json.dumps({"kind": vocab.kind, "values": list(vocab.values)},
                      ensure_ascii=False).encode()


def vocab_from_json(data: bytes, source: str) -> Vocabulary:
    raw = json.loads(data.decode())
    return Vocabulary(raw["values"], kind=raw["kind"], source=source)


def _value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _feature_to_json(f: _IdFeature, files: dict[str, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fld in dataclasses.fields(f):
        v = getattr(f, fld.name)
        if fld.name == "vocab" and v is not None:
            if isinstance(v, VocabFromData):
                raise ArtifactError(
                    f"feature {f.name!r} takes its vocabulary from the data ({v!r}), which has "
                    "not been built: export from a Trainer that trained (or resumed), or from a "
                    "checkpoint that holds it.")
            name = _vocab_file(f.name)
            files[name] = vocab_to_json(v)
            # The entries' hash too: the spec's hash (features_sha256) then pins the vocabulary,
            # so a delta cannot be taken across a vocabulary that changed at the same size.
            v = {"file": name, "kind": v.kind, "size": len(v), "sha256": sha256_bytes(files[name])}
        out[fld.name] = _value(v)
    return out


def spec_to_json(spec: FeatureSpec) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The spec as JSON-able data, and the vocabulary files it names (``{name: bytes}``).

    Every field of every feature is written (defaults too), so reading it back needs no
    default of this version's classes."""
    files: dict[str, bytes] = {}
    dense = [{fld.name: _value(getattr(d, fld.name)) for fld in dataclasses.fields(d)}
             for d in spec.dense_features]
    return {
        "labels": list(spec.labels),
        "dense": dense,
        "sparse": [_feature_to_json(s, files) for s in spec.sparse],
        "sequence": [_feature_to_json(q, files) for q in spec.sequence],
        "weight_column": spec.weight_column,
        "on_nan_label": spec.on_nan_label,
        "label_range": _value(spec.label_range),
        "passthrough": list(spec.passthrough),
    }, files


def _feature_from_json(cls: type[_IdFeature], raw: Mapping[str, Any],
                       read: Any) -> _IdFeature:
    kwargs = dict(raw)
    vocab = kwargs.get("vocab")
    if vocab is not None:
        kwargs["vocab"] = vocab_from_json(read(vocab["file"]), f"artifact file {vocab['file']}")
    return cls(**kwargs)


def spec_from_json(raw: Mapping[str, Any], read: Any) -> FeatureSpec:
    """The ``FeatureSpec`` ``spec_to_json`` wrote; ``read(name) -> bytes`` reads a vocabulary
    file of the artifact."""
    return FeatureSpec(
        labels=list(raw["labels"]),
        dense=[DenseFeature(**d) for d in raw["dense"]],
        sparse=[_feature_from_json(SparseFeature, s, read) for s in raw["sparse"]],  # type: ignore[misc]
        sequence=[_feature_from_json(SequenceFeature, q, read) for q in raw["sequence"]],  # type: ignore[misc]
        weight_column=raw["weight_column"],
        on_nan_label=raw["on_nan_label"],
        label_range=raw["label_range"],
        passthrough=list(raw["passthrough"]),
    )


# ------------------------------------------------------------------------ reading

def read_file(root: storage.Location, name: str) -> bytes:
    """One file of the artifact at ``root``; an ``ArtifactError`` naming it if absent."""
    loc = root.join(name)
    try:
        with storage.open_input_stream(loc) as f:
            return bytes(f.read())
    except (FileNotFoundError, storage.StorageError) as e:
        if isinstance(e, storage.StorageError) and e.kind != "not_found":
            raise
        raise ArtifactError(f"the serving artifact {root.url!r} has no file {name!r}.") from None


def read_manifest(root: storage.Location, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of the committed artifact at ``root``; with ``verify`` every listed file's
    size and sha256 are checked first (a corrupt or truncated file is an ``ArtifactError``
    naming it)."""
    try:
        marker = read_file(root, MARKER)
    except ArtifactError:
        raise ArtifactError(
            f"{root.url!r} is not a committed serving artifact (no {MARKER} marker: the export "
            "did not finish, or this is another directory).") from None
    try:
        committed = json.loads(marker.decode())["manifest_sha256"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError):
        raise ArtifactError(f"the {MARKER} marker of {root.url!r} is corrupt (not the JSON the "
                            "export writes); export the model again.") from None
    data = read_file(root, MANIFEST)
    # The marker's hash first: a truncated or garbled manifest is named as such, not a JSON error.
    if committed != sha256_bytes(data):
        raise ArtifactError(f"the manifest of {root.url!r} does not match its {MARKER} marker "
                            "(corrupt, or changed after the export committed).")
    manifest = json.loads(data.decode())
    if manifest.get("schema_version") not in READABLE_VERSIONS:
        raise ArtifactError(
            f"the serving artifact {root.url!r} has schema version "
            f"{manifest.get('schema_version')!r}; this reader reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Export it "
            "again with this version, or read it with the version that wrote it "
            f"({manifest.get('versions', {}).get('recsys_trainer')}).")
    check_table_dtypes(manifest, root.url)
    if verify:
        verify_files(root, manifest["files"], skip=(MANIFEST,))
    return manifest


def check_table_dtypes(manifest: Mapping[str, Any], source: str) -> None:
    """Refuse a table stored in a precision this reader does not know (an artifact of a newer
    writer, or an edited manifest), naming the artifact, the table and the precision: read
    as float32 its bytes would be garbage rows."""
    for t in manifest.get("tables", []):
        dtype = t.get("dtype", "fp32")
        if dtype not in TABLE_DTYPES:
            raise ArtifactError(
                f"table {t.get('name')!r} of the serving artifact {source!r} is stored in "
                f"{dtype!r}; this reader reads {', '.join(TABLE_DTYPES)}. Export it again "
                "with this version, or read it with the version that wrote it "
                f"({manifest.get('versions', {}).get('recsys_trainer')}).")


def verify_files(root: storage.Location, files: Mapping[str, Mapping[str, Any]],
                 skip: Sequence[str] = ()) -> None:
    for name, meta in sorted(files.items()):
        if name in skip:
            continue
        data = read_file(root, name)
        if len(data) != meta["size"] or sha256_bytes(data) != meta["sha256"]:
            raise ArtifactError(
                f"file {name!r} of the serving artifact {root.url!r} is corrupt: "
                f"{len(data)} bytes (manifest: {meta['size']}), sha256 does "
                f"{'' if sha256_bytes(data) == meta['sha256'] else 'not '}match.")
