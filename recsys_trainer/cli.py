"""``recsys-train``: run a YAML config, one process or under ``torchrun`` (one or many nodes).

    recsys-train CONFIG.yaml [--section.key VALUE ...] [--print-config] [--smoke]
    python -m recsys_trainer CONFIG.yaml --args.train_steps 100
    torchrun --nproc_per_node=2 -m recsys_trainer CONFIG.yaml
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST0:29400 \\
        --rdzv_id=job1 -m recsys_trainer CONFIG.yaml

Overrides use the config's dotted keys with YAML typing (``--args.train_steps 100``,
``--dense_optimizer.lr=1e-3``, ``--hooks "[metrics, jsonl]"``). The config is validated before
the process group starts, so a bad key fails fast, on every rank alike, with exit status 2 and a
message naming the key and what is allowed; that includes every ``class:`` import path (module,
attribute, arguments). ``--smoke`` runs the test mode (``recsys_trainer.smoke``): a couple of
train steps, one eval batch, a checkpoint save and a resume, in a temporary directory; exit status
0, or 1 with the phase that failed. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from recsys_trainer.checkpoint import layout
from recsys_trainer.config import (
    ClassDataConfig,
    ConfigError,
    RunConfig,
    SyntheticDataConfig,
    config_to_dict,
    load_config,
)
from recsys_trainer.serving.exporting.export import export_delta, export_for_serving

USAGE = "recsys-train [-h] [--print-config] [--smoke] CONFIG [--section.key VALUE ...]"


def parse_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[tuple[str, str]]]:
    """Split the command line into the CLI's own options and ``(dotted_key, value)`` overrides.

    An override is ``--a.b VALUE`` or ``--a.b=VALUE``; a top-level key works too (``--run
    train``). Anything else that starts with ``--`` is an error.
    """
    parser = argparse.ArgumentParser(
        prog="recsys-train", usage=USAGE, description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", nargs="?", help="the YAML config file")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (after overrides and defaults) and exit")
    parser.add_argument("--smoke", action="store_true",
                        help="test mode: a couple of train steps, one eval batch, a checkpoint save "
                             "and a resume, in a temporary directory (not output_dir); exit 0 or 1")
    ns, rest = parser.parse_known_args(list(argv))
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("--") or len(tok) == 2:
            parser.error(f"unexpected argument {tok!r}; overrides look like `--args.train_steps 100`.")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                parser.error(f"override `--{key}` needs a value.")
            value = rest[i + 1]
            i += 1
        overrides.append((key, value))
        i += 1
    if ns.config is None and not overrides:
        parser.error("a CONFIG file is required (or give every section as overrides).")
    return ns, overrides


def build_datasets(cfg: RunConfig, rank: int) -> tuple[Any, Any]:
    """This rank's train and eval datasets for the configured data."""
    d = cfg.data
    if isinstance(d, SyntheticDataConfig):
        from recsys_trainer.data.generators.synthetic import PlantedSignal, synthetic_batches

        features, num_dense, rows = cfg.synthetic_schema()
        signal = PlantedSignal.make(len(features), num_dense, rows, seed=d.signal_seed,
                                    strength=d.signal_strength)

        def make(n: int, seed: int) -> Any:
            return synthetic_batches(n, d.batch_size, features, num_dense, rows, seed=seed,
                                     signal=signal)

        train = make(d.train_batches, d.seed + rank)
        held_out = make(d.eval_batches, d.seed + 10_000 + rank) if d.eval_batches else None
        return train, held_out
    return d.datasets()


def _data_key(cfg: RunConfig, which: str) -> str:
    """The config key that supplies ``which`` ("train"/"eval") data, for messages."""
    if isinstance(cfg.data, SyntheticDataConfig):
        return "data.train_batches" if which == "train" else "data.eval_batches"
    if isinstance(cfg.data, ClassDataConfig):
        return f"data.{which}_args"
    return f"data.{which}"


