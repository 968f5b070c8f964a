"""The CUDA paths: page-locked staging buffers, the device-to-host copy on a side stream, and
saves/loads of device tensors. They run wherever CUDA is (`make test` on a GPU machine, or
`.venv/bin/python -m pytest -q tests/test_cuda.py`); the CPU suite covers everything else."""

from __future__ import annotations

import pytest
import torch

import resurgo
from resurgo.pipeline import async_save as async_mod
from helpers import bits_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _state(device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "big": torch.randn(3 << 20, device=device, generator=g),  # 12 MiB: several staging spans
        "bf16": torch.randn(1000, 37, device=device, generator=g).to(torch.bfloat16),
        "strided": torch.randn(256, 512, device=device, generator=g).t(),
        "scalar": torch.tensor(3, device=device),
        "cpu": torch.arange(10),
    }


def _cpu(state):
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}  # a copy, CPU tensors too


def test_async_snapshot_of_device_tensors_ignores_kernels_queued_after_the_call(tmp_path):
    state = _state()
    expected = _cpu(state)
    h = resurgo.async_save(state, tmp_path / "c")
    for v in state.values():  # queued on the training stream right after the call returns
        v.add_(1)
    h.wait()
    assert bits_equal(resurgo.load_dict(tmp_path / "c"), expected)
    for key in ("big", "bf16", "strided", "scalar"):
        assert async_mod._pool._buffers[key].is_pinned(), key
    # exactly the staging size: torch's pinned allocator would round 12 MiB + 4 KiB up to 16 MiB
    assert async_mod._pool._buffers["big"].numel() == (12 << 20) + 4096


def test_async_snapshot_on_a_non_default_training_stream(tmp_path):
    """Copy threads other than the caller's must order the copy against the caller's stream."""
    state = _state()
    training = torch.cuda.Stream()
    training.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(training):
        for v in state.values():
            v.mul_(2)  # queued on the training stream before the call
        expected = _cpu(state)
        h = resurgo.async_save(state, tmp_path / "c")
        for v in state.values():
            v.add_(1)  # and right after it
    h.wait()
    assert bits_equal(resurgo.load_dict(tmp_path / "c"), expected)


def test_guarded_async_save_of_a_cuda_model(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 256, device="cuda")

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    state = {"model": model, "optimizer": opt}
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    h = resurgo.async_save(state, tmp_path / "c", guard=opt)
    step()  # forward/backward overlap the copy; opt.step() waits for it
    h.wait()
    saved = resurgo.load_dict(tmp_path / "c")["model"]
    assert bits_equal(dict(saved), expected)


def test_sync_save_and_in_place_load_of_device_tensors(tmp_path):
    state = _state()
    resurgo.save(state, tmp_path / "c")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    resurgo.load(target, tmp_path / "c")
    assert all(target[k].device == state[k].device for k in state)
    assert bits_equal(_cpu(target), _cpu(state))


def test_cpu_checkpoint_loads_into_device_tensors_and_back(tmp_path):
    cpu_state = _state("cpu")
    resurgo.save(cpu_state, tmp_path / "c")
    target = {k: torch.zeros_like(v, device="cuda") for k, v in cpu_state.items()}
    resurgo.load(target, tmp_path / "c")
    assert bits_equal(_cpu(target), cpu_state)


SLEEP_CYCLES = 2_000_000_000  # about 1 s of GPU clock: far longer than the host work below


def _side_stream_sleeping(state, tmp_path) -> torch.cuda.Stream:
    """The staging side stream, busy for about a second. A first save of ``state`` made the stream
    and the staging buffers: allocating page-locked memory waits for the whole device."""
    resurgo.async_save(state, tmp_path / "first").wait()
    side = async_mod._pool._streams[torch.device("cuda", torch.cuda.current_device())]
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    return side


def test_training_stream_waits_for_the_snapshot_right_after_an_unguarded_call(tmp_path):
    state = {"w": torch.randn(1 << 20, device="cuda")}
    side = _side_stream_sleeping(state, tmp_path)
    expected = _cpu(state)
    h = resurgo.async_save(state, tmp_path / "c")
    state["w"].add_(1)  # must wait: the copy is queued behind the sleep
    after = torch.cuda.Event()
    after.record()
    after.synchronize()
    assert side.query()  # the training stream ran nothing before the copy had landed
    h.wait()
    assert bits_equal(resurgo.load_dict(tmp_path / "c"), expected)


def test_guarded_copies_overlap_forward_and_backward_and_step_waits_for_them(tmp_path, monkeypatch):
    """A deferred copy is made to take about a second on the side stream (a sleep queued before
    it). Forward and backward must finish while it runs; step() must wait for it."""
    import threading

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 256, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state = {"model": model, "optimizer": opt}
    resurgo.async_save(state, tmp_path / "first").wait()  # buffers and stream exist from here on
    side = async_mod._pool._streams[torch.device("cuda", torch.cuda.current_device())]
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    issued = threading.Event()
    real_stage = async_mod._pool.stage

    def slow_stage(leaf, *args, **kwargs):
        staged = real_stage(leaf, *args, **kwargs)
        if leaf.key != "model.0.weight":
            return staged
        (copy,) = staged.tasks

        def slow_copy():
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
            copy()
            issued.set()
        return staged._replace(tasks=[slow_copy])

    monkeypatch.setattr(async_mod._pool, "stage", slow_stage)
    h = resurgo.async_save(state, tmp_path / "c", guard=opt)
    assert issued.wait(30)  # the background thread has queued the slow copy
    model(x).square().mean().backward()
    backward_done = torch.cuda.Event()
    backward_done.record()
    backward_done.synchronize()
    assert not side.query()  # forward and backward did not wait for the copies
    opt.step()
    step_done = torch.cuda.Event()
    step_done.record()
    step_done.synchronize()
    assert side.query()  # but the step's kernels did
    h.wait()
    assert bits_equal(dict(resurgo.load_dict(tmp_path / "c")["model"]), expected)
