"""Rank functions that write real torch.distributed.checkpoint (DCP) saves on gloo, for the
import tests: FSDP2 with uneven shards, and tensor parallelism (column- and row-wise)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn


def _mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _train_and_save(model: nn.Module, path: str, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    model(torch.randn(4, 5)).square().sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "extra": {"step": 7, "tags": ["a", "b"]}}, checkpoint_id=path)


def fsdp2_then_tp(rank: int, world: int, fsdp_path: str, tp_path: str) -> None:
    """An FSDP2 save (dimensions 7 and 3 split unevenly over 2 ranks), then a TP save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp(7)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train_and_save(model, fsdp_path, rank)
    # TP needs a hidden size the ranks split evenly (DTensor activations of uneven shards do not compute)
    tp = parallelize_module(_mlp(8), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    _train_and_save(tp, tp_path, rank)