def build_trainer(cfg: RunConfig, needs: Sequence[str] = ()) -> Any:
    """The ``Trainer`` of ``cfg`` on this rank. ``needs``: the datasets ("train", "eval") the
    run mode cannot do without.

    The placement first (process group, device, seed; once, for everything built after it): the
    datasets are per rank, and the model's dense layers are initialised in its constructor, from
    ``args.seed`` (a dataset by ``class`` may draw too)."""
    from recsys_trainer.placement import place
    from recsys_trainer.trainer import Trainer

    placement = place(cfg.args)
    train, held_out = build_datasets(cfg, placement.rank)
    for which in needs:
        if (train if which == "train" else held_out) is None:
            raise ConfigError(f"`run: {cfg.run}` needs {which} data; set `{_data_key(cfg, which)}`.")
    return Trainer(
        model=cfg.model.build(),
        args=cfg.args,
        train_dataset=train,
        eval_dataset=held_out,
        hooks=[h.build(i) for i, h in enumerate(cfg.hooks)],
        dense_optimizers=(cfg.dense_optimizer.factory(),
                          cfg.lr_scheduler.factory() if cfg.lr_scheduler is not None else None),
        sparse_optimizer=cfg.sparse_optimizer,
        table_optimizers=cfg.table_optimizers,
        placement=placement,
    )


RunResult = dict[str, Any]
"""What a run mode adds to the run's summary (``eval`` metrics, ``predicted_rows``)."""


def _train(trainer: Any, cfg: RunConfig) -> RunResult:
    trainer.train()
    return {}


def _load_trained(trainer: Any, cfg: RunConfig) -> None:
    # Evaluate or score a trained model: the checkpoint `args.resume_from` names ("auto": the
    # newest committed one in output_dir that verifies). Only the model and what it needs: the
    # data section may differ from training's (eval data, batch size, passthrough columns).
    trainer.resume(mode="scoring")
    if trainer.state.global_step == 0 and trainer.is_rank_zero and not cfg.args.smoke_test:
        logging.getLogger("recsys_trainer").warning(
            "run: %s found no checkpoint to load (args.resume_from=%r, output_dir=%r): "
            "using an untrained model.", cfg.run, cfg.args.resume_from, cfg.args.output_dir)


def _evaluate(trainer: Any, cfg: RunConfig) -> RunResult:
    _load_trained(trainer, cfg)
    return {"eval": trainer.evaluate()}


def _predict(trainer: Any, cfg: RunConfig) -> RunResult:
    _load_trained(trainer, cfg)
    p = cfg.predict
    assert p is not None  # RunConfig.from_dict refuses `run: predict` without the section
    summary = trainer.predict(trainer.eval_dataset, p.output_dir, activation=p.activation,
                              output_names=p.output_names, rows_per_row_group=p.rows_per_row_group)
    return {"predicted_rows": summary.rows_written}


def _export(trainer: Any, cfg: RunConfig) -> RunResult:
    # The checkpoint args.resume_from names, as evaluate/predict load it; exported from the
    # checkpoint itself (the live model gives the tables' layout, the data section the spec).
    _load_trained(trainer, cfg)
    if trainer.state.global_step == 0:
        raise ConfigError(f"`run: export` found no checkpoint to export (args.resume_from="
                          f"{cfg.args.resume_from!r}, output_dir={cfg.args.output_dir!r}).")
    where = cfg.args.resume_from
    ckpt = layout.resolve_checkpoint(cfg.args.output_dir if where in (None, "auto") else where,
                                     "`args.resume_from`").path
    e = cfg.export
    assert e is not None  # RunConfig.from_dict refuses `run: export` without the section
    if e.delta_from is not None:
        summary = export_delta(trainer, e.delta_from, e.output_dir, full_out_dir=e.full_output_dir,
                               output_names=e.output_names, activation=e.activation,
                               quantize=e.quantize, checkpoint=ckpt)
    else:
        summary = export_for_serving(trainer, e.output_dir, aot_inductor=e.aot_inductor,
                                     output_names=e.output_names, activation=e.activation,
                                     quantize=e.quantize, checkpoint=ckpt)
    return {"exported": summary.content_hash}


