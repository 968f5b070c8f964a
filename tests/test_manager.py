"""CheckpointManager in one process: policies, restore and its fallbacks, retention and crash-safe
deletion, leftovers, preemption signals, the measured save cost and the auto interval, the CLI
on a manager root. Fault tests with real processes are in test_manager_faults.py, multi-rank
agreement in test_manager_dist.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    KeyMismatchError,
    StorageError,
    UnsupportedValueError,
)
from resurgo.manager import CheckpointManager, catalog
from resurgo.manager.catalog import COMMITTED, TEMPORARY, checkpoint_name, scan
from resurgo.pipeline import async_save as async_mod
from resurgo.storage import local
from helpers import bits_equal, flip_stored_bit

runner = CliRunner()


def state_at(step: int) -> dict:
    """A small state whose every value depends on the step."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g), "step": step}


def blank() -> dict:
    return {"w": torch.zeros(64, 16), "b": torch.zeros(16), "step": -1}


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def committed_steps(root: Path) -> list[int]:
    return [e.step for e in scan(root) if e.status == COMMITTED]


# -- saving by policy ------------------------------------------------------------------------------
@pytest.mark.parametrize("use_async", [True, False])
def test_maybe_save_follows_the_policy_and_checkpoints_hold_the_step_state(tmp_path, use_async):
    root = tmp_path / "run"
    with CheckpointManager(root, every_steps=3, async_save=use_async) as mgr:
        decisions = [mgr.maybe_save(state_at(s), s, metrics={"loss": 1.0 / s}) for s in range(1, 11)]
    assert decisions == [s % 3 == 0 for s in range(1, 11)]
    assert names(root) == ["step_000000003", "step_000000006", "step_000000009"]
    for s in (3, 6, 9):
        path = root / checkpoint_name(s)
        assert bits_equal(resurgo.load_dict(path), state_at(s))
        manifest = resurgo.read_manifest(path)
        assert manifest.step == s
        assert manifest.metadata["metrics"] == {"loss": 1.0 / s}
    assert mgr.steps() == [3, 6, 9]


def test_the_same_step_is_never_saved_twice_by_policy(tmp_path):
    with CheckpointManager(tmp_path, every_steps=2) as mgr:
        assert mgr.maybe_save(state_at(2), 2) is True
        assert mgr.maybe_save(state_at(2), 2) is False
        mgr.wait()
        fresh = CheckpointManager(tmp_path, every_steps=2)
        state = blank()
        assert fresh.restore(state) == 2
        assert fresh.maybe_save(state, 2) is False  # a loop that calls maybe_save right after restore
        fresh.close()


