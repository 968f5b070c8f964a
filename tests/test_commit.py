"""Commit protocol: a save that fails or is killed at any moment commits nothing and damages nothing."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import CheckpointExistsError, StorageError
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.storage import local

SCRIPTS = Path(__file__).parent / "scripts"


def tmp_leftovers(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if local.TMP_MARKER in p.name]


def test_existing_checkpoint_is_refused_without_overwrite(tmp_path):
    path = tmp_path / "c"
    resurgo.save({"a": torch.ones(3)}, path)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        resurgo.save({"a": torch.zeros(3)}, path)
    assert torch.equal(resurgo.load_dict(path)["a"], torch.ones(3))
    assert tmp_leftovers(tmp_path) == []
    (tmp_path / "plainfile").write_text("keep me")
    with pytest.raises(CheckpointExistsError):
        resurgo.save({"a": torch.ones(3)}, tmp_path / "plainfile", overwrite=True)
    assert (tmp_path / "plainfile").read_text() == "keep me"


def test_overwrite_replaces_atomically_and_never_in_place(tmp_path):
    path = tmp_path / "c"
    resurgo.save({"a": torch.ones(1000)}, path)
    # Hard links keep the old files' inodes reachable: their bytes must not change.
    keep = tmp_path / "keep"
    keep.mkdir()
    old = {}
    for f in path.rglob("*"):
        if f.is_file():
            link = keep / f.name
            os.link(f, link)
            old[link] = f.read_bytes()
    resurgo.save({"a": torch.zeros(1000)}, path, overwrite=True)
    assert torch.equal(resurgo.load_dict(path)["a"], torch.zeros(1000))
    for link, content in old.items():
        assert link.read_bytes() == content
    assert tmp_leftovers(tmp_path) == []


@pytest.mark.parametrize("fail_at", ["write", "fsync", "rename", "exchange"])
def test_failed_save_commits_nothing_and_keeps_the_old_checkpoint(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "c"
    resurgo.save({"a": torch.ones(100)}, path)

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if fail_at == "write":
        monkeypatch.setattr(local.os, "write", boom)
    elif fail_at == "fsync":
        monkeypatch.setattr(local.os, "fsync", boom)
    elif fail_at == "rename":
        monkeypatch.setattr(local.os, "rename", boom)
        monkeypatch.setattr(local, "_exchange", lambda *args: False)
    else:
        monkeypatch.setattr(local, "_exchange", boom)
    with pytest.raises(StorageError) as ei:
        resurgo.save({"a": torch.zeros(100)}, path, overwrite=True)
    assert ei.value.errno == 28 and str(path) in str(ei.value)
    monkeypatch.undo()
    assert torch.equal(resurgo.load_dict(path)["a"], torch.ones(100))
    assert verify_checkpoint(path).ok
    assert tmp_leftovers(tmp_path) == []
    with pytest.raises(StorageError):
        monkeypatch.setattr(local.os, "write", boom)
        resurgo.save({"a": torch.zeros(100)}, tmp_path / "new")
    monkeypatch.undo()
    assert not (tmp_path / "new").exists()


def test_exchange_fallback_without_renameat2(tmp_path, monkeypatch):
    path = tmp_path / "c"
    resurgo.save({"a": torch.ones(3)}, path)
    monkeypatch.setattr(local, "_exchange", lambda *args: False)
    resurgo.save({"a": torch.zeros(3)}, path, overwrite=True)
    assert torch.equal(resurgo.load_dict(path)["a"], torch.zeros(3))
    assert tmp_leftovers(tmp_path) == []


def check_after_kill(root: Path) -> int:
    """Every committed checkpoint is complete and self-consistent; returns how many there are."""
    sys.path.insert(0, str(SCRIPTS))
    from save_loop import state_for

    committed = 0
    for p in sorted(root.iterdir()):
        if local.TMP_MARKER in p.name:
            with pytest.raises(resurgo.ResurgoError):
                resurgo.load_dict(p)  # a leftover is never a checkpoint
            continue
        out = resurgo.load_dict(p)
        i = out["i"]
        if p.name.startswith("step_"):
            assert p.name == f"step_{i:06d}"
        expected = state_for(i)
        assert torch.equal(out["big"], expected["big"]) and torch.equal(out["small"], expected["small"])
        committed += 1
    return committed


@pytest.mark.parametrize("seed", range(6))
def test_sigkill_during_saves_leaves_only_complete_checkpoints(tmp_path, seed):
    rng = random.Random(seed)
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "save_loop.py"), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        seen = -1
        target = rng.randint(0, 2)
        while seen < target:  # wait for a few commits, then kill at a random moment
            line = proc.stdout.readline()
            assert line, "save loop died"
            seen = int(line.split()[1])
        time.sleep(rng.uniform(0, 0.25))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    n = check_after_kill(tmp_path)
    assert n >= seen + 2  # `latest` plus every step_i announced
    assert (tmp_path / "latest").exists()  # overwrite never leaves the path empty
    assert resurgo.load_dict(tmp_path / f"step_{seen:06d}")["i"] == seen
