"""Functions the memory-tier tests run on every rank (see dist_harness.run_ranks): 4 ranks on 2
simulated nodes (node = rank // 2), one memory root per node under the test's directory."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import resurgo
from resurgo.manager import CheckpointManager, MemoryTier, Tier
from resurgo.storage.spare_pages import SPARE_DIR, SparePages

ROWS = 24  # rows of w: a block per rank on 2, 3 or 4 ranks
MTBF = 3600.0


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, 1000, generator=g), "b": torch.randn(300, generator=g), "step": step}


def rank_state(step: int, rank: int, world: int) -> dict:
    """This rank's part of step ``step``'s state: a row block of w, all of b, a value of its own."""
    full = full_state(step)
    per = ROWS // world
    rows = slice(per * rank, per * rank + per)
    return {"w": resurgo.Shard(full["w"][rows].clone(), (ROWS, 1000), (per * rank, 0)), "b": full["b"].clone(),
            "mine": torch.full((5,), float(100 * step + rank)), "step": step}


def blank(rank: int, world: int) -> dict:
    state = rank_state(0, rank, world)
    state["w"].local.zero_()
    state["b"].zero_()
    state["mine"].zero_()
    state["step"] = -1
    return state


def same(state: dict, step: int, rank: int, world: int) -> bool:
    want = rank_state(step, rank, world)
    return (torch.equal(state["w"].local, want["w"].local) and torch.equal(state["b"], want["b"])
            and torch.equal(state["mine"], want["mine"]) and state["step"] == step)


def manager(tmp: str, rank: int, *, every_steps: int = 1, **kw) -> CheckpointManager:
    mem = MemoryTier(replicas=1, keep_last=1, root=os.path.join(tmp, "mem", "node{node}"), node=rank // 2)
    return CheckpointManager(tiers=[mem, Tier(Path(tmp) / "durable", copy_every_steps=every_steps)], **kw)


def save_steps(rank: int, world: int, tmp: str, steps: list[int], every_steps: int = 1) -> dict:
    mgr = manager(tmp, rank, every_steps=every_steps, interval="auto", mtbf=MTBF)
    for s in steps:
        mgr.save(rank_state(s, rank, world), s)
    mgr.close()
    return {"cost": mgr.save_cost_seconds, "interval": mgr.interval_seconds}


def save_restore_replace(rank: int, world: int, tmp: str) -> dict:
    """One job, restarted twice (a new manager each time, in the same processes): save steps 1
    and 2; hide the durable tier's data files; restore from memory; wipe node 1's root; restore
    from node 0's replicas."""
    out = save_steps(rank, world, tmp, [1, 2])
    dist.barrier()
    if rank == 0:
        out["listing"] = {str(p.relative_to(tmp)): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}
        durable = Path(tmp) / "durable"
        for name in os.listdir(durable):  # no durable byte can be read now: a restore that works read memory
            (durable / name / "data").rename(durable / name / "moved")
    dist.barrier()
    return {**out, **restore_then_replace_node(rank, world, tmp, 2)}


def restore_then_replace_node(rank: int, world: int, tmp: str, step: int) -> dict:
    """Restore from memory as it is; then wipe node 1's root, and restore again (a new manager:
    the job restarted with node 1 replaced)."""
    out: dict = {}
    mgr = manager(tmp, rank)
    state = blank(rank, world)
    out["local"] = mgr.restore(state)
    out["local_exact"] = same(state, step, rank, world)
    mgr.close()
    dist.barrier()
    if rank == 2:
        shutil.rmtree(Path(tmp) / "mem" / "node1")
    dist.barrier()
    mgr = manager(tmp, rank)
    state = blank(rank, world)
    out["replaced"] = mgr.restore(state)
    out["replaced_exact"] = same(state, step, rank, world)
    mgr.close()
    return out


def restore_only(rank: int, world: int, tmp: str, step: int) -> dict:
    mgr = manager(tmp, rank)
    state = blank(rank, world)
    restored = mgr.restore(state)
    mgr.close()
    return {"step": restored, "exact": restored is not None and same(state, restored, rank, world)}


def kill_mid_replication(rank: int, world: int, tmp: str) -> None:
    """Save step 1, then SIGKILL every rank while step 2's replicas are being received."""
    from resurgo.pipeline import replicate

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    mgr = manager(tmp, rank, async_save=False)
    mgr.save(rank_state(1, rank, world), 1)
    mgr.wait()

    def die(transfer) -> None:  # rank 2 has written rank 0's replica of step 2: everyone dies now
        if rank == 2:
            for pid in pids:
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    replicate.after_receive = die
    mgr.save(rank_state(2, rank, world), 2)
    raise AssertionError("step 2 committed: the kill did not happen")


