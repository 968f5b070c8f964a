"""Rank functions for the Hugging Face import tests: a fine-tuning job's start, loading an
imported model into FSDP2 (fully_shard) and tensor-parallel (ColwiseParallel / RowwiseParallel)
layouts on gloo, and returning what each rank read."""

from __future__ import annotations

import torch

import resurgo


def _expected_bytes(ckpt: str, target: dict) -> tuple[int, int]:
    """(bytes this rank should read, bytes of its own shards). A tensor sharded by rows (Shard(0))
    is read as its own rows only; one split by columns, replicated, or held in a single checksum
    block is read whole (its blocks hold other ranks' elements too, and a block is verified whole)."""
    from torch.distributed.tensor import DTensor, Shard

    entries = resurgo.read_manifest(ckpt).tensors
    expected = own = 0
    for key, value in target.items():
        entry = entries[key]
        whole = sum(c.byte_range[1] - c.byte_range[0] for c in entry.chunks)
        local = value.to_local() if isinstance(value, DTensor) else value
        mine = local.numel() * local.element_size()
        rows = isinstance(value, DTensor) and value.placements == (Shard(0),)
        one_block = all(c.block_bytes >= c.byte_range[1] - c.byte_range[0] for c in entry.chunks)
        expected += mine if rows and not one_block else whole
        own += mine
    return expected, own


def _check(model: torch.nn.Module, want: dict, ckpt: str) -> dict:
    from torch.distributed.tensor import DTensor

    target = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    report = resurgo.load(target, ckpt)
    for key, value in target.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(full.view(torch.uint8), want[key].view(torch.uint8)), key
    expected, own = _expected_bytes(ckpt, target)
    return {"bytes_read": report.bytes_read, "expected": expected, "own": own,
            "placements": {k: str(v.placements) for k, v in target.items() if isinstance(v, DTensor)}}


def fsdp2_and_tp(rank: int, world: int, model_dir: str, ckpt: str) -> dict:
    """Load the imported checkpoint into a fresh FSDP2 model, then into a fresh TP model; each
    compared bit for bit with from_pretrained, with the bytes each load read."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    want = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    config = transformers.AutoConfig.from_pretrained(model_dir)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(100 + rank)  # other weights on every rank: the load must replace them all
    fsdp = transformers.AutoModelForCausalLM.from_config(config)
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    out = {"fsdp2": _check(fsdp, want, ckpt)}

    torch.manual_seed(200 + rank)
    tp = transformers.AutoModelForCausalLM.from_config(config)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    for i in range(len(tp.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(tp, mesh, plan)
    out["tp"] = _check(tp, want, ckpt)
    return out
