"""A load that races an overwrite sees one version of the checkpoint, old or new, never a mix,
and never reports corruption for it; real corruption is still reported, without endless retries."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import CheckpointReplacedError, CorruptCheckpointError
from resurgo.pipeline import consistent
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.storage import local

KEYS = [f"t{i}" for i in range(6)]


def versioned(v: int) -> dict:
    """Every tensor holds ``v`` (several data files: a mix of versions would show)."""
    return {**{k: torch.full((128, 64), float(v)) for k in KEYS}, "version": v}


def blank() -> dict:
    return {**{k: torch.zeros(128, 64) for k in KEYS}, "version": -1}


def one_version(tensors: dict, step: int | None) -> int:
    values = {float(tensors[k][0, 0]) for k in KEYS}
    assert len(values) == 1, f"a mix of versions: {sorted(values)}"
    (v,) = values
    assert all(bool((tensors[k] == v).all()) for k in KEYS)
    assert tensors["version"] == v == step, (tensors["version"], v, step)
    return int(v)


class Overwriter:
    """Saves version 1, 2, 3, ... over one path, one every few milliseconds, until stopped."""

    def __init__(self, path: str | Path, storage_options: dict | None = None):
        self.path, self.options = path, storage_options
        self.version = 1
        resurgo.save(versioned(1), path, step=1, io_threads=4, storage_options=storage_options)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.version += 1
                resurgo.save(versioned(self.version), self.path, step=self.version, overwrite=True, io_threads=4,
                             storage_options=self.options)
                time.sleep(0.005)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e

    def __enter__(self) -> "Overwriter":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        assert self.error is None, self.error


def race(path: str | Path, seconds: float, storage_options: dict | None = None) -> tuple[int, set[int]]:
    """Load (in place and as a dict) and verify while an Overwriter replaces the checkpoint."""
    loads, seen = 0, set()
    with Overwriter(path, storage_options) as writer:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            target = blank()
            report = resurgo.load(target, path, storage_options=storage_options)
            seen.add(one_version(target, report.step))
            loaded = resurgo.load_dict(path, storage_options=storage_options)
            seen.add(one_version(loaded, loaded["version"]))
            assert verify_checkpoint(path, storage_options=storage_options).ok
            loads += 2
        assert writer.version > 3
    return loads, seen


def test_loads_racing_overwrites_see_one_version_never_corruption(tmp_path):
    loads, seen = race(tmp_path / "ck", 3.0)
    assert loads > 20 and len(seen) > 3  # versions changed under the loads many times


def test_object_store_loads_racing_overwrites_see_one_version(mem_url):
    loads, seen = race(f"{mem_url}/ck", 2.0)
    assert loads > 10 and len(seen) > 2


@pytest.mark.slow
def test_loads_racing_overwrites_soak(tmp_path):
    loads, seen = race(tmp_path / "ck", 30.0)
    assert loads > 200 and len(seen) > 30


def test_a_flipped_byte_is_still_corruption_and_is_not_retried(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    resurgo.save(versioned(1), path, step=1)
    data = next((path / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x10
    data.write_bytes(bytes(raw))
    checks = []
    original = consistent.manifest_changed
    monkeypatch.setattr(consistent, "manifest_changed", lambda *a: (checks.append(original(*a)), checks[-1])[1])
    for load in (lambda: resurgo.load(blank(), path), lambda: resurgo.load_dict(path)):
        checks.clear()
        with pytest.raises(CorruptCheckpointError, match=r"tensor 't\d' is corrupt in data/.*does not match"):
            load()
        assert checks == [False]  # one look at the manifest: unchanged, so the error is real
    checks.clear()
    report = verify_checkpoint(path)
    assert not report.ok and "does not match its checksum" in report.problems[0] and checks == [False]


def test_a_checkpoint_replaced_at_every_attempt_raises_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    resurgo.save(versioned(1), path, step=1)
    version = [1]
    original = local.PinnedCheckpointDir.read_manifest_bytes

    def replaced_meanwhile(self):  # an overwrite commits right after each pin
        raw = original(self)
        version[0] += 1
        resurgo.save(versioned(version[0]), path, step=version[0], overwrite=True)
        return raw

    monkeypatch.setattr(local.PinnedCheckpointDir, "read_manifest_bytes", replaced_meanwhile)
    with pytest.raises(CheckpointReplacedError, match=r"ck: replaced by another save 5 times while being read"):
        resurgo.load_dict(path)
    assert isinstance(CheckpointReplacedError("x"), OSError)
    monkeypatch.undo()
    assert one_version(resurgo.load_dict(path), resurgo.read_manifest(path).step) == version[0]
    assert os.listdir(tmp_path) == ["ck"]


@pytest.mark.parametrize("how", ["error", "version"])
def test_ranks_retry_together_and_end_on_one_version(tmp_path, how):
    from dist_harness import run_ranks

    resurgo.save({"w": torch.full((8,), 1.0)}, tmp_path / "ck", step=1)
    resurgo.save({"w": torch.full((8,), 1.0)}, tmp_path / "other", step=2)  # same data files, another manifest
    results = run_ranks(2, "dist_workers:load_while_replaced", str(tmp_path / "ck"), str(tmp_path / "other"), how)
    assert results == [[2, 1, 1.0], [2, 1, 1.0]] or results == [(2, 1, 1.0), (2, 1, 1.0)]
