"""Page-locked staging memory, with CUDA's register calls faked so the logic runs on any machine:
exact size, page-aligned, unregistered when the last view goes, torch's allocator as fallback."""

from __future__ import annotations

import gc

import pytest
import torch

from resurgo.pipeline import staging


class FakeCudart:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - CUDA's name
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_exact_size_page_aligned_and_unregistered_after_the_last_view(cudart):
    n = (64 << 20) + 4096  # torch's pinned allocator would round this up to 128 MiB
    buf = staging.page_locked(n)
    assert buf.numel() == n and buf.dtype == torch.uint8
    ptr = buf.data_ptr()
    assert ptr % 4096 == 0 and cudart.registered == {ptr: n}
    view = buf[4096:].numpy()  # a staging view outlives the pool's reference
    view[:3] = 7
    del buf
    gc.collect()
    assert view[:3].tolist() == [7, 7, 7]
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_falls_back_to_torch_pinned_memory_when_registering_fails(cudart, monkeypatch):
    cudart.fail = True
    calls = []

    def fake_empty(*args, **kwargs):
        calls.append(kwargs.get("pin_memory"))
        return torch.zeros(*args, dtype=kwargs["dtype"])

    monkeypatch.setattr(staging.torch, "empty", fake_empty)
    buf = staging.page_locked(10_000)
    assert buf.numel() == 10_000 and calls == [True]
    assert cudart.unregistered == []


def test_zero_bytes_needs_no_registration(cudart):
    assert staging.page_locked(0).numel() == 0
    assert cudart.registered == {}
