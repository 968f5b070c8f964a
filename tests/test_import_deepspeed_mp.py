"""resurgo.import_checkpoint(source="deepspeed") of checkpoints with tensor or pipeline parallelism,
as Megatron-DeepSpeed writes them: ``mp_rank_<t>_model_states.pt`` per tensor-parallel rank, or
``layer_<i>-model_<t>-model_states.pt`` per layer and rank (PipelineModule).

The files are written here with torch.save in DeepSpeed's structure, split from a consolidated
model of Megatron-LM's layer names (column-parallel ``query_key_value`` and ``dense_h_to_4h``,
a gated one as [gate_t; up_t] per rank, row-parallel ``dense`` and ``dense_4h_to_h``); the import
must give back the consolidated weights bit for bit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import CorruptCheckpointError

H, FFN = 8, 12
LAYER = {"input_layernorm.weight": (H,), "self_attention.query_key_value.weight": (3 * H, H),
         "self_attention.query_key_value.bias": (3 * H,), "self_attention.dense.weight": (H, H),
         "self_attention.dense.bias": (H,), "post_attention_layernorm.weight": (H,),
         "mlp.dense_h_to_4h.weight": (2 * FFN, H), "mlp.dense_h_to_4h.bias": (2 * FFN,),
         "mlp.dense_4h_to_h.weight": (H, FFN), "mlp.dense_4h_to_h.bias": (H,)}


def bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def pipe_model(layers: int) -> dict[int, dict[str, torch.Tensor]]:
    """GPTModelPipe's layers that hold parameters: 1 the embedding, 3.. the transformer layers, then the final norm."""
    g = torch.Generator().manual_seed(5)
    out = {1: {"word_embeddings.weight": torch.randn(32, H, generator=g),
               "position_embeddings.weight": torch.randn(16, H, generator=g)}}
    for i in range(layers):
        out[3 + i] = {n: torch.randn(s, generator=g) for n, s in LAYER.items()}
    out[4 + layers] = {"weight": torch.randn(H, generator=g), "bias": torch.randn(H, generator=g)}
    return out


def shard(name: str, t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    if "dense_h_to_4h" in name:  # gated: [gate; up], each split over the ranks
        gate, up = t.chunk(2)
        return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]).clone()
    if any(k in name for k in ("query_key_value", "word_embeddings")):
        return t.chunk(tp)[r].clone()
    if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")):
        return t.chunk(tp, dim=1)[r].clone()
    return t.clone()


def common(tp: int, module: dict | None) -> dict:
    return {"module": module, "buffer_names": [], "optimizer": None, "lr_scheduler": {}, "global_steps": 9,
            "global_samples": 72, "iteration": 9, "ds_version": "0.14.0", "mp_world_size": tp, "dp_world_size": 1,
            "args": argparse.Namespace(tensor_model_parallel_size=tp, swiglu=True, params_dtype=torch.float32)}


def write(folder: Path, model: dict[int, dict[str, torch.Tensor]], tp: int, pipeline: bool) -> None:
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text(folder.name)
    for r in range(tp):
        if pipeline:
            for i, layer in model.items():
                torch.save({n: shard(n, t, tp, r) for n, t in layer.items()},
                           folder / f"layer_{i:02d}-model_{r:02d}-model_states.pt")
            torch.save(common(tp, None), folder / f"mp_rank_{r:02d}_model_states.pt")
        else:
            flat = {f"language_model.encoder.layers.{i - 3}.{n}" if n in LAYER else f"language_model.{i}.{n}":
                    shard(n, t, tp, r) for i, layer in model.items() for n, t in layer.items()}
            torch.save(common(tp, flat), folder / f"mp_rank_{r:02d}_model_states.pt")


@pytest.mark.parametrize("pipeline", [True, False])
def test_tensor_and_pipeline_parallel_checkpoint_imports_consolidated(tmp_path, pipeline):
    model = pipe_model(layers=2)
    write(tmp_path / "ds" / "global_step9", model, tp=2, pipeline=pipeline)
    report = resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "ckpt", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "ckpt")
    for i, layer in model.items():
        for n, t in layer.items():
            key = (f"{i}.{n}" if pipeline else
                   f"language_model.encoder.layers.{i - 3}.{n}" if n in LAYER else f"language_model.{i}.{n}")
            assert bits(got["model"][key]) == bits(t), key
    assert report.num_tensors == sum(len(layer) for layer in model.values())
    assert got["step"] == got["iteration"] == 9 and got["tensor_model_parallel_size"] == 2
    assert got["args"]["swiglu"] is True


def test_missing_layer_file_and_mismatched_shards_are_named(tmp_path):
    folder = tmp_path / "ds" / "global_step9"
    write(folder, pipe_model(layers=2), tp=2, pipeline=True)
    (folder / "layer_04-model_01-model_states.pt").rename(tmp_path / "away.pt")
    with pytest.raises(CorruptCheckpointError, match=r"global_step9/layer_04-model_01-model_states.pt: missing"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "out", source="deepspeed")
    state = torch.load(tmp_path / "away.pt")
    state["self_attention.dense.weight"] = torch.zeros(H, 3)
    torch.save(state, folder / "layer_04-model_01-model_states.pt")
    with pytest.raises(CorruptCheckpointError, match=r"layer_04-model_01-model_states.pt: '4.self_attention.dense."
                                                     r"weight' is a float32 tensor of shape \[8, 3\]"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "out", source="deepspeed")
    assert not (tmp_path / "out").exists()
