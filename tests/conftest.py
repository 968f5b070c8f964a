import os
import sys

import pytest

# Tests import helper scripts from tests/scripts.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"