def test_metrics_are_stored_as_plain_numbers(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(state_at(1), 1, metrics={"t": torch.tensor(0.25), "n": np.float32(0.5), "i": 3,
                                           "nan": float("nan"), "inf": torch.tensor(float("inf"))})
        with pytest.raises(UnsupportedValueError, match=r"metrics\['x'\]: expected a number, got str"):
            mgr.save(state_at(2), 2, metrics={"x": "high"})
    assert resurgo.read_manifest(tmp_path / checkpoint_name(1)).metadata["metrics"] == {
        "t": 0.25, "n": 0.5, "i": 3.0, "nan": None, "inf": None}
    assert committed_steps(tmp_path) == [1]


# -- restore ---------------------------------------------------------------------------------------
def test_restore_on_an_empty_or_missing_root_is_a_fresh_start(tmp_path):
    with CheckpointManager(tmp_path / "nothing-yet") as mgr:
        state = blank()
        assert mgr.restore(state) is None
        assert bits_equal(state, blank())


def save_steps(root: Path, steps, **kwargs) -> None:
    with CheckpointManager(root, async_save=False, **kwargs) as mgr:
        for s in steps:
            mgr.save(state_at(s), s, metrics={"loss": float(s)})


def test_restore_loads_the_newest_committed_checkpoint(tmp_path):
    save_steps(tmp_path, [10, 20, 30])
    with CheckpointManager(tmp_path) as mgr:
        state = blank()
        assert mgr.restore(state) == 30
        assert bits_equal(state, state_at(30))
        assert mgr.restore(state, step=10) == 10
        assert bits_equal(state, state_at(10))
        with pytest.raises(CheckpointNotFoundError, match="step_000000099: no such checkpoint"):
            mgr.restore(state, step=99)


def test_restore_skips_corrupt_and_incomplete_checkpoints_with_warnings_and_keeps_them(tmp_path):
    save_steps(tmp_path, [10, 20, 30])
    flip_stored_bit(tmp_path / checkpoint_name(30), "w")  # committed, but a block is bad
    (tmp_path / checkpoint_name(40) / "data").mkdir(parents=True)  # a save that never committed
    (tmp_path / checkpoint_name(50)).mkdir()
    (tmp_path / checkpoint_name(50) / "manifest.json").write_text("{not json")
    state = blank()
    with pytest.warns(UserWarning) as record, CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        assert mgr.restore(state) == 20
        assert bits_equal(state, state_at(20))  # nothing of the corrupt 30 is left in the state
        messages = [str(w.message) for w in record]
        assert any("step_000000050" in m and "corrupt" in m and "not valid JSON" in m for m in messages), messages
        assert any("step_000000040" in m and "incomplete" in m and "no manifest.json" in m for m in messages)
        assert any("step_000000030" in m and "tensor 'w'" in m and "checksum" in m for m in messages)
        # retention runs after the next commit; the unreadable checkpoints are neither counted nor deleted
        mgr.save(state_at(25), 25)
        mgr.wait()
    assert names(tmp_path) == ["step_000000025", "step_000000030", "step_000000040", "step_000000050"]


def test_restore_raises_when_no_committed_checkpoint_can_be_loaded(tmp_path):
    save_steps(tmp_path, [5])
    flip_stored_bit(tmp_path / checkpoint_name(5), "b")
    with CheckpointManager(tmp_path) as mgr, pytest.warns(UserWarning, match="not restoring .*step_000000005"):
        with pytest.raises(CorruptCheckpointError, match=r"none of the committed checkpoints could be restored \(steps \[5\]"):
            mgr.restore(blank())
    assert names(tmp_path) == ["step_000000005"]


def test_a_state_mismatch_is_raised_not_skipped(tmp_path):
    save_steps(tmp_path, [1, 2])
    with CheckpointManager(tmp_path) as mgr, warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipping" warning: the caller's state is at fault
        with pytest.raises(KeyMismatchError, match="'extra'"):
            mgr.restore({**blank(), "extra": torch.zeros(1)})


def test_a_checkpoint_whose_manifest_names_another_step_is_not_restored(tmp_path):
    save_steps(tmp_path, [1])
    resurgo.save(state_at(9), tmp_path / checkpoint_name(7), step=9)  # copied under the wrong name
    with CheckpointManager(tmp_path) as mgr, pytest.warns(UserWarning, match="manifest says step 9, its name says step 7"):
        assert mgr.restore(blank()) == 1


# -- retention -------------------------------------------------------------------------------------
@pytest.fixture
def gated_writes(monkeypatch):
    """Background writes wait for the test to open the gate."""
    gate = threading.Event()
    original = async_mod.write_and_commit

    def gated(prep, sources, digests=None, **options):
        assert gate.wait(30)
        return original(prep, sources, digests, **options)

    monkeypatch.setattr(async_mod, "write_and_commit", gated)
    return gate


def test_retention_deletes_only_after_a_newer_checkpoint_is_committed(tmp_path, gated_writes):
    gated_writes.set()
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(state_at(1), 1)
    mgr.wait()
    gated_writes.clear()
    mgr.save(state_at(2), 2)  # staged; its write waits at the gate
    assert mgr.maybe_save(state_at(3), 3) is False
    time.sleep(0.1)
    assert committed_steps(tmp_path) == [1]  # the only committed checkpoint stays
    gated_writes.set()
    mgr.wait()
    assert names(tmp_path) == ["step_000000002"]
    mgr.close()


def test_keep_best_uses_metrics_stored_in_the_checkpoints_across_restarts(tmp_path):
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.7}
    with CheckpointManager(tmp_path, keep_best=("loss", "min", 1), keep_last=1, async_save=False) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(state_at(s), s, metrics={"loss": losses[s]})
    assert committed_steps(tmp_path) == [2, 4]
    with CheckpointManager(tmp_path, keep_best=("loss", "min", 1), keep_last=1) as mgr:  # a new process
        assert mgr.restore(blank()) == 4
        mgr.save(state_at(5), 5, metrics={"loss": 0.4})
    assert committed_steps(tmp_path) == [2, 5]
    with CheckpointManager(tmp_path, keep_best=("loss", "min", 1), keep_last=1) as mgr:
        mgr.save(state_at(6), 6, metrics={"loss": 0.1})
    assert committed_steps(tmp_path) == [6]


