import os
import sys

import pytest
from hypothesis import settings

# A shared 2-core machine stalls single examples for seconds at times: no per-example deadline.
settings.register_profile("resurgo", deadline=None)
settings.load_profile("resurgo")

# Tests import helper scripts from tests/scripts.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture(autouse=True)
def no_save_left_behind():
    """An asynchronous save a test left in flight ends with the test (its error, if any, is the test's)."""
    yield
    from resurgo.pipeline import inflight

    try:
        inflight.settle("wait")
    except Exception:
        pass
