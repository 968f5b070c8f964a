"""Checkpoints at fsspec URLs: ``memory://`` (fast, in-process) and ``s3://`` against a real
SeaweedFS server (the ``seaweed`` fixture). The commit protocol on object stores: data first,
manifest last, a writer token per save, incomplete saves recognized, two writers refused."""

from __future__ import annotations

import errno
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest
import torch

import resurgo
from helpers import bits_equal
from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    UnsupportedValueError,
)
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.storage import retry
from resurgo.storage.fsspec_store import RANGE_SPLIT_BYTES, ObjectCheckpoint, ObjectReadHandle, split_url
from resurgo.storage.s3 import S3MultipartWriteHandle, split_views
from seaweed import ACCESS_KEY, SECRET_KEY


def _state(seed: int = 0, big: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16)},
             "step": 7 + seed, "note": f"seed {seed}", "ids": (1, 2, 3)}
    if big:
        state["model"]["big"] = torch.randn(big, generator=g)
    return state


def _zeros_like(state: dict) -> dict:
    out = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "note": "", "ids": ()}
    return out


def _objects(url: str, options: dict | None = None) -> dict[str, int]:
    fs, root = split_url(url, options)
    fs.invalidate_cache()
    return {k[len(root) + 1:]: int(v["size"]) for k, v in fs.find(root, detail=True).items()}


@contextmanager
def _requests_sent(url: str, options: dict) -> Iterator[list[tuple[str, str]]]:
    """Every HTTP request (method, path) the S3 client for ``url`` and ``options`` sends meanwhile:
    the one resurgo uses (fsspec keeps one filesystem per set of options)."""
    fs, _ = split_url(url, options)
    fs.connect()
    sent: list[tuple[str, str]] = []

    def record(request, **_) -> None:
        sent.append((request.method, urlsplit(request.url).path))

    fs.s3.meta.events.register("before-send.s3", record)
    try:
        yield sent
    finally:
        fs.s3.meta.events.unregister("before-send.s3", record)


# -- memory:// ---------------------------------------------------------------------------------
def test_memory_round_trip_data_then_manifest(mem_url):
    state = _state()
    report = resurgo.save(state, f"{mem_url}/c", step=7)
    objects = _objects(f"{mem_url}/c")
    data = [k for k in objects if k.startswith("data/")]
    assert sorted(objects) == sorted(data + ["manifest.json"])  # no writer token left after the commit
    assert report.bytes_written == sum(objects.values())
    assert len(data) == 1 and data[0].endswith("-rank00000-000.safetensors")  # a per-save tag before the rank
    manifest = resurgo.read_manifest(f"{mem_url}/c")
    assert manifest.step == 7 and list(manifest.files) == data
    target = _zeros_like(state)
    load_report = resurgo.load(target, f"{mem_url}/c")
    assert load_report.step == 7 and load_report.files == data
    assert all(bits_equal(target["model"][k], state["model"][k]) for k in state["model"])
    assert (target["step"], target["note"], target["ids"]) == (7, "seed 0", (1, 2, 3))
    loaded = resurgo.load_dict(f"{mem_url}/c")
    assert bits_equal(loaded["model"]["w"], state["model"]["w"]) and loaded["ids"] == (1, 2, 3)
    assert verify_checkpoint(f"{mem_url}/c").ok


def test_memory_async_save_and_overwrite_replaces_objects(mem_url):
    url = f"{mem_url}/c"
    resurgo.async_save(_state(0), url).wait()
    first = set(_objects(url))
    with pytest.raises(CheckpointExistsError, match=f"{url}: already exists"):
        resurgo.save(_state(1), url)
    resurgo.save(_state(1), url, overwrite=True)
    second = set(_objects(url))
    assert first & second == {"manifest.json"}  # new data objects; the old ones were deleted after the commit
    assert bits_equal(resurgo.load_dict(url)["model"]["w"], _state(1)["model"]["w"])