def test_deletion_renames_the_checkpoint_away_before_removing_any_file(tmp_path, monkeypatch):
    save_steps(tmp_path, [1, 2])
    seen = []
    real_remove = local.remove_checkpoint_dir

    def watching_remove(path, owned):
        step = catalog.step_of(catalog.temporary_target(Path(path).name))
        seen.append((Path(path).name, step, (tmp_path / checkpoint_name(step)).exists(),
                     [e.status for e in scan(tmp_path) if e.step == step]))
        return real_remove(path, owned)

    monkeypatch.setattr(local, "remove_checkpoint_dir", watching_remove)
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        mgr.save(state_at(3), 3)
    assert sorted(step for _, step, _, _ in seen) == [1, 2]
    for removed, step, original_still_there, statuses in seen:
        assert removed.startswith(f".{checkpoint_name(step)}.resurgo-tmp-trash-") and not original_still_there
        assert statuses == [TEMPORARY]
    assert names(tmp_path) == ["step_000000003"]


def test_an_interrupted_deletion_reads_as_temporary_and_is_cleaned_at_the_next_start(tmp_path, monkeypatch):
    save_steps(tmp_path, [1, 2])
    # The process dies right after the rename, and once more in the middle of removing files.
    monkeypatch.setattr(local, "remove_checkpoint_dir", lambda path, owned: None)
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        mgr.save(state_at(3), 3)
    trash = [p for p in tmp_path.iterdir() if "trash" in p.name]
    assert len(trash) == 2 and committed_steps(tmp_path) == [3]
    os.remove(next((trash[0] / "data").iterdir()))  # half deleted
    for t in trash:
        with pytest.raises(IncompleteCheckpointError, match="temporary directory"):
            resurgo.load(blank(), t)
        (entry,) = [e for e in scan(tmp_path) if e.path.name == t.name]
        assert entry.status == TEMPORARY and "deletion was interrupted" in entry.detail
    monkeypatch.undo()
    with CheckpointManager(tmp_path) as mgr:
        mgr.wait()
        assert mgr.restore(blank()) == 3
    assert names(tmp_path) == ["step_000000003"]


# -- leftovers and replacing -----------------------------------------------------------------------
def test_leftover_temporary_directories_are_removed_and_never_block_a_step(tmp_path):
    save_steps(tmp_path, [4])
    leftover = tmp_path / ".step_000000005.resurgo-tmp-0123456789ab"
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / "rank00000-000.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "notes.txt").write_text("not the manager's")
    with CheckpointManager(tmp_path) as mgr:
        mgr.wait()
        assert names(tmp_path) == ["notes.txt", "step_000000004"]
        mgr.save(state_at(5), 5)
    assert bits_equal(resurgo.load_dict(tmp_path / checkpoint_name(5)), state_at(5))


