import os
import sys

import pytest
from hypothesis import settings

# A shared 2-core machine stalls single examples for seconds at times: no per-example deadline.
settings.register_profile("resurgo", deadline=None)
settings.load_profile("resurgo")

# Tests import helper scripts from tests/scripts.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True, scope="session")
def import_key_in_tmp(tmp_path_factory):
    """Imports in place tag their checkpoints with a per-user key: the suite's lives in a temporary
    directory, never in the home directory."""
    os.environ["RESURGO_KEY_FILE"] = str(tmp_path_factory.mktemp("resurgo-key") / "import.key")


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


@pytest.fixture(autouse=True)
def torch_flags_restored():
    """A test that turns on deterministic algorithms (Lightning's ``deterministic=True`` does, and
    leaves them on) must not change what later tests run with."""
    import torch

    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One SeaweedFS server with an S3 gateway for the whole session, stopped at its end."""
    from seaweed import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweed_bucket(seaweed):
    """One bucket for the session (each bucket takes several volumes of the server)."""
    import uuid

    import s3fs

    fs = s3fs.S3FileSystem(**seaweed.storage_options)
    name = f"resurgo-tests-{uuid.uuid4().hex[:8]}"
    fs.mkdir(name)
    return name


@pytest.fixture
def s3_bucket(seaweed, seaweed_bucket):
    """A fresh prefix in the session's bucket: ``(url "s3://bucket/prefix", storage_options)``."""
    import uuid

    return f"s3://{seaweed_bucket}/{uuid.uuid4().hex[:12]}", dict(seaweed.storage_options)


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """The server's endpoint and admin credentials in the ``AWS_*`` environment variables, for code
    given no storage_options. s3fs reads them when it creates a filesystem and keeps filesystems
    by their options: its cached ones are dropped before and after."""
    from s3fs import S3FileSystem

    for name, value in (("AWS_ENDPOINT_URL", seaweed.endpoint), ("AWS_ACCESS_KEY_ID", seaweed.storage_options["key"]),
                        ("AWS_SECRET_ACCESS_KEY", seaweed.storage_options["secret"]),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    S3FileSystem.clear_instance_cache()
    yield
    S3FileSystem.clear_instance_cache()


@pytest.fixture
def mem_url():
    """A fresh prefix on fsspec's in-process memory:// filesystem, removed afterwards."""
    import uuid

    from resurgo.storage.fsspec_store import split_url

    url = f"memory://resurgo-tests/{uuid.uuid4().hex[:12]}"
    yield url
    fs, root = split_url(url, None)
    if fs.exists(root):
        fs.rm(root, recursive=True)
