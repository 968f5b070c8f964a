"""A rank that dies or stalls in a collective makes every other rank raise RankFailedError, in
bounded time, naming it; a rank that is slow but progressing is waited for.

Four gloo ranks save (or load) while one of them is killed, stopped or slowed at a fault point
(tests/liveness_workers.py). Each surviving rank's error, and the time from the fault to it, is
checked; nothing of the failed save is committed, the next save of that path cleans its leftovers,
and the earlier checkpoint loads bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.dist import liveness
from resurgo.format.manifest import TMP_MARKER as TMP
from resurgo.errors import RankFailedError, UnsupportedValueError
from dist_harness import run_ranks
from liveness_workers import C0, C1, full

WORLD = 4
BOUND_DEATH = 30.0  # seconds from a death to the error on every survivor


def _run(tmp_path: Path, victim: int, point: str, action: str, operation: str) -> tuple[list[dict], float]:
    """Run the cell; every survivor's outcome, and the moment the victim reached its fault point."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankFailedError) as launched:  # the launcher reports the victim's death, only it
        run_ranks(WORLD, "liveness_workers:fail_during", str(root), str(out), victim, point, action, operation,
                  timeout=120)
    assert f"1 of {WORLD} ranks failed" in str(launched.value)
    assert f"rank {victim}: exited with code -9 and no result" in str(launched.value)
    outcomes = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD) if r != victim]
    return outcomes, json.loads((out / "victim.json").read_text())["t"]


def _bits(tensors: dict) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


def _check_storage(root: Path, saved: bool) -> None:
    """C0 loads bit for bit; C1, if its save failed, was not committed, and a manager started on
    the root removes what the save left (as after a single-process kill); C1 then saves."""
    assert _bits(resurgo.load_dict(root / C0)) == _bits(full(0, WORLD))
    if saved:
        return
    assert not (root / C1).exists()
    resurgo.CheckpointManager(root).close()
    assert sorted(p.name for p in root.iterdir()) == [C0]
    resurgo.save(full(1, 1), root / C1)
    assert _bits(resurgo.load_dict(root / C1)) == _bits(full(1, 1))


def _check_named(outcomes: list[dict], victim: int, operation: str, checkpoint: Path, t_fault: float,
                 bound: float) -> list[float]:
    delays = []
    for o in outcomes:
        assert o["error"] == "RankFailedError", o
        assert o["ranks"] == [victim], o
        assert o["operation"] == operation and o["checkpoint"] == str(checkpoint), o
        assert f"rank {victim} (host " in o["message"] and str(checkpoint) in o["message"], o
        delays.append(o["t_end"] - t_fault)
        assert 0 <= delays[-1] < bound, o
    return delays


@pytest.mark.parametrize("victim", [2])
def test_a_rank_killed_mid_save_is_named_on_every_survivor(tmp_path, victim):
    outcomes, t_kill = _run(tmp_path, victim, "save.write", "kill", "save")
    delays = _check_named(outcomes, victim, "save", tmp_path / "root" / C1, t_kill, BOUND_DEATH)
    assert all("its process has exited" in o["message"] for o in outcomes)
    print("kill mid-save: seconds to the error on each survivor", [round(d, 2) for d in delays])
    _check_storage(tmp_path / "root", saved=False)


@pytest.mark.slow
@pytest.mark.parametrize("operation,point,checkpoint", [("async", "save.write", C1), ("load", "load.read", C0),
                                                       ("shared", "load.read", C0)])
def test_a_rank_killed_mid_async_save_or_load_is_named(tmp_path, operation, point, checkpoint):
    """``shared``: a load whose bytes are read once and sent to the other ranks (point to point)."""
    outcomes, t_kill = _run(tmp_path, 2, point, "kill", operation)
    name = {"async": "async save", "load": "load", "shared": "load"}[operation]
    delays = _check_named(outcomes, 2, name, tmp_path / "root" / checkpoint, t_kill, BOUND_DEATH)
    print(f"kill mid-{operation}: seconds to the error on each survivor", [round(d, 2) for d in delays])
    _check_storage(tmp_path / "root", saved=operation != "async")


@pytest.mark.slow
def test_the_store_host_killed_mid_save_is_named(tmp_path):
    """Rank 0 hosts the job's store: its death is seen as the store's."""
    outcomes, t_kill = _run(tmp_path, 0, "save.write", "kill", "save")
    for o in outcomes:
        assert o["error"] == "RankFailedError" and o["ranks"] == [0], o
        assert o["t_end"] - t_kill < BOUND_DEATH, o
    print("kill of rank 0 mid-save: seconds to the error", [round(o["t_end"] - t_kill, 2) for o in outcomes])
    _check_storage(tmp_path / "root", saved=False)


@pytest.mark.parametrize("operation", ["save", pytest.param("shared", marks=pytest.mark.slow)])
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path, monkeypatch, operation):
    """``shared``: the stopped rank is the one that reads bytes the others wait to receive."""
    timeout = 10
    monkeypatch.setenv(liveness.ENV, str(timeout))
    point, checkpoint = ("save.write", C1) if operation == "save" else ("load.read", C0)
    outcomes, t_stop = _run(tmp_path, 1, point, "stop", operation)
    delays = _check_named(outcomes, 1, {"save": "save", "shared": "load"}[operation], tmp_path / "root" / checkpoint,
                          t_stop, timeout + 15)
    assert all("no heartbeat" in o["message"] for o in outcomes)
    print(f"stop mid-{operation}: seconds to the error on each survivor", [round(d, 2) for d in delays])
    _check_storage(tmp_path / "root", saved=operation != "save")