def test_a_save_that_failed_can_be_made_again_at_the_same_step(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with CheckpointManager(tmp_path, every_steps=1) as mgr:
        monkeypatch.setattr(local.os, "write", no_space)
        assert mgr.maybe_save(state_at(1), 1) is True  # the failure happens in the background
        with pytest.raises(StorageError, match=r"step_000000001 \(saving .*No space left on device"):
            mgr.maybe_save(state_at(2), 2)  # ... and is raised by the next call
        monkeypatch.undo()
        mgr.save(state_at(1), 1)
        mgr.wait()
    assert names(tmp_path) == ["step_000000001"]
    assert bits_equal(resurgo.load_dict(tmp_path / checkpoint_name(1)), state_at(1))


def test_saving_over_an_incomplete_or_corrupt_step_warns_and_replaces_it(tmp_path):
    (tmp_path / checkpoint_name(3) / "data").mkdir(parents=True)
    (tmp_path / checkpoint_name(3) / "data" / "rank00000-000.safetensors").write_bytes(b"cut short")
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.warns(UserWarning, match=r"replacing .*step_000000003 \(incomplete: data/ but no manifest.json"):
            mgr.save(state_at(3), 3)
        resurgo.save(state_at(4), tmp_path / checkpoint_name(4), step=4)
        data = next((tmp_path / checkpoint_name(4) / "data").iterdir())
        data.write_bytes(data.read_bytes()[:-1])  # its manifest verifies, its data does not
        with pytest.warns(UserWarning, match=r"replacing .*step_000000004 \(corrupt: .*bytes on disk"):
            mgr.save(state_at(4), 4)
    assert committed_steps(tmp_path) == [3, 4]
    assert bits_equal(resurgo.load_dict(tmp_path / checkpoint_name(4)), state_at(4))


def test_a_step_whose_manifest_does_not_verify_is_not_replaced(tmp_path):
    (tmp_path / checkpoint_name(4)).mkdir()
    (tmp_path / checkpoint_name(4) / "manifest.json").write_text("{}")
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "replacing" warning for what is refused
            with pytest.raises(resurgo.ForeignFilesError, match=r"step_000000004: holds 'manifest.json' \(it does "
                               r"not verify: .*'format' is 'None'.*\), which resurgo did not write"):
                mgr.save(state_at(4), 4)
    assert names(tmp_path) == ["step_000000004"] and names(tmp_path / checkpoint_name(4)) == ["manifest.json"]
    assert (tmp_path / checkpoint_name(4) / "manifest.json").read_text() == "{}"


def test_a_background_error_is_raised_by_close(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    monkeypatch.setattr(local.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    mgr.save(state_at(1), 1)
    with pytest.raises(StorageError, match="fsync failed: Input/output error"):
        mgr.close()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="is closed"):
        mgr.save(state_at(2), 2)
    assert names(tmp_path) == []


def test_the_context_manager_waits_and_does_not_hide_the_loop_error(tmp_path, gated_writes):
    gated_writes.set()
    with pytest.raises(ZeroDivisionError):
        with CheckpointManager(tmp_path) as mgr:
            mgr.save(state_at(1), 1)
            1 / 0
    assert committed_steps(tmp_path) == [1]


# -- preemption ------------------------------------------------------------------------------------
def test_sigterm_saves_at_the_next_maybe_save_whatever_the_policy_and_sets_should_stop(tmp_path, gated_writes):
    gated_writes.set()
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        mgr = CheckpointManager(tmp_path, every_steps=1000)
        assert mgr.maybe_save(state_at(7), 7) is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]  # the handler installed before the manager still runs
        assert not mgr.should_stop
        assert mgr.maybe_save(state_at(8), 8) is True
        assert mgr.should_stop
        assert committed_steps(tmp_path) == [8]  # committed before maybe_save returned
        assert mgr.maybe_save(state_at(9), 9) is False  # the flag was consumed
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) != mgr._preemption.on_signal
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM] * 2  # our handler is gone, the previous one is back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigint_does_not_raise_keyboard_interrupt_and_the_default_action_is_not_chained(tmp_path):
    # Python's own SIGINT handler, whatever the launcher left (a background job of a script ignores SIGINT).
    launched_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with CheckpointManager(tmp_path, signals=(signal.SIGINT, signal.SIGUSR1), async_save=False) as mgr:
            mgr.save(state_at(3), 3)
            os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt if chained
            os.kill(os.getpid(), signal.SIGUSR1)  # SIG_DFL would terminate the process if chained
            assert mgr.maybe_save(state_at(3), 3) is False  # step 3 is already committed: nothing new
            assert mgr.should_stop
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        assert committed_steps(tmp_path) == [3]
    finally:
        signal.signal(signal.SIGINT, launched_with)


def test_off_the_main_thread_no_handler_is_installed(tmp_path):
    result = {}

    def make():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            mgr = CheckpointManager(tmp_path)
        result["warnings"] = [str(x.message) for x in w]
        mgr.notify_preemption()
        result["saved"] = mgr.maybe_save(state_at(1), 1)
        result["stop"] = mgr.should_stop
        mgr.close()

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is before
    assert any("outside the main thread" in m and "notify_preemption" in m for m in result["warnings"])
    assert result["saved"] is True and result["stop"] is True


