"""The fault-injection matrix: a fault (kill, stop, raise, enospc) in one of 4 gloo ranks at each
phase of save, async save, load, manager restore, tier copy, memory-tier replication and peer
restore, and shared reads (workers: tests/fault_matrix_workers.py).

Every cell checks: the error on every surviving rank, of the same resurgo type (RankFailedError
naming the victim for kill and stop; for raise and enospc the agreed error, the same on every
rank, naming the rank where it arose), within a bound of the fault; nothing of the operation
committed; the earlier checkpoint bit-exact; for raise and enospc, the same operation and a save
that follow succeed on every rank, bit-exact. Many raise/enospc cells share one job; a kill or
stop cell has a job of its own. A killed and a stopped rank at ``save.write`` are the default
cells of tests/test_rank_liveness.py, not repeated here. ``python tests/fault_matrix_table.py``
runs every cell and prints the table of fault x phase -> what the survivors saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import resurgo
from dist_harness import run_ranks
from fault_matrix_workers import EARLIER, PHASES, VICTIM, full
from resurgo.dist import liveness
from resurgo.errors import RankFailedError
from resurgo.manager.catalog import checkpoint_name

WORLD = 4
STOP_TIMEOUT = 6  # RESURGO_COLLECTIVE_TIMEOUT for stop cells
BOUND = {"kill": 30.0, "stop": STOP_TIMEOUT + 15.0, "raise": 30.0, "enospc": 30.0}  # seconds, fault to error
FATAL_IN_LIVENESS = {("save.write", "kill"), ("save.write", "stop")}  # default cells of test_rank_liveness.py
STEP0, STEP1, STEP2 = (checkpoint_name(s) for s in (0, 1, 2))


def expected_error(fault: str, phase: str) -> str | None:
    """The error every rank raises; None: the operation succeeds on every rank regardless."""
    if fault in ("kill", "stop"):
        return "RankFailedError"
    if (fault, phase) == ("enospc", "restore.peer"):
        return None  # memory that cannot be read is skipped (warned): every rank restores from the durable tier
    return "RankFailedError" if fault == "raise" else "StorageError"


def bits(tensors: dict) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


def earlier_and_operation(where: Path, phase: str) -> tuple[Path, list[str]]:
    """The checkpoint that must stay bit-exact, and what the failed operation must not have
    committed (relative paths under ``where``)."""
    kind = PHASES[phase][1]
    if kind in ("save", "async"):
        return where / EARLIER, ["c1"]
    if kind in ("load", "shared"):
        return where / EARLIER, []
    if kind == "restore":
        return where / "mgr" / STEP0, []
    if kind == "tier":
        return where / "durable" / STEP0, [f"durable/{STEP1}"]
    if kind == "memory":
        return where / "durable" / STEP0, [f"durable/{STEP1}", f"mem/node0/{STEP1}", f"mem/node1/{STEP1}"]
    return where / "durable" / STEP0, []  # "peer"


def committed(where: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(where)) for p in where.rglob("manifest.json"))


def check_storage(where: Path, phase: str) -> None:
    earlier, not_committed = earlier_and_operation(where, phase)
    assert bits(resurgo.load_dict(earlier)) == bits(full(0, WORLD)), earlier
    listing = committed(where)
    assert not set(not_committed) & set(listing), listing


def run_nonfatal(root: Path, cells: list[tuple[str, str]]) -> list[dict]:
    """Run ``cells`` (phase, raise|enospc) in one 4-rank job and check each; one table row per cell."""
    results = run_ranks(WORLD, "fault_matrix_workers:nonfatal_cells", str(root), cells, timeout=300)
    rows = []
    for i, (phase, fault) in enumerate(cells):
        where, victim = root / f"{phase}-{fault}", VICTIM[phase]
        cell = [results[r][i] for r in range(WORLD)]
        t_fault = cell[victim]["t_fault"]
        assert t_fault is not None, f"{phase}: rank {victim} never reached {PHASES[phase][0]}"
        errors = {(o["error"], o.get("message")) for o in cell}
        assert len(errors) == 1, (phase, fault, errors)  # the same error, word for word, on every rank
        error, message = errors.pop()
        assert error == expected_error(fault, phase), (phase, fault, error, message)
        if error is None:
            assert all(o["result"] is True for o in cell), cell  # restored, bit-exact
        else:
            assert message.startswith(f"rank {victim} failed: "), message
        if error == "RankFailedError":
            assert all(o["ranks"] == [victim] for o in cell), cell
        delays = [o["t_end"] - t_fault for o in cell]
        assert all(0 <= d < BOUND[fault] for d in delays), delays
        assert cell[0]["listing"] is not None
        _, not_committed = earlier_and_operation(where, phase)
        assert not set(not_committed) & set(cell[0]["listing"]), cell[0]["listing"]
        for o in cell:  # the same operation again, then a save: every rank succeeds, bit-exact
            assert o["retry"]["error"] is None and o["after"]["error"] is None, o
            assert o["retry"]["result"] in (None, True), o
        check_storage(where, phase)
        kind = PHASES[phase][1]
        again = {"save": where / "c2", "async": where / "c2", "tier": where / "durable" / STEP2,
                 "memory": where / "durable" / STEP2}.get(kind)
        if again is not None:
            assert bits(resurgo.load_dict(again)) == bits(full(2, WORLD)), again
        assert bits(resurgo.load_dict(where / "after")) == bits(full(9, WORLD))
        rows.append(row(phase, fault, error or "none: restored from the durable tier", delays, listing_ok=True,
                        followup=True))
    return rows


def run_fatal(root: Path, phase: str, fault: str, monkeypatch: Any) -> dict:
    """Run one kill or stop cell and check it; its table row."""
    if fault == "stop":
        monkeypatch.setenv(liveness.ENV, str(STOP_TIMEOUT))
    out, victim = root / "out", VICTIM[phase]
    out.mkdir(parents=True)
    with pytest.raises(RankFailedError) as launched:  # the launcher reports the victim's death, only it
        run_ranks(WORLD, "fault_matrix_workers:fatal_cell", str(root), str(out), phase, fault, timeout=150)
    assert f"1 of {WORLD} ranks failed" in str(launched.value)
    assert f"rank {victim}: exited with code -9 and no result" in str(launched.value)
    t_fault = json.loads((out / "victim.json").read_text())["t"]
    survivors = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD) if r != victim]
    delays = []
    for o in survivors:
        assert o["error"] == "RankFailedError" and o["ranks"] == [victim], o
        assert f"rank {victim}" in o["message"], o
        delays.append(o["t_end"] - t_fault)
    assert all(0 <= d < BOUND[fault] for d in delays), delays
    where = root / f"{phase}-{fault}"
    check_storage(where, phase)
    kind = PHASES[phase][1]
    if kind in ("restore", "tier", "memory", "peer"):  # a manager's start removes the leftovers
        durable = where / ("mgr" if kind == "restore" else "durable")
        with resurgo.CheckpointManager(durable) as mgr:
            mgr.wait()
            assert mgr.steps() == [0]
    return row(phase, fault, "RankFailedError", delays, listing_ok=True, followup=None)


def row(phase: str, fault: str, error: str, delays: list[float], listing_ok: bool, followup: bool | None) -> dict:
    print(f"{fault} at {phase}: {error}, seconds to the error on each rank {[round(d, 2) for d in delays]}")
    return {"phase": phase, "fault": fault, "error": error, "max_delay": max(delays), "committed": not listing_ok,
            "earlier_intact": True, "followup": followup}


# -- the default suite: a representative subset -------------------------------------------------
DEFAULT_NONFATAL = [("save.commit", "enospc"), ("async.write", "raise"), ("manager.restore", "enospc"),
                    ("tier.copy", "raise"), ("replicate.send", "enospc"), ("restore.peer", "raise"),
                    ("load.share", "enospc")]


def test_raise_and_enospc_on_one_rank_are_agreed_in_each_phase(tmp_path):
    run_nonfatal(tmp_path, DEFAULT_NONFATAL)


def test_rank_0_stopped_while_it_commits_is_named_on_every_rank(tmp_path, monkeypatch):
    """Rank 0 hosts the job's store: stopped, it answers nothing, and must still be found."""
    run_fatal(tmp_path, "save.commit", "stop", monkeypatch)


# -- the whole matrix ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raise", "enospc"])
def test_every_phase_agrees_a_nonfatal_fault(tmp_path, fault):
    run_nonfatal(tmp_path, [(phase, fault) for phase in PHASES])


FATAL_CELLS = [(phase, fault) for fault in ("kill", "stop") for phase in PHASES
               if (phase, fault) not in FATAL_IN_LIVENESS | {("save.commit", "stop")}]


@pytest.mark.slow
@pytest.mark.parametrize("phase,fault", FATAL_CELLS)
def test_every_phase_names_a_killed_or_stopped_rank(tmp_path, monkeypatch, phase, fault):
    run_fatal(tmp_path, phase, fault, monkeypatch)