def _train_and_evaluate(trainer: Any, cfg: RunConfig) -> RunResult:
    trainer.train_and_evaluate()
    return {}


RUNNERS: dict[str, tuple[tuple[str, ...], Callable[[Any, RunConfig], RunResult]]] = {
    "train": (("train",), _train),
    "evaluate": (("eval",), _evaluate),
    "train_and_evaluate": (("train", "eval"), _train_and_evaluate),
    "predict": (("eval",), _predict),
    "export": ((), _export),
}
"""Run mode -> (the datasets it needs, what it calls on the built Trainer; returns what it adds
to the summary). A new mode adds an entry here and its name to ``config.RUN_MODES``."""


def run(cfg: RunConfig) -> dict[str, Any]:
    """Build the Trainer from ``cfg`` and run ``cfg.run``; returns a summary of what ran.

    Must be called on every rank. The caller ends the job (``recsys_trainer.shutdown()``).
    """
    needs, runner = RUNNERS[cfg.run]
    trainer = build_trainer(cfg, needs)
    result = runner(trainer, cfg)
    st = trainer.state
    return {
        "rank": trainer.rank,
        "world_size": trainer.world_size,
        "global_step": st.global_step,
        "epoch": st.epoch,
        "stop_reason": st.stop_reason,
        "eval": result.get("eval"),
        "predicted_rows": result.get("predicted_rows"),
        "exported": result.get("exported"),
        "smoke": trainer.smoke.report if trainer.smoke is not None else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point; returns the exit status (0 ok, 2 config error, 128 + signal
    after a preemption signal stopped training: 143 for SIGTERM, 130 for SIGINT)."""
    ns, overrides = parse_argv(sys.argv[1:] if argv is None else argv)
    if ns.smoke:
        overrides.append(("args.smoke_test", "true"))
    try:
        cfg = load_config(ns.config, overrides)
    except ConfigError as exc:
        print(f"recsys-train: config error: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0

    from recsys_trainer.distributed import shutdown
    from recsys_trainer.logs import setup_logging
    from recsys_trainer.preemption import Preempted

    setup_logging()
    try:
        summary = run(cfg)
    except Preempted as exc:
        # Every rank stopped after the same step and saved it (or says why not); a rerun of
        # the same command resumes there. No shutdown(): the ranks leave together anyway.
        print(f"recsys-train: rank {os.environ.get('RANK', '0')}: {exc}", file=sys.stderr,
              flush=True)
        return int(exc.preemption.exit_code)
    except ConfigError as exc:
        # Raised identically on every rank before any collective: safe to just exit.
        print(f"recsys-train: config error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not cfg.args.smoke_test:
            raise
        # SmokeTestError names its phase; anything earlier failed while building the Trainer.
        phase = getattr(exc, "phase", "build")
        logging.getLogger("recsys_trainer").error("smoke test failed", exc_info=exc)
        print(f"recsys-train: smoke test FAILED in phase {phase!r}: "
              f"{type(exc.__cause__ or exc).__name__}: {exc.__cause__ or exc}", file=sys.stderr)
        return 1
    if summary["smoke"] is not None:
        print(f"recsys-train: rank {summary['rank']}/{summary['world_size']} smoke test passed: "
              f"{summary['smoke']}", flush=True)
    # One line per rank (torchrun prefixes nothing by default): lets a launcher check that every
    # rank trained the same number of steps.
    print(
        f"recsys-train: rank {summary['rank']}/{summary['world_size']} done: "
        f"global_step={summary['global_step']} epoch={summary['epoch']} "
        f"stop_reason={summary['stop_reason']!r}"
        + (f" eval={summary['eval']}" if summary["eval"] is not None else "")
        + (f" predicted_rows={summary['predicted_rows']}" if summary["predicted_rows"] is not None else "")
        + (f" exported={summary['exported']}" if summary["exported"] is not None else ""),
        flush=True,
    )
    # Success path only: barrier + destroy. On an exception we exit non-zero and let torchrun
    # tear the job down (destroying a group while peers sit in a collective can deadlock).
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
