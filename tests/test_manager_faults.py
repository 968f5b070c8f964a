"""Fault tests of the CheckpointManager with real processes: SIGKILL at random moments, disk full.

Kill-and-restart: tests/scripts/manager_train.py (async saves every 2 steps, keep_last=2, ~22 MB
of state) is killed with SIGKILL again and again and restarted each time; each kill targets a
phase in turn (training, staging, background write, retention delete): the test waits for the
line the process prints as it enters that phase, then sleeps a random delay and kills. Where a
kill really landed is read afterwards from what it left on disk. After every kill: every
checkpoint directory under a step name is committed and verifies, once anything was committed a
committed checkpoint exists, and the newest committed step never goes back. Every restart must
restore exactly the state the uninterrupted reference run had at that step (digest of parameters
and optimizer state), every loss any process printed must equal the reference's bit for bit, and
the final parameters and optimizer state must equal the reference's bit for bit.

The default run kills 6 times; ``make test-slow`` runs the 52-kill version.

Disk full: a real 8 MiB tmpfs mounted in a private namespace (``unshare -rm``), and everywhere a
fault-injecting variant (a write quota on storage/local.py's writes); see each test's docstring.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from resurgo.manager.catalog import COMMITTED, TEMPORARY, TRASH_TAG, scan
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.storage import direct_io, local
from resurgo.format.manifest import TMP_MARKER

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from kill_resume_worker import parse_losses  # noqa: E402

from helpers import bits_equal  # noqa: E402
from scripts import disk_full, manager_train  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TRAIN = SCRIPTS / "manager_train.py"
PHASES = ("training", "staging", "writing", "deleting")
SLOW_DELETE = 0.15  # seconds between the rename and the removal of files (widens that window only)
LINE_TIMEOUT = 120.0


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _forkserver():
    """A multiprocessing context whose server process has imported torch, resurgo and the training
    script and done nothing else: each process forked from it is a new process in the state a
    fresh interpreter reaches after its imports, without paying 2-4 s of imports per restart."""
    ctx = mp.get_context("forkserver")
    # torch._dynamo: creating an optimizer imports it (and sympy), 2+ s, on first use
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "resurgo", "scripts.manager_train"])
    return ctx


class Run:
    """One training process (a fresh interpreter, or forked from the pre-imported server); a
    thread collects its stdout lines."""

    def __init__(self, root: Path, out: Path, steps: int, log: Path, fresh_interpreter: bool):
        argv = ["--root", str(root), "--out", str(out), "--steps", str(steps), "--slow-delete", str(SLOW_DELETE)]
        self.log = log
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        if fresh_interpreter:
            self._stderr = open(log, "w")
            popen = subprocess.Popen([sys.executable, str(TRAIN), *argv], stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env=_env())
            self.pid, self._wait = popen.pid, lambda: popen.wait(timeout=LINE_TIMEOUT)
            threading.Thread(target=self._read, args=(lambda: popen.stdout,), daemon=True).start()
        else:
            fifo = log.with_suffix(".fifo")
            os.mkfifo(fifo)
            proc = _forkserver().Process(target=manager_train.forked_main, args=(argv, str(fifo), str(log)))
            proc.start()

            def wait() -> int:
                proc.join(LINE_TIMEOUT)
                assert proc.exitcode is not None, f"{log}: still running after {LINE_TIMEOUT} s"
                return proc.exitcode

            self.pid, self._wait = proc.pid, wait
            threading.Thread(target=self._read, args=(lambda: open(fifo),), daemon=True).start()

    def _read(self, open_stream) -> None:
        with open_stream() as stream:
            for line in stream:
                self.lines.append(line)
                self._queue.put(line)
        self._queue.put(None)

    def next_line(self) -> str | None:
        """The next line, or None at the end of the output."""
        try:
            return self._queue.get(timeout=LINE_TIMEOUT)
        except queue.Empty:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended without closing its output (died before opening it)
                pass
            raise AssertionError(f"no output for {LINE_TIMEOUT} s:\n{''.join(self.lines[-20:])}\n"
                                 f"{self.log.read_text() if self.log.exists() else ''}") from None

    def wait_for(self, prefix: str) -> str | None:
        while (line := self.next_line()) is not None:
            if line.startswith(prefix):
                return line
        return None

    def no_deletion_under_way(self) -> bool:
        started = sum(line.startswith("EVENT deleting step") for line in self.lines)
        return started == sum(line.startswith("EVENT deleted step") for line in self.lines)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def finish(self) -> int:
        """The exit status (negative: the signal that ended it), once all output is read."""
        rc = self._wait()
        while self.next_line() is not None:
            pass
        if hasattr(self, "_stderr"):
            self._stderr.close()
        return rc


def kill_in(run: Run, phase: str, rng: random.Random) -> bool:
    """Wait until ``run`` enters ``phase``, sleep a random delay, SIGKILL. False if it ended first."""
    if phase == "training":
        marker, delay = "LOSS", rng.uniform(0.0, 0.03)
        for _ in range(rng.randint(0, 2)):
            if run.wait_for("LOSS") is None:
                return False
        # Retention deletes in the background (paused SLOW_DELETE in the middle): a kill meant for
        # training waits for a step taken while no deletion is under way.
        while not run.no_deletion_under_way():
            if run.wait_for("LOSS") is None:
                return False
    else:
        marker, delay = {"staging": ("EVENT saving step", rng.uniform(0.0, 0.012)),
                         "writing": ("EVENT staged step", rng.uniform(0.0, 0.15)),
                         "deleting": ("EVENT deleting step", rng.uniform(0.0, SLOW_DELETE))}[phase]
    if run.wait_for(marker) is None:
        return False
    time.sleep(delay)
    run.kill()
    return run.finish() == -signal.SIGKILL


def landed_in(root: Path, lines: list[str]) -> str:
    """Where the kill landed, judged by the killed process's last lines and what it left on disk."""
    leftovers = [p for p in root.iterdir() if TMP_MARKER in p.name] if root.exists() else []
    if any(TRASH_TAG in p.name for p in leftovers):
        return "deleting"  # renamed away, files not yet (all) removed
    events = [line.split()[1] for line in lines if line.startswith("EVENT saving step") or
              line.startswith("EVENT staged step")]
    if events and events[-1] == "saving":
        return "staging"  # a save had begun and its snapshot was not complete
    if any((tmp / "manifest.json").exists() for tmp in leftovers):
        return "committing"
    if leftovers:
        return "writing"  # snapshot taken, the background write had not committed
    return "training"


