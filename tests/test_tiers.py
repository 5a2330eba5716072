"""The test tiers: the fast tier (``-m "not distributed and not gpu"``) never starts processes."""

from __future__ import annotations

import pytest
from dist_utils import run_distributed


def _never_called() -> None:
    raise AssertionError("no rank should have started")


def test_a_test_not_marked_distributed_cannot_start_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"mark the test @pytest.mark.distributed"):
        run_distributed(_never_called, world_size=2, timeout_s=5)
