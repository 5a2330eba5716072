"""``TrainingArguments``: the run's configuration, validated at construction, nested by
concern (``checkpoint``: ``CheckpointArguments``, ``eval``: ``EvalArguments``, ``logging``:
``LoggingArguments``), and ``ModelBankSource``, one warm-start entry of the checkpoint section's
``model_bank``.

Field names follow Alibaba RecIS's ``TrainingArguments`` where the concept is the same, so RecIS
users feel at home: every field of a section is also accepted, read and written flat
(``TrainingArguments(save_steps=2)``, ``args.save_steps``, YAML ``args: {save_steps: 2}``), as an
alias of the section's field (``FLAT_ALIASES``). Every invalid value raises ``ValueError`` naming
the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from recsys_trainer.distributed import DEFAULT_COLLECTIVE_TIMEOUT_S
from recsys_trainer.periods import Period, one_period
from recsys_trainer.storage import scheme_of
from recsys_trainer.validation import check_choice, check_int, check_number, check_type, fail

logger = logging.getLogger(__name__)

MixedPrecision = Literal["no", "bf16", "fp16"]
NonFiniteLoss = Literal["ignore", "stop", "skip"]
ReshardDataPosition = Literal["exact", "error", "restart_window", "next_window"]
RESHARD_DATA_POSITIONS = ("exact", "error", "restart_window", "next_window")
SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise",
                  "data_parallel")
MODEL_BANK_COMPONENTS = ("tables", "dense", "optimizer", "counters", "data")
"""Parts of a checkpoint that model-bank sources select from (see ``ModelBankSource``)."""


def name_matches(name: str, patterns: Sequence[str]) -> bool:
    """True when ``name`` matches any pattern: a glob (``*``, ``?``, ``[``) matches the whole
    name; a pattern without wildcards matches as a substring (``"t_user"``). The meaning of
    ``params_not_save`` and of model-bank patterns."""
    for p in patterns:
        if any(c in p for c in "*?["):
            if fnmatch.fnmatchcase(name, p):
                return True
        elif p in name:
            return True
    return False


@dataclass(kw_only=True)
class ModelBankSource:
    """One warm-start source: a checkpoint and, per component, which of *this* model's names to
    initialise from it (see ``recsys_trainer.checkpoint.model_bank``)."""

    path: str
    """A committed checkpoint directory, or an output directory (its newest checkpoint)."""
    include: dict[str, list[str]] = field(
        default_factory=lambda: {"tables": ["*"], "dense": ["*"]})
    """Component -> patterns of this model's names to load; a component not listed is not
    loaded. Patterns: globs, or substrings when they have no wildcard."""
    exclude: dict[str, list[str]] = field(default_factory=dict)
    """Component -> patterns left out (applied after ``include``)."""
    name_map: dict[str, str] = field(default_factory=dict)
    """Source-name fragment -> this model's fragment (renamed tables or modules)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"`model_bank[].path` must be a non-empty path, but is {self.path!r}.")
        for what, comps in (("include", self.include), ("exclude", self.exclude)):
            unknown = sorted(set(comps) - set(MODEL_BANK_COMPONENTS))
            if unknown:
                raise ValueError(f"`model_bank[].{what}` has unknown components {unknown}; "
                                 f"known: {', '.join(MODEL_BANK_COMPONENTS)}.")
            for c, pats in comps.items():
                if isinstance(pats, str) or not all(isinstance(p, str) for p in pats):
                    raise ValueError(f"`model_bank[].{what}[{c!r}]` must be a list of patterns, "
                                     f"but is {pats!r}.")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelBankSource:
        """From ``TrainingArguments.model_bank`` entries (same keys as the fields)."""
        unknown = sorted(set(d) - {"path", "include", "exclude", "name_map"})
        if unknown:
            raise ValueError(f"`model_bank` entry has unknown keys {unknown}; "
                             "known: path, include, exclude, name_map.")
        return cls(**d)

    def selects(self, component: str, name: str) -> bool:
        pats = self.include.get(component)
        if not pats or not name_matches(name, pats):
            return False
        return not name_matches(name, self.exclude.get(component, []))

    def source_name(self, name: str) -> str:
        """This model's name -> the name in the source checkpoint."""
        for src, dst in self.name_map.items():
            if dst in name:
                name = name.replace(dst, src)
        return name


def model_bank_sources(entries: Sequence[ModelBankSource | dict[str, Any]] | None
                       ) -> list[ModelBankSource]:
    """``model_bank`` entries (sources or dicts of their fields) as ``ModelBankSource``s."""
    return [e if isinstance(e, ModelBankSource) else ModelBankSource.from_dict(e)
            for e in (entries or [])]


@dataclass(kw_only=True)
class CheckpointArguments:
    """When checkpoints are saved, which are kept, what they hold and where training resumes
    from: ``TrainingArguments.checkpoint`` (see ``recsys_trainer.checkpoint``). Each field is
    also a flat key of ``TrainingArguments``."""

    save_steps: int | None = None
    """Save every this many optimizer steps."""
    save_every_n_rows: int | None = None
    """Save after every this many training rows of all ranks (exclusive with ``save_steps``;
    windows and epochs triggers may be added to either)."""
    save_every_n_windows: int | None = None
    """Save after every this many train windows."""
    save_every_n_epochs: int | None = None
    """Save after every this many epochs."""
    save_every_n_event_seconds: float | None = None
    """Save after the train window that crosses every this many seconds of event time (a
    source with event-time windows, e.g. a Kafka topic: ``TrainerState.event_time_s``)."""
    save_end: bool = False
    """Save once more when training ends (not twice if that step was saved anyway)."""
    max_to_keep: int = 5
    """Keep this many newest committed checkpoints on disk."""
    save_concurrency_per_rank: int = 4
    """Writer threads per rank for checkpoint files."""
    model_bank: list[dict[str, Any] | ModelBankSource] | None = None
    """Warm-start sources (other checkpoints) applied before training: ``ModelBankSource``s or
    dicts of their fields."""
    params_not_save: list[str] | None = None
    """Parameter-name patterns left out of checkpoints."""
    save_filter_fn: Callable[[str], bool] | None = None
    """Predicate on state-dict keys; False leaves the key out of checkpoints."""
    resume_from: str | None = "auto"
    """"auto" (newest committed checkpoint in output_dir, if any), a checkpoint directory, an
    output directory (its newest committed checkpoint), or None (fresh start)."""
    async_save: bool = True
    """Snapshot tensors to a CPU buffer and write in a background thread (the loop continues);
    False: the loop waits for every save to commit."""
    keep_every_n_hours: float | None = None
    """Also keep (never rotate away) the oldest checkpoint of every such period."""
    keep_best_metric: str | None = None
    """Also keep the checkpoint with the best value of this evaluation metric (e.g. "loss")."""
    keep_best_mode: Literal["min", "max"] = "min"
    """Whether lower ("min") or higher ("max") ``keep_best_metric`` is better."""
    reshard_data_position: ReshardDataPosition = "exact"
    """Resuming with another world size (an elastic job that lost or gained a node) from a
    checkpoint taken mid-window: "exact" (default: the new ranks train exactly the rows of the
    window that no old rank consumed; needs a train dataset with ``exact_reshard``, as
    ``ParquetWindowDataset``), "error" (refuse, saying what to do), "restart_window" (re-read
    the whole window: some rows twice) or "next_window" (skip its rest: some rows never).
    Checkpoints at window boundaries resume exactly at any world size whatever this says."""

    def __post_init__(self) -> None:
        for name in ("save_steps", "save_every_n_windows", "save_every_n_epochs"):
            check_int(name, getattr(self, name), allow_none=True)
        for name in ("max_to_keep", "save_concurrency_per_rank"):
            check_int(name, getattr(self, name))
        check_number("save_every_n_event_seconds", self.save_every_n_event_seconds, above=0,
                     allow_none=True)
        one_period("save", {"save_steps": (self.save_steps, "steps"),
                            "save_every_n_rows": (self.save_every_n_rows, "rows")})
        check_number("keep_every_n_hours", self.keep_every_n_hours, above=0, allow_none=True)
        check_choice("keep_best_mode", self.keep_best_mode, ("min", "max"))
        check_choice("reshard_data_position", self.reshard_data_position,
                     RESHARD_DATA_POSITIONS)
        if self.params_not_save is not None and (
            isinstance(self.params_not_save, str)
            or not all(isinstance(p, str) for p in self.params_not_save)
        ):
            fail("params_not_save", "a list of name patterns", self.params_not_save)
        if self.save_filter_fn is not None and not callable(self.save_filter_fn):
            fail("save_filter_fn", "a callable name -> bool", self.save_filter_fn)
        if self.model_bank is not None:
            for entry in self.model_bank:
                if not isinstance(entry, dict | ModelBankSource):
                    raise ValueError(f"`model_bank` entries must be dicts, but one is {entry!r}.")
            model_bank_sources(self.model_bank)  # validates keys and components


@dataclass(kw_only=True)
class EvalArguments:
    """How much and how often ``train_and_evaluate`` evaluates: ``TrainingArguments.eval``. Each
    field is also a flat key of ``TrainingArguments``."""

    eval_steps: int | None = None
    """Evaluate at most this many batches per evaluation (None: all eval data)."""
    eval_every_n_steps: int | None = None
    """``train_and_evaluate`` evaluates every this many steps. At most one of the
    ``eval_every_n_*`` fields; with none, it evaluates after every train window (windowed eval
    data: eval window i after train window i) or after every epoch (unwindowed eval data). A
    steps or rows period evaluates the eval window paired with the current train window
    (windowed eval data) or all eval data; it needs pipeline="none"."""
    eval_every_n_rows: int | None = None
    """``train_and_evaluate`` evaluates after every this many training rows of all ranks."""
    eval_every_n_windows: int | None = None
    """``train_and_evaluate`` evaluates after every this many train windows of an epoch
    (windowed eval data: the paired eval window; else all eval data)."""
    eval_every_n_epochs: int | None = None
    """``train_and_evaluate`` evaluates all eval data after every this many epochs."""

    def __post_init__(self) -> None:
        check_int("eval_steps", self.eval_steps, allow_none=True)
        _ = self.period  # validates the period fields: ints, at most one set

    @property
    def period(self) -> Period | None:
        """When ``train_and_evaluate`` evaluates (None: after each window or epoch, see
        ``eval_every_n_steps``)."""
        return one_period("eval", {
            "eval_every_n_steps": (self.eval_every_n_steps, "steps"),
            "eval_every_n_rows": (self.eval_every_n_rows, "rows"),
            "eval_every_n_windows": (self.eval_every_n_windows, "windows"),
            "eval_every_n_epochs": (self.eval_every_n_epochs, "epochs"),
        })


@dataclass(kw_only=True)
class LoggingArguments:
    """Where the hooks' local files go and how often periodic reporters report:
    ``TrainingArguments.logging``. Each field is also a flat key of ``TrainingArguments``."""

    logging_dir: str | None = None
    """A local directory for the hooks' files (TensorBoard events, ``metrics.jsonl``, profiler
    traces). Default: ``output_dir`` when it is local; when it is a URL, ``./logs/<its bucket
    and path>`` (these files are appended to while training, which object storage cannot do)."""
    log_steps: int | None = None
    """``LoggerHook`` (and other periodic reporters) report every this many steps (100 when
    neither this nor ``log_every_n_rows`` is set)."""
    log_every_n_rows: int | None = None
    """Report instead after every this many training rows of all ranks (``rows_seen``; the
    same step on every rank). Exclusive with ``log_steps``."""

    def __post_init__(self) -> None:
        if self._given_period() is None:
            self.log_steps = 100
        if self.logging_dir is not None and (not isinstance(self.logging_dir, str)
                                             or scheme_of(self.logging_dir) not in ("", "file")):
            fail("logging_dir", "a local directory (hooks append to their files there, which "
                 "object storage cannot do)", self.logging_dir)

    def _given_period(self) -> Period | None:
        return one_period("log", {"log_steps": (self.log_steps, "steps"),
                                  "log_every_n_rows": (self.log_every_n_rows, "rows")})

    @property
    def period(self) -> Period:
        """When periodic reporters report (``log_steps`` or ``log_every_n_rows``)."""
        period = self._given_period()
        return period if period is not None else Period(100, "steps")


SECTIONS: dict[str, type[CheckpointArguments] | type[EvalArguments] | type[LoggingArguments]] = {
    "checkpoint": CheckpointArguments, "eval": EvalArguments, "logging": LoggingArguments}
"""``TrainingArguments``' nested sections: field name -> its dataclass."""

FLAT_ALIASES: dict[str, str] = {
    f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
"""Flat key (RecIS-style, ``save_steps``) -> the section holding that field (``checkpoint``):
accepted as a keyword of ``TrainingArguments`` and in YAML ``args``, and readable and writable as
an attribute (``args.save_steps`` is ``args.checkpoint.save_steps``)."""

_FLAT: Any = None
"""The default mypy sees for a flat alias (see ``TrainingArguments``' TYPE_CHECKING block)."""


@dataclass(kw_only=True)
class TrainingArguments:
    """How to train. All counts are optimizer steps unless the name says otherwise.

    The settings of one concern are nested: ``checkpoint`` (``CheckpointArguments``), ``eval``
    (``EvalArguments``), ``logging`` (``LoggingArguments``). Each section's fields are also flat
    keys (``FLAT_ALIASES``): ``TrainingArguments(save_steps=2)`` is
    ``TrainingArguments(checkpoint=CheckpointArguments(save_steps=2))``, ``args.save_steps``
    reads and writes ``args.checkpoint.save_steps``. A section may be given as a mapping of its
    fields (YAML: ``args: {checkpoint: {save_steps: 2}}``); a flat key overrides the same field
    of a section given alongside it (so ``dataclasses.replace(args, save_steps=None)`` works). A
    given section is copied, never shared between two ``TrainingArguments``."""

    output_dir: str = "output"
    """Where checkpoints, logs and TensorBoard events go: a local path, or a URL
    (``s3://bucket/prefix``, ``gs://``, ``hdfs://``...) for checkpoints on object storage, in
    which case the hooks' local files go to ``logging_dir`` (docs/checkpoint.md)."""

    train_steps: int | None = None
    """Stop after exactly this many optimizer steps (None: run ``train_epoch`` epochs)."""

    train_epoch: int = 1
    """Passes over the training data (each pass walks every train window once)."""

    smoke_test: bool = False
    """Test mode: ``train``/``evaluate``/``train_and_evaluate`` run a couple of train steps, one
    eval batch, one checkpoint save and a resume from it, in a temporary directory (never
    ``output_dir``), and raise ``SmokeTestError`` naming the phase that failed
    (``recsys_trainer.smoke``)."""

    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. Dense grads accumulate (no all-reduce until the last
    micro-batch); fused sparse optimizers update embeddings on every micro-batch."""

    max_grad_norm: float | None = None
    """Clip the global L2 norm of the dense gradients (identical on every rank). None: off."""

    mixed_precision: MixedPrecision = "no"
    """Autocast for the forward pass: "no", "bf16", or "fp16" (CUDA only; with loss scaling)."""

    non_finite_loss: NonFiniteLoss = "ignore"
    """What a NaN/inf training loss on any rank does, on every rank alike: "ignore"; "stop"
    after that step (checked after each step: a device sync on CUDA; the step has been applied,
    fused sparse updates included); or "skip" that micro-batch's backward and the step's dense
    update (one extra 1-int all-reduce per micro-batch plus a device sync on CUDA; the step
    still counts in ``global_step``; needs pipeline="none")."""

    max_non_finite_skips: int | None = None
    """With ``non_finite_loss="skip"``: stop every rank after this many skipped steps."""

    window_iter: int | None = None
    """Train on at most this many windows per epoch (None: all)."""

    pipeline: Literal["none", "sparse_dist"] = "none"
    """"sparse_dist": train with TorchRec's ``TrainPipelineSparseDist`` (overlaps the next
    batches' device copy and sparse all-to-all with this step). Needs
    gradient_accumulation_steps=1, no fp16, and non_finite_loss other than "skip"."""

    seed: int = 0
    """Seeds torch, numpy and python RNGs on every rank when the Trainer is built (before the
    tables are materialised). Dense layers are initialised when the model is constructed,
    before that: call ``recsys_trainer.seed_everything(args.seed)`` before constructing the
    model for run-to-run reproducibility (``recsys-train`` does; DDP makes ranks agree either
    way, broadcasting rank 0's dense parameters)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": CUDA when available, else CPU."""

    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    """Seconds a collective (on every process group the Trainer uses) waits for the other ranks
    before failing with a ``PeerLostError`` that names the step: how long a stopped or stuck rank
    can hold up the others. Raise it when ranks legitimately drift apart by more (e.g. a rank
    with far larger table shards writing its part of a huge checkpoint)."""

    preemption_grace_s: float | None = 25.0
    """While training, SIGTERM/SIGINT (a scheduler's preemption, torchrun's agent forwarding its
    own, Ctrl-C) stop every rank after the same step and save that step's checkpoint, which
    must commit within this many seconds of the signal; then ``train()`` raises ``Preempted``
    (exit code 128 + signal: 143 for SIGTERM). Keep it below the launcher's grace before SIGKILL
    (torchrun's ``--shutdown-timeout``, Kubernetes' ``terminationGracePeriodSeconds``: 30 s by
    default). None: no handlers, the signals act as without the Trainer."""

    sharding_types: dict[str, str] = field(default_factory=dict)
    """Per-table sharding override, e.g. ``{"t_user": "row_wise"}``. On CPU only table_wise,
    column_wise and data_parallel exist."""

    checkpoint: CheckpointArguments = field(default_factory=CheckpointArguments)
    """Saving, retention, warm start and resume (``CheckpointArguments``; its fields are also
    flat keys: ``save_steps``, ``max_to_keep``, ``resume_from``...)."""

    eval: EvalArguments = field(default_factory=EvalArguments)
    """Evaluation size and period (``EvalArguments``; flat keys ``eval_steps``,
    ``eval_every_n_*``)."""

    logging: LoggingArguments = field(default_factory=LoggingArguments)
    """The hooks' local directory and the report period (``LoggingArguments``; flat keys
    ``logging_dir``, ``log_steps``, ``log_every_n_rows``)."""

    if TYPE_CHECKING:
        # The flat keys exist at runtime as properties (added below the class, from
        # FLAT_ALIASES) and as keywords of the wrapped __init__ (``_accept_flat_keys``), which a
        # type checker cannot see. Declared here as defaulted fields, for mypy only, so that it
        # types `TrainingArguments(save_steps=2)`, `args.save_steps = 3` and
        # `dataclasses.replace(args, save_steps=None)`. The real defaults are the sections';
        # tests/test_args_sections.py checks that these names and types match theirs.
        save_steps: int | None = _FLAT
        save_every_n_rows: int | None = _FLAT
        save_every_n_windows: int | None = _FLAT
        save_every_n_epochs: int | None = _FLAT
        save_every_n_event_seconds: float | None = _FLAT
        save_end: bool = _FLAT
        max_to_keep: int = _FLAT
        save_concurrency_per_rank: int = _FLAT
        model_bank: list[dict[str, Any] | ModelBankSource] | None = _FLAT
        params_not_save: list[str] | None = _FLAT
        save_filter_fn: Callable[[str], bool] | None = _FLAT
        resume_from: str | None = _FLAT
        async_save: bool = _FLAT
        keep_every_n_hours: float | None = _FLAT
        keep_best_metric: str | None = _FLAT
        keep_best_mode: Literal["min", "max"] = _FLAT
        reshard_data_position: ReshardDataPosition = _FLAT
        eval_steps: int | None = _FLAT
        eval_every_n_steps: int | None = _FLAT
        eval_every_n_rows: int | None = _FLAT
        eval_every_n_windows: int | None = _FLAT
        eval_every_n_epochs: int | None = _FLAT
        logging_dir: str | None = _FLAT
        log_steps: int | None = _FLAT
        log_every_n_rows: int | None = _FLAT

    def __post_init__(self) -> None:
        for name in ("train_steps", "window_iter", "max_non_finite_skips"):
            check_int(name, getattr(self, name), allow_none=True)
        for name in ("train_epoch", "gradient_accumulation_steps"):
            check_int(name, getattr(self, name))
        eval_period = self.eval_period
        if eval_period is not None and eval_period.unit in ("steps", "rows") and \
                self.pipeline == "sparse_dist":
            raise ValueError(
                f"`eval_every_n_{eval_period.unit}` evaluates between two steps, which `pipeline` "
                "'sparse_dist' cannot (it holds the next batches in flight); evaluate per window "
                "(`eval_every_n_windows`) or epoch, or use pipeline='none'.")
        check_type("smoke_test", self.smoke_test, (bool,), "true or false")
        check_number("max_grad_norm", self.max_grad_norm, above=0, allow_none=True)
        check_number("collective_timeout_s", self.collective_timeout_s, above=0)
        check_number("preemption_grace_s", self.preemption_grace_s, above=0, allow_none=True)
        check_choice("mixed_precision", self.mixed_precision, ("no", "bf16", "fp16"))
        check_choice("pipeline", self.pipeline, ("none", "sparse_dist"))
        check_choice("non_finite_loss", self.non_finite_loss, ("ignore", "stop", "skip"))
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        if not isinstance(self.output_dir, str) or not self.output_dir:
            fail("output_dir", "a non-empty path string", self.output_dir)
        check_type("seed", self.seed, (int,), "an int")
        for table, st in self.sharding_types.items():
            check_choice(f"sharding_types[{table!r}]", st, SHARDING_TYPES, quote=False)
        self._check_combinations()

    @property
    def log_period(self) -> Period:
        """When periodic reporters report (``log_steps`` or ``log_every_n_rows``)."""
        return self.logging.period

    @property
    def eval_period(self) -> Period | None:
        """When ``train_and_evaluate`` evaluates (None: after each window or epoch, see
        ``eval_every_n_steps``)."""
        return self.eval.period

    def _check_combinations(self) -> None:
        if self.pipeline == "sparse_dist" and self.gradient_accumulation_steps != 1:
            raise ValueError(
                "`pipeline` is 'sparse_dist', which steps the optimizer on every batch; it needs "
                f"`gradient_accumulation_steps` = 1, but that is {self.gradient_accumulation_steps}. "
                "Use pipeline='none' with accumulation."
            )
        if self.pipeline == "sparse_dist" and self.mixed_precision == "fp16":
            raise ValueError(
                "`pipeline` 'sparse_dist' runs backward itself without loss scaling; it cannot be "
                "combined with `mixed_precision` 'fp16'. Use 'bf16' or pipeline='none'."
            )
        if self.pipeline == "sparse_dist" and self.non_finite_loss == "skip":
            raise ValueError(
                "`non_finite_loss` 'skip' decides before backward, which `pipeline` 'sparse_dist' "
                "runs itself; use pipeline='none' to skip non-finite losses."
            )
        if self.max_non_finite_skips is not None and self.non_finite_loss != "skip":
            raise ValueError(
                "`max_non_finite_skips` needs `non_finite_loss` = 'skip', but that is "
                f"{self.non_finite_loss!r}."
            )

    @property
    def local_log_dir(self) -> str:
        """Where hooks write their local files (see ``logging_dir``)."""
        if self.logging.logging_dir is not None:
            return self.logging.logging_dir
        if scheme_of(self.output_dir) in ("", "file"):
            return self.output_dir.split("://", 1)[-1]
        local = os.path.join("logs", *self.output_dir.split("://", 1)[1].strip("/").split("/"))
        logger.warning("output_dir %r is not a local directory: the hooks' files (TensorBoard "
                       "events, metrics.jsonl, profiler traces) go to the local directory %r; set "
                       "`logging_dir` to choose another.", self.output_dir, local)
        return local

    @classmethod
    def config_keys(cls) -> list[str]:
        """Every key YAML ``args`` accepts: the fields (the sections' names included), then the
        flat aliases of the sections' fields."""
        return [f.name for f in dataclasses.fields(cls)] + list(FLAT_ALIASES)

    def to_jsonable(self) -> dict[str, Any]:
        """The settings as JSON-friendly values (callables and other objects by their repr), as
        checkpoints record them (``args.json``): flat, one key per setting, the sections'
        fields by their flat names."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in SECTIONS}
        values.update((name, getattr(getattr(self, section), name))
                      for name, section in FLAT_ALIASES.items())
        out: dict[str, Any] = {}
        for name, v in values.items():
            try:
                json.dumps(v)
                out[name] = v
            except (TypeError, ValueError):
                out[name] = repr(v)
        return out

    def __copy__(self) -> TrainingArguments:
        # A shallow copy would share the section objects (and a flat write to one would show
        # in the other): copy them, as the constructor does.
        return dataclasses.replace(self)


def _section(name: str, cls: type[Any], given: Any, flat: dict[str, Any]) -> Any:
    """Section ``name`` of a new ``TrainingArguments``: a copy of ``given`` (a ``cls``, a
    mapping of its fields, or None for the defaults) with the flat keys ``flat`` applied."""
    if given is None:
        return cls(**flat)
    if isinstance(given, cls):
        return dataclasses.replace(given, **flat)
    if isinstance(given, Mapping):
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in given if k not in allowed)
        if unknown:
            raise ValueError(
                f"unknown key{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(f'`{name}.{k}`' for k in unknown)}; allowed keys in `{name}`: "
                f"{', '.join(allowed)}."
            )
        return cls(**{**given, **flat})
    raise ValueError(f"`{name}` must be {cls.__name__}(...) or a mapping of its fields, but is "
                     f"{given!r}.")


def _accept_flat_keys(cls: type[TrainingArguments]) -> None:
    """Wrap the dataclass ``__init__`` of ``cls`` so that it takes the flat keys too, and add a
    property per flat key (see ``TrainingArguments``)."""
    clash = sorted(set(FLAT_ALIASES) & {f.name for f in dataclasses.fields(cls)})
    if clash:
        raise TypeError(f"TrainingArguments fields {clash} are also section fields")
    dataclass_init = cls.__init__

    def __init__(self: TrainingArguments, **kwargs: Any) -> None:
        flat: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for key in [k for k in kwargs if k in FLAT_ALIASES]:
            flat[FLAT_ALIASES[key]][key] = kwargs.pop(key)
        for section, section_cls in SECTIONS.items():
            kwargs[section] = _section(section, section_cls, kwargs.get(section), flat[section])
        dataclass_init(self, **kwargs)

    # The signature lists the flat keys (after the fields), so that inspect.signature, and the
    # config loader that reads its keys from it, sees every accepted keyword.
    own = list(inspect.signature(dataclass_init).parameters.values())
    fields = {section: {f.name: f for f in dataclasses.fields(c)} for section, c in SECTIONS.items()}
    flat_params = []
    for name, section in FLAT_ALIASES.items():
        f = fields[section][name]
        flat_params.append(inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
            default=f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty))
    __init__.__signature__ = inspect.Signature(own + flat_params)  # type: ignore[attr-defined]
    __init__.__qualname__ = dataclass_init.__qualname__
    __init__.__doc__ = dataclass_init.__doc__
    cls.__init__ = __init__  # type: ignore[method-assign]

    def alias(name: str, section: str) -> property:
        def get(self: TrainingArguments) -> Any:
            return getattr(getattr(self, section), name)

        def set_(self: TrainingArguments, value: Any) -> None:
            setattr(getattr(self, section), name, value)

        return property(get, set_, doc=f"The flat key of ``{section}.{name}``.")

    for name, section in FLAT_ALIASES.items():
        setattr(cls, name, alias(name, section))


_accept_flat_keys(TrainingArguments)