def check_root_after_kill(root: Path, history: dict) -> int | None:
    """The invariants of the root once the process is dead; returns the newest committed step."""
    entries = scan(root)
    named = [e for e in entries if e.status != TEMPORARY]
    assert all(e.status == COMMITTED for e in named), [(e.path.name, e.status, e.detail) for e in named]
    committed = [e.step for e in named]
    if history["seen_commit"]:
        assert committed, "a committed checkpoint existed before this kill, none after it"
    if not committed:
        return None
    history["seen_commit"] = True
    newest = max(committed)
    assert newest >= history["newest"], f"the newest committed step went back from {history['newest']} to {newest}"
    history["newest"] = newest
    for e in named:
        report = verify_checkpoint(e.location)
        assert report.ok, (e.path, report.problems)
    return newest


def lines_with(lines: list[str], tag: str) -> list[list[str]]:
    return [line.split() for line in lines if line.startswith(tag + " ")]


def assert_same_result(ref_path: Path, res_path: Path) -> None:
    ref, res = torch.load(ref_path, weights_only=True), torch.load(res_path, weights_only=True)
    assert bits_equal(ref["params"], res["params"]), "parameters differ from the uninterrupted run"
    assert bits_equal(ref["optimizer"], res["optimizer"]), "optimizer state differs from the uninterrupted run"
    assert (ref["step"], ref["epoch"]) == (res["step"], res["epoch"])


