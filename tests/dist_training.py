"""A small transformer trained with FSDP2 (``fully_shard``) on gloo, checkpointed with resurgo and
resumed on another number of ranks (see test_distributed_training.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import resurgo

VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 8


def build() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)]
    return nn.Sequential(nn.Embedding(VOCAB, 32), *layers, nn.Linear(32, VOCAB))


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    return tokens[rank * per:(rank + 1) * per]


def shard(model: nn.Module) -> nn.Module:
    for layer in list(model)[1:-1]:
        fully_shard(layer)
    fully_shard(model)
    return model


def step_once(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> float:
    tokens = batch(step, rank, world)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            out[f"opt.{i}.{name}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def run(rank: int, world: int, root: str, save_at: int, steps: int) -> dict:
    """Train ``steps`` steps; save after ``save_at`` steps; record losses and the saved state."""
    model = shard(build())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        losses.append(step_once(model, opt, step, rank, world))
        if step + 1 == save_at:
            resurgo.save(resurgo.TrainState(model=model, optimizer=opt, step=step + 1), f"{root}/ckpt")
            saved = full_state(model, opt)
            if rank == 0:
                torch.save(saved, f"{root}/reference.pt")
    return {"losses": losses}


def resume(rank: int, world: int, root: str, steps: int) -> dict:
    model = shard(build())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ts = resurgo.TrainState(model=model, optimizer=opt, step=0)  # a fresh optimizer: no state yet
    report = resurgo.load(ts, f"{root}/ckpt")
    sharded = all(type(v).__name__ == "DTensor" for st in opt.state.values() for k, v in st.items() if k != "step")
    loaded = full_state(model, opt)
    reference = torch.load(f"{root}/reference.pt", weights_only=True)
    mismatched = sorted(k for k in reference if not torch.equal(
        reference[k].reshape(-1).view(torch.uint8), loaded[k].reshape(-1).view(torch.uint8)))
    missing = sorted(set(reference) ^ set(loaded))
    losses = [step_once(model, opt, step, rank, world) for step in range(ts.step, steps)]
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"losses": losses, "mismatched": mismatched, "missing": missing, "step": ts.step, "sharded": sharded,
            "bytes_read": report.bytes_read, "local_param_bytes": local_bytes}


def mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def save_fsdp_over_tp(rank: int, world: int, root: str) -> list[str]:
    """2-D: tensor parallel on the inner mesh dim, FSDP2 on the outer: the dim-0 parameters are
    split twice along dim 0 (a strided shard). Returns each parameter's placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    resurgo.save({"model": model.state_dict()}, f"{root}/ckpt2d")
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, f"{root}/reference2d.pt")
    return [f"{k}: {v.placements}" for k, v in model.state_dict().items()]


def load_fsdp_only(rank: int, world: int, root: str) -> list[str]:
    model = fully_shard(mlp())
    sd = model.state_dict()
    resurgo.load({"model": sd}, f"{root}/ckpt2d")
    reference = torch.load(f"{root}/reference2d.pt", weights_only=True)
    return sorted(k for k, v in model.state_dict().items() if not torch.equal(v.full_tensor(), reference[k]))