# -- measured cost and the auto interval -----------------------------------------------------------
def test_the_cost_is_the_whole_save_when_sync_and_the_stall_when_async(tmp_path, monkeypatch):
    delay = 0.5
    original = async_mod.write_and_commit

    def slow(prep, sources, digests=None, **options):
        time.sleep(delay)
        return original(prep, sources, digests, **options)

    monkeypatch.setattr(async_mod, "write_and_commit", slow)
    import resurgo.api as api_mod

    monkeypatch.setattr(api_mod, "write_and_commit", slow)
    with CheckpointManager(tmp_path / "sync", async_save=False) as mgr:
        assert mgr.save_cost_seconds is None
        mgr.save(state_at(1), 1)
        assert mgr.save_cost_seconds >= delay
    with CheckpointManager(tmp_path / "async") as mgr:
        mgr.save(state_at(1), 1)
        assert mgr.save_cost_seconds < delay  # the write runs behind: only the stall counts
        first = mgr.save_cost_seconds
        mgr.save(state_at(2), 2)  # waits for the first write: part of what training waits
        assert mgr.save_cost_seconds > first


def test_auto_interval_uses_daly_with_the_measured_cost(tmp_path, monkeypatch):
    monkeypatch.delenv("RESURGO_MTBF_SECONDS", raising=False)
    with pytest.raises(ValueError, match="pass mtbf= .* or set RESURGO_MTBF_SECONDS"):
        CheckpointManager(tmp_path, interval="auto")
    monkeypatch.setenv("RESURGO_MTBF_SECONDS", "soon")
    with pytest.raises(ValueError, match="RESURGO_MTBF_SECONDS='soon' is not a number"):
        CheckpointManager(tmp_path, interval="auto")
    with pytest.raises(ValueError, match="interval must be 'auto' or None"):
        CheckpointManager(tmp_path, interval="1h")

    monkeypatch.setenv("RESURGO_MTBF_SECONDS", str(1e9))  # failures are rare: save seldom
    with CheckpointManager(tmp_path, interval="auto", async_save=False) as mgr:
        assert mgr.interval_seconds is None
        assert mgr.maybe_save(state_at(1), 1) is True  # unmeasured: the first save measures δ
        delta = mgr.save_cost_seconds
        assert delta > 0
        assert mgr.interval_seconds == resurgo.daly_interval(delta, 1e9) > 400
        assert [mgr.maybe_save(state_at(s), s) for s in range(2, 6)] == [False] * 4
    with CheckpointManager(tmp_path, interval="auto", mtbf=1e-6, async_save=False) as mgr:  # failures all the time
        assert mgr.restore(blank()) == 1
        # the first checkpoint was saved before any cost was known: it records none
        assert resurgo.read_manifest(tmp_path / checkpoint_name(1)).save_info["save_cost_seconds"] is None
        assert mgr.save_cost_seconds is None
        assert [mgr.maybe_save(state_at(s), s) for s in range(2, 5)] == [True] * 3  # δ >= 2M: τ = M
        assert mgr.interval_seconds == 1e-6


