"""What every rank runs in tests/test_plan_fingerprint_dist.py (see dist_harness.run_ranks)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import resurgo
from resurgo.dist.comm import sent_bytes
from resurgo.pipeline import save as save_module
from resurgo.format import checksum
from resurgo.layout.box import ChunkBox, FlatRange
from resurgo.plan.global_plan import PlanCache, RankDecl, TensorDecl

TENSORS = 40  # sharded: a rank's declarations weigh several KiB, its summary a few hundred bytes


def fixed_digests() -> list:
    """The layout fingerprints of a fixed job of 3 ranks, and the id and per-rank keys of its plan:
    equal in every process, whatever its str hashes (each spawned process has its own seed)."""
    decls = []
    for r in range(3):
        tensors = (TensorDecl("w\u00e9", "torch", "bfloat16", (6, 4), (ChunkBox((2 * r, 0), (2, 4)),), True),
                   TensorDecl("f", "numpy", "int64", (9,), (FlatRange(3 * r, 3 * r + 3),), True),
                   TensorDecl("s", "torch", "float32", (), (ChunkBox((), ()),), False, str(r % 2) * 32),
                   TensorDecl("q", "torch", "float32", (), (ChunkBox((), ()),), False, str(r) * 32))
        decls.append(RankDecl({"type": "dict", "items": [[t.key, {"type": "tensor", "key": t.key}] for t in tensors]},
                              tensors))
    cache = PlanCache()
    cache.plan(decls, checksum.block_bytes_for, None)
    plan_id, per_rank = cache.ticket()
    return [[d.layout for d in decls], plan_id, sorted(per_rank)]


def state(rank: int, world: int, step: int, *, own: bool = False, bad: bool = False) -> dict:
    """``own``: this rank's PerRank value holds a tensor the other ranks' do not; ``bad``: a value
    no save accepts."""
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4) * step
    rng: dict = {"seed": 100 * rank + step}
    if own:
        rng["t"] = torch.full((3,), float(rank))
    out = {"w": {f"w{i}": distribute_tensor(full + i, mesh, [Shard(0)], src_data_rank=None) for i in range(TENSORS)},
           "step": step,
           "s": torch.tensor(float(step)),  # replicated, equal on every rank
           "seen": torch.tensor([float(rank + step)]),  # differs between ranks: kept per rank
           "rng": resurgo.PerRank(rng)}
    if bad:
        out["bad"] = object()
    return out


def repeated_saves(rank: int, world: int, new: str, old: str) -> dict:
    """Saves 1-3 of one layout in ``new``, measuring what each rank sent while the save was
    planned; the same saves in ``old`` with no plan held (every rank sends its declarations, as
    before summaries); then a layout that changes on rank 1 alone, a bad value on rank 1, and the
    same layout again."""
    from resurgo import api

    out: dict = {"gather": [], "broadcast": [], "hits": [], "fixed": fixed_digests()}
    prepare = api.prepare_save

    def measured(*args, **kwargs):  # type: ignore[no-untyped-def]
        before = sent_bytes()
        prep = prepare(*args, **kwargs)
        after = sent_bytes()
        out["gather"].append(after["gather"] - before["gather"])
        out["broadcast"].append(after["broadcast"] - before["broadcast"])
        return prep

    def save(path: str, **kw: bool) -> None:
        api.prepare_save = measured
        try:
            resurgo.save(state(rank, world, kw.pop("step"), **kw), path)  # type: ignore[arg-type]
        finally:
            api.prepare_save = prepare
        out["hits"].append(save_module._plans.hits)

    for step in (1, 2, 3):
        save(f"{new}/c{step}", step=step)
    held = save_module._plans
    for step in (1, 2, 3):
        save_module._plans = PlanCache()
        resurgo.save(state(rank, world, step), f"{old}/c{step}")
    save_module._plans = held
    save(f"{new}/c4", step=4, own=rank == 1)  # rank 1's layout changes: a new plan
    save(f"{new}/c5", step=5, own=rank == 1)  # and that one is reused in turn
    try:
        resurgo.save(state(rank, world, 6, own=rank == 1, bad=rank == 1), f"{new}/c6")
        out["error"] = None
    except resurgo.ResurgoError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    save(f"{new}/c7", step=7, own=rank == 1)  # the failed save changed nothing held
    return out
