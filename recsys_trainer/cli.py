"""``recsys-train``: run a YAML config, one process or under ``torchrun`` (one or many nodes).

    recsys-train CONFIG.yaml [--section.key VALUE ...] [--print-config]
    python -m recsys_trainer CONFIG.yaml --args.train_steps 100
    torchrun --nproc_per_node=2 -m recsys_trainer CONFIG.yaml
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST0:29400 \\
        --rdzv_id=job1 -m recsys_trainer CONFIG.yaml

Overrides use the config's dotted keys with YAML typing (``--args.train_steps 100``,
``--dense_optimizer.lr=1e-3``, ``--hooks "[metrics, jsonl]"``). The config is validated before
the process group starts, so a bad key fails fast, on every rank alike, with exit status 2 and a
message naming the key and what is allowed. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from recsys_trainer.config import (
    ConfigError,
    RunConfig,
    SyntheticDataConfig,
    config_to_dict,
    load_config,
)

USAGE = "recsys-train [-h] [--print-config] CONFIG [--section.key VALUE ...]"


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
        from recsys_trainer.data.synthetic import PlantedSignal, synthetic_batches

        m = cfg.model
        assert isinstance(m.sparse_features, list) and isinstance(m.num_embeddings, int)
        assert m.num_dense is not None
        signal = PlantedSignal.make(len(m.sparse_features), m.num_dense, m.num_embeddings,
                                    seed=d.signal_seed, strength=d.signal_strength)

        def make(n: int, seed: int) -> Any:
            return synthetic_batches(n, d.batch_size, m.sparse_features, m.num_dense,  # type: ignore[arg-type]
                                     m.num_embeddings, seed=seed, signal=signal)  # type: ignore[arg-type]

        train = make(d.train_batches, d.seed + rank)
        held_out = make(d.eval_batches, d.seed + 10_000 + rank) if d.eval_batches else None
        return train, held_out
    return d.build("train"), d.build("eval")


def run(cfg: RunConfig) -> dict[str, Any]:
    """Build the Trainer from ``cfg`` and run ``cfg.run``; returns a summary of what ran.

    Must be called on every rank. The caller ends the job (``recsys_trainer.shutdown()``).
    """
    import torch.distributed as dist

    from recsys_trainer.distributed import init_distributed
    from recsys_trainer.trainer import Trainer

    needs = {"train": ("train",), "evaluate": ("eval",), "train_and_evaluate": ("train", "eval"),
             "predict": ("eval",)}
    # Start the group first: the datasets are per rank.
    init_distributed(cfg.args.device, cfg.args.collective_timeout_s)
    rank = dist.get_rank()
    train, held_out = build_datasets(cfg, rank)
    for which in needs[cfg.run]:
        if (train if which == "train" else held_out) is None:
            key = "data.train_batches" if isinstance(cfg.data, SyntheticDataConfig) else f"data.{which}"
            if which == "eval" and isinstance(cfg.data, SyntheticDataConfig):
                key = "data.eval_batches"
            raise ConfigError(f"`run: {cfg.run}` needs {which} data; set `{key}`.")
    trainer = Trainer(
        model=cfg.model.build(),
        args=cfg.args,
        train_dataset=train,
        eval_dataset=held_out,
        hooks=[h.build(i) for i, h in enumerate(cfg.hooks)],
        dense_optimizers=(cfg.dense_optimizer.factory(), None),
        sparse_optimizer=cfg.sparse_optimizer,
        table_optimizers=cfg.table_optimizers,
    )
    metrics: dict[str, float] | None = None
    predicted: int | None = None
    if cfg.run == "train":
        trainer.train()
    elif cfg.run in ("evaluate", "predict"):
        # Evaluate (or score) a trained model: the checkpoint `args.resume_from` names ("auto":
        # the newest committed one in output_dir), loaded on every rank as a resumed training would.
        trainer.resume()
        if trainer.state.global_step == 0 and trainer.is_rank_zero:
            logging.getLogger("recsys_trainer").warning(
                "run: %s found no checkpoint to load (args.resume_from=%r, output_dir=%r): "
                "using an untrained model.", cfg.run, cfg.args.resume_from, cfg.args.output_dir)
        if cfg.run == "evaluate":
            metrics = trainer.evaluate()
        else:
            assert cfg.predict is not None
            p = cfg.predict
            predicted = trainer.predict(held_out, p.output_dir, activation=p.activation,
                                        output_names=p.output_names,
                                        rows_per_row_group=p.rows_per_row_group).rows_written
    else:
        trainer.train_and_evaluate()
    st = trainer.state
    return {
        "rank": trainer.rank,
        "world_size": trainer.world_size,
        "global_step": st.global_step,
        "epoch": st.epoch,
        "stop_reason": st.stop_reason,
        "eval": metrics,
        "predicted_rows": predicted,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The console entry point; returns the exit status (0 ok, 2 config error)."""
    ns, overrides = parse_argv(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(ns.config, overrides)
    except ConfigError as exc:
        print(f"recsys-train: config error: {exc}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
        return 0

    from recsys_trainer.distributed import shutdown
    from recsys_trainer.trainer import setup_logging

    setup_logging()
    try:
        summary = run(cfg)
    except ConfigError as exc:
        # Raised identically on every rank before any collective: safe to just exit.
        print(f"recsys-train: config error: {exc}", file=sys.stderr)
        return 2
    # One line per rank (torchrun prefixes nothing by default): lets a launcher check that every
    # rank trained the same number of steps.
    print(
        f"recsys-train: rank {summary['rank']}/{summary['world_size']} done: "
        f"global_step={summary['global_step']} epoch={summary['epoch']} "
        f"stop_reason={summary['stop_reason']!r}"
        + (f" eval={summary['eval']}" if summary["eval"] is not None else "")
        + (f" predicted_rows={summary['predicted_rows']}" if summary["predicted_rows"] is not None else ""),
        flush=True,
    )
    # Success path only: barrier + destroy. On an exception we exit non-zero and let torchrun
    # tear the job down (destroying a group while peers sit in a collective can deadlock).
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
