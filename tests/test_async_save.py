"""Asynchronous save: snapshot semantics, one save in flight, errors never lost, guard, budget."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import resurgo
from resurgo.errors import MemoryBudgetError, SaveInFlightError, StorageError
from resurgo.pipeline import async_save as async_mod
from resurgo.pipeline import writer
from resurgo.storage import local
from helpers import bits_equal

SCRIPTS = Path(__file__).parent / "scripts"


def make_state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=g),
        "t": torch.randn(16, 16, generator=g).t(),  # non-contiguous
        "bf": torch.randn(100, generator=g).bfloat16(),
        "i": torch.arange(7),
        "zero_d": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "np": np.arange(12, dtype=np.float64).reshape(3, 4),
        "nested": {"list": [torch.ones(3), 2.5], "step": 10},
    }


def clone(state):
    return {k: (clone(v) if isinstance(v, dict) else [clone(x) if isinstance(x, dict) else (x.clone() if isinstance(x, torch.Tensor) else x) for x in v] if isinstance(v, list) else v.clone() if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}


def test_snapshot_holds_the_values_at_the_call(tmp_path):
    state = make_state()
    expected = clone(state)
    h = resurgo.async_save(state, tmp_path / "c", step=1)
    # Training changes everything right after the call.
    for v in (state["w"], state["t"], state["bf"], state["i"], state["zero_d"], state["nested"]["list"][0]):
        v.add_(1)
    state["np"] += 1
    state["nested"]["step"] = 11
    state["nested"]["list"][1] = -1.0
    report = h.wait()
    assert h.done() and h.staged()
    assert report.tensor_bytes == sum(
        x.numel() * x.element_size() for x in (expected["w"], expected["t"], expected["bf"], expected["i"],
                                              expected["zero_d"], expected["empty"], expected["nested"]["list"][0])
    ) + expected["np"].nbytes
    assert {"stage", "stall", "write", "fsync", "commit", "total"} <= set(report.seconds)
    assert bits_equal(resurgo.load_dict(tmp_path / "c"), expected)


def test_staging_buffers_are_reused_across_saves(tmp_path):
    state = {"a": torch.randn(1000), "b": torch.randn(10)}
    resurgo.async_save(state, tmp_path / "1").wait()
    first = {k: b.data_ptr() for k, b in async_mod._pool._buffers.items()}
    state["a"].mul_(2)
    resurgo.async_save(state, tmp_path / "2").wait()
    assert {k: b.data_ptr() for k, b in async_mod._pool._buffers.items()} == first
    assert async_mod._pool.nbytes == 4 * 1010  # the state's size, no more
    assert torch.equal(resurgo.load_dict(tmp_path / "2")["a"], state["a"])


@pytest.fixture
def slow_writes(monkeypatch):
    """Writers block until the test releases them."""
    gate = threading.Event()
    real = writer.write_data_file

    def gated(*args, **kwargs):
        gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_mod, "write_and_commit", _with_writer(gated))
    yield gate
    gate.set()


def _with_writer(write_file):
    from resurgo.pipeline import save as save_mod

    def write_and_commit(prep, sources, digests=None, **options):
        original = save_mod.write_data_file
        save_mod.write_data_file = write_file
        try:
            return save_mod.write_and_commit(prep, sources, digests, **options)
        finally:
            save_mod.write_data_file = original
    return write_and_commit


def test_one_save_in_flight(tmp_path, slow_writes):
    state = {"a": torch.ones(10)}
    first = resurgo.async_save(state, tmp_path / "1")
    assert not first.done()
    with pytest.raises(SaveInFlightError, match=str(tmp_path / "1")):
        resurgo.async_save(state, tmp_path / "2", if_busy="raise")
    assert not (tmp_path / "2").exists()
    released = threading.Timer(0.2, slow_writes.set)
    released.start()
    second = resurgo.async_save(state, tmp_path / "3")  # waits for the first to commit
    assert first.done() and (tmp_path / "1" / "manifest.json").exists()
    second.wait()
    assert torch.equal(resurgo.load_dict(tmp_path / "3")["a"], torch.ones(10))


def test_background_error_is_raised_by_wait(tmp_path, monkeypatch):
    def broken(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local.os, "fsync", broken)
    h = resurgo.async_save({"a": torch.ones(10)}, tmp_path / "c")
    with pytest.raises(StorageError) as ei:
        h.wait()
    assert ei.value.errno == 28 and str(tmp_path / "c") in str(ei.value)
    assert not (tmp_path / "c").exists()
    assert [p for p in tmp_path.iterdir()] == []  # staging directory removed
    monkeypatch.undo()
    resurgo.save({"a": torch.ones(1)}, tmp_path / "next")  # the error was seen: not raised again


def test_unseen_background_error_is_raised_by_the_next_save(tmp_path, monkeypatch):
    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local.os, "fsync", broken)
    h = resurgo.async_save({"a": torch.ones(10)}, tmp_path / "c")
    h._done.wait()
    monkeypatch.undo()
    with pytest.raises(StorageError, match="Input/output error"):
        resurgo.save({"a": torch.ones(1)}, tmp_path / "next")
    assert not (tmp_path / "next").exists()  # the new save did not start
    resurgo.save({"a": torch.ones(1)}, tmp_path / "next")  # reported once, then out of the way
    with pytest.raises(StorageError):
        h.wait()  # the handle still tells what happened


def test_exit_waits_for_the_save_to_commit(tmp_path):
    path = tmp_path / "c"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "async_exit.py"), str(path), "ok"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "returned" in proc.stdout
    out = resurgo.load_dict(path)
    assert torch.equal(out["big"], torch.arange(8 << 20, dtype=torch.float32)) and out["step"] == 3


def test_exit_raises_an_unseen_background_error(tmp_path):
    path = tmp_path / "c"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "async_exit.py"), str(path), "fail"],
                          capture_output=True, text=True, timeout=120)
    assert "StorageError" in proc.stderr and "Input/output error" in proc.stderr
    assert not path.exists()


def test_guard_defers_parameters_and_optimizer_state_until_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(32, 8)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    state = {"model": model, "optimizer": opt, "step": 2}
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": resurgo.load_dict(_sync_copy(state, tmp_path))["optimizer"]}
    h = resurgo.async_save(state, tmp_path / "c", guard=opt)
    # The next training step: forward changes BatchNorm statistics (copied during the call),
    # step() changes parameters and optimizer state (it waits for their copy).
    opt.zero_grad()
    model(x + 1).pow(2).mean().backward()
    opt.step()
    assert h.staged()
    h.wait()
    saved = resurgo.load_dict(tmp_path / "c")
    assert bits_equal(dict(saved["model"]), expected["model"])
    assert bits_equal(saved["optimizer"], expected["optimizer"])
    assert not bits_equal(dict(model.state_dict()), expected["model"])  # training did move on
    assert len(opt._optimizer_step_pre_hooks) == 1  # one guard hook per optimizer, idle now


def _sync_copy(state, tmp_path):
    resurgo.save(state, tmp_path / "reference")
    return tmp_path / "reference"


def test_guard_with_train_state_restores_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ts = resurgo.TrainState(model=model, optimizer=opt, step=0)
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    ts.step = 3
    weight = model.weight.detach().clone()
    h = resurgo.async_save(ts, tmp_path / "c", guard=opt)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    h.wait()
    fresh = torch.nn.Linear(4, 4)
    ts2 = resurgo.TrainState(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9), step=0)
    resurgo.load(ts2, tmp_path / "c")
    assert torch.equal(fresh.weight, weight) and ts2.step == 3


def test_staging_bytes(tmp_path):
    state = {"a": torch.ones(1000)}
    with pytest.raises(MemoryBudgetError, match="4000 bytes") as ei:
        resurgo.async_save(state, tmp_path / "c", staging_bytes=3999)
    assert isinstance(ei.value, MemoryError)
    assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []
    h = resurgo.async_save(state, tmp_path / "c", staging_bytes=3999, fallback="sync")
    assert h.done() and h.staged()
    assert h.wait().tensor_bytes == 4000
    assert torch.equal(resurgo.load_dict(tmp_path / "c")["a"], torch.ones(1000))
    resurgo.async_save(state, tmp_path / "d", staging_bytes=4000).wait()


def test_errors_in_the_call_raise_at_once(tmp_path):
    resurgo.save({"a": 1}, tmp_path / "exists")
    with pytest.raises(resurgo.CheckpointExistsError):
        resurgo.async_save({"a": 1}, tmp_path / "exists")
    with pytest.raises(resurgo.UnsupportedValueError):
        resurgo.async_save({"a": object()}, tmp_path / "bad")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_guard_hook_is_never_removed_while_step_runs_hooks(tmp_path):
    """A slow user hook before ours: the save commits while step() iterates its hooks."""
    import time

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    slow = {"on": False}
    opt.register_step_pre_hook(lambda *_: time.sleep(0.5) if slow["on"] else None)
    h = resurgo.async_save({"model": model, "optimizer": opt}, tmp_path / "c", guard=opt)
    slow["on"] = True
    model(torch.randn(2, 64)).sum().backward()
    opt.step()  # raised "OrderedDict mutated during iteration" when the writer removed the hook
    h.wait()
    assert len(opt._optimizer_step_pre_hooks) == 2  # the user's and ours, which stays, idle
    opt.step()


def test_wait_in_another_thread_while_step_runs_hooks(tmp_path):
    """A waiter thread's wait() returns while step() iterates its hooks (seen on a GPU, where a
    save commits within a step: wait() removed the hook and step() raised)."""
    import threading
    import time

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    in_hook = threading.Event()

    def slow_hook(*_):
        in_hook.set()
        time.sleep(0.3)

    opt.register_step_pre_hook(slow_hook)  # runs before ours: ours is still to come when wait() runs
    h = resurgo.async_save({"model": model, "optimizer": opt}, tmp_path / "c", guard=opt)
    h.wait_staged()
    waiter = threading.Thread(target=lambda: (in_hook.wait(), h.wait()))
    waiter.start()
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    waiter.join()
    assert h.done()


def test_one_guard_hook_per_optimizer_however_many_saves(tmp_path):
    model, opt = _trained_linear()
    weights = []
    for i in range(3):
        weights.append(model.weight.detach().clone())
        h = resurgo.async_save({"model": model}, tmp_path / f"c{i}", guard=opt)
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        h.wait()
    assert len(opt._optimizer_step_pre_hooks) == 1
    for i, w in enumerate(weights):
        assert torch.equal(resurgo.load_dict(tmp_path / f"c{i}")["model"]["weight"], w)


def test_background_writer_runs_at_lower_priority(tmp_path, monkeypatch):
    import os

    seen = []
    real = async_mod._lower_priority

    def spy():
        real()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    monkeypatch.setattr(async_mod, "_lower_priority", spy)
    resurgo.async_save({"a": torch.ones(3)}, tmp_path / "c").wait()
    assert seen and seen[0] >= 10
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 10  # the caller is untouched


def test_report_carries_the_stall(tmp_path):
    h = resurgo.async_save({"a": torch.ones(10)}, tmp_path / "c")
    report = h.wait()
    assert report.seconds["stall"] == h.stall_seconds > 0
    assert report.seconds["total"] >= report.seconds["stall"]


def test_the_handle_shows_a_user_only_what_to_read_and_wait_for(tmp_path):
    """Its state changes are the save's own: no public method of the handle changes its state."""
    public = {name for name in dir(resurgo.AsyncSaveHandle) if not name.startswith("_")}
    assert public == {"done", "staged", "wait", "wait_staged"}
    h = resurgo.async_save({"a": torch.ones(10)}, tmp_path / "c")
    h.wait_staged()
    report = h.wait()
    assert {name for name in vars(h) if not name.startswith("_")} == {"path", "stall_seconds"}
    assert h.done() and h.staged() and report.path == h.path


