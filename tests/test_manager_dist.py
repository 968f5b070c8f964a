"""Multi-rank agreement of the manager with 2 real processes on gloo (CPU).

The checkpoints to restore are written beforehand by one process (each rank gets a root of its
own, so that the ranks can be shown different contents); the saving cases write one checkpoint
from both ranks (the distributed save) into a shared root.
Rank 0 chooses the step to restore and every rank restores it; a checkpoint that fails on one
rank is skipped on all; a preemption signal or a save decision on one rank makes every rank save.
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resurgo.manager import CheckpointManager
from resurgo.manager.catalog import COMMITTED, checkpoint_name, scan
from helpers import bits_equal, flip_stored_bit

WORLD = 2


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 8, generator=g), "step": step}


def blank() -> dict:
    return {"w": torch.zeros(32, 8), "step": -1}


class OnlyOnRank:
    """A save policy that says yes on one rank only (as a clock-based policy may)."""

    def __init__(self, rank: int):
        self.rank = rank

    def should_save(self, ctx) -> bool:
        return dist.get_rank() == self.rank


def _restore(root: Path) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(root) as mgr:
            state = blank()
            step = mgr.restore(state)
    return {"step": step, "exact": step is not None and bits_equal(state, state_at(step)),
            "warnings": [str(w.message) for w in caught]}


def _worker(rank: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=rank, world_size=WORLD)
    out: dict = {}
    out["choose"] = _restore(tmp_path / f"choose{rank}")
    out["fallback"] = _restore(tmp_path / f"fallback{rank}")

    # Saving: one checkpoint written by both ranks (the distributed save) into a shared root.
    mgr = CheckpointManager(tmp_path / "preempt", every_steps=1000, async_save=True)
    out["preempt_before"] = mgr.maybe_save(state_at(1), 1)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told
    out["preempt_saved"] = mgr.maybe_save(state_at(2), 2)
    out["preempt_stop"] = mgr.should_stop
    mgr.close()
    dist.barrier()
    out["preempt_steps"] = [e.step for e in scan(tmp_path / "preempt") if e.status == COMMITTED]

    with CheckpointManager(tmp_path / "decide", policy=OnlyOnRank(0), async_save=False) as mgr:
        out["decide_saved"] = [mgr.maybe_save(state_at(s), s) for s in (3, 4)]
    dist.barrier()
    out["decide_steps"] = [e.step for e in scan(tmp_path / "decide") if e.status == COMMITTED]

    (tmp_path / f"result{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _write(root: Path, steps) -> None:
    with CheckpointManager(root, async_save=False) as mgr:
        for s in steps:
            mgr.save(state_at(s), s)


def test_ranks_agree_on_restore_and_on_saving(tmp_path):
    _write(tmp_path / "choose0", [10, 20])
    _write(tmp_path / "choose1", [10, 20, 30])  # alone, rank 1 would restore 30
    _write(tmp_path / "fallback0", [10, 20])
    _write(tmp_path / "fallback1", [10, 20])
    flip_stored_bit(tmp_path / "fallback1" / checkpoint_name(20), "w")  # bad on rank 1 only
    assert _restore(tmp_path / "choose1")["step"] == 30

    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(WORLD))

    # rank 0 chose 20; rank 1 restored 20 too (exactly), not its newer 30
    assert r0["choose"]["step"] == r1["choose"]["step"] == 20
    assert r0["choose"]["exact"] and r1["choose"]["exact"]
    # 20 failed on rank 1 (checksum), so both ranks fell back to 10
    assert r0["fallback"]["step"] == r1["fallback"]["step"] == 10
    assert r0["fallback"]["exact"] and r1["fallback"]["exact"]
    for r in (r0, r1):  # a load fails on every rank with the failing rank's error
        assert any("step_000000020" in w and "rank 1 failed" in w and "checksum" in w
                   for w in r["fallback"]["warnings"]), r["fallback"]
    # the signal reached rank 1 only; both ranks saved step 2, waited for its commit and stop
    for r in (r0, r1):
        assert r["preempt_before"] is False
        assert r["preempt_saved"] is True and r["preempt_stop"] is True
        assert r["preempt_steps"] == [2]
    # the policy said yes on rank 0 only: both ranks saved
    assert r0["decide_saved"] == r1["decide_saved"] == [True, True]
    assert r0["decide_steps"] == r1["decide_steps"] == [3, 4]
