import os
import sys

import pytest

# Tests import tests/dist_utils.py as a top-level module; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _tier(request: pytest.FixtureRequest) -> None:
    """Only tests marked ``distributed`` may start process groups (see ``dist_utils``)."""
    import dist_utils

    dist_utils.current_test_is_distributed = request.node.get_closest_marker("distributed") is not None