def kill_and_restart(tmp_path: Path, kills: int, seed: int, fresh_interpreter: bool) -> Counter:
    rng = random.Random(seed)
    steps = 4 * kills + 12
    root = tmp_path / "root"
    reference = Run(tmp_path / "ref-root", tmp_path / "ref.pt", steps, tmp_path / "ref.log", fresh_interpreter)

    history = {"seen_commit": False, "newest": -1}
    landed: Counter = Counter()
    runs: list[Run] = []
    restored: list[tuple[int, str, int | None]] = []  # (step, digest, newest committed when it started)
    newest: int | None = None
    for i in range(kills + 1):
        run = Run(root, tmp_path / "out.pt", steps, tmp_path / f"run{i}.log", fresh_interpreter)
        runs.append(run)
        line = run.wait_for("RESTORED")
        assert line is not None, (tmp_path / f"run{i}.log").read_text()
        _, step, digest = line.split()
        restored.append((int(step), digest, newest))
        if i == kills:
            break
        phase = PHASES[i % len(PHASES)]
        assert kill_in(run, phase, rng), f"run {i} ended before it could be killed while {phase}; raise steps"
        landed[landed_in(root, run.lines)] += 1
        newest = check_root_after_kill(root, history)
    final = runs[-1]
    assert final.wait_for("DONE") is not None and final.finish() == 0, (tmp_path / f"run{kills}.log").read_text()
    assert reference.finish() == 0, (tmp_path / "ref.log").read_text()

    ref_digests = {int(s): d for _, s, d in lines_with(reference.lines, "DIGEST")}
    ref_losses = parse_losses(reference.lines)
    assert sorted(ref_losses) == list(range(1, steps + 1))
    for step, digest, newest_on_disk in restored:
        # each process restored the newest committed checkpoint there was, and exactly its state
        assert step == (-1 if newest_on_disk is None else newest_on_disk)
        if step >= 0:
            assert digest == ref_digests[step], f"restored step {step} is not the reference's state at that step"
    for run in runs:
        for s, loss in parse_losses(run.lines).items():
            assert loss.hex() == ref_losses[s].hex(), f"loss at step {s} differs from the uninterrupted run"
    assert_same_result(tmp_path / "ref.pt", tmp_path / "out.pt")
    assert all(e.status == COMMITTED for e in scan(root))
    assert [e.step for e in scan(root)] == [steps - 2, steps]  # keep_last=2
    print(f"\n{kills} kills landed in: {json.dumps(dict(landed))}")
    return landed


@pytest.mark.slow  # a soak of random kills, 13-14 s
def test_sigkill_at_random_moments_loses_nothing(tmp_path):
    landed = kill_and_restart(tmp_path, kills=6, seed=5, fresh_interpreter=False)
    assert sum(landed.values()) == 6


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 52 fresh interpreters, each importing torch: minutes on 2 cores
def test_sigkill_fifty_times_loses_nothing(tmp_path):
    landed = kill_and_restart(tmp_path, kills=52, seed=11, fresh_interpreter=True)
    assert sum(landed.values()) == 52
    for phase in PHASES:
        assert landed[phase] >= 1, landed


# -- disk full -------------------------------------------------------------------------------------
def check_disk_full(result: dict, root: Path) -> None:
    step3 = str(root / "step_000000003")
    assert result["error"] == {
        "type": "StorageError", "is_resurgo_error": True, "errno": 28,
        "message": f"[Errno 28] {step3} (saving data/rank00000-000.safetensors): write failed after "
                   f"{disk_full.LEFT_FREE} bytes: No space left on device"}
    assert result["after_failure"] == ["step_000000001", "step_000000002"]  # no temporary leftovers
    assert {int(k): v for k, v in result["older_intact"].items()} == {1: True, 2: True}
    assert result["after_retry"] == ["step_000000001", "step_000000002", "step_000000003"]
    assert result["retry_exact"] is True


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


def test_disk_full_on_a_real_tmpfs(tmp_path):
    """A real 8 MiB tmpfs, mounted in a private user+mount namespace (``unshare -rm``, no root needed
    where unprivileged user namespaces are allowed) that only the scenario process sees. Where
    mounting is impossible this test is skipped and the fault-injecting variant below covers it."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (no unshare -rm); test_disk_full_injected covers the scenario")
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs "$1" && exec "$2" "$3" "$1"', "sh",
         str(mount), sys.executable, str(SCRIPTS / "disk_full.py")],
        capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["fs_bytes"] == 8 << 20
    for mode in ("sync", "async"):
        check_disk_full(doc[mode], mount / mode)
    assert list(mount.iterdir()) == []  # the tmpfs was private to that process: nothing here


class _QuotaOS:
    """``os`` for storage/local.py with a write quota: past it, os.write fails with ENOSPC."""

    def __init__(self) -> None:
        self.left: int | None = None

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, data) -> int:
        if self.left is None:
            return os.write(fd, data)
        if self.left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, memoryview(data)[: self.left])
        self.left -= n
        return n


@pytest.mark.parametrize("use_async", [False, True])
def test_disk_full_injected(tmp_path, monkeypatch, use_async):
    """Fault injection: the local backend's ``os`` (storage/local.py, and storage/direct_io.py for
    data files) gets a write quota (512 KiB once "full"), so the real write paths meet ENOSPC
    exactly as on a full filesystem; "freeing space" lifts the quota. Runs everywhere, including
    where no tmpfs can be mounted."""
    quota = _QuotaOS()
    monkeypatch.setattr(local, "os", quota)
    monkeypatch.setattr(direct_io, "os", quota)

    def fill() -> None:
        quota.left = disk_full.LEFT_FREE

    def free() -> None:
        quota.left = None

    root = tmp_path / "root"
    check_disk_full(disk_full.scenario(root, fill, free, async_save=use_async), root)