def test_memory_incomplete_save_is_refused_and_blocks_a_second_writer(mem_url):
    url = f"{mem_url}/c"
    staging = ObjectCheckpoint(url).stage(overwrite=False)  # a save that started and never committed
    h = staging.create(f"data/{staging.file_tag}rank00000-000.safetensors")
    h.write(memoryview(b"x" * 100))
    h.fsync()
    h.close()
    with pytest.raises(IncompleteCheckpointError, match=f"{url}: has data objects but no manifest.json"):
        resurgo.load_dict(url)
    with pytest.raises(CheckpointExistsError, match=f"{url}: another save is writing this checkpoint "
                                                    rf"\(writer token .resurgo-writers/{staging.save_id}\)"):
        resurgo.save(_state(), url)
    assert set(_objects(url)) == {f"data/{staging.file_tag}rank00000-000.safetensors",
                                  f".resurgo-writers/{staging.save_id}"}  # the refused save left nothing
    staging.abort()
    assert _objects(url) == {}
    resurgo.save(_state(), url)
    assert resurgo.read_manifest(url).step == 7  # the state's own "step"


def test_memory_second_writer_detected_at_commit(mem_url):
    url = f"{mem_url}/c"
    first = ObjectCheckpoint(url).stage(overwrite=False)
    # A second writer whose token appeared after the first one checked (a race): the first refuses at commit.
    fs, root = split_url(url, None)
    fs.pipe_file(f"{root}/.resurgo-writers/intruder0000", b"{}")
    with pytest.raises(CheckpointExistsError, match="intruder0000.*not committing this one"):
        first.commit(b"{}")
    assert "manifest.json" not in _objects(url)


def test_memory_corruption_and_missing_objects(mem_url):
    url = f"{mem_url}/c"
    resurgo.save(_state(), url)
    fs, root = split_url(url, None)
    (name,) = [k for k in _objects(url) if k.startswith("data/")]
    raw = bytearray(fs.cat_file(f"{root}/{name}"))
    raw[-5] ^= 0x10
    fs.pipe_file(f"{root}/{name}", bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=rf"{url}: tensor .* is corrupt in {name}"):
        resurgo.load_dict(url)
    assert not verify_checkpoint(url).ok
    fs.pipe_file(f"{root}/{name}", bytes(raw[:-1]))
    with pytest.raises(CorruptCheckpointError, match=f"{url}: data file {name} has {len(raw) - 1} bytes, "
                                                    f"the manifest says {len(raw)}"):
        resurgo.load_dict(url)
    fs.rm(f"{root}/{name}")
    with pytest.raises(CorruptCheckpointError, match=f"{url}: data file '{name}' listed in the manifest is missing"):
        resurgo.load_dict(url)


def test_memory_not_found_and_local_path_with_options(mem_url, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=f"{mem_url}/nothing: not found"):
        resurgo.load_dict(f"{mem_url}/nothing")
    with pytest.raises(UnsupportedValueError, match="storage_options apply to URLs"):
        resurgo.save(_state(), tmp_path / "c", storage_options={"anon": True})


def test_memory_partial_load_reads_only_the_needed_ranges(mem_url):
    url = f"{mem_url}/c"
    full = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)
    resurgo.save({"t": full}, url, block_bytes=64 << 10)
    part = torch.zeros(512, 64)
    report = resurgo.load({"t": resurgo.Shard(part, (4096, 64), (1024, 0))}, url)
    assert bits_equal(part, full[1024:1536])
    assert report.bytes_read == 512 * 64 * 4  # whole checksum blocks of the rows asked for, nothing more


