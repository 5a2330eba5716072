"""The sequence ranking models' batch checks (``DINClassifier``, ``HSTURankingModel``; the
retrieval models' are ``retrieval.checks``'): a candidate of exactly one id per row, a history
of at most ``max_len`` ids, and a value feature (event times) aligned with what it times.

Each names the model in use (``model``). On the CPU a malformed batch is a ``ValueError``
naming the rows at fault and their counts; on any other device an asynchronous device assert
(no host sync per step), whose message is fixed when the step runs, so it names the features
but no row. ``torch.fx`` leaves: TorchRec's ``pipeline="sparse_dist"`` traces the forwards
that call them, and they branch on data.
"""

from __future__ import annotations

import torch

from recsys_trainer.retrieval.checks import rows_at_fault


def check_sequence_lengths(candidate: torch.Tensor, history: torch.Tensor, max_len: int,
                           candidate_feature: str, history_feature: str, *, model: str) -> None:
    """Refuse candidate features without exactly one id per row and histories longer than
    ``max_len``: padding would silently take the first id (or the *oldest* ``max_len`` items).
    ``candidate``/``history``: the features' lengths ``[B]``."""
    ok_c, ok_h = (candidate == 1).all(), (history <= max_len).all()
    if candidate.device.type != "cpu":
        torch._assert_async(ok_c & ok_h, f"{model}: the candidate feature {candidate_feature!r} "
                            "must have exactly one id per row (a null in its column gives none), "
                            f"and the history {history_feature!r} at most max_len={max_len} ids")
        return
    if not bool(ok_c):
        raise ValueError(
            f"{model}'s candidate feature {candidate_feature!r} (the SequenceFeature of that "
            "name, read from its column) must have exactly one id per row; at fault: "
            f"{rows_at_fault(candidate != 1, lambda r: f'{int(candidate[r])} ids')} (a null or "
            "an empty list in its column gives none). Read it from a scalar column "
            "(SequenceFeature on a non-list column) with no nulls, or give the SequenceFeature "
            "a null_id.")
    if not bool(ok_h):
        raise ValueError(
            f"{model}'s history {history_feature!r} must hold at most the model's "
            f"max_len={max_len} ids; at fault: "
            f"{rows_at_fault(history > max_len, lambda r: f'{int(history[r])} ids')}. Give the "
            f"SequenceFeature max_len={max_len} (the reader keeps the most recent ids) or build "
            "the model with a larger max_len.")


def check_value_feature(lengths: torch.Tensor, expected: torch.Tensor, feature: str, what: str,
                        *, model: str) -> None:
    """A value feature (event times) must have as many values per row as ``expected [B]``
    (``what``: what it holds, for the error)."""
    ok = (lengths == expected).all()
    if lengths.device.type != "cpu":
        torch._assert_async(ok, f"{model}: {feature!r} must hold {what}")
        return
    if not bool(ok):
        def counts(r: int) -> str:
            return f"{int(lengths[r])} values, needs {int(expected[r])}"

        raise ValueError(
            f"{model}'s {feature!r} holds {what}; at fault: "
            f"{rows_at_fault(lengths != expected, counts)}. Write it with the history (one time "
            "per history item, the same max_len) or one per row for the query time.")


for _leaf in ("check_sequence_lengths", "check_value_feature"):
    torch.fx.wrap(_leaf)


__all__ = ["check_sequence_lengths", "check_value_feature"]
