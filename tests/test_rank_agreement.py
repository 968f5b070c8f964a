"""One job, one outcome: what only one rank finds out (a budget, a failing disk, a user's
state_dict(), a background failure), what the ranks pass differently to one call, and whether a
save is still running, is agreed, so every rank raises the same error naming the rank where it
arose, nothing is written, and the next call succeeds (real gloo processes; workers in
tests/agreement_workers.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import resurgo
from agreement_workers import BUDGET, full_w
from dist_harness import run_ranks
from resurgo.manager.catalog import COMMITTED, checkpoint_name, scan

TIMEOUT = 120  # a rank left inside a collective fails the test instead of hanging it


def same_everywhere(results: list[dict], key: str) -> str:
    seen = {r[key] for r in results}
    assert len(seen) == 1, (key, seen)
    return seen.pop()


def committed_w(path: Path) -> torch.Tensor:
    return resurgo.load_dict(path)["w"]


@pytest.fixture(scope="module")
def local_outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    return root, run_ranks(2, "agreement_workers:rank_local_outcomes", str(root), timeout=TIMEOUT)


def test_a_budget_exceeded_on_one_rank_is_raised_on_every_rank(local_outcomes):
    root, results = local_outcomes
    message = same_everywhere(results, "budget")
    assert message.startswith("MemoryBudgetError: rank 0 failed: ") and f"the budget is {BUDGET}" in message
    assert "on rank 0" in message and str(root / "budget") in message
    # fallback="sync": every rank saved synchronously, together
    assert same_everywhere(results, "budget_sync") == "ok"
    assert torch.equal(committed_w(root / "budget_sync"), full_w())
    assert [r["budget_aborted"] for r in results] == [["budget"], []]
    assert same_everywhere(results, "budget_after") == "ok"  # the following save
    assert torch.equal(committed_w(root / "budget"), full_w())


def test_a_staging_failure_on_one_rank_is_raised_everywhere_and_only_rank0_aborts(local_outcomes):
    root, results = local_outcomes
    message = same_everywhere(results, "stage")
    assert message == "RankFailedError: rank 1 failed: fault injected at async.stage on rank 1 (InjectedFault)"
    assert [r["stage_aborted"] for r in results] == [["stage"], []]  # the shared staging: rank 0's to remove
    assert results[0]["stage_leftovers"] == []
    assert same_everywhere(results, "stage_after") == "ok"
    assert torch.equal(committed_w(root / "stage"), full_w())


@pytest.mark.parametrize("fault, text", [("enospc", "No space left on device"), ("eio", "Input/output error"),
                                         ("eacces", "Permission denied")])
def test_one_ranks_disk_failing_fails_every_rank_and_commits_nothing(local_outcomes, fault, text):
    root, results = local_outcomes
    message = same_everywhere(results, f"disk_{fault}")
    assert message.startswith("StorageError: rank 1 failed: ") and text in message, message
    assert f"fault injected at save.write on rank 1" in message and str(root / f"disk_{fault}") in message
    assert results[0]["disk_leftovers"] == []  # no staging left over, nothing committed
    assert not (root / "disk_eio").exists() and not (root / "disk_eacces").exists()
    assert torch.equal(committed_w(root / "earlier"), full_w())  # the earlier checkpoint is intact


def test_an_asynchronous_write_or_commit_failing_on_one_rank_reaches_every_ranks_wait(local_outcomes):
    root, results = local_outcomes
    message = same_everywhere(results, "disk_async")
    assert message.startswith("StorageError: rank 1 failed: ") and "Input/output error" in message
    assert not (root / "disk_async").exists()
    message = same_everywhere(results, "commit_async")
    assert message.startswith("StorageError: rank 0 failed: ") and "fault injected at save.commit on rank 0" in message
    assert not (root / "commit_async").exists()
    assert same_everywhere(results, "disk_after") == "ok"
    assert torch.equal(committed_w(root / "disk_enospc"), full_w())


def test_a_users_state_dict_or_load_state_dict_failing_on_one_rank_fails_every_rank(local_outcomes):
    root, results = local_outcomes
    assert same_everywhere(results, "state_dict") == ("RankFailedError: rank 1 failed: state_dict refused on rank 1 "
                                                      "(ValueError)")
    assert same_everywhere(results, "state_dict_after") == "ok"
    message = same_everywhere(results, "load_state_dict")
    assert message.startswith("RankFailedError: rank 1 failed: ") and "load_state_dict refused on rank 1" in message
    assert same_everywhere(results, "load_after") == "ok"
    assert all(r["load_exact"] for r in results)


def test_the_guards_background_copy_failing_on_one_rank_reaches_every_ranks_wait(local_outcomes):
    root, results = local_outcomes
    message = same_everywhere(results, "guard_copy")
    assert message == "RankFailedError: rank 1 failed: fault injected at async.copy on rank 1 (InjectedFault)"
    assert same_everywhere(results, "guard_after") == "ok"
    assert [e.status for e in scan(root) if e.name == "guarded"] in ([], [COMMITTED])
    assert (root / "guarded" / "manifest.json").is_file()
    assert all("guarded" not in a for a in results[1]["aborted"])  # only rank 0 removes a shared staging


def test_if_busy_raise_raises_on_every_rank_or_on_none(tmp_path):
    calls = 6
    results = run_ranks(4, "agreement_workers:busy_saves", str(tmp_path), calls, timeout=TIMEOUT)
    assert all(r == results[0] for r in results), results
    outcomes = results[0]
    assert outcomes[0] == "ok" and any(o != "ok" for o in outcomes), outcomes
    for i, o in enumerate(outcomes):
        if o == "ok":
            assert torch.equal(committed_w(tmp_path / f"c{i}"), full_w())
        else:
            assert re.fullmatch(rf"SaveInFlightError: {re.escape(str(tmp_path / f'c{i}'))}: not saved: the previous "
                                r"asynchronous save is still running on ranks? [0-9, ]+ \(if_busy='raise'\); every "
                                r"rank skips this save", o), o
            assert not (tmp_path / f"c{i}").exists()


def test_ranks_passing_different_arguments_are_refused_before_anything_is_written(tmp_path):
    results = run_ranks(2, "agreement_workers:mismatched_calls", str(tmp_path), timeout=TIMEOUT)
    expect = {
        "path": f"path: {str(tmp_path / 'p0')!r} on rank 0; {str(tmp_path / 'p1')!r} on rank 1",
        "step": "step: 1 on rank 0; 2 on rank 1",
        "overwrite": "overwrite: False on rank 0; True on rank 1",
        "as_base": "as_base: False on rank 0; True on rank 1",
        "base": f"base: None on rank 0; {str(tmp_path / 'b0')!r} on rank 1",
        "allow_pickle": "allow_pickle: False on rank 0; True on rank 1",
        "async_fallback": "fallback: 'raise' on rank 0; 'sync' on rank 1",
        "if_busy": "if_busy: 'wait' on rank 0; 'raise' on rank 1",
        "load_path": "checkpoint: 'b0' on rank 0; 'b1' on rank 1",
        "load_strict": "strict: False on rank 0; True on rank 1",
        "load_allow_pickle": "allow_pickle: False on rank 0; True on rank 1",
        "manager_step": f"path: {str(tmp_path / 'mgr' / checkpoint_name(10))!r} on rank 0; "
                        f"{str(tmp_path / 'mgr' / checkpoint_name(11))!r} on rank 1",
        "manager_restore": "step: None on rank 0; 20 on rank 1",
    }
    for name, part in expect.items():
        message = same_everywhere(results, name)
        assert message.startswith("UnsupportedValueError: ") and part in message, (name, message)
        assert "every rank must pass the same value" in message
    assert results[0]["written"] == [] and results[0]["manager_written"] == []  # refused before any byte
    assert same_everywhere(results, "as_base_either_name") == "ok"
    # a step that does not exist: the same error on every rank
    message = same_everywhere(results, "manager_restore_missing")
    assert message.startswith("CheckpointNotFoundError: ") and checkpoint_name(5) in message, message
    assert same_everywhere(results, "manager_restored") == "ok"
    assert same_everywhere(results, "after") == "ok" and same_everywhere(results, "load_after") == "ok"
    assert all(r["load_exact"] for r in results)


def test_background_failures_reach_every_rank_and_stop_the_job(tmp_path):
    results = run_ranks(2, "agreement_workers:background_failures", str(tmp_path), timeout=TIMEOUT)
    message = same_everywhere(results, "copy_next_call")
    assert message.startswith("StorageError: rank 1 failed: ") and "fault injected at tier.copy on rank 1" in message
    assert all(r["copy_should_stop"] for r in results)
    assert same_everywhere(results, "copy_after") == "ok" and same_everywhere(results, "copy_wait_after") == "ok"
    assert results[0]["durable"] == [checkpoint_name(3)]  # the failed copy left nothing
    message = same_everywhere(results, "copy_wait")
    assert message.startswith("StorageError: rank 0 failed: ") and "Permission denied" in message
    assert all(r["copy_wait_should_stop"] for r in results)
    message = same_everywhere(results, "async_wait")
    assert message.startswith("StorageError: rank 1 failed: ") and "No space left on device" in message
    assert all(r["async_should_stop"] for r in results)
    assert same_everywhere(results, "async_after") == "ok"
    assert results[0]["async_steps"] == [checkpoint_name(2)]
    message = same_everywhere(results, "replicate_wait")
    # rank 1 could not read what it sends: rank 0 receives bytes that do not verify, and rank 1's error is the cause
    assert message.startswith("StorageError: rank 1 failed: ") and "Input/output error" in message, message
    assert all(r["replicate_should_stop"] for r in results)
    assert same_everywhere(results, "replicate_after") == "ok"
    assert all(checkpoint_name(2) in r["memory_steps"] and checkpoint_name(1) not in r["memory_steps"] for r in results)


def test_accelerates_refused_prune_on_the_main_process_is_raised_on_every_process(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata")
    results = run_ranks(2, "agreement_workers:accelerate_refused_prune", str(tmp_path), timeout=TIMEOUT)
    message = same_everywhere(results, "train")
    assert message.startswith("ForeignFilesError: rank 0 failed: ") and "notes.txt" in message, message
    assert same_everywhere(results, "after") == "ok"
    assert (tmp_path / "checkpoints" / "checkpoint_1" / "manifest.json").is_file()


def test_ranks_holding_different_tensors_or_loading_differently_are_refused_before_any_byte_moves(tmp_path):
    results = run_ranks(2, "agreement_workers:mismatched_trees_and_loads", str(tmp_path), timeout=TIMEOUT)
    prefix = "UnsupportedValueError: rank 0 failed: "
    expect = {
        "extra_tensor": "the ranks' states hold different tensors (no other tensor on rank 0; 'extra' on rank 1)",
        "extra_plain": "the ranks' states hold different tensors ('opt.0', 'opt.1', 'opt.2', 'opt.3' and 2 more on "
                       "rank 0; no other tensor on rank 1)",
        "shape": "tensor 'b': the ranks hold it differently (torch float32 [50] on rank 0; torch float32 [51] on rank 1)",
        "dtype": "tensor 'b': the ranks hold it differently (torch float32 [50] on rank 0; torch float64 [50] on rank 1)",
    }
    for name, part in expect.items():
        message = same_everywhere(results, name)
        assert message.startswith(prefix + part), (name, message)
    assert results[0]["written"] == []  # refused before any byte
    loads = {
        "load_strict": "strict: False on rank 0; True on rank 1",
        "load_allow_pickle": "allow_pickle: False on rank 0; True on rank 1",
        "load_path": "checkpoint: 'b' on rank 0; 'nowhere' on rank 1",
        "load_share_reads": "share_reads (None on rank 0; False on rank 1)",
        "load_dict_path": "checkpoint: 'b' on rank 0; 'nowhere' on rank 1",
        "load_dict_allow_pickle": "allow_pickle: False on rank 0; True on rank 1",
    }
    for name, part in loads.items():  # not one rank's KeyMismatchError, PickleNotAllowedError, CheckpointNotFoundError
        message = same_everywhere(results, name)
        assert message.startswith("UnsupportedValueError: ") and part in message, (name, message)
    assert all(all(r["untouched"].values()) for r in results), [r["untouched"] for r in results]
    assert same_everywhere(results, "legit") == "ok" and same_everywhere(results, "legit_load") == "ok"
    assert all(r["legit_exact"] for r in results)
    assert same_everywhere(results, "after") == "ok"


def test_a_deletion_that_retention_could_not_make_is_warned_alike_on_every_rank(tmp_path):
    results = run_ranks(2, "agreement_workers:retention_failures", str(tmp_path), timeout=TIMEOUT)
    warned = same_everywhere([{"w": tuple(r["refused_warned"])} for r in results], "w")
    assert len(warned) == 1 and warned[0].startswith(f"ResurgoWarning: resurgo: retention in {tmp_path} could not "
                                                     "delete everything it chose (rank 0: ForeignFilesError: "), warned
    assert "notes.txt" in warned[0] and "rank 1: " not in warned[0] and "should_stop is not set" in warned[0]
    warned = same_everywhere([{"w": tuple(r["oserror_warned"])} for r in results], "w")
    assert len(warned) == 1 and "(rank 0: OSError: [Errno 5] Input/output error: " in warned[0], warned
    for name in ("refused", "oserror", "after"):
        assert same_everywhere(results, name) in ("ok", "False"), name
        assert not any(r[f"{name}_should_stop"] for r in results)  # the saves are committed: the job carries on
    assert same_everywhere([{"w": tuple(r["after_warned"])} for r in results], "w") == ()
    warned = same_everywhere([{"w": tuple(r["close_warned"])} for r in results], "w")
    assert len(warned) == 1 and "(rank 0: OSError: [Errno 5] Input/output error: " in warned[0], warned
    assert same_everywhere(results, "close") == "ok"
    assert results[0]["steps"] == [checkpoint_name(6), checkpoint_name(7)]