# -- retries -----------------------------------------------------------------------------------
def test_retries_transient_errors_then_gives_up_naming_the_url(monkeypatch):
    monkeypatch.setattr(retry, "RETRY", retry.RetryPolicy(attempts=3, first_delay=0.001))
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert retry.with_retries(flaky, "s3://b/c", "reading") == "ok" and len(calls) == 3
    calls.clear()

    def down() -> None:
        calls.append(1)
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(StorageError, match=r"s3://b/c: reading failed: ConnectionRefusedError: .*Connection refused"
                                           r".*\(gave up after 3 attempts\)"):
        retry.with_retries(down, "s3://b/c", "reading")
    assert len(calls) == 3
    calls.clear()

    def denied() -> None:
        calls.append(1)
        raise PermissionError("Access Denied")

    with pytest.raises(StorageError, match="s3://b/c: access denied while reading: Access Denied"):
        retry.with_retries(denied, "s3://b/c", "reading")
    assert len(calls) == 1  # permanent: not retried


# -- s3:// on SeaweedFS ------------------------------------------------------------------------
def test_s3_save_load_async_multipart(s3_bucket):
    bucket, options = s3_bucket
    url = f"{bucket}/run/c1"
    state = _state(3, big=9_000_000)  # 36 MB: a multipart upload of 8 MiB parts
    report = resurgo.save(state, url, step=3, storage_options=options, io_threads=2)
    objects = _objects(url, options)
    assert report.bytes_written == sum(objects.values()) and "manifest.json" in objects
    assert max(objects.values()) > 32 << 20
    target = _zeros_like(state)
    load_report = resurgo.load(target, url, storage_options=options)
    assert load_report.bytes_read == sum(t.nbytes for t in state["model"].values())
    assert all(bits_equal(target["model"][k], state["model"][k]) for k in state["model"])
    assert verify_checkpoint(url, storage_options=options).ok
    handle = resurgo.async_save(_state(4), f"{bucket}/run/c2", storage_options=options)
    handle.wait()
    loaded = resurgo.load_dict(f"{bucket}/run/c2", storage_options=options)
    assert bits_equal(loaded["model"]["w"], _state(4)["model"]["w"]) and loaded["note"] == "seed 4"


def test_s3_credentials_and_endpoint_from_environment(s3_bucket, s3_env):
    bucket, _ = s3_bucket
    resurgo.save(_state(5), f"{bucket}/env")  # no storage_options: s3fs reads the environment
    assert resurgo.load_dict(f"{bucket}/env")["step"] == 12


def test_s3_no_such_bucket_names_the_url(seaweed):
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/c"
    with _requests_sent(url, seaweed.storage_options) as sent:
        with pytest.raises(CheckpointNotFoundError, match=f"{url}: no such bucket"):
            resurgo.load_dict(url, storage_options=seaweed.storage_options)
        with pytest.raises(CheckpointNotFoundError, match=f"{url}: no such bucket"):
            resurgo.save(_state(), url, storage_options=seaweed.storage_options)
    assert len(sent) == 2  # one request each: a permanent error is not retried


def test_s3_two_writers_and_conditional_manifest(s3_bucket):
    bucket, options = s3_bucket
    url = f"{bucket}/c"
    first = ObjectCheckpoint(url, options).stage(overwrite=False)
    with pytest.raises(CheckpointExistsError, match=f"{url}: another save is writing this checkpoint"):
        resurgo.save(_state(), url, storage_options=options)
    first.abort()
    resurgo.save(_state(), url, storage_options=options)
    # A manifest put meanwhile by someone else is never replaced (If-None-Match: *, a 412 from the server).
    late = ObjectCheckpoint(f"{bucket}/d", options).stage(overwrite=False)
    fs, root = split_url(f"{bucket}/d", options)
    fs.pipe_file(f"{root}/manifest.json", b'{"other": true}')
    with pytest.raises(CheckpointExistsError, match=f"{bucket}/d: appeared while saving"):
        late.commit(b'{"files": {}}')
    assert json.loads(fs.cat_file(f"{root}/manifest.json")) == {"other": True}


