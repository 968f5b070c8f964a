"""DeviceOrder's stream ordering, with fake streams so it runs without CUDA (tests/test_cuda.py
checks the same on a GPU with real kernels)."""

from __future__ import annotations

import pytest
import torch

from resurgo.pipeline.staging import DeviceOrder, StagingPool

DEV = torch.device("cuda", 0)


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


@pytest.fixture
def streams(monkeypatch):
    log: list[str] = []
    current = {"stream": FakeStream("training", log)}
    side = FakeStream("side", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    monkeypatch.setattr(StagingPool, "side_stream", lambda self, device: side)
    return log, current


def test_side_stream_waits_for_the_callers_stream_once_per_device(streams):
    log, _ = streams
    order = DeviceOrder(StagingPool())
    assert order.side(DEV) is order.side(DEV)
    assert log == ["side waits for training"]


def test_training_waits_only_for_copies_issued_since_it_last_waited(streams):
    log, current = streams
    order = DeviceOrder(StagingPool())
    order.side(DEV)
    order.training_waits()  # nothing issued: a guarded call whose copies are all deferred
    assert log == ["side waits for training"]
    order.issued(DEV)
    order.training_waits()
    order.training_waits()
    assert log == ["side waits for training", "training waits for side"]
    current["stream"] = FakeStream("step's stream", log)  # the stream current where step() runs
    order.issued(DEV)
    order.training_waits()
    assert log[-1] == "step's stream waits for side"


def test_no_device_tensors_no_cuda_calls(monkeypatch):
    def no_cuda(*_a, **_k):
        raise AssertionError("touched CUDA")

    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    DeviceOrder(StagingPool()).training_waits()