def test_the_cost_estimate_survives_a_restart(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(state_at(s), s)
        before_last = resurgo.read_manifest(tmp_path / checkpoint_name(3)).save_info["save_cost_seconds"]
    assert before_last is not None and before_last > 0
    with CheckpointManager(tmp_path, interval="auto", mtbf=3600) as mgr:
        assert mgr.restore(blank()) == 3
        assert mgr.save_cost_seconds == before_last
        assert mgr.interval_seconds == resurgo.daly_interval(before_last, 3600)


def test_a_fresh_and_a_resumed_manager_save_checkpoints_diff_calls_the_same(tmp_path):
    """The save cost the manager records describes the save, not the state: two managers saving
    one state at one step make checkpoints that diff calls identical (unless asked for save_info)."""
    with CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        for s in (1, 2):
            mgr.save(state_at(s), s)
    with CheckpointManager(tmp_path / "run", async_save=False) as resumed:
        assert resumed.restore(blank()) == 2 and resumed.save_cost_seconds is not None
        resumed.save(state_at(3), 3, metrics={"loss": 0.5})
    with CheckpointManager(tmp_path / "fresh", async_save=False) as fresh:
        fresh.save(state_at(3), 3, metrics={"loss": 0.5})
    a, b = tmp_path / "run" / checkpoint_name(3), tmp_path / "fresh" / checkpoint_name(3)
    assert resurgo.read_manifest(b).save_info["save_cost_seconds"] is None
    assert resurgo.read_manifest(a).save_info["save_cost_seconds"] > 0
    assert resurgo.diff_checkpoints(a, b).identical
    result = runner.invoke(app, ["diff", str(a), str(b)])
    assert result.exit_code == 0 and "SAME" in result.stdout, result.output
    named = [f for f, _, _ in resurgo.diff_checkpoints(a, b, include_save_info=True).fields]
    assert "save_info.save_cost_seconds" in named and "created_at" in named


# -- command line on a manager root ----------------------------------------------------------------
def test_ls_and_gc_on_a_manager_root(tmp_path):
    save_steps(tmp_path, [1, 2, 3, 4, 5, 6])
    (tmp_path / checkpoint_name(7) / "data").mkdir(parents=True)
    (tmp_path / ".step_000000008.resurgo-tmp-abcdefabcdef" / "data").mkdir(parents=True)
    flip_stored_bit(tmp_path / checkpoint_name(2), "w")

    result = runner.invoke(app, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["path"]: r for r in json.loads(result.stdout)["checkpoints"]}
    assert [(p, r["status"], r["step"]) for p, r in rows.items()] == [
        (".step_000000008.resurgo-tmp-abcdefabcdef", "temporary", 8)] + [
        (checkpoint_name(s), "committed", s) for s in range(1, 7)] + [(checkpoint_name(7), "incomplete", None)]
    assert rows[checkpoint_name(4)]["metrics"] == {"loss": 4.0}
    text = runner.invoke(app, ["ls", str(tmp_path)]).stdout
    assert "loss=4" in text and "temporary" in text
    verified = runner.invoke(app, ["ls", str(tmp_path), "--verify"])
    assert verified.exit_code == 3 and "corrupt" in verified.stdout

    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "2", "--keep-every", "3", "--dry-run",
                                 "--stale-after", "0", "--json"])
    assert result.exit_code == 0, result.output
    plan = {i["path"]: i["action"] for i in json.loads(result.stdout)["items"]}
    assert plan == {checkpoint_name(1): "delete", checkpoint_name(2): "delete", checkpoint_name(3): "keep",
                    checkpoint_name(4): "delete", checkpoint_name(5): "keep", checkpoint_name(6): "keep",
                    checkpoint_name(7): "delete", ".step_000000008.resurgo-tmp-abcdefabcdef": "delete"}
    assert len(names(tmp_path)) == 8  # a dry run deletes nothing
    text = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "2", "--keep-every", "3", "--dry-run"]).stdout
    assert "would delete 3 of 8" in text and "dry run: nothing was deleted" in text  # young leftovers are kept

    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "2", "--keep-every", "3", "--stale-after", "0"])
    assert result.exit_code == 0, result.output
    assert "deleted 5 of 8" in result.stdout
    assert names(tmp_path) == [checkpoint_name(s) for s in (3, 5, 6)]
    clean = runner.invoke(app, ["ls", str(tmp_path), "--verify"])
    assert clean.exit_code == 0 and clean.stdout.count("committed (verified)") == 3


def test_gc_keeps_corrupt_checkpoints_and_refuses_a_missing_root(tmp_path):
    save_steps(tmp_path, [1, 2])
    (tmp_path / checkpoint_name(1) / "manifest.json").write_text("[]")
    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "1", "--json"])
    items = {i["path"]: (i["status"], i["action"]) for i in json.loads(result.stdout)["items"]}
    assert items == {checkpoint_name(1): ("corrupt", "keep"), checkpoint_name(2): ("committed", "keep")}
    missing = runner.invoke(app, ["gc", str(tmp_path / "nope"), "--keep-last", "1"])
    assert missing.exit_code == 4 and "no such directory" in missing.stderr
    assert runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "0"]).exit_code == 2


