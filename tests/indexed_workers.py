"""Rank functions of the format version 4 tests (see dist_harness.run_ranks)."""

from __future__ import annotations

import torch

import resurgo


def _rows(i: int) -> int:
    return 9 + i % 5


def sharded_state(rank: int, world: int, tensors: int) -> dict:
    """``tensors`` small tensors, each cut in ``world`` row blocks by torch.chunk's rule (the layout
    of DTensor's Shard(0)), as resurgo.Shard; plus a replicated tensor and a value."""
    state: dict = {}
    for i in range(tensors):
        full = torch.arange(_rows(i) * 4, dtype=torch.float32).reshape(_rows(i), 4) + i
        block = -(-full.shape[0] // world)
        a, b = min(rank * block, full.shape[0]), min((rank + 1) * block, full.shape[0])
        state[f"t{i:04d}"] = resurgo.Shard(full[a:b].clone(), full.shape, (a, 0))
    state["replicated"] = torch.arange(10.0)
    state["step"] = 7
    return state


def save_then_load(rank: int, world: int, path: str, tensors: int) -> tuple[int, int, bool]:
    """Save, then load into the same layout: (metadata bytes this rank read, data bytes read, equal)."""
    resurgo.save(sharded_state(rank, world, tensors), path)
    target = sharded_state(rank, world, tensors)
    for v in target.values():
        if isinstance(v, resurgo.Shard):
            v.local.zero_()
    target["replicated"].zero_()
    report = resurgo.load(target, path)
    want = sharded_state(rank, world, tensors)
    same = all(torch.equal(target[k].local, want[k].local) for k in want if isinstance(want[k], resurgo.Shard))
    return report.metadata_bytes_read, report.bytes_read, same and torch.equal(target["replicated"], want["replicated"])


def save_only(rank: int, world: int, path: str, tensors: int) -> bool:
    resurgo.save(sharded_state(rank, world, tensors), path)
    return True
