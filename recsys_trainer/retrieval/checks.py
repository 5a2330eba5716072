"""The retrieval models' input checks: ``torch.fx`` leaves (TorchRec's ``pipeline="sparse_dist"``
traces the model's forward, and these branch on data).

Each check refuses a malformed batch with a ``ValueError`` naming the row on the CPU, and with
an asynchronous device assert (no host sync) on any other device.

``torch.fx.wrap`` patches the function in the globals of the module that calls it: a module
that calls these by name (``models.retrieval_base``, ``models.sasrec``, ...) registers them again.
"""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def check_one_id_per_row(lengths: torch.Tensor, feature: str) -> None:
    """Refuse a target feature without exactly one id per row (CPU: naming the row; any other
    device: an asynchronous device assert, no host sync)."""
    ok = (lengths == 1).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "the target item feature must have exactly one id per row")
        return
    if not bool(ok):
        row = int(torch.nonzero(lengths != 1)[0, 0])
        raise ValueError(
            f"the target item feature {feature!r} must have exactly one id per row, but row {row} "
            f"of the batch has {int(lengths[row])}. Read it from a scalar column with no nulls.")


def check_history_lengths(lengths: torch.Tensor, max_len: int, feature: str) -> None:
    """Refuse histories longer than the model's ``max_len`` (padding would keep the oldest)."""
    ok = (lengths <= max_len).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "a history is longer than the model's max_len")
        return
    if not bool(ok):
        row = int(torch.nonzero(lengths > max_len)[0, 0])
        raise ValueError(
            f"row {row} of the batch has a {feature!r} history of {int(lengths[row])} ids, more "
            f"than the model's max_len={max_len}. Give the SequenceFeature max_len={max_len} "
            "(the reader keeps the most recent ids) or build the model with a larger max_len.")


def check_aligned_history(side_lengths: torch.Tensor, lengths: torch.Tensor, feature: str,
                          history_feature: str) -> None:
    """A history side feature must hold one id per history item (its i-th id is the i-th
    item's): refuse a row where the two lengths differ."""
    ok = (side_lengths == lengths).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, "a history side feature is not as long as the history")
        return
    if not bool(ok):
        row = int(torch.nonzero(side_lengths != lengths)[0, 0])
        raise ValueError(
            f"row {row} of the batch has {int(side_lengths[row])} {feature!r} ids but "
            f"{int(lengths[row])} {history_feature!r} items: a history side feature holds one id "
            f"per history item, in the same order. Write them together and give both "
            "SequenceFeatures the same max_len.")


def check_sequence_keys(sequence: KeyedJaggedTensor | None, expected: list[str]) -> None:
    """The batch's sequence keys must be the model's, in its order: a sharded table fixes its
    feature order at its first input, and the model's own lookups (negatives, the corpus) use
    this order."""
    if sequence is None:
        raise ValueError(
            f"this retrieval model reads batch.sequence (keys {expected}), but the batch has none: "
            "declare them as FeatureSpec(sequence=[SequenceFeature(...), ...]).")
    if list(sequence.keys()) != expected:
        raise ValueError(
            f"batch.sequence has keys {list(sequence.keys())}, but the model reads {expected} in "
            f"this order: declare FeatureSpec(sequence=[...]) in the order {expected}.")


for _leaf in ("check_one_id_per_row", "check_history_lengths", "check_aligned_history",
              "check_sequence_keys"):
    torch.fx.wrap(_leaf)


__all__ = [
    "check_aligned_history",
    "check_history_lengths",
    "check_one_id_per_row",
    "check_sequence_keys",
]
