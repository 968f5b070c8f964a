"""A load whose bytes fail a checksum leaves every damaged target tensor exactly as it was
(bitwise), on every load path: plain, resharded (Shard, FlatShard, DTensor targets; a tensor
assembled from a good and a bad chunk), 2 gloo ranks with and without shared reads, and a
manager's restore. The CorruptCheckpointError lists the keys this rank loaded (each equal to the
saved tensor, bitwise) and those it left untouched (each equal to what it held before)."""

from __future__ import annotations

import copy
import importlib.util
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import load_atomic_workers as w
import resurgo
from dist_harness import run_ranks
from helpers import bits_equal, flip_stored_bit, random_tensor
from resurgo.errors import CorruptCheckpointError
from resurgo.format.manifest import parse_manifest
from resurgo.pipeline.reader import place_destinations, plan_tasks, read_ops
from resurgo.plan.load_plan import plan_reads
from resurgo.state.unflatten import TargetFill
from resurgo.storage.local import CheckpointDir


def _bench_common():
    """benchmarks/common.py, whose ``evict`` drops files from the page cache."""
    spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).resolve().parents[1] / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_common"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _sixteen() -> dict[str, torch.Tensor]:
    """16 tensors of 0.25-3 MiB: several reads each for some, several per read for others."""
    return {f"t{i:02d}": random_tensor(torch.float32, (64 * (1 + i % 4), 1024 * (1 + i % 3)), seed=i) for i in range(16)}


def _check_split(error: CorruptCheckpointError, keys: list[str], target: dict, before: dict, saved: dict) -> None:
    """loaded and untouched partition ``keys``; loaded ones hold the saved bytes, untouched ones
    what they held before."""
    assert sorted(error.loaded + error.untouched) == sorted(keys)
    assert not set(error.loaded) & set(error.untouched)
    for k in error.loaded:
        assert bits_equal(target[k], saved[k]), k
    for k in error.untouched:
        assert bits_equal(target[k], before[k]), k


@pytest.mark.parametrize("io_threads", [1, 4])
@pytest.mark.parametrize("damaged", ["t05", "t15"])
@pytest.mark.parametrize("cached", [True, False])
def test_damaged_tensor_is_untouched(tmp_path, monkeypatch, io_threads, damaged, cached):
    """Bytes the page cache holds are hashed where they are; others are faulted in through the
    mapping first (``cached`` False: the data files are dropped from the page cache)."""
    saved = _sixteen()
    path = tmp_path / "ck"
    resurgo.save({"model": saved, "step": 3}, path)
    data_file = flip_stored_bit(path, f"model.{damaged}")
    if not cached:
        _bench_common().evict(path / "data")
    target = {"model": {k: torch.full_like(v, -1.0) for k, v in saved.items()}, "step": 0}
    before = copy.deepcopy(target)
    with pytest.raises(CorruptCheckpointError) as info:
        resurgo.load(target, path, io_threads=io_threads)
    e = info.value
    assert type(e) is CorruptCheckpointError
    message = str(e)
    assert str(path) in message and data_file in message and f"'model.{damaged}'" in message
    assert "left untouched" in message and "and 8 more" not in message or len(e.untouched) > 8
    keys = [f"model.{k}" for k in saved]
    assert f"model.{damaged}" in e.untouched
    _check_split(e, keys, {f"model.{k}": v for k, v in target["model"].items()},
                 {f"model.{k}": v for k, v in before["model"].items()}, {f"model.{k}": v for k, v in saved.items()})
    assert target["step"] == 0  # no value of the target changes either
    if io_threads == 1 and damaged == "t15":  # one worker fills each verified group of reads before the next
        assert e.loaded and e.loaded == keys[: len(e.loaded)]


@pytest.mark.parametrize("io_threads", [1, 4])
def test_tensors_of_one_read_are_loaded_alone(tmp_path, io_threads):
    """Small tensors back to back in a file are read in one request, but each is a unit of its
    own: those before the damaged one in the request are loaded (each verified, then filled), the
    damaged one and those after it are untouched."""
    saved = {f"t{i:02d}": random_tensor(torch.float32, (64, 256), seed=i) for i in range(16)}  # 64 KiB each
    path = tmp_path / "ck"
    resurgo.save(saved, path)
    ckpt = CheckpointDir(path)
    manifest = parse_manifest(ckpt.read_manifest_bytes(), "test")
    target_fill = TargetFill(manifest)
    target_fill.plan({k: torch.zeros_like(v) for k, v in saved.items()})
    placed, _, _ = place_destinations(target_fill.destinations)
    assert len(plan_reads(placed, {d.key: d.entry for d in target_fill.destinations})) == 1  # one request
    flip_stored_bit(path, "t09")
    target = {k: torch.full_like(v, 7.0) for k, v in saved.items()}
    with pytest.raises(CorruptCheckpointError) as info:
        resurgo.load(target, path, io_threads=io_threads)
    assert info.value.loaded == [f"t{i:02d}" for i in range(9)]
    assert info.value.untouched == [f"t{i:02d}" for i in range(9, 16)]
    for i, (k, v) in enumerate(target.items()):
        assert bits_equal(v, saved[k] if i < 9 else torch.full_like(v, 7.0)), k