def _trained_linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def test_guard_step_takes_over_the_copy_the_background_has_not_done(tmp_path, monkeypatch):
    """The background copy is held back: step() copies the rest itself instead of waiting for it."""
    model, opt = _trained_linear()
    state = {"model": model, "optimizer": opt}
    expected = resurgo.load_dict(_sync_copy(state, tmp_path))
    release = threading.Event()
    held = []

    class HeldBack(async_mod.CopyBatch):
        def run(self):
            if threading.current_thread().name == "resurgo-async-save":
                held.append(release.wait(30))
            super().run()

    monkeypatch.setattr(async_mod, "CopyBatch", HeldBack)
    h = resurgo.async_save(state, tmp_path / "c", guard=opt)
    assert not h.staged()
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # returns although the background thread has not started copying
    assert h.staged() and not release.is_set()
    release.set()
    h.wait()
    assert held == [True]  # the background thread was released, not timed out
    assert bits_equal(resurgo.load_dict(tmp_path / "c"), expected)
    assert not torch.equal(model.weight, expected["model"]["weight"])


def test_guard_copy_failure_lets_step_run_and_is_raised_by_wait(tmp_path, monkeypatch):
    model, opt = _trained_linear()
    real_stage = async_mod._pool.stage

    def failing_stage(leaf, *args, **kwargs):
        staged = real_stage(leaf, *args, **kwargs)
        if leaf.key.endswith("exp_avg"):
            def boom():
                raise OSError(14, "Bad address")
            staged = staged._replace(tasks=[boom])
        return staged

    monkeypatch.setattr(async_mod._pool, "stage", failing_stage)
    h = resurgo.async_save({"model": model, "optimizer": opt}, tmp_path / "c", guard=opt)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # the copy failed: training goes on, the save reports it
    with pytest.raises(OSError, match="Bad address"):
        h.wait()
    assert not (tmp_path / "c").exists()


