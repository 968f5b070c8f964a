"""Rank functions for importing a DCP save of a 2-D mesh: FSDP2 over tensor parallelism on 4
gloo ranks (a 2x2 DeviceMesh), and loading the imported checkpoint into FSDP2 on 3 ranks."""

from __future__ import annotations

import torch

import resurgo
from dcp_import_workers import _mlp, _train_and_save


def fsdp2_over_tp(rank: int, world: int, path: str) -> None:
    """dp x tp = 2 x 2: the first layer column-parallel, the second row-parallel, both sharded by
    FSDP2 over dp; the second layer's 3 rows split 2 and 1 (uneven)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(_mlp(8), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    _train_and_save(model, path, rank // (world // 2))  # one batch per dp rank: tp peers see the same data


def _flat(node: object, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {k: v for key, sub in node.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def load_into_fsdp2(rank: int, world: int, imported: str, consolidated: str) -> dict:
    """The imported checkpoint loaded into FSDP2 on ``world`` ranks (model and Adam state), each
    tensor compared bit for bit with DCP's consolidation; (keys loaded, bytes read)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp(8)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.ones(2, 5)).sum().backward()
    optim.step()  # creates the Adam state the load replaces
    model_sd, optim_sd = get_state_dict(model, optim)
    target = {k: v for k, v in _flat({"model": model_sd, "optim": {"state": optim_sd["state"]}}).items()
              if isinstance(v, torch.Tensor)}
    report = resurgo.load(target, imported, strict=False)
    want = _flat(torch.load(consolidated, weights_only=False))
    for key, value in target.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert full.shape == want[key].shape and torch.equal(full.reshape(-1).view(torch.uint8), want[key].reshape(-1).view(torch.uint8)), key
    return {"keys": sorted(target), "missing": report.missing_keys, "bytes_read": report.bytes_read,
            "shards": {k: list(v.to_local().shape) for k, v in target.items() if isinstance(v, DTensor)}}
