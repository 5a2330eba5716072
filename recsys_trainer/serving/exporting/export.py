"""``export_for_serving``: a trained model as one portable, committed directory.

From a committed checkpoint (local or object storage) or a live ``Trainer`` (which first
saves, blocking, so that the export is of a committed step):

1. the model state is read merged (``checkpoint.export.export_model_state_dict``: whole
   tables whatever world size or plan wrote them; no process group);
2. each embedding table (torchrec ``EmbeddingBagCollection`` / ``EmbeddingCollection``,
   sharded or not, and dynamic tables) becomes a tensor in ``tables.safetensors``, quantized
   row-wise if asked; a dynamic table becomes its sorted raw ids, their rows, its default rows
   and its routing rule (``routing.py``);
3. the rest of the model (a copy without its embedding modules, loaded with the checkpoint's
   dense state) is exported with ``torch.export`` around its ``serving_logits`` method (the
   serving contract below), and with AOTInductor when asked (``model_parts.py``);
4. the ``FeatureSpec`` (every transform) and its vocabularies are written as JSON;
5. ``manifest.json`` (sizes, sha256s, content hash) is written, then every file, then
   ``COMMITTED`` **last**, as checkpoints commit; a directory without it is never loaded
   (``artifact.py``).

**The serving contract** a model implements (the bundled ``DLRMClassifier``,
``DINClassifier`` and ``MMoEClassifier`` do)::

    def serving_logits(self, dense: Tensor,                 # [B, num_dense], decoded
                       pooled: dict[str, Tensor],           # feature -> [B, dim], pooled
                       sequences: dict[str, Tensor],        # feature -> [B, L, dim], 0-padded
                       lengths: dict[str, Tensor]) -> Tensor:  # feature -> [B] ids per row
        '''The logits forward(batch) returns, from the looked-up embeddings.'''
    def serving_sequence_lengths(self) -> dict[str, int]:   # only with sequence features
        '''L per sequence feature the model reads (its padding length).'''
    def serving_value_features(self) -> set[str]:           # optional
        '''Sequence features read as raw values (event times): sequences[f] is then
        their integers, [B, L] int64, 0-padded, not embeddings.'''

``serving_logits`` must not call the embedding modules (they are not in the program).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import safetensors
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from recsys_trainer import storage
from recsys_trainer.checkpoint import contents, layout
from recsys_trainer.checkpoint.export import export_model_state_dict, export_vocabularies
from recsys_trainer.data.spec import FeatureSpec
from recsys_trainer.data.vocab import VocabFromData
from recsys_trainer.dynamic import EMPTY_SLOT, rows_key, unmix_ids
from recsys_trainer.serving import delta as dl
from recsys_trainer.serving import manifest as mf
from recsys_trainer.serving.exporting.artifact import write_artifact
from recsys_trainer.serving.exporting.model_parts import (
    TableModule,
    aot_package,
    check_contract,
    dense_copy,
    example_inputs,
    export_program,
    on_host,
    program_bytes,
    table_modules,
    weighted,
)
from recsys_trainer.serving.quantize import QUANTIZATIONS, quantize
from recsys_trainer.serving.routing import RULE, Routing
from recsys_trainer.table_dtypes import DTYPE_NAMES
from recsys_trainer.validation import check_choice, check_type

logger = logging.getLogger(__name__)

_MC = "_managed_collision_collection._managed_collision_modules"


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """``run: export``'s section (the CLI): where and how the artifact is written."""

    output_dir: str
    """The artifact's directory: a path or URL; must not hold a committed artifact."""
    quantize: str | None = None
    """None, ``"int8"`` or ``"int4"``: row-wise quantized tables."""
    aot_inductor: bool = False
    """Also compile the dense program with AOTInductor (minutes on a small CPU host)."""
    activation: str = "sigmoid"
    """As ``predict``'s: what ``Scorer.score`` applies by default."""
    output_names: list[str] | None = None
    """Names of the outputs (default: the labels, as ``predict``)."""
    delta_from: str | None = None
    """A full export: write only what changed since it (``export_delta``) to ``output_dir``."""
    full_output_dir: str | None = None
    """With ``delta_from``: also write the full export here (the next delta's base)."""

    def __post_init__(self) -> None:
        check_type("output_dir", self.output_dir, (str,), "a path or URL")
        if not self.output_dir:
            raise ValueError("`output_dir` must be a path or URL, but is ''.")
        if self.quantize is not None:
            check_choice("quantize", self.quantize, QUANTIZATIONS)
        check_choice("activation", self.activation, ("sigmoid", "none"))
        if self.full_output_dir is not None and self.delta_from is None:
            raise ValueError("`full_output_dir` goes with `delta_from` (a delta export); for a "
                             "full export set only `output_dir`.")


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote: where, which step, its content hash, its files' bytes, and the
    AOTInductor outcome (``aot_inductor_error``: why it was not built, if asked and failed)."""

    path: str
    step: int | None
    content_hash: str
    bytes: int
    seconds: float
    aot_inductor: bool
    aot_inductor_error: str | None = None


# ------------------------------------------------------------------------ building

@dataclass
class _Built:
    manifest: dict[str, Any]
    files: dict[str, bytes]
    tensors: dict[str, torch.Tensor]
    aot_error: str | None


def _table_tensors(tm: TableModule, state: Mapping[str, torch.Tensor], quant: str | None,
                   fallback_per_shard: Mapping[str, int]) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    entries: list[dict[str, Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    prefix = f"{tm.path}." if tm.path else ""

    def stored(w: torch.Tensor) -> torch.Tensor:
        # Half-precision tables are served in their own precision: the rows training reads,
        # bit for bit, at half the bytes (the scorer widens the rows it reads to float32, as
        # FBGEMM's lookup does before pooling).
        if quant:
            return quantize(w, quant)
        return (w if w.dtype in DTYPE_NAMES else w.to(torch.float32)).contiguous()

    for c in tm.configs:
        name = c.name
        entry: dict[str, Any] = {
            "name": name, "kind": tm.kind, "rows": int(c.num_embeddings), "dim": int(c.embedding_dim),
            "pooling": tm.pooling[name], "weighted": weighted(tm.module),
            "features": list(c.feature_names), "quantization": quant, "tensor": None, "dynamic": None,
        }

        if not tm.dynamic:
            group = "embedding_bags" if tm.kind == "pooled" else "embeddings"
            key = f"{prefix}{group}.{name}.weight"
            if key not in state:
                raise KeyError(f"the checkpoint has no {key!r} (table {name!r}); was it left out "
                               "by params_not_save / save_filter_fn?")
            entry["tensor"] = f"{name}.weight"
            tensors[f"{name}.weight"] = stored(state[key])
            _note_dtype(entry, state[key], quant)
        else:
            mc = f"{prefix}{_MC}.{name}."
            weight = state[rows_key(state, prefix, name)]
            raw, slots = state[mc + "_mch_sorted_raw_ids"], state[mc + "_mch_remapped_ids_mapping"]
            segments = state[mc + "_output_segments_tensor"]
            keep = raw != EMPTY_SLOT
            ids = unmix_ids(raw[keep])
            order = torch.argsort(ids)
            ends = segments[segments >= 0][1:]
            shards = len(ends)
            per_shard = fallback_per_shard.get(name, 1)
            # Each shard's last `per_shard` rows, shard-major: the fallback rows in id-space order.
            fallback = (ends.unsqueeze(1) - per_shard + torch.arange(per_shard)).reshape(-1)
            tensors[f"{name}.ids"] = ids[order].contiguous()
            tensors[f"{name}.vectors"] = stored(weight[slots[keep][order]])
            tensors[f"{name}.default_rows"] = stored(weight[fallback])
            _note_dtype(entry, weight, quant)
            routing = Routing(rule=RULE, shards=shards, rows_per_shard=per_shard)
            entry["dynamic"] = {"ids": f"{name}.ids", "vectors": f"{name}.vectors",
                                "default_rows": f"{name}.default_rows", "slots": int(c.num_embeddings),
                                "routing": routing.to_json()}
        entries.append(entry)
    return entries, tensors


def _note_dtype(entry: dict[str, Any], weight: torch.Tensor, quant: str | None) -> None:
    """A half-precision table's entry says so (``dtype``; absent: float32 rows)."""
    name = DTYPE_NAMES.get(weight.dtype, "fp32")
    if not quant and name != "fp32":
        entry["dtype"] = name