def _manifest_checksums(path):
    import json

    from resurgo.format.manifest import MANIFEST_NAME

    doc = json.loads((path / MANIFEST_NAME).read_text())
    return {key: [(c["block_bytes"], c["checksums"]) for c in t["chunks"]] for key, t in doc["tensors"].items()}


def test_guard_copy_hashes_blocks_as_it_copies(tmp_path, monkeypatch):
    """The guard's background copy computes the block digests (many slices, odd block sizes);
    the writer hashes only what the call copied, and the digests equal a synchronous save's."""
    from resurgo.pipeline import host_copy

    monkeypatch.setattr(host_copy, "SLICE_BYTES", 3000)
    model, opt = _trained_linear()
    state = {"model": model, "optimizer": opt, "extra": torch.arange(1000)}
    hashed = []
    real = writer.checksum.block_digests
    monkeypatch.setattr(writer.checksum, "block_digests", lambda buf, b: hashed.append(len(buf)) or real(buf, b))
    resurgo.save(state, tmp_path / "sync", block_bytes=1000)
    sync_hashed = sum(hashed)
    hashed.clear()
    h = resurgo.async_save(state, tmp_path / "guard", guard=opt, block_bytes=1000)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    h.wait()
    assert sum(hashed) == 8000  # only "extra" (copied in the call) was hashed by the writer
    assert sync_hashed == h.wait().tensor_bytes
    assert _manifest_checksums(tmp_path / "guard") == _manifest_checksums(tmp_path / "sync")
    from resurgo.pipeline.verify import verify_checkpoint

    assert verify_checkpoint(tmp_path / "guard").problems == []


def test_guarded_saves_without_a_step_between_them(tmp_path):
    """The second save waits for the first; the first's take-over never runs, and does no harm."""
    model, opt = _trained_linear()
    weight = model.weight.detach().clone()
    first = resurgo.async_save({"model": model}, tmp_path / "a", guard=opt)
    second = resurgo.async_save({"model": model}, tmp_path / "b", guard=opt)
    assert first.done()
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    second.wait()
    for name in ("a", "b"):
        assert torch.equal(resurgo.load_dict(tmp_path / name)["model"]["weight"], weight)
    assert len(opt._optimizer_step_pre_hooks) == 1
    opt.step()  # the hook is idle again


def test_guard_hook_does_not_keep_the_optimizer_alive(tmp_path):
    import gc
    import weakref

    model, opt = _trained_linear()
    resurgo.async_save({"model": model}, tmp_path / "c", guard=opt).wait()
    hooks = len(async_mod._guard_hooks)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None and len(async_mod._guard_hooks) == hooks - 1
