"""Build a Trainer's components once: ``build_trainer_parts`` (the builder) and ``TrainerParts``.

``Trainer(model=..., args=..., ...)`` calls the builder; ``recsys-train`` calls ``place`` first
(before its datasets and model exist) and hands the ``Placement`` in; a Python user who wants
to inspect or replace a component calls the builder and then ``Trainer.from_parts(parts)``.
Every component receives the one ``Placement``; nothing here starts a group, resolves the
device or resolves the table optimizers a second time. (The one deliberate re-seed: where the
caller placed the job first and built things in between, the tables still materialise from
``args.seed``, so a seed gives the same tables from Python and from ``recsys-train``.)

The order matters and is the order below: the placement (group, device, seed) before the
tables are materialised by sharding; the test-mode settings (``args.smoke_test``) before
anything reads ``args``; the datasets' shard before the vocabularies attach to them; the hooks
before the checkpoint manager (whose ``CheckpointHook`` runs after all of them).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

from recsys_trainer import dynamic
from recsys_trainer.args import TrainingArguments
from recsys_trainer.checkpoint.manager import CheckpointManager
from recsys_trainer.data.base import WindowedDataset, as_windowed
from recsys_trainer.data.batch_check import BatchCheck
from recsys_trainer.data.spec import apply_model_to_specs
from recsys_trainer.data.vocab import Vocabularies
from recsys_trainer.distributed import Gang
from recsys_trainer.hooks.base import Hook, HookList
from recsys_trainer.hooks.dynamic_tables import DynamicTableStatsHook
from recsys_trainer.hooks.logger import LoggerHook
from recsys_trainer.optimizers import (
    DenseOptimizerArg,
    SchedulerArg,
    SparseDenseOptimizer,
    SparseOptimizer,
    TableOptimizers,
    build_dense_optimizer,
    build_lr_scheduler,
)
from recsys_trainer.placement import Placement, place
from recsys_trainer.precision import Precision
from recsys_trainer.rng import seed_everything
from recsys_trainer.sharding import build_sharded_model
from recsys_trainer.smoke import SmokeTest
from recsys_trainer.step import DenseStep, NonFiniteGuard, StepTimings

P = ParamSpec("P")
SelfT = TypeVar("SelfT")


@dataclass
class TrainerParts:
    """Everything a ``Trainer`` runs with, built once by ``build_trainer_parts``."""

    args: TrainingArguments
    """The run's settings (in test mode, the smoke test's: its directories, a few steps)."""
    placement: Placement
    model: nn.Module
    """The sharded model (``DistributedModelParallel``)."""
    sparse_optimizer: SparseOptimizer
    table_optimizers: dict[str, SparseOptimizer]
    """``{table: SparseOptimizer}``: the fused optimizer every embedding table trains with."""
    optimizer: SparseDenseOptimizer
    lr_scheduler: Any
    dense_params: list[nn.Parameter]
    precision: Precision
    dense_step: DenseStep
    timings: StepTimings
    non_finite: NonFiniteGuard
    batch_check: BatchCheck
    train_dataset: WindowedDataset | None
    eval_dataset: WindowedDataset | None
    vocabularies: Vocabularies
    hooks: HookList
    checkpointer: CheckpointManager
    smoke: SmokeTest | None


def build_trainer_parts(
    model: nn.Module,
    args: TrainingArguments | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    hooks: Sequence[Hook] | None = None,
    dense_optimizers: tuple[DenseOptimizerArg, SchedulerArg] | None = None,
    sparse_optimizer: SparseOptimizer | None = None,
    *,
    table_optimizers: TableOptimizers | None = None,
    add_logger_hook: bool = True,
    gang: Gang | None = None,
    checkpointer: CheckpointManager | None = None,
    placement: Placement | None = None,
) -> TrainerParts:
    """Build every component of a Trainer (the arguments are ``Trainer``'s); all ranks call this
    together. ``placement``: from ``place(args)``, when the caller started the job already
    (``recsys-train``); otherwise this calls it."""
    args = args if args is not None else TrainingArguments()
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"`args` must be a TrainingArguments, got {type(args).__name__}.")
    given = placement is not None
    if placement is None:
        placement = place(args, gang)
    smoke = SmokeTest(args, placement.gang) if args.smoke_test else None
    if smoke is not None:
        args = smoke.args
        checkpointer = None  # a given one saves into its own output_dir: never in test mode
        for h in (h for h in hooks or [] if isinstance(h, Hook)):
            h.in_smoke_test(smoke.output_dir)  # e.g. a PublishHook: never the real location

    sparse_spec = sparse_optimizer or SparseOptimizer()
    apply_model_to_specs((train_dataset, eval_dataset), label_range=getattr(model, "label_range", None),
                         row_id_features=getattr(model, "row_id_features", ()))
    precision = Precision(args.mixed_precision, cuda=placement.is_cuda,
                          gradient_accumulation_steps=args.gradient_accumulation_steps)
    if given:
        # The tables materialise from args.seed whatever the caller drew since place() (the CLI
        # builds its datasets and model in between): the same seed gives the same tables from
        # Python and from recsys-train, as before the placement existed.
        seed_everything(args.seed)
    built = build_sharded_model(
        model, (train_dataset, eval_dataset), sparse_spec, table_optimizers, placement.device,
        process_group=placement.process_group, sharding_types=args.sharding_types,
        local_world_size=placement.local_world_size,
        static_graph=args.gradient_accumulation_steps == 1,
    )
    sharded, chosen = built.model, built.table_optimizers
    batch_check = BatchCheck(built.pooled_features, built.sequence_features)
    if dense_optimizers is None:
        dense_optimizers = (lambda params: torch.optim.Adam(params, lr=1e-3), None)
    dense_arg, sched_arg = dense_optimizers
    dense_opt, dense_named = build_dense_optimizer(sharded, dense_arg)
    dense_params = [p for _, p in dense_named]
    optimizer = SparseDenseOptimizer(dense_opt, dense_named, sharded.fused_optimizer)
    lr_scheduler = build_lr_scheduler(sched_arg, dense_opt)
    precision.prepare_model(sharded)
    timings = StepTimings()
    dense_step = DenseStep(
        dense_opt, dense_params, precision, accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm, lr_scheduler=lr_scheduler, timings=timings,
    )

    train_ds, eval_ds = as_windowed(train_dataset), as_windowed(eval_dataset)
    vocabularies = Vocabularies(placement.gang)
    for ds in (train_ds, eval_ds):
        if ds is not None:
            ds.setup(placement.rank, placement.world_size)
            ds.set_gang(placement.gang)  # e.g. rank 0 lists the windows for every rank
            ds.follow_id_kinds(train_ds)  # eval reads ids as training does
    for name, ds in (("train_dataset", train_ds), ("eval_dataset", eval_ds)):
        if ds is not None:
            vocabularies.attach(ds, name)

    # Attached by the Trainer on every rank (the default creates its own gloo group: a
    # collective). It resumes, saves on the configured triggers, and serves save/load_checkpoint.
    manager = checkpointer if checkpointer is not None else CheckpointManager.from_args(args)
    return TrainerParts(
        args=args, placement=placement, model=sharded, sparse_optimizer=sparse_spec,
        table_optimizers=chosen, optimizer=optimizer, lr_scheduler=lr_scheduler,
        dense_params=dense_params, precision=precision, dense_step=dense_step, timings=timings,
        non_finite=NonFiniteGuard(args.non_finite_loss, args.max_non_finite_skips),
        batch_check=batch_check, train_dataset=train_ds, eval_dataset=eval_ds,
        vocabularies=vocabularies, hooks=_hook_list(sharded, hooks, add_logger_hook),
        checkpointer=manager, smoke=smoke,
    )


def takes_arguments_of(
    build: Callable[P, Any],
) -> Callable[[Callable[Concatenate[SelfT, ...], None]], Callable[Concatenate[SelfT, P], None]]:
    """Decorate an ``__init__(self, *args, **kwargs)`` that hands its arguments to ``build``
    (``build_trainer_parts``): its signature is then ``build``'s, for type checkers (the
    ``ParamSpec``), ``inspect.signature`` and ``help()``, and arguments ``build`` does not take
    are refused naming the ``__init__``. So the arguments are written once, on ``build``."""
    signature = inspect.signature(build)

    def decorate(
        init: Callable[Concatenate[SelfT, ...], None],
    ) -> Callable[Concatenate[SelfT, P], None]:
        @functools.wraps(init)
        def checked(self: SelfT, *args: Any, **kwargs: Any) -> None:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{init.__qualname__}(): {exc}") from None
            init(self, *args, **kwargs)

        self_param = next(iter(inspect.signature(init).parameters.values()))
        checked.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[self_param, *signature.parameters.values()],
            return_annotation=inspect.Signature.empty)
        return checked

    return decorate


def _hook_list(model: nn.Module, hooks: Sequence[Hook] | None, add_logger_hook: bool) -> HookList:
    """The user's hooks, a ``LoggerHook`` first unless there is one or it is turned off, and the
    dynamic tables' report first of all where the model has such tables. (The Trainer pins the
    ``CheckpointHook`` of whatever ``checkpointer`` it is given after all of them.)"""
    user_hooks = list(hooks or [])
    if add_logger_hook and not any(isinstance(h, LoggerHook) for h in user_hooks):
        user_hooks.insert(0, LoggerHook())
    if dynamic.dynamic_table_names(model) and not any(
        isinstance(h, DynamicTableStatsHook) for h in user_hooks
    ):
        # Placed first so reporting hooks after it see its window report.
        user_hooks.insert(0, DynamicTableStatsHook())
    return HookList(user_hooks)


__all__ = ["TrainerParts", "build_trainer_parts", "takes_arguments_of"]