def fallback_rows_per_shard(ckpt: storage.Where) -> dict[str, int]:
    """``{table: fallback rows per shard}`` of a checkpoint's dynamic tables, from rank 0's
    ``dynamic_tables`` state (every rank has the same layout; before fallback rows: 1)."""
    info = layout.info_of(ckpt)
    extra = contents.load_extra(info.where.join(contents.extra_file_name(0)), info.step)
    tables = (extra.get("dynamic_tables") or {}).get("tables", {})
    return {t: int(st.get("fallback_per_shard", 1)) for t, st in tables.items()}


def _resolve_vocabs(spec: FeatureSpec, ckpt: str) -> FeatureSpec:
    pending = [f.name for f in spec.id_features if isinstance(f.vocab, VocabFromData)]
    if not pending:
        return spec
    built = export_vocabularies(ckpt)
    missing = [n for n in pending if n not in built]
    if missing:
        raise ValueError(f"features {missing} take their vocabulary from the data, but the "
                         f"checkpoint {ckpt!r} holds none for them.")

    def fix(f: Any) -> Any:
        return dataclasses.replace(f, vocab=built[f.name]) if f.name in pending else f

    return dataclasses.replace(spec, sparse=[fix(s) for s in spec.sparse],
                               sequence=[fix(q) for q in spec.sequence])