def resume_on_two(rank: int, world: int, tmp: str, step: int) -> dict:
    """Two ranks on one node (node 0): restore what four ranks saved, through universal load."""
    mem = MemoryTier(replicas=0, keep_last=1, root=os.path.join(tmp, "mem", "node{node}"), node=0)
    mgr = CheckpointManager(tiers=[mem, Tier(Path(tmp) / "durable")])
    state = blank(rank, world)
    # rank r of 2 takes over the value of saved rank 2r
    state["mine"] = resurgo.PerRank(torch.zeros(5), on_resize=lambda saved, r, w: saved[2 * r])
    restored = mgr.restore(state)
    mgr.close()
    mine = torch.as_tensor(state["mine"].value)
    state["mine"] = rank_state(step, rank, world)["mine"]  # compared apart: it is saved rank 2r's
    return {"step": restored, "exact": restored == step and same(state, step, rank, world)
            and torch.equal(mine, rank_state(step, 2 * rank, 4)["mine"])}


def three_nodes(rank: int, world: int, tmp: str) -> dict:
    """Three nodes of one rank each, one replica: every node holds 2 of the 3 data files. Save
    steps 1 to 3 (keep_last=1), then wipe node 1 and restore."""
    mem = MemoryTier(replicas=1, keep_last=1, root=os.path.join(tmp, "mem", "node{node}"), node=rank)
    mgr = CheckpointManager(tiers=[mem], async_save=False)
    for s in (1, 2, 3):
        mgr.save(rank_state(s, rank, world), s)
    mgr.close()
    mine = Path(tmp) / "mem" / f"node{rank}"
    out: dict = {"steps": sorted(n for n in os.listdir(mine) if n != SPARE_DIR),
                 "spares": len(SparePages(mine).files()), "held": sorted(os.listdir(mine / "step_000000003" / "data"))}
    dist.barrier()
    if rank == 1:
        shutil.rmtree(mine)
    dist.barrier()
    mgr = CheckpointManager(tiers=[mem])
    state = blank(rank, world)
    out["restored"] = mgr.restore(state)
    out["exact"] = same(state, 3, rank, world)
    mgr.close()
    out["after"] = sorted(os.listdir(mine / "step_000000003" / "data"))
    return out


def flip_what_is_sent(cls) -> None:
    """From now on, every file ``cls.map_read`` maps to be sent has one byte flipped (a private
    mapping: the file itself keeps its bytes)."""
    mapped = cls.map_read

    def flipped(self, rel):
        f = mapped(self, rel)
        f.view[len(f.view) - 9] ^= 1
        return f

    cls.map_read = flipped


def corrupt_in_transit(rank: int, world: int, tmp: str) -> dict:
    """Save step 1; then save step 2 with one byte of rank 0's data flipped on its way to its
    replica holder (rank 2): the save fails on every rank, and step 1 is what memory restores."""
    from resurgo.pipeline import replicate

    mgr = manager(tmp, rank, async_save=False)
    mgr.save(rank_state(1, rank, world), 1)

    def flip(transfer, piece, view) -> None:  # rank 0's last piece to rank 2: a byte flipped on arrival
        if transfer.src == 0 and piece.stop == transfer.nbytes:
            view[len(view) - 9] ^= 1

    if rank == 2:
        replicate.on_piece = flip
    out: dict = {}
    try:
        mgr.save(rank_state(2, rank, world), 2)
    except resurgo.ResurgoError as e:
        out["error"] = (type(e).__name__, str(e))
    mgr.close()
    out.update(restore_only(rank, world, tmp, 1))
    return out


def corrupt_peer_read(rank: int, world: int, tmp: str) -> dict:
    """Save steps 1 and 2 (both copied to the durable tier); wipe node 1's root; restore with one
    byte of every file node 0 sends flipped on its way: node 1's ranks find it does not verify,
    and every rank restores step 2 from the durable tier instead."""
    import warnings

    from resurgo.storage.local import CheckpointDir

    save_steps(rank, world, tmp, [1, 2])
    dist.barrier()
    if rank == 2:
        shutil.rmtree(Path(tmp) / "mem" / "node1")
    dist.barrier()
    if rank in (0, 1):
        flip_what_is_sent(CheckpointDir)
    mgr = manager(tmp, rank)
    state = blank(rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = mgr.restore(state)
    mgr.close()
    node1 = Path(tmp) / "mem" / "node1" / "step_000000002"
    return {"step": restored, "exact": same(state, 2, rank, world), "warnings": [str(w.message) for w in caught],
            "node1": sorted(str(p.relative_to(node1)) for p in node1.rglob("*") if p.is_file()) if rank == 2 else None}
