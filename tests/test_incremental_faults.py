"""SIGKILL during incremental saves, retention and gc: after every kill, every committed checkpoint
of the root verifies and loads bit for bit (no dangling reference), and the run resumes.

The default suite kills a few times; the ``slow`` variant many more."""

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
from resurgo.manager.catalog import COMMITTED, scan
from resurgo.pipeline.verify import verify_checkpoint

SCRIPT = Path(__file__).resolve().parent / "scripts" / "incremental_loop.py"
sys.path.insert(0, str(SCRIPT.parent))
from incremental_loop import state_at  # noqa: E402


def check_all_committed(root: Path) -> list[int]:
    steps = []
    for e in scan(root):
        if e.status != COMMITTED:
            assert e.status in ("incomplete", "temporary"), (e.name, e.status, e.detail)
            continue
        report = verify_checkpoint(root / e.name)
        assert report.ok, (e.name, report.problems)
        loaded, expected = resurgo.load_dict(root / e.name), state_at(e.step)
        assert loaded["step"] == e.step
        for key in ("emb", "frozen"):
            assert torch.equal(loaded[key].view(torch.int32), expected[key].view(torch.int32)), (e.name, key)
        steps.append(e.step)
    return steps


def kill_and_check(root: Path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    newest = 0
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(root)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the first save of this run: past imports and restore
        assert line.startswith("SAVED"), line + (proc.stderr.read() if proc.stderr else "")
        time.sleep(rng.uniform(0.0, 0.4))  # lands in a save, a retention deletion or a gc
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        steps = check_all_committed(root)
        assert steps and max(steps) >= newest  # the run resumes from its newest checkpoint
        newest = max(steps)


def test_sigkill_during_incremental_saves_and_gc(tmp_path: Path):
    kill_and_check(tmp_path, kills=2, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_during_incremental_saves_and_gc_soak(tmp_path: Path):
    kill_and_check(tmp_path, kills=30, seed=2)