def test_module_target_untouched(tmp_path):
    """An nn.Module's parameters (filled in place through its state_dict) and its
    load_state_dict: nothing of a damaged one changes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    resurgo.save({"model": model}, tmp_path / "ck")
    flip_stored_bit(tmp_path / "ck", "model.0.weight")
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(CorruptCheckpointError) as info:
        resurgo.load({"model": fresh}, tmp_path / "ck")
    assert "model.0.weight" in info.value.untouched
    for k, v in fresh.state_dict().items():
        if f"model.{k}" not in info.value.loaded:
            assert bits_equal(v, before[k]), k


def test_no_damage_loads_everything(tmp_path):
    saved = _sixteen()
    resurgo.save(saved, tmp_path / "ck")
    for threads in (1, 4):
        target = {k: torch.zeros_like(v) for k, v in saved.items()}
        resurgo.load(target, tmp_path / "ck", io_threads=threads)
        assert bits_equal(target, saved)


@pytest.fixture(scope="module")
def two_chunks(tmp_path_factory):
    """``big`` saved by 2 ranks in 2 chunks (rows 0-127, 128-255); row 150 damaged."""
    path = str(tmp_path_factory.mktemp("atomic") / "ck")
    run_ranks(2, "load_atomic_workers:save", path, timeout=120)
    w.damage(path, "big", 150)
    return path


@pytest.mark.parametrize("layout", ["plain", "mid_rows", "mid_flat"])
def test_assembled_from_good_and_bad_chunk(two_chunks, layout):
    """One process, a target that needs both chunks of ``big``: the good chunk's bytes do not
    land either."""
    out = w.load_damaged(0, 1, two_chunks, layout, None, 4)
    _check_outcome(out, needs_bad_chunk=True)


def _check_outcome(out: dict, needs_bad_chunk: bool) -> None:
    keys = sorted(w.reference())
    assert out["error"] == "CorruptCheckpointError"
    assert "'big'" in out["message"] and "rank00001" in out["message"] and two_chunks_name(out["message"])
    assert sorted(out["loaded"] + out["untouched"]) == keys
    assert set(out["loaded"]) <= set(out["as_saved"])
    assert set(out["untouched"]) <= set(out["unchanged"])
    if needs_bad_chunk:
        assert "big" in out["untouched"]
    assert out["step"] == 0


def two_chunks_name(message: str) -> bool:
    return "/ck" in message


@pytest.mark.parametrize("share_reads", [False, True])
def test_two_ranks(two_chunks, share_reads):
    """2 gloo ranks, each layout: every rank raises CorruptCheckpointError; a rank whose part of
    ``big`` lies in the damaged chunk leaves it untouched. Shared, every byte a rank needs from
    another rank's read waits in memory until every rank's reads verified."""
    layouts = ["plain", "dt_s0", "manual", "flat"]
    outs = run_ranks(2, "load_atomic_workers:load_damaged_layouts", two_chunks, layouts, share_reads, 4, timeout=180)
    for rank, by_layout in enumerate(outs):
        for layout in layouts:
            _check_outcome(by_layout[layout], needs_bad_chunk=rank == 1 or layout == "plain")
            assert f"target tensors on rank {rank}, " in by_layout[layout]["message"]


def test_manager_restore(tmp_path):
    """restore(step=) of a damaged checkpoint raises and leaves the target as it was; restore()
    skips it and loads the step before, whole."""
    one, two = _sixteen(), {k: v + 1 for k, v in _sixteen().items()}
    with resurgo.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save({"model": one}, 1)
        mgr.save({"model": two}, 2)
    flip_stored_bit(mgr.path_for(2, 0), "model.t03")
    target = {"model": {k: torch.zeros_like(v) for k, v in one.items()}}
    before = copy.deepcopy(target)
    with resurgo.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(CorruptCheckpointError) as info:
            mgr.restore(target, step=2)
        assert "model.t03" in info.value.untouched
        for k, v in target["model"].items():
            expected = two[k] if f"model.{k}" in info.value.loaded else before["model"][k]
            assert bits_equal(v, expected), k
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert mgr.restore(target) == 1
    assert bits_equal(target["model"], one)


class _Flipping:
    """A data file read like an object store's or a peer's (no mapping): every read's bytes land
    in the caller's buffers, one byte flipped in the bytes of ``file_range``."""

    def __init__(self, handle, file_range: tuple[int, int]):
        self.handle, self.file_range = handle, file_range
        self.rel, self.size = handle.rel, handle.size

    def read_into_many(self, offset, bufs):
        self.handle.read_into_many(offset, bufs)
        at = offset
        for b in bufs:
            view = np.frombuffer(b, dtype=np.uint8)
            lo, hi = max(at, self.file_range[0]), min(at + len(view), self.file_range[1])
            if lo < hi:
                view[lo - at] ^= 0x01
            at += len(view)

    def read_into(self, offset, buf):
        self.read_into_many(offset, [buf])

    def read_at(self, offset, n):
        return self.handle.read_at(offset, n)

    def close(self):
        self.handle.close()