def test_s3_partial_load_reads_only_the_ranges_needed(s3_bucket):
    bucket, options = s3_bucket
    full = torch.arange(8192 * 64, dtype=torch.float32).reshape(8192, 64)  # 2 MiB
    resurgo.save({"t": full, "u": torch.ones(3)}, f"{bucket}/c", block_bytes=64 << 10, storage_options=options)
    part = torch.zeros(1000, 64)
    report = resurgo.load({"t": resurgo.Shard(part, (8192, 64), (4000, 0))}, f"{bucket}/c", strict=False,
                          storage_options=options)
    assert bits_equal(part, full[4000:5000])
    # rows 4000..4999 are bytes 1024000..1280000: the 64 KiB blocks 15..19 that hold them, no more
    assert report.bytes_read == 5 * (64 << 10)


@pytest.mark.slow  # ~40 s: five spawned interpreters
def test_s3_distributed_save_on_2_ranks_resharded_load_on_3(s3_bucket, s3_env):
    """Ranks other than 0 write into rank 0's save (its staging pickles); each loading rank reads
    only the byte ranges its shards need. Credentials and endpoint reach the ranks by environment."""
    from dist_harness import run_ranks

    bucket, options = s3_bucket
    root = f"{bucket}/dist"
    run_ranks(2, "dist_workers:save_layouts", root, ["dt_s0", "manual"])
    manifest = resurgo.read_manifest(f"{root}/n2-dt_s0", storage_options=options)
    assert manifest.world == {"size": 2} and {f.split("-rank")[1][:5] for f in manifest.files} == {"00000", "00001"}
    results = run_ranks(3, "dist_workers:load_layouts", root, [(2, "dt_s0"), (2, "manual")], ["dt_s0", "flat"])
    assert [p for r in results for p in r["problems"]] == []
    for r in results:
        for name, (read, need) in r["d_bytes"].items():
            assert need and read <= 1.05 * need, (name, read, need)


# -- reads straight into place ------------------------------------------------------------------
def test_split_views_covers_the_views_in_ranges_of_at_most_most():
    a, b, c = bytearray(5), bytearray(7), bytearray(2)
    ranges = split_views(100, [memoryview(a), memoryview(b), memoryview(c)], 6)
    assert [(start, stop, [len(d) for d in dests]) for start, stop, dests in ranges] == [
        (100, 106, [5, 1]), (106, 112, [6]), (112, 114, [2])]
    for i, (start, stop, dests) in enumerate(ranges):  # the slices are views of the buffers, in order
        for d in dests:
            d[:] = bytes([i + 1]) * len(d)
    assert bytes(a + b + c) == bytes([1] * 6 + [2] * 6 + [3] * 2)
    assert split_views(0, [memoryview(bytearray(12))], 6)[-1][:2] == (6, 12)