def _trained_id_kinds(info: Any, spec: FeatureSpec) -> dict[str, str]:
    """``{id column: "integer" | "string"}``: the kind of ids each column held in training, as
    the training reader recorded it (``ParquetWindowDataset``'s data state in the checkpoint;
    every rank plans every file, so rank 0's record is every file's), and for columns it did not
    record, the kind of a vocabulary reading them. The Scorer converts a request's ids of the
    other kind losslessly or refuses them: a string ``"79"`` hashes to another row than ``79``."""
    with layout.reading(info.where):
        extra = contents.load_extra(info.where.join(contents.extra_file_name(0)), info.step)
    state = extra.get("train_dataset") or {}
    recorded = state.get("id_kinds") if isinstance(state, dict) else None
    kinds = {c: str(v["kind"]) for c, v in (recorded or {}).items()
             if isinstance(v, dict) and v.get("kind") in ("integer", "string")}
    for f in spec.id_features:
        kind = getattr(f.vocab, "kind", None)
        if f.boundaries is None and kind in ("integer", "string"):
            for c in f.sources:
                kinds.setdefault(c, kind)
    return dict(sorted(kinds.items()))


def _output_names(spec: FeatureSpec, width: int, given: list[str] | None) -> list[str]:
    if given is not None:
        if len(given) != width:
            raise ValueError(f"`output_names` has {len(given)} names for {width} outputs.")
        return list(given)
    if len(spec.labels) == width:
        return list(spec.labels)
    return ["score"] if width == 1 else [f"score_{i}" for i in range(width)]


