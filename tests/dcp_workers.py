"""Workers of tests/test_convert_dcp.py on real gloo ranks: an FSDP2 job saves with resurgo, and
another FSDP2 job (another sharding) loads the DCP conversion with ``dcp.load``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

import resurgo


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))  # 10 and 5 rows: uneven on 3 ranks


def train_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    model(torch.randn(4, 6, generator=g)).square().sum().backward()
    opt.step()


def full(value: object) -> object:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def flat_full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optimizer.state.{i}.{name}": full(v) for name, v in st.items()})
    return out


def save_fsdp(rank: int, world: int, root: str) -> None:
    """FSDP2 (rows sharded) with AdamW after one step, saved as a TrainState; rank 0 keeps the full view."""
    model = fully_shard(build())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, opt, rank)
    resurgo.save(resurgo.TrainState(model=model, optimizer=opt, step=3), f"{root}/ck")
    reference = flat_full(model, opt)
    if rank == 0:
        torch.save(reference, f"{root}/reference.pt")


def load_dcp_fsdp(rank: int, world: int, root: str) -> list[str]:
    """FSDP2 sharded by columns (another sharding) loads the DCP directory; returns the placements."""
    model = fully_shard(build(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    train_step(model, opt, rank + 7)  # the optimizer state exists, with other values
    target = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 0}
    dcp.load(target, checkpoint_id=f"{root}/dcp")
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optimizer"])
    got = flat_full(model, opt)
    if rank == 0:
        torch.save({**got, "step": target["step"], "lr": opt.param_groups[0]["lr"]}, f"{root}/loaded.pt")
    dist.barrier()
    return [f"{k}: {v.placements}" for k, v in model.state_dict().items()]