@pytest.mark.parametrize("victim", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_a_rank_stopped_inside_an_entered_collective_is_named(tmp_path, victim):
    """Every rank arrived, then the victim stops inside gloo's exchange: the others are told within
    the heartbeat limit (rank 0, the store's host, through the store), not at the group's timeout
    (30 minutes), and whatever the collective timeout is."""
    outcomes, t_stop = _run(tmp_path, victim, "collective.entered", "stop", "save")
    for o in outcomes:
        assert o["error"] == "RankFailedError" and o["ranks"] == [victim], o
        assert o["operation"] == "save" and o["checkpoint"] == str(tmp_path / "root" / C1), o
        assert 0 <= o["t_end"] - t_stop < liveness.HEARTBEAT_LIMIT + 15, o
    print(f"rank {victim} stopped inside a collective: seconds to the error",
          [round(o["t_end"] - t_stop, 2) for o in outcomes])
    _check_storage(tmp_path / "root", saved=False)


@pytest.mark.parametrize("alone", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_rank_calling_alone_what_the_others_call_collectively_is_named(tmp_path, monkeypatch, alone):
    """A rank that passes collective=False to the call the others make collectively: the others
    raise UnsupportedValueError naming it within seconds, not a RankFailedError at the collective
    timeout; it raises the same at its next collective call."""
    monkeypatch.setenv(liveness.ENV, "60")
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    outcomes = run_ranks(WORLD, "liveness_workers:call_alone", str(root), str(out), alone, timeout=120)
    for o in outcomes:
        assert o["error"] == "UnsupportedValueError", o
        assert f"rank {alone} (host " in o["message"] and "collective=False" in o["message"], o
        assert str(root / C1) in o["message"], o
        assert o["t_end"] - o["t_start"] < 15, o
    assert "alone_saved" in outcomes[alone]
    print("call made alone: seconds to the error", [round(o["t_end"] - o["t_start"], 2) for o in outcomes])


def test_a_slow_rank_that_progresses_is_waited_for(tmp_path, monkeypatch):
    timeout = 4
    monkeypatch.setenv(liveness.ENV, str(timeout))
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    # Each of rank 1's 8 chunk writes takes 1 s: its save lasts twice the timeout, progressing.
    outcomes = run_ranks(WORLD, "liveness_workers:fail_during", str(root), str(out), 1, "save.write", "slow=1",
                         "save", timeout=120)
    assert [o["error"] for o in outcomes] == [None] * WORLD
    assert outcomes[1]["t_end"] - outcomes[1]["t_start"] > 2 * timeout
    assert _bits(resurgo.load_dict(root / C1)) == _bits(full(1, WORLD))


def test_the_collective_timeout_is_configured_and_checked(monkeypatch):
    monkeypatch.setenv(liveness.ENV, "7.5")
    assert liveness.collective_timeout() == 7.5
    liveness.set_collective_timeout(3)
    try:
        assert liveness.collective_timeout() == 3
    finally:
        liveness.set_collective_timeout(None)
    monkeypatch.delenv(liveness.ENV)
    assert liveness.collective_timeout() == liveness.DEFAULT_TIMEOUT == 120
    for bad in ("0", "-1", "soon", "inf"):
        monkeypatch.setenv(liveness.ENV, bad)
        with pytest.raises(UnsupportedValueError, match=f"{liveness.ENV}='{bad}'"):
            liveness.collective_timeout()


def test_rank_failed_error_still_builds_from_a_message_alone():
    e = RankFailedError("rank 3 failed: boom")
    assert (str(e), e.ranks, e.operation, e.checkpoint) == ("rank 3 failed: boom", (), "", "")



@pytest.mark.slow
@pytest.mark.parametrize("kind,point", [("save", "save.write"), ("tier", "tier.copy"), ("memory", "replicate.send")])
def test_a_rank_killed_mid_manager_save_tier_copy_or_replication_is_named(tmp_path, kind, point):
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankFailedError) as launched:
        run_ranks(WORLD, "liveness_workers:manager_fail_during", str(root), str(out), 2, point, kind, timeout=120)
    assert f"1 of {WORLD} ranks failed" in str(launched.value)
    t_kill = json.loads((out / "victim.json").read_text())["t"]
    outcomes = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1, 3)]
    for o in outcomes:
        assert o["error"] == "RankFailedError" and o["ranks"] == [2], o
        assert "rank 2 (host " in o["message"], o
        assert o["t_end"] - t_kill < BOUND_DEATH, o
    print(f"kill mid-{kind} ({point}): seconds to the error", [round(o["t_end"] - t_kill, 2) for o in outcomes])
    durable = root / ("durable" if kind != "save" else "")
    with resurgo.CheckpointManager(durable) as mgr:  # its start removes the leftovers
        mgr.wait()
        assert mgr.steps() == [0]
        target = {k: torch.zeros_like(v) for k, v in full(0, WORLD).items()}
        assert mgr.restore(target) == 0
    assert _bits(target) == _bits(full(0, WORLD))
    assert not any(TMP in p.name for p in durable.iterdir())


def test_a_rank_killed_mid_restore_is_named_in_the_restore(tmp_path):
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    with pytest.raises(RankFailedError) as launched:
        run_ranks(2, "liveness_workers:manager_fail_during", str(root), str(out), 1, "manager.restore", "restore",
                  timeout=120)
    assert "rank 1: exited with code -9 and no result" in str(launched.value)
    t_kill = json.loads((out / "victim.json").read_text())["t"]
    o = json.loads((out / "rank0.json").read_text())
    assert o["error"] == "RankFailedError" and o["ranks"] == [1], o
    assert o["operation"] == "restore" and o["checkpoint"] == str(root), o
    assert o["message"].startswith(f"restore of {root} failed on rank 0: rank 1 (host "), o
    assert f"last seen in restore, of {root}" in o["message"], o
    assert o["t_end"] - t_kill < BOUND_DEATH, o
