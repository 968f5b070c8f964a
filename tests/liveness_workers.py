"""Functions the rank-liveness tests run on every rank (see dist_harness.run_ranks).

Each rank holds row blocks (resurgo.Shard) of a few global tensors. ``fail_during`` saves an
earlier checkpoint (C0), then runs an operation while one rank (the victim) is killed, stopped or slowed
at a fault point; every other rank records what it raised and when, in ``<out>/rank<r>.json``;
the victim records the moment its fault point was reached in ``<out>/victim.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import torch

import resurgo
from resurgo import faults

ROWS, COLS, TENSORS = 4, 256, 8
C0, C1 = "step_000000000", "step_000000001"  # manager names: a manager start cleans what a save left


def full(seed: int, world: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(ROWS * world, COLS, generator=g) for i in range(TENSORS)}


def state(seed: int, rank: int, world: int) -> dict:
    """This rank's row block of each tensor of ``full(seed)``."""
    return {k: resurgo.Shard(v[rank * ROWS:(rank + 1) * ROWS].clone(), tuple(v.shape), (rank * ROWS, 0))
            for k, v in full(seed, world).items()}


def _time_point(point: str, out: Path) -> None:
    """Record when this rank first reaches ``point``, then let the armed fault act."""
    original = faults.point

    def timed(name: str) -> None:
        if name == point and not (out / "victim.json").exists():
            (out / "victim.json").write_text(json.dumps({"t": time.time(), "pid": os.getpid()}))
        original(name)

    faults.point = timed  # type: ignore[assignment]


def fail_during(rank: int, world: int, root: str, out: str, victim: int, point: str, action: str,
                operation: str) -> dict:
    """Save ``root/C0``; then ``operation`` ("save", "async", "load" or "shared") while ``victim``'s fault
    ``action`` acts at ``point``. Returns (and records) this rank's outcome."""
    out_dir = Path(out)
    resurgo.save(state(0, rank, world), f"{root}/{C0}")
    if rank == victim:
        _time_point(point, out_dir)
        faults.arm(f"{victim}:{point}:{action}")
    t0 = time.time()
    outcome: dict = {"rank": rank}
    try:
        if operation == "save":
            resurgo.save(state(1, rank, world), f"{root}/{C1}")
        elif operation == "async":
            resurgo.async_save(state(1, rank, world), f"{root}/{C1}").wait()
        elif operation == "load":
            target = {k: resurgo.Shard(torch.zeros(ROWS, COLS), (ROWS * world, COLS), (rank * ROWS, 0))
                      for k in full(0, world)}
            resurgo.load(target, f"{root}/{C0}")
        else:  # "shared": every rank loads every tensor whole, each byte read by one rank and sent
            resurgo.load({k: torch.zeros_like(v) for k, v in full(0, world).items()}, f"{root}/{C0}",
                         share_reads=True)
        outcome.update(error=None)
    except resurgo.ResurgoError as e:
        outcome.update(error=type(e).__name__, message=str(e), ranks=list(getattr(e, "ranks", ())),
                       operation=getattr(e, "operation", ""), checkpoint=getattr(e, "checkpoint", ""))
    outcome.update(t_start=t0, t_end=time.time())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    if action == "stop" and rank != victim:  # the stopped rank never ends by itself
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(json.loads((out_dir / "victim.json").read_text())["pid"], signal.SIGKILL)
    return outcome


def agree_rounds(rank: int, world: int, rounds: int) -> float:
    """Seconds for ``rounds`` calls of Comm.agree on the io channel (the cost per collective)."""
    from resurgo.dist import comm as dist_comm

    comm = dist_comm.current()
    comm.agree(lambda: None)  # the group and the heartbeat exist before the clock starts
    t0 = time.perf_counter()
    for _ in range(rounds):
        comm.agree(lambda: None)
    return time.perf_counter() - t0


def manager_fail_during(rank: int, world: int, root: str, out: str, victim: int, point: str, kind: str) -> dict:
    """A manager saves step 0; then step 1 while ``victim`` is killed at ``point``: in the save
    itself (``kind`` "save"), in the background copy of step 1 to a second tier, every step copied
    ("tier"), or in the replication of a memory tier to the next node ("memory", 2 ranks a node);
    or ("restore") it restores instead, while ``victim`` is killed at ``point`` of the restore."""
    from resurgo.manager import MemoryTier, Tier

    out_dir = Path(out)
    if kind == "tier":
        mgr = resurgo.CheckpointManager(tiers=[Tier(f"{root}/fast"), Tier(f"{root}/durable", copy_every_steps=1)])
    elif kind == "memory":
        memory = MemoryTier(replicas=1, root=f"{root}/memory/node{{node}}", node=rank // 2)
        mgr = resurgo.CheckpointManager(tiers=[memory, Tier(f"{root}/durable", copy_every_steps=1)])
    else:
        mgr = resurgo.CheckpointManager(root, async_save=False)
    mgr.save(state(0, rank, world), 0)
    mgr.wait()
    if rank == victim:
        _time_point(point, out_dir)
        faults.arm(f"{victim}:{point}:kill")
    outcome: dict = {"rank": rank}
    try:
        if kind == "restore":
            mgr.restore(state(1, rank, world))
        else:
            mgr.save(state(1, rank, world), 1)
            mgr.wait()
        outcome.update(error=None)
    except resurgo.ResurgoError as e:
        outcome.update(error=type(e).__name__, message=str(e), ranks=list(getattr(e, "ranks", ())),
                       operation=getattr(e, "operation", ""), checkpoint=getattr(e, "checkpoint", ""))
    outcome.update(t_end=time.time())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
    return outcome


def call_alone(rank: int, world: int, root: str, out: str, alone: int) -> dict:
    """Save C0 together; then rank ``alone`` saves C1 with collective=False while the others save
    it collectively, and afterwards calls a collective load. Returns (and records) what each
    call raised and when."""
    resurgo.save(state(0, rank, world), f"{root}/{C0}")
    outcome: dict = {"rank": rank, "t_start": time.time()}
    try:
        if rank == alone:
            resurgo.save(full(1, world), f"{root}/{C1}", collective=False)
            outcome["alone_saved"] = time.time()
            resurgo.load_dict(f"{root}/{C0}")
        else:
            resurgo.save(state(1, rank, world), f"{root}/{C1}")
        outcome.update(error=None)
    except resurgo.ResurgoError as e:
        outcome.update(error=type(e).__name__, message=str(e))
    outcome["t_end"] = time.time()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(outcome))
    return outcome
