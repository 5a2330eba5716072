"""The retrieval models' input checks: ``torch.fx`` leaves (TorchRec's ``pipeline="sparse_dist"``
traces the model's forward, and these branch on data).

Each check refuses a malformed batch with a ``ValueError`` naming the row on the CPU, and with
an asynchronous device assert (no host sync) on any other device.

``torch.fx.wrap`` patches the function in the globals of the module that calls it: a module
that calls these by name (``models.retrieval_base``, ``models.sasrec``, ...) registers them again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

SHOWN_ROWS = 5
"""How many rows at fault an error lists (then how many more there are)."""


def rows_at_fault(bad: torch.Tensor, describe: Callable[[int], str]) -> str:
    """The batch rows where ``bad [B]`` holds, each with ``describe(row)``: "batch row 3 (0
    ids)", or "batch rows 3 (0 ids), 7 (2 ids) and 12 more": what a host-side check's error
    names, so that a user finds the rows at fault and their values, not the first one only."""
    rows = torch.nonzero(bad).flatten().tolist()
    shown = ", ".join(f"{r} ({describe(r)})" for r in rows[:SHOWN_ROWS])
    more = f" and {len(rows) - SHOWN_ROWS} more" if len(rows) > SHOWN_ROWS else ""
    return f"batch row{'s' if len(rows) > 1 else ''} {shown}{more}"


def check_one_id_per_row(lengths: torch.Tensor, feature: str) -> None:
    """Refuse a target feature without exactly one id per row (CPU: naming the row; any other
    device: an asynchronous device assert, no host sync)."""
    ok = (lengths == 1).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "the target item feature must have exactly one id per row")
        return
    if not bool(ok):
        raise ValueError(
            f"the target item feature {feature!r} must have exactly one id per row; at fault: "
            f"{rows_at_fault(lengths != 1, lambda r: f'{int(lengths[r])} ids')}. Read it from a "
            "scalar column with no nulls.")


def check_history_lengths(lengths: torch.Tensor, max_len: int, feature: str) -> None:
    """Refuse histories longer than the model's ``max_len`` (padding would keep the oldest)."""
    ok = (lengths <= max_len).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "a history is longer than the model's max_len")
        return
    if not bool(ok):
        raise ValueError(
            f"a {feature!r} history must hold at most the model's max_len={max_len} ids; at "
            f"fault: {rows_at_fault(lengths > max_len, lambda r: f'{int(lengths[r])} ids')}. "
            f"Give the SequenceFeature max_len={max_len} (the reader keeps the most recent ids) "
            "or build the model with a larger max_len.")


def check_aligned_history(side_lengths: torch.Tensor, lengths: torch.Tensor, feature: str,
                          history_feature: str) -> None:
    """A history side feature must hold one id per history item (its i-th id is the i-th
    item's): refuse a row where the two lengths differ."""
    ok = (side_lengths == lengths).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "a history side feature is not as long as the history")
        return
    if not bool(ok):
        def counts(r: int) -> str:
            return (f"{int(side_lengths[r])} {feature!r} ids, {int(lengths[r])} "
                    f"{history_feature!r} items")

        raise ValueError(
            f"a history side feature holds one id per history item, in the same order; at "
            f"fault: {rows_at_fault(side_lengths != lengths, counts)}. Write them together and "
            "give both SequenceFeatures the same max_len.")


def check_sequence_keys(sequence: KeyedJaggedTensor | None, expected: list[str], model: str) -> None:
    """The batch's sequence keys must be the model's (``model``: its name, for the error), in
    its order: a sharded table fixes its feature order at its first input, the model's own
    lookups (negatives, the corpus) use this order, and the value features (event times) are
    the keys after the tables'."""
    if sequence is None:
        raise ValueError(
            f"{model} reads batch.sequence (keys {expected}), but the batch has none: "
            "declare them as FeatureSpec(sequence=[SequenceFeature(...), ...]).")
    keys = list(sequence.keys())
    if keys != expected:
        missing = [k for k in expected if k not in keys]
        extra = [k for k in keys if k not in expected]
        what = (f"lacks {missing}" if missing else "") + (" and " if missing and extra else "") + (
            f"has {extra}, which it does not read" if extra else "")
        raise ValueError(
            f"batch.sequence has keys {keys}, but {model} reads {expected} in this order "
            f"(the batch {what or 'has them in another order'}): declare "
            f"FeatureSpec(sequence=[...]) in the order {expected}.")


for _leaf in ("check_one_id_per_row", "check_history_lengths", "check_aligned_history",
              "check_sequence_keys"):
    torch.fx.wrap(_leaf)


__all__ = [
    "SHOWN_ROWS",
    "check_aligned_history",
    "check_history_lengths",
    "check_one_id_per_row",
    "check_sequence_keys",
    "rows_at_fault",
]