def test_bytes_read_into_memory_wait_there_until_verified(tmp_path):
    """Reads from a handle without a mapping (object stores, peers' sends) are held in memory and
    copied into place once every read of their tensors verified: a tensor with a damaged read
    keeps its bytes (the damage is in its last read: its first three verified); those read after
    it are not filled; the loaded set says which were."""
    saved = {f"t{i}": random_tensor(torch.float32, (1024, 1024), seed=i) for i in range(6)}  # 4 MiB: a read each
    resurgo.save(saved, tmp_path / "ck")
    ckpt = CheckpointDir(tmp_path / "ck")
    manifest = parse_manifest(ckpt.read_manifest_bytes(), "test")
    (name,) = manifest.files
    chunk = manifest.tensors["t3"].chunks[0]
    targets = {k: torch.full_like(v, 2.0) for k, v in saved.items()}
    before = copy.deepcopy(targets)
    target_fill = TargetFill(manifest)
    target_fill.plan(targets)
    placed, bufs, _ = place_destinations(target_fill.destinations)
    entries = {d.key: d.entry for d in target_fill.destinations}
    ops = plan_reads(placed, entries, max_piece_bytes=1 << 20)  # 4 reads per tensor
    tasks = plan_tasks(manifest, ops, {name}, True)
    assert len(tasks) == 24
    loaded: set[str] = set()
    handle = _Flipping(ckpt.open_read(name), (chunk.byte_range[0] + (3 << 20), chunk.byte_range[0] + (3 << 20) + 1))
    with pytest.raises(CorruptCheckpointError, match="'t3'"):
        read_ops(ckpt, manifest, entries, bufs, ops, threads=1, handles={name: handle}, tasks=tasks, loaded=loaded)
    handle.close()
    assert loaded == {"t0", "t1", "t2"}  # one reader: each tensor filled as soon as it verified
    for k in saved:
        assert bits_equal(targets[k], saved[k] if k in loaded else before[k]), k


def test_peer_restore_leaves_targets_untouched(tmp_path):
    """A memory tier's peer restore (4 ranks, 2 nodes) whose received bytes fail their checksums:
    the receiving ranks' damaged tensor ``w`` stays as it was, and each of their other tensors is
    either as it was or as saved, never a mix (no durable copy to fall back on: the restore raises)."""
    out = run_ranks(4, "load_atomic_workers:peer_restore_damaged", str(tmp_path), timeout=240)
    assert all(r["error"] is not None for r in out)
    for rank in (2, 3):
        assert "w" in out[rank]["unchanged"] and "w" not in out[rank]["as_saved"]
        assert set(out[rank]["unchanged"]) | set(out[rank]["as_saved"]) == {"w", "b", "mine"}
        assert out[rank]["step"] == -1


def test_one_reader_has_the_next_requests_mapped_ahead_of_it(tmp_path, monkeypatch):
    """With one I/O thread a helper maps the next requests (in order, at most two ahead of the
    reader) while the reader hashes and copies; its failures are left to the reader, which meets
    them itself, and the load is exact either way."""
    from resurgo.pipeline import reader

    saved = {f"t{i:02d}": random_tensor(torch.float32, (1024, 1024), seed=i) for i in range(16)}  # 4 MiB each: 4 requests of 16 MiB
    path = tmp_path / "ck"
    resurgo.save(saved, path)
    mapped_ahead: list[tuple[str, int]] = []
    fetched: list[int] = []
    real_map_ahead, real_fetch = reader._PlanReading.map_ahead, reader._PlanReading.fetch

    def map_ahead(self, task):
        mapped_ahead.append((threading.current_thread().name, task.ops[0].file_offset))
        if len(mapped_ahead) == 2:
            raise OSError(5, "Input/output error")  # the helper stops; the reader maps the rest itself
        real_map_ahead(self, task)

    def fetch(self, task):
        fetched.append(task.ops[0].file_offset if task.ops else -1)
        return real_fetch(self, task)

    monkeypatch.setattr(reader._PlanReading, "map_ahead", map_ahead)
    monkeypatch.setattr(reader._PlanReading, "fetch", fetch)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    resurgo.load(target, path, io_threads=1)
    assert all(bits_equal(target[k], saved[k]) for k in saved)
    assert len(fetched) > 2, fetched
    assert [name for name, _ in mapped_ahead] == ["resurgo-readahead"] * 2
    assert [off for _, off in mapped_ahead] == [off for off in fetched if off >= 0][:2]