# -- gc applies the rules the manager recorded -------------------------------------------------------
def _retention_policies():
    from hypothesis import strategies as st

    from resurgo.manager.retention import KeepAny, KeepBest, KeepEvery, KeepLast

    n = st.integers(1, 10**9)
    leaves = st.one_of(n.map(KeepLast), n.map(KeepEvery),
                       st.builds(KeepBest, st.text(min_size=1, max_size=12), st.sampled_from(["min", "max"]),
                                 st.integers(1, 5)))
    return st.recursive(leaves, lambda inner: st.lists(inner, min_size=1, max_size=3).map(lambda ps: KeepAny(*ps)),
                        max_leaves=6)


def test_retention_specs_round_trip_through_json():
    from hypothesis import given, settings

    from resurgo.manager.retention import policy_from_spec, policy_spec

    @settings(max_examples=200, deadline=None)
    @given(_retention_policies())
    def check(policy):
        spec = json.loads(json.dumps(policy_spec(policy)))
        assert policy_from_spec(spec) == policy

    check()
    assert policy_spec(None) is None and policy_from_spec(None) is None


def test_retention_spec_of_a_custom_policy_is_refused_by_name():
    from resurgo.manager.retention import KeepAny, KeepLast, policy_from_spec, policy_spec

    class Odd:
        def keep(self, checkpoints):
            return {c.step for c in checkpoints if c.step % 2}

    spec = policy_spec(KeepAny(KeepLast(2), Odd()))
    assert spec["policies"][1] == {"type": "custom", "class": f"{Odd.__module__}.{Odd.__qualname__}"}
    with pytest.raises(UnsupportedValueError, match=r"retention\.policies\[1\]: a custom retention policy"):
        policy_from_spec(spec)
    with pytest.raises(UnsupportedValueError, match="unknown retention spec"):
        policy_from_spec({"type": "keep_most"})
    with pytest.raises(UnsupportedValueError, match="KeepLast.n must be a positive int"):
        policy_from_spec({"type": "keep_last", "n": 0})


def _manager_run(root: Path, steps, losses, **kwargs) -> None:
    with CheckpointManager(root, async_save=False, **kwargs) as mgr:
        for s, loss in zip(steps, losses):
            mgr.save(state_at(s), s, metrics={"loss": loss})


def test_the_manager_records_its_retention_rules():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        _manager_run(Path(d), [1], [0.5], keep_last=3, keep_best=("loss", "min"))
        info = resurgo.read_manifest(Path(d) / checkpoint_name(1)).save_info
    assert info["retention"] == {"type": "keep_any", "policies": [
        {"type": "keep_last", "n": 3}, {"type": "keep_best", "metric": "loss", "mode": "min", "k": 1}]}


def test_gc_keeps_the_best_checkpoint_the_manager_kept(tmp_path):
    losses = [5.0, 1.0, 4.0, 3.0, 2.5, 2.0]  # the best is step 2
    _manager_run(tmp_path, [1, 2, 3, 4, 5, 6], losses, keep_last=3, keep_best=("loss", "min"))
    assert committed_steps(tmp_path) == [2, 4, 5, 6]  # what the manager kept

    alone = runner.invoke(app, ["gc", str(tmp_path), "--dry-run", "--json"])  # the manager's own rules
    assert alone.exit_code == 0, alone.output
    assert [i["action"] for i in json.loads(alone.stdout)["items"]] == ["keep"] * 4

    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "1", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "retention: keep_best loss:min or keep_last 1 (recorded by the manager at step 6 and the command line)" \
        in result.stdout
    rows = {ln.split()[0]: ln for ln in result.stdout.splitlines() if ln.strip().startswith("step_")}
    assert "kept by keep_best loss:min" in rows[checkpoint_name(2)]
    assert "the newest committed checkpoint; kept by keep_last 1" in rows[checkpoint_name(6)]
    assert "would delete" in rows[checkpoint_name(4)] and "kept by no retention rule" in rows[checkpoint_name(4)]
    assert committed_steps(tmp_path) == [2, 4, 5, 6]  # a dry run

    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "1"])
    assert result.exit_code == 0, result.output
    assert committed_steps(tmp_path) == [2, 6]  # the best and the newest

    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "1", "--no-keep-best"])
    assert result.exit_code == 0, result.output
    assert committed_steps(tmp_path) == [6]