def build(ckpt_dir: str, model: nn.Module, features: FeatureSpec, *, output_names: list[str] | None,
          activation: str, quant: str | None, aot_inductor: bool, verify: bool,
          ) -> _Built:
    """Everything an artifact holds, in memory (see the module docstring)."""
    if quant is not None and quant not in QUANTIZATIONS:
        raise ValueError(f"`quantize` must be one of {QUANTIZATIONS} or None, but is {quant!r}.")
    if activation not in ("sigmoid", "none"):
        raise ValueError(f"`activation` must be 'sigmoid' or 'none', but is {activation!r}.")
    info = layout.resolve_checkpoint(ckpt_dir, "`source`")
    state = export_model_state_dict(info.where, verify=verify)
    modules = table_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no embedding tables to export.")
    lengths = dict(model.serving_sequence_lengths()) if any(  # type: ignore[operator]
        tm.kind == "sequence" for tm in modules) else {}
    check_contract(model, bool(lengths))
    spec = _resolve_vocabs(features, info.path)

    tables: list[dict[str, Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    per_shard = fallback_rows_per_shard(info.where) if any(tm.dynamic for tm in modules) else {}
    for tm in modules:
        entries, ts = _table_tensors(tm, state, quant, per_shard)
        tables.extend(entries)
        tensors.update(ts)
    names = [t["name"] for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique across the model's collections: {names}.")

    dense_model = dense_copy(model, modules)
    table_prefixes = tuple(f"{tm.owner}." for tm in modules)
    dense_state = {k: v for k, v in state.items() if not k.startswith(table_prefixes)}
    expected = set(dense_model.state_dict())
    missing, unexpected = sorted(expected - set(dense_state)), sorted(set(dense_state) - expected)
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit the model's dense part: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; pass the model the checkpoint was trained "
                         "with.")
    dense_model = on_host(dense_model, dense_state)
    example = example_inputs(dense_model, spec, modules, lengths)
    ep = export_program(dense_model.eval(), example)
    with torch.no_grad():
        width = ep.module()(*example)
    outputs = _output_names(spec, 1 if width.dim() == 1 else int(width.shape[1]), output_names)

    features_json, files = mf.spec_to_json(spec)
    features_json["id_kinds"] = _trained_id_kinds(info, spec)
    files[mf.TABLES] = save_safetensors(tensors)
    files[mf.PROGRAM] = program_bytes(ep)
    aot_error: str | None = None
    if aot_inductor:
        with tempfile.TemporaryDirectory() as tmp:
            data, aot_error = aot_package(ep, tmp)
        if data is not None:
            files[mf.AOTI_PROGRAM] = data
    features_canon = json.dumps(features_json, sort_keys=True).encode()
    # A value feature (raw integers, no table: event times) has no dim.
    sequence_inputs = [{"feature": f, "length": lengths[f], "dim": int(v.shape[2])}
                       if v.dim() == 3 else {"feature": f, "length": lengths[f], "values": True}
                       for f, v in example[2].items()]
    manifest: dict[str, Any] = {
        "schema_version": mf.schema_version_of(tables, sequence_inputs),
        "kind": "full",
        "versions": {"recsys_trainer": metadata.version("recsys_trainer"),
                     "torch": torch.__version__, "safetensors": safetensors.__version__},
        "source": info.path,
        "step": info.step,
        "trained_world_size": info.world_size,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "id_hash": mf.ID_HASH,
        "features": features_json,
        "features_sha256": mf.sha256_bytes(features_canon),
        "labels": list(spec.labels),
        "tables": tables,
        "program": {
            "file": mf.PROGRAM,
            "format": "torch.export",
            "inputs": {
                "dense": spec.num_dense,
                "pooled": [{"feature": f, "dim": int(v.shape[1])} for f, v in example[1].items()],
                "sequences": sequence_inputs,
            },
            "outputs": outputs,
            "activation": activation,
            "aot_inductor": ({"file": mf.AOTI_PROGRAM, "error": None} if mf.AOTI_PROGRAM in files
                             else {"file": None, "error": aot_error if aot_inductor else "not asked"}),
        },
    }
    manifest["files"] = {n: {"size": len(b), "sha256": mf.sha256_bytes(b)} for n, b in files.items()}
    manifest["content_hash"] = mf.content_hash(manifest["files"])
    return _Built(manifest=manifest, files=files, tensors=tensors, aot_error=aot_error)


# ------------------------------------------------------------------------ entry points

def _on_rank_zero(trainer: Any, work: Any) -> Any:
    """Run ``work()`` on rank 0; every rank gets its result, or raises its error."""
    result, error = None, None
    if trainer.rank == 0:
        try:
            result = work()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    outcome = trainer.gang.broadcast_object(
        (None, f"{type(error).__name__}: {error}") if error is not None else (result, None))
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise RuntimeError(f"the serving export failed on rank 0: {outcome[1]}")
    return outcome[0]


def _source(source: Any, model: nn.Module | None, features: FeatureSpec | None,
            checkpoint: str | None = None) -> tuple[str, nn.Module, FeatureSpec, Any]:
    """``(checkpoint, model, spec, trainer)`` for a Trainer or a checkpoint path."""
    if hasattr(source, "save_checkpoint") and hasattr(source, "model"):
        trainer = source
        # All ranks; a no-op when this step is committed already.
        ckpt = checkpoint if checkpoint is not None else trainer.save_checkpoint()
        live = model if model is not None else trainer.model.module
        spec = features
        if spec is None:
            ds = trainer.train_dataset or trainer.eval_dataset
            spec = getattr(ds, "features", None)
        if not isinstance(spec, FeatureSpec):
            raise ValueError("the Trainer's datasets have no FeatureSpec (`features`); pass "
                             "export_for_serving(..., features=spec).")
        return ckpt, live, spec, trainer
    if model is None or features is None:
        raise ValueError("exporting from a checkpoint needs `model` (an unsharded instance of the "
                         "trained architecture; its tables may be on the meta device) and "
                         "`features` (the FeatureSpec it was trained with).")
    return os.fspath(source), model, features, None


def export_for_serving(source: Any, out_dir: str, *, model: nn.Module | None = None,
                       features: FeatureSpec | None = None,
                       output_names: list[str] | None = None, activation: str = "sigmoid",
                       quantize: str | None = None, aot_inductor: bool = False,
                       verify: bool = True, filesystem: Any = None,
                       checkpoint: str | None = None) -> ExportSummary:
    """Write the serving artifact of ``source`` to ``out_dir`` (a path or URL).

    ``source``: a committed checkpoint (``step_<N>`` directory, or an output directory: its
    newest; local or a URL), with ``model`` (an unsharded instance of the architecture, as
    built for training) and ``features`` (the training ``FeatureSpec``); or a live ``Trainer``
    (all ranks call this: it saves a checkpoint of the current step, blocking, and rank 0
    exports it; model and spec default to the Trainer's). ``quantize``: None, ``"int8"`` or
    ``"int4"`` (row-wise, every table). ``aot_inductor``: also compile the dense program with
    AOTInductor (minutes on a small CPU host; a failure is recorded, not raised).
    ``activation``/``output_names``: as ``Trainer.predict``'s. ``checkpoint`` (with a Trainer):
    the committed checkpoint its model was loaded from, exported instead of saving one.
    """
    ckpt, mdl, spec, trainer = _source(source, model, features, checkpoint)

    def work() -> ExportSummary:
        t0 = time.perf_counter()
        built = build(ckpt, mdl, spec, output_names=output_names, activation=activation,
                      quant=quantize, aot_inductor=aot_inductor, verify=verify)
        n = write_artifact(out_dir, built.manifest, built.files, filesystem)
        return ExportSummary(path=out_dir, step=built.manifest["step"],
                             content_hash=built.manifest["content_hash"], bytes=n,
                             seconds=time.perf_counter() - t0,
                             aot_inductor=mf.AOTI_PROGRAM in built.files,
                             aot_inductor_error=built.aot_error)

    result: ExportSummary = _on_rank_zero(trainer, work) if trainer is not None else work()
    if trainer is None or trainer.rank == 0:  # the one rank that wrote it says so
        logger.info("serving export of step %s written to %s (%.1f MB, %.1f s)", result.step,
                    result.path, result.bytes / 1e6, result.seconds)
    return result


def _check_delta_features(base_manifest: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """A delta carries no feature spec: refuse one whose base was exported with another. A base
    from before ``id_kinds`` were recorded in the features JSON differs only by that record (it
    is hashed into ``features_sha256``), so it gets its own message, not "the spec changed"."""
    if new["features_sha256"] == base_manifest["features_sha256"]:
        return
    base_features = base_manifest.get("features")
    if isinstance(base_features, Mapping) and "id_kinds" not in base_features:
        raise mf.ArtifactError(
            "the base was exported before id kinds were recorded (recsys_trainer 0.1.0 before "
            "the features JSON's id_kinds); export in full once, then deltas work again.")
    raise mf.ArtifactError("the feature spec changed since the base export; a delta cannot "
                           "carry that: export in full.")


def export_delta(source: Any, base: str, out_dir: str, *, full_out_dir: str | None = None,
                 model: nn.Module | None = None, features: FeatureSpec | None = None,
                 output_names: list[str] | None = None, activation: str = "sigmoid",
                 quantize: str | None = None, verify: bool = True,
                 filesystem: Any = None, checkpoint: str | None = None) -> ExportSummary:
    """Write only what changed between the full export ``base`` and ``source`` (as for
    ``export_for_serving``) to ``out_dir`` (see ``delta.py``); with ``full_out_dir`` also the
    new full export, the base of the next delta. ``Scorer(base)`` then ``apply_delta(out_dir)``
    scores exactly as ``Scorer`` of a full export of ``source``."""
    ckpt, mdl, spec, trainer = _source(source, model, features, checkpoint)

    def work() -> ExportSummary:
        t0 = time.perf_counter()
        root = storage.resolve(base, filesystem)
        base_manifest = mf.read_manifest(root, verify=verify)
        if base_manifest.get("kind") != "full":
            raise mf.ArtifactError(f"the base {base!r} of a delta must be a full export.")
        base_tensors = load_safetensors(mf.read_file(root, mf.TABLES))
        built = build(ckpt, mdl, spec, output_names=output_names, activation=activation,
                      quant=quantize, aot_inductor=False, verify=verify)
        new = built.manifest
        _check_delta_features(base_manifest, new)
        delta_tensors, summary = dl.compute_delta(base_manifest, base_tensors, new, built.tensors)
        files = {dl.DELTA_TABLES: save_safetensors(delta_tensors)}
        program_changed = new["files"][mf.PROGRAM]["sha256"] != base_manifest["files"][mf.PROGRAM]["sha256"]
        if program_changed:
            files[mf.PROGRAM] = built.files[mf.PROGRAM]
        manifest = dl.delta_manifest(base_manifest, new, summary,
                                     mf.PROGRAM if program_changed else None)
        manifest["files"] = {n: {"size": len(b), "sha256": mf.sha256_bytes(b)} for n, b in files.items()}
        manifest["content_hash"] = mf.content_hash(manifest["files"])
        if full_out_dir is not None:
            write_artifact(full_out_dir, new, built.files, filesystem)
        n = write_artifact(out_dir, manifest, files, filesystem)
        return ExportSummary(path=out_dir, step=new["step"], content_hash=manifest["content_hash"],
                             bytes=n, seconds=time.perf_counter() - t0, aot_inductor=False)

    return _on_rank_zero(trainer, work) if trainer is not None else work()


__all__ = ["ExportOptions", "ExportSummary", "build", "export_delta", "export_for_serving",
           "fallback_rows_per_shard"]
