"""Moved to ``recsys_trainer.data.generators.interactions_synthetic`` (the data generators
live apart from the reader). This path keeps working: it re-exports the module's public names,
and ``python -m recsys_trainer.data.interactions_synthetic`` still runs it."""

from recsys_trainer.data.generators.interactions_synthetic import (
    INTEREST_WEIGHTS,
    InteractionSignal,
    ensure_dataset,
    generate_window,
    interaction_features,
    main,
    oracle_metrics,
    oracle_ranks,
    write_dataset,
)

__all__ = [
    "INTEREST_WEIGHTS",
    "InteractionSignal",
    "ensure_dataset",
    "generate_window",
    "interaction_features",
    "main",
    "oracle_metrics",
    "oracle_ranks",
    "write_dataset",
]

if __name__ == "__main__":
    main()
