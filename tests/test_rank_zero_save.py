"""``collective=False``: one process of a distributed job saves and loads on its own (the
``if rank == 0: torch.save(...)`` habit), while the other ranks do not call resurgo at all."""

from __future__ import annotations

import torch
import torch.distributed as dist

import resurgo
from dist_harness import run_ranks
from helpers import bits_equal


def state_of(rank: int) -> dict:
    g = torch.Generator().manual_seed(7 + rank)  # the ranks' states differ: rank 0's is the one saved
    return {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16), "step": 4}


def rank_zero_saves(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (world,)), [Shard(0)])
    refused = None
    if rank == 0:  # half of a tensor is not a checkpoint of one process
        try:
            resurgo.save({"d": sharded}, f"{root}/sharded", collective=False)
        except resurgo.ResurgoError as e:
            refused = f"{type(e).__name__}: {e}"
    if rank == 0:  # rank 1 calls no resurgo function: it goes straight to the barrier
        resurgo.save(state_of(0), f"{root}/sync", collective=False)
        resurgo.async_save(state_of(0), f"{root}/async", collective=False).wait()
    dist.barrier()
    out = {"refused": refused}
    for name in ("sync", "async"):
        target = {"w": torch.zeros(5, 3), "b": torch.zeros(3, dtype=torch.bfloat16), "step": 0}
        if rank == 1:  # rank 1 alone reads it back; rank 0 meanwhile does nothing
            resurgo.load(target, f"{root}/{name}", collective=False)
            out[name] = {"loaded": target, "dict": resurgo.load_dict(f"{root}/{name}", collective=False)}
        dist.barrier()
    return out


def test_rank_zero_saves_alone_and_another_rank_loads_it_bit_exact(tmp_path):
    ranks = run_ranks(2, "test_rank_zero_save:rank_zero_saves", str(tmp_path), timeout=120)
    expected = state_of(0)
    for name in ("sync", "async"):
        assert resurgo.read_manifest(tmp_path / name).world == {"size": 1}
        assert bits_equal(ranks[1][name]["loaded"], expected), name
        assert bits_equal(ranks[1][name]["dict"], expected), name
    assert ranks[0] == {"refused": "ShardingError: tensor 'd': the ranks' shards hold 4 of its 8 elements "
                                   "(global shape [8]): some part is held by no rank"}
    assert not (tmp_path / "sharded").exists()