def test_verified_parts_are_read_into_place_once_per_run():
    """Read by several threads, a request's verified parts of a local file are read into place
    again: one vectored read per run of parts landing in a target back to back in the file (a
    part copied out through scatters, or a gap, ends a run), each byte where the plan puts it."""
    from resurgo.pipeline.reader import _PlanReading
    from resurgo.plan.load_plan import ReadPart, Scatter

    data = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8)
    calls: list[tuple[int, list[int]]] = []

    class File:
        def read_into_many(self, offset: int, bufs: list[memoryview]) -> None:
            calls.append((offset, [len(b) for b in bufs]))
            for b in bufs:
                np.frombuffer(b, dtype=np.uint8)[:] = data[offset : offset + len(b)]
                offset += len(b)

    bufs = [np.zeros(1000, np.uint8), np.zeros(3000, np.uint8), np.zeros(500, np.uint8)]
    reading = _PlanReading(None, None, {}, bufs, {"f": File()}, verify=True)
    parts = [(ReadPart("a", 0, 1000, 0, 0), 100), (ReadPart("b", 0, 2000, 0, 1, dst_offset=1000), 1100),
             (ReadPart("c", 0, 500, 0, None, scatters=(Scatter(0, 2, 0, 500),)), 3100),
             (ReadPart("d", 0, 1000, 0, 1), 3600), (ReadPart("e", 0, 300, 0, 2, dst_offset=200), 5000)]
    reading.reread_into_place("f", [(p, data[at : at + p.length].data, at) for p, at in parts])
    assert calls == [(100, [1000, 2000]), (3600, [1000]), (5000, [300])]
    assert bufs[0].tobytes() == data[100:1100].tobytes()
    assert bufs[1].tobytes() == data[3600:4600].tobytes() + data[1100:3100].tobytes()
    assert bufs[2].tobytes() == data[3100:3300].tobytes() + data[5000:5300].tobytes()


@pytest.mark.parametrize("io_threads", [1, 4])
def test_files_are_unmapped_by_the_thread_done_with_them(tmp_path, monkeypatch, io_threads):
    """Each data file's mapping is let go once, by the reading thread that finished the file's
    last request or part, before the files are closed (not by the loading thread after the last
    read); the load is exact."""
    import functools

    from resurgo.pipeline import save as save_module
    from resurgo.storage import local_files

    saved = _sixteen()  # about 22 MiB: 4 files when a file holds at least 4 MiB
    monkeypatch.setattr(save_module, "plan_files", functools.partial(save_module.plan_files, min_file_bytes=4 << 20))
    resurgo.save(saved, tmp_path / "ck")
    events: list[tuple[str, str, str]] = []
    unmap, close = local_files.ReadHandle.unmap, local_files.ReadHandle.close

    def recording_unmap(self):
        if self._bytes is not None:
            events.append(("unmap", self.rel, threading.current_thread().name))
        unmap(self)

    def recording_close(self):
        events.append(("close", self.rel, threading.current_thread().name))
        close(self)

    monkeypatch.setattr(local_files.ReadHandle, "unmap", recording_unmap)
    monkeypatch.setattr(local_files.ReadHandle, "close", recording_close)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    resurgo.load(target, tmp_path / "ck", io_threads=io_threads)
    assert bits_equal(target, saved)
    files = sorted({rel for _, rel, _ in events})
    assert len(files) >= 3
    unmapped = [(rel, name) for what, rel, name in events if what == "unmap"]
    assert sorted(rel for rel, _ in unmapped) == files  # each once
    if io_threads > 1:  # one thread reads in the loading thread
        assert all(name != threading.main_thread().name for _, name in unmapped)
    first_close = min(i for i, e in enumerate(events) if e[0] == "close")
    assert all(events.index(("unmap", rel, name)) < first_close for rel, name in unmapped)