def test_gc_keep_best_option_and_a_root_without_recorded_rules(tmp_path):
    for s, loss in [(1, 3.0), (2, 9.0), (3, 1.0), (4, 7.0)]:
        resurgo.save(state_at(s), tmp_path / checkpoint_name(s), step=s, metadata={"metrics": {"loss": loss}})
    refused = runner.invoke(app, ["gc", str(tmp_path)])
    assert refused.exit_code == 2
    assert "records no retention rules" in refused.stderr and "--keep-last N" in refused.stderr
    assert runner.invoke(app, ["gc", str(tmp_path), "--keep-best", "loss"]).exit_code == 2  # no mode
    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-best", "loss:max", "--keep-last", "1"])
    assert result.exit_code == 0, result.output
    assert committed_steps(tmp_path) == [2, 4]


def test_gc_of_a_durable_tier_applies_that_tiers_rules(tmp_path):
    from resurgo.manager import Tier

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    with CheckpointManager(tiers=[Tier(fast, keep_last=1), Tier(durable, keep_last=3)], async_save=False) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(state_at(s), s)
    assert committed_steps(fast) == [4] and committed_steps(durable) == [2, 3, 4]
    plan = json.loads(runner.invoke(app, ["gc", str(durable), "--dry-run", "--json"]).stdout)
    assert plan["retention"]["rules"] == "keep_last 3"
    assert [i["action"] for i in plan["items"]] == ["keep"] * 3


# -- observing commits without blocking -----------------------------------------------------------
def test_latest_committed_step_changes_only_once_the_async_save_is_committed(tmp_path, gated_writes):
    seen: list[tuple[int, str, str, list[int]]] = []
    published: list[int | None] = []
    called = threading.Event()

    def on_commit(step, path):  # the checkpoint is on disk, committed, when this runs
        published.append(mgr.latest_committed_step)
        seen.append((step, str(path), threading.current_thread().name, committed_steps(tmp_path)))
        called.set()

    mgr = CheckpointManager(tmp_path, on_commit=on_commit)
    assert mgr.latest_committed_step is None
    mgr.save(state_at(1), 1)  # staged; its write waits at the gate
    time.sleep(0.1)
    assert mgr.latest_committed_step is None and seen == [] and committed_steps(tmp_path) == []
    gated_writes.set()
    deadline = time.monotonic() + 30
    while mgr.latest_committed_step is None and time.monotonic() < deadline:
        time.sleep(0.005)  # polled, never waited for: the property alone reports the commit
    assert mgr.latest_committed_step == 1
    # The step is published first, then on_commit runs in the committing thread: it may still be
    # running when the poll above sees the step, so its record is waited for, not assumed.
    assert called.wait(30)
    assert published == [1]
    assert seen == [(1, str(tmp_path / checkpoint_name(1)), "resurgo-async-save", [1])]
    for s in (2, 3):
        mgr.save(state_at(s), s)
    mgr.close()
    assert [(s, p) for s, p, _, _ in seen] == [(s, str(tmp_path / checkpoint_name(s))) for s in (1, 2, 3)]
    assert all(steps[-1] == s for s, _, _, steps in seen)
    assert published == [1, 2, 3]
    assert mgr.latest_committed_step == 3


def test_on_commit_runs_in_the_callers_thread_when_sync_and_its_errors_are_warned(tmp_path):
    calls: list[tuple[int, str]] = []

    def on_commit(step, path):
        calls.append((step, threading.current_thread().name))
        raise ValueError(f"dashboard down at {step}")

    with CheckpointManager(tmp_path, async_save=False, on_commit=on_commit) as mgr:
        with pytest.warns(RuntimeWarning, match=r"on_commit\(4, .*step_000000004'\) raised ValueError: dashboard down at 4"):
            mgr.save(state_at(4), 4)
        assert mgr.latest_committed_step == 4
    assert calls == [(4, threading.current_thread().name)]
    assert committed_steps(tmp_path) == [4]
    with CheckpointManager(tmp_path, on_commit=on_commit) as mgr:  # asynchronous: warned from the writer
        with pytest.warns(RuntimeWarning, match="dashboard down at 5"):
            mgr.save(state_at(5), 5)
            mgr.wait()
    assert calls[-1] == (5, "resurgo-async-save") and committed_steps(tmp_path) == [4, 5]