def test_s3_load_reads_each_file_in_ranged_gets_header_included(s3_bucket):
    url, options = s3_bucket
    g = torch.Generator().manual_seed(11)
    state = {"big": torch.randn(9_000_000, generator=g), "small": torch.randn(100, generator=g)}  # 36 MB
    resurgo.save(state, f"{url}/c", storage_options=options, io_threads=1)
    files = {k: v for k, v in _objects(f"{url}/c", options).items() if k.startswith("data/")}
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with _requests_sent(url, options) as sent:
        resurgo.load(target, f"{url}/c", storage_options=options)
    assert all(bits_equal(target[k], state[k]) for k in state)
    gets = [path for method, path in sent if method == "GET" and "/data/" in path]
    # Every data file in ranges of 16 MiB from byte 0: its header comes with its first data, no GET of its own.
    assert len(gets) == sum(-(-size // RANGE_SPLIT_BYTES) for size in files.values())


def test_s3_multipart_upload_reusing_part_buffers_is_byte_exact(s3_bucket):
    url, options = s3_bucket
    fs, root = split_url(url, options)
    data = torch.randint(0, 256, (33 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).numpy()
    handle = S3MultipartWriteHandle(fs, f"{root}/obj", f"{url}/obj", part_bytes=5 << 20)  # 7 parts: buffers reused
    for start in range(0, len(data), 3_000_001):  # pieces that straddle the parts
        handle.write(memoryview(data[start : start + 3_000_001]))
    handle.fsync()
    handle.close()
    assert handle.bytes_written == len(data) and fs.cat_file(f"{root}/obj") == data.tobytes()


def test_s3_corrupt_header_or_data_and_short_object(s3_bucket):
    url, options = s3_bucket
    resurgo.save(_state(), f"{url}/c", storage_options=options)
    fs, root = split_url(f"{url}/c", options)
    (name,) = [k for k in _objects(f"{url}/c", options) if k.startswith("data/")]
    good = fs.cat_file(f"{root}/{name}")
    for at, expected in ((20, f"the safetensors header of {name} .* does not match its checksum"),
                         (len(good) - 5, rf"tensor .* is corrupt in {name}: block 0")):
        bad = bytearray(good)
        bad[at] ^= 0x01
        fs.pipe_file(f"{root}/{name}", bytes(bad))
        with pytest.raises(CorruptCheckpointError, match=f"{url}/c: {expected}"):
            resurgo.load_dict(f"{url}/c", storage_options=options)
    # An object shorter than the reader was told: the server's short answer is refused, not retried.
    handle = ObjectReadHandle(fs, f"{root}/{name}", name, f"{url}/c", size=len(good) + 10)
    with pytest.raises(CorruptCheckpointError, match=f"{url}/c: data file '{name}': got 10 bytes at {len(good) - 10}, "
                                                    "expected 20"):
        handle.read_into(len(good) - 10, memoryview(bytearray(20)))


# -- access denied, against the server's identities ---------------------------------------------
@pytest.mark.parametrize("who, server_says", [("wrong secret key", "signature .* does not match"),
                                              ("unknown access key", "access key ID .* does not exist")])
def test_s3_bad_credentials_refused_at_once_naming_the_url(s3_bucket, seaweed, who, server_says):
    url, options = s3_bucket
    resurgo.save(_state(), f"{url}/c", storage_options=options)
    bad = (seaweed.options_for(ACCESS_KEY, "not-" + SECRET_KEY) if who == "wrong secret key"
           else seaweed.options_for("nobody-" + uuid.uuid4().hex[:6], SECRET_KEY))
    with _requests_sent(url, bad) as sent:
        with pytest.raises(StorageError, match=f"{url}/c: access denied while reading manifest.json: .*{server_says}") as e:
            resurgo.load_dict(f"{url}/c", storage_options=bad)
    assert e.value.errno == errno.EACCES
    assert sent == [("GET", f"/{url[len('s3://'):]}/c/manifest.json")]  # refused once: a permanent error is not retried
    with _requests_sent(url, bad) as sent:
        with pytest.raises(StorageError, match=f"{url}/d: access denied while listing: .*{server_says}"):
            resurgo.save(_state(), f"{url}/d", storage_options=bad)
    assert len(sent) == 1


def test_s3_identity_without_write_permission_reads_but_cannot_save(s3_bucket, seaweed):
    url, options = s3_bucket
    state = _state(2)
    resurgo.save(state, f"{url}/c", storage_options=options)
    reader = seaweed.reader_storage_options
    loaded = resurgo.load_dict(f"{url}/c", storage_options=reader)
    assert bits_equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 9
    with _requests_sent(url, reader) as sent:
        with pytest.raises(StorageError, match=f"{url}/d: access denied while writing the writer token: Access Denied"):
            resurgo.save(state, f"{url}/d", storage_options=reader)
    assert [m for m, _ in sent].count("PUT") == 1  # the token's put, refused once
    with pytest.raises(StorageError, match=f"{url}/c: access denied while writing the writer token"):
        resurgo.save(state, f"{url}/c", storage_options=reader, overwrite=True)
    assert bits_equal(resurgo.load_dict(f"{url}/c", storage_options=options)["model"]["w"], state["model"]["w"])
    assert not _objects(f"{url}/d", options)  # nothing was written there
