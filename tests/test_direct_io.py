"""Direct I/O writes: the pure step plan (hypothesis), the handle on a real filesystem, the
fallbacks (tmpfs, a refused write, RESURGO_DIRECT_IO=0), and async snapshots going direct."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import resurgo
from resurgo.storage import direct_io, local
from resurgo.storage.direct_io import ALIGN, DirectWriteHandle, plan_direct_write


def _run_plan(writes, align, bounce_bytes):
    """Carry out the plans of successive writes on a model file; check every invariant."""
    out = bytearray()
    pending = bytearray()
    expected = bytearray()
    for address, data in writes:
        expected += data
        for s in plan_direct_write(len(pending), address, len(data), bounce_bytes, align):
            assert len(out) % align == 0  # the written part stays block-aligned
            if s.kind == "stage":
                pending += data[s.start:s.stop]
                assert len(pending) <= bounce_bytes
            elif s.kind == "flush":
                assert pending and len(pending) % align == 0
                out += pending
                pending.clear()
            else:
                assert not pending
                assert (address + s.start) % align == 0 and (s.stop - s.start) % align == 0 and s.stop > s.start
                out += data[s.start:s.stop]
    return bytes(out + pending), bytes(expected)


@settings(max_examples=400)
@given(st.lists(st.tuples(st.integers(0, 200), st.binary(min_size=0, max_size=300)), max_size=8),
       st.sampled_from([4, 16]), st.sampled_from([1, 2, 4]))
def test_plan_writes_every_byte_in_order_with_aligned_direct_steps(writes, align, bounce_blocks):
    got, expected = _run_plan(writes, align, bounce_blocks * align)
    assert got == expected


def test_plan_sends_phase_matched_memory_direct():
    # 10 blocks whose memory is at the file position's phase: all but the staged head go direct
    steps = plan_direct_write(pending=100, address=4096 * 7 + 100, length=10 * 4096)
    assert [s.kind for s in steps] == ["stage", "flush", "direct", "stage"]
    assert steps[0].stop == 4096 - 100 and steps[2].stop - steps[2].start == 9 * 4096


def _pieces(seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, 6 << 20, dtype=np.uint8)
    aligned = raw[-raw.ctypes.data % ALIGN:]
    head = [memoryview(raw[3:1003]), memoryview(raw[5000:5000 + (1 << 20) + 17]), memoryview(b"")]
    phase = sum(len(p) for p in head) % ALIGN  # the big piece's memory has its file position's phase
    # header-like small piece, odd offsets, an empty one, the phase-matched large piece, a tail
    return head + [memoryview(aligned[phase:phase + (3 << 20)]), memoryview(raw[77:77 + 12345])]


def _write(path: Path, pieces) -> DirectWriteHandle:
    h = DirectWriteHandle(path)
    try:
        for p in pieces:
            h.write(p)
        h.fsync()
    finally:
        h.close()
    return h


def test_handle_writes_exact_bytes_and_size(tmp_path):
    pieces = _pieces()
    h = _write(tmp_path / "f", pieces)
    data = (tmp_path / "f").read_bytes()
    assert data == b"".join(bytes(p) for p in pieces)
    assert h.bytes_written == len(data) == os.path.getsize(tmp_path / "f")


def test_handle_goes_direct_where_the_filesystem_allows(tmp_path):
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        supported = True
    except OSError:
        supported = False
    pieces = _pieces(1)
    h = _write(tmp_path / "f", pieces)
    assert h.direct is supported
    total = sum(len(p) for p in pieces)
    if supported:
        # the large piece, at its file position's phase, went straight from memory but for
        assert h.bytes_bounced <= total - (3 << 20) + 2 * ALIGN  # its partial first and last blocks
    else:
        assert h.bytes_bounced == 0


def test_a_filesystem_refusing_direct_io_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    pieces = _pieces(2)
    h = _write(tmp_path / "f", pieces)
    assert not h.direct and h.bytes_bounced == 0
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_a_refused_direct_write_falls_back_to_buffered(tmp_path, monkeypatch):
    real_write = os.write
    refused = []

    def picky_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", picky_write)
    pieces = _pieces(3)
    h = DirectWriteHandle(tmp_path / "f")
    if not h.direct:
        h.close()
        pytest.fail("the test directory must accept O_DIRECT (it is on the machine's disk)")
    for p in pieces:
        h.write(p)
    h.fsync()
    h.close()
    assert refused and not h.direct
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(p) for p in pieces)


def test_env_switch_disables_direct_io(tmp_path, monkeypatch):
    monkeypatch.setenv("RESURGO_DIRECT_IO", "0")
    h = _write(tmp_path / "f", _pieces(4))
    assert not h.direct and h.bytes_bounced == 0


def test_async_snapshot_is_written_from_staging_without_bounce(tmp_path, monkeypatch):
    handles = []
    real_create = local.LocalStaging.create

    def spy(self, rel):
        h = real_create(self, rel)
        handles.append(h)
        return h

    monkeypatch.setattr(local.LocalStaging, "create", spy)
    state = {"big": torch.randn(1 << 20), "odd": torch.randn(300_001), "small": torch.arange(10)}
    resurgo.async_save(state, tmp_path / "c").wait()
    assert len(handles) == 1 and handles[0].direct
    # only the header, the small tensor and partial blocks pass through the bounce buffer
    assert handles[0].bytes_bounced <= 4096 * 4 + 80
    assert torch.equal(resurgo.load_dict(tmp_path / "c")["big"], state["big"])
    assert torch.equal(resurgo.load_dict(tmp_path / "c")["odd"], state["odd"])
