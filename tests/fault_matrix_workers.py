"""Functions tests/test_fault_matrix.py runs on every rank (see dist_harness.run_ranks).

A cell is a fault (kill, stop, raise, enospc) injected into one rank (the victim) at one phase of
a collective operation. :data:`PHASES` names each phase's fault point and the operation that
reaches it; :func:`prepare` makes what the operation needs (an earlier checkpoint, a manager with
its tiers) and :func:`operate` runs it. Each rank records, per cell, what it raised and when, and
the victim when it reached its fault point (``time.time()``: the ranks share one host's clock).

- :func:`nonfatal_cells` runs many raise/enospc cells in sequence in one job: after each, every
  rank runs the same operation again unarmed (it must succeed) and a plain save.
- :func:`fatal_cell` runs one kill/stop cell; every survivor writes ``<out>/rank<r>.json``, and
  kills a stopped victim once it has its error.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import resurgo
from liveness_workers import COLS, ROWS, full, state  # the rank-liveness tests' sharded state
from resurgo import faults

EARLIER = "earlier"  # the checkpoint every plain cell starts from; it must stay bit-exact

# phase -> (its fault point, the kind of operation that reaches it): "save" and "async" save c<seed>
# beside EARLIER; "load" and "shared" load EARLIER; the others are a manager's: "restore" restores
# step 0, "tier" and "memory" save a step (copied to a durable tier, replicated to the other node),
# "peer" restores step 0 on a node whose memory was wiped, from the other node's.
PHASES: dict[str, tuple[str, str]] = {
    "save.write": ("save.write", "save"),
    "save.commit": ("save.commit", "save"),
    "async.stage": ("async.stage", "async"),
    "async.write": ("save.write", "async"),
    "async.commit": ("save.commit", "async"),
    "load.read": ("load.read", "load"),
    "manager.restore": ("manager.restore", "restore"),
    "tier.copy": ("tier.copy", "tier"),
    "replicate.send": ("replicate.send", "memory"),
    "restore.peer": ("restore.peer", "peer"),
    "load.share": ("load.share", "shared"),
}
# the rank injected at each phase: the committing rank (0, the store's host too) for commits and
# the manager's choice of step; a sender of node 0 for a peer restore; other ranks elsewhere
VICTIM = {"save.write": 2, "save.commit": 0, "async.stage": 1, "async.write": 3, "async.commit": 0,
          "load.read": 1, "manager.restore": 0, "tier.copy": 3, "replicate.send": 2, "restore.peer": 1,
          "load.share": 2}


def blank(rank: int, world: int) -> dict:
    return {k: resurgo.Shard(torch.zeros(ROWS, COLS), (ROWS * world, COLS), (rank * ROWS, 0))
            for k in full(0, world)}


def exact(target: dict, seed: int, rank: int, world: int) -> bool:
    want = state(seed, rank, world)
    return all(torch.equal(target[k].local.view(torch.int32), want[k].local.view(torch.int32)) for k in want)


def cell_dir(root: str, phase: str, fault: str) -> Path:
    return Path(root) / f"{phase}-{fault}"


def tiers(where: Path, rank: int, kind: str) -> Any:
    from resurgo.manager import MemoryTier, Tier

    if kind == "tier":
        return resurgo.CheckpointManager(tiers=[Tier(where / "fast"), Tier(where / "durable", copy_every_steps=1)])
    if kind in ("memory", "peer"):  # two ranks a node; node n's memory under mem/node<n>
        memory = MemoryTier(replicas=1, root=str(where / "mem" / "node{node}"), node=rank // 2)
        return resurgo.CheckpointManager(tiers=[memory, Tier(where / "durable", copy_every_steps=1)])
    return resurgo.CheckpointManager(where / "mgr", async_save=False)


def prepare(rank: int, world: int, where: Path, phase: str) -> dict:
    """What ``phase``'s operation starts from: EARLIER (seed 0) for plain saves and loads; a
    manager holding step 0 for the manager phases (for a peer restore: node 1's memory wiped
    and a new manager, as when node 1 is replaced)."""
    kind = PHASES[phase][1]
    ctx: dict[str, Any] = {"where": where, "kind": kind}
    if kind in ("save", "async", "load", "shared"):
        resurgo.save(state(0, rank, world), where / EARLIER)
        return ctx
    mgr = tiers(where, rank, kind)
    mgr.save(state(0, rank, world), 0)
    mgr.wait()
    if kind == "peer":
        mgr.close()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where / "mem" / "node1")
        dist.barrier()
        mgr = tiers(where, rank, kind)
    ctx["mgr"] = mgr
    return ctx


def operate(rank: int, world: int, ctx: dict, seed: int) -> Any:
    """Run the cell's operation once: a save of ``state(seed)`` (manager phases: step ``seed``),
    or a load of what was prepared; returns whether a load came back bit-exact (None for saves)."""
    kind, where = ctx["kind"], ctx["where"]
    if kind == "save":
        resurgo.save(state(seed, rank, world), where / f"c{seed}")
    elif kind == "async":
        resurgo.async_save(state(seed, rank, world), where / f"c{seed}").wait()
    elif kind == "load":
        target = blank(rank, world)
        resurgo.load(target, where / EARLIER)
        return exact(target, 0, rank, world)
    elif kind == "shared":  # every rank loads every tensor whole; each byte read by one rank and sent
        target = {k: torch.zeros_like(v) for k, v in full(0, world).items()}
        resurgo.load(target, where / EARLIER, share_reads=True)
        return all(torch.equal(target[k].view(torch.int32), v.view(torch.int32)) for k, v in full(0, world).items())
    elif kind in ("restore", "peer"):
        target = blank(rank, world)
        step = ctx["mgr"].restore(target)
        return step == 0 and exact(target, 0, rank, world)
    else:  # "tier", "memory": a manager's save, its copy or replication in the background
        ctx["mgr"].save(state(seed, rank, world), seed)
        ctx["mgr"].wait()
    return None


def _timed(point: str, clock: dict) -> None:
    """Record when this process first reaches ``point`` (``clock["t"]``), then let the fault act."""
    original = faults.point

    def timed(name: str) -> None:
        if name == point and "t" not in clock:
            clock["t"] = time.time()
            if "file" in clock:  # for a killed or stopped victim, the others read it
                Path(clock["file"]).write_text(json.dumps({"t": clock["t"], "pid": os.getpid()}))
        original(name)

    faults.point = timed  # type: ignore[assignment]
    clock["restore"] = lambda: setattr(faults, "point", original)


def _record(fn: Any) -> dict:
    t0 = time.time()
    outcome: dict[str, Any] = {"t_start": t0}
    try:
        outcome["result"] = fn()
        outcome["error"] = None
    except resurgo.ResurgoError as e:
        outcome.update(error=type(e).__name__, message=str(e), ranks=list(getattr(e, "ranks", ())))
    except Exception as e:  # noqa: BLE001 - not a ResurgoError: the test fails on it, showing what it was
        outcome.update(error=f"raw {type(e).__name__}", message=str(e), ranks=[])
    outcome["t_end"] = time.time()
    return outcome


def nonfatal_cells(rank: int, world: int, root: str, cells: list[tuple[str, str]]) -> list[dict]:
    """Each ``(phase, fault)`` in turn, the fault raised on that phase's victim; then the same
    operation again, unarmed (seed 2), and a save of seed 9 to ``<cell>/after``. One record per cell."""
    records = []
    for phase, fault in cells:
        where = cell_dir(root, phase, fault)
        point, _ = PHASES[phase]
        victim = VICTIM[phase]
        ctx = prepare(rank, world, where, phase)
        clock: dict = {}
        if rank == victim:
            _timed(point, clock)
            faults.arm(f"{victim}:{point}:{fault}")
        outcome = _record(lambda: operate(rank, world, ctx, 1))
        faults.arm("")
        if "restore" in clock:
            clock["restore"]()
        outcome.update(phase=phase, fault=fault, victim=victim, t_fault=clock.get("t"))
        dist.barrier()
        outcome["listing"] = _listing(where) if rank == 0 else None  # before anything else is saved there
        dist.barrier()
        outcome["retry"] = _record(lambda: operate(rank, world, ctx, 2))
        outcome["after"] = _record(lambda: resurgo.save(state(9, rank, world), where / "after"))
        if "mgr" in ctx:
            ctx["mgr"].close()
        dist.barrier()
        records.append(outcome)
    return records


def _listing(where: Path) -> list[str]:
    """The committed checkpoints under ``where`` (a manifest beside them), relative paths."""
    return sorted(str(p.parent.relative_to(where)) for p in where.rglob("manifest.json"))


def fatal_cell(rank: int, world: int, root: str, out: str, phase: str, fault: str) -> dict:
    """One kill or stop cell. Every survivor records its outcome in ``<out>/rank<r>.json``; the
    victim's moment at the fault point is in ``<out>/victim.json``."""
    where, out_dir = cell_dir(root, phase, fault), Path(out)
    point, _ = PHASES[phase]
    victim = VICTIM[phase]
    ctx = prepare(rank, world, where, phase)
    if rank == victim:
        _timed(point, {"file": str(out_dir / "victim.json")})
        faults.arm(f"{victim}:{point}:{fault}")
    outcome = _record(lambda: operate(rank, world, ctx, 1))
    outcome.update(rank=rank, phase=phase, fault=fault, victim=victim)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    if fault == "stop" and rank != victim:  # the stopped rank never ends by itself
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(json.loads((out_dir / "victim.json").read_text())["pid"], signal.SIGKILL)
    return outcome
