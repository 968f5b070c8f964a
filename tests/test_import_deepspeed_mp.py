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
import dataclasses
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import CorruptCheckpointError, UnsupportedValueError

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
    trimmed = resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "trimmed", source="deepspeed", vocab_size=30)
    key = "1.word_embeddings.weight" if pipeline else "language_model.1.word_embeddings.weight"
    assert bits(resurgo.load_dict(tmp_path / "trimmed")["model"][key]) == bits(model[1]["word_embeddings.weight"][:30])
    assert trimmed.num_tensors == report.num_tensors
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


# -- Universal Checkpointing's sub-parameters, the ZeRO optimizer, the vocabulary size ---------------
NQ, NKV, HD = 4, 2, 2  # grouped-query attention: 4 query heads, 2 key/value heads of 2 channels
QKV_ROWS = (NQ + 2 * NKV) * HD


@dataclasses.dataclass
class SubparamShape:  # pickled under DeepSpeed's name (deepspeed itself is not needed)
    patterns: list
    shape: tuple
    partition_dim: int


@pytest.fixture
def deepspeed_names(monkeypatch):
    for name in ("deepspeed", "deepspeed.checkpoint", "deepspeed.checkpoint.universal_checkpoint"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = sys.modules["deepspeed.checkpoint.universal_checkpoint"]
    module.SubparamShape = SubparamShape  # type: ignore[attr-defined]
    monkeypatch.setattr(SubparamShape, "__module__", module.__name__)


def qkv_shard(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """Rank r's own [q_r; k_r; v_r] block of the consolidated [q; k; v]."""
    q, k, v = full.split([NQ * HD, NKV * HD, NKV * HD])
    return torch.cat([q.chunk(tp)[r], k.chunk(tp)[r], v.chunk(tp)[r]]).clone()


GQA_LAYER = {**LAYER, "self_attention.query_key_value.weight": (QKV_ROWS, H),
             "self_attention.query_key_value.bias": (QKV_ROWS,)}


def gqa_shard(name: str, t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    return qkv_shard(t, tp, r) if "query_key_value" in name else shard(name, t, tp, r)


def ucp_info(as_dicts: bool = False) -> dict:
    """Megatron-DeepSpeed's universal_checkpoint_info: SubparamShape objects, or (``as_dicts``, the
    form DeepSpeed's ds_to_universal now reads) dicts of their fields."""
    shapes = [SubparamShape([r"\d+.self_attention.query_key_value.weight"], ((NQ, NKV, NKV), HD, H), 0),
              SubparamShape([r"\d+.self_attention.query_key_value.bias"], ((NQ, NKV, NKV), HD), 0)]
    return {"parameter_with_sub_params": [dataclasses.asdict(s) for s in shapes] if as_dicts else shapes,
        "parameter_with_2_sub_params_cat_dim_0": [r"\d+.mlp.dense_h_to_4h.weight", r"\d+.mlp.dense_h_to_4h.bias"]}


def gqa_model(layers: int, vocab: int = 32) -> dict[int, dict[str, torch.Tensor]]:
    """Distinct values everywhere (a running count), so that any misplaced row shows."""
    count = iter(range(1, 1 << 30))
    out = {1: {"word_embeddings.weight": (vocab, H), "position_embeddings.weight": (16, H)}}
    for i in range(layers):
        out[3 + i] = dict(GQA_LAYER)
    out[4 + layers] = {"weight": (H,), "bias": (H,)}
    return {i: {n: torch.tensor([float(next(count)) for _ in range(math.prod(s))]).reshape(s) for n, s in layer.items()}
            for i, layer in out.items()}


def test_fused_qkv_of_each_rank_is_split_then_gathered_per_sub_parameter(tmp_path, deepspeed_names):
    """Each rank holds its own [q_t; k_t; v_t]: laid side by side they would interleave q, k and v;
    Universal Checkpointing's SubparamShape in the model states makes the import gather each on its own."""
    model = gqa_model(layers=1)
    folder = tmp_path / "ds" / "global_step9"
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text(folder.name)
    for r in range(2):
        for i, layer in model.items():
            torch.save({n: gqa_shard(n, t, 2, r) for n, t in layer.items()},
                       folder / f"layer_{i:02d}-model_{r:02d}-model_states.pt")
        torch.save({**common(2, None), "universal_checkpoint_info": ucp_info(as_dicts=True)},
                   folder / f"mp_rank_{r:02d}_model_states.pt")
    resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "ckpt", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "ckpt")["model"]
    for n in ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias"):
        want = model[3][n]
        assert bits(got[f"3.{n}"]) == bits(want), n
        side_by_side = torch.cat([qkv_shard(want, 2, r) for r in range(2)])
        assert bits(side_by_side) != bits(want)
    assert bits(got["3.mlp.dense_h_to_4h.weight"]) == bits(model[3]["mlp.dense_h_to_4h.weight"])
    # a sub_param_shape the shards do not fit is named
    info = ucp_info()
    info["parameter_with_sub_params"][0] = SubparamShape([r"\d+.self_attention.query_key_value.weight"],
                                                         ((NQ, NKV, NKV + 2), HD, H), 0)
    torch.save({**common(2, None), "universal_checkpoint_info": info}, folder / "mp_rank_00_model_states.pt")
    with pytest.raises(CorruptCheckpointError, match=r"layer_03-model_00-model_states.pt: '3.self_attention."
                                                     r"query_key_value.weight' of shape \[8, 8\] .* does not fit "
                                                     r"the sub_param_shape"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "bad", source="deepspeed")


def zero_files(folder: Path, model: dict[int, dict[str, torch.Tensor]], moments: dict, *, tp: int, pp: int, dp: int,
               stages: list[list[int]], bf16: bool, tied: bool = False, info: dict | None = None) -> None:
    """Megatron-DeepSpeed's ZeRO-1 (``bf16``: its bf16 optimizer's) files: per model-parallel rank
    m = stage * tp + t its model states
    (param_shapes: weight-decayed parameters, then the others) and per data-parallel rank d its
    partition of each group's flat fp32 weights and Adam moments (padded to a multiple of dp)."""
    for s, held in enumerate(stages):
        for t in range(tp):
            groups: list[dict[str, torch.Size]] = [{}, {}]
            flats: dict[str, list[torch.Tensor]] = {"fp32": [[], []], "exp_avg": [[], []], "exp_avg_sq": [[], []]}
            for i in held:
                for n, full in model[i].items():
                    g = 1 if n.endswith("bias") or full.dim() == 1 else 0
                    part = gqa_shard(n, full, tp, t)
                    # a PipelineModule names a tied layer's parameters after its key
                    groups[g][f"tied_modules.embed.{n}" if tied and i == 1 else f"{i}.{n}"] = part.shape
                    flats["fp32"][g].append(part.reshape(-1))
                    for k in ("exp_avg", "exp_avg_sq"):
                        flats[k][g].append(gqa_shard(n, moments[i, n][k], tp, t).reshape(-1))
            mp = s * tp + t
            torch.save({**common(tp, None), "param_shapes": groups, "universal_checkpoint_info": info or ucp_info(),
                        "args": argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                   swiglu=True, vocab_size=30)},
                       folder / f"mp_rank_{mp:02d}_model_states.pt")
            for d in range(dp):
                parts: dict[str, list[torch.Tensor]] = {}
                for k, per_group in flats.items():
                    parts[k] = []
                    for tensors in per_group:
                        flat = torch.cat(tensors)
                        flat = torch.cat([flat, torch.zeros(-len(flat) % dp)])
                        parts[k].append(flat.chunk(dp)[d].clone())
                base = {"state": {g: {"step": torch.tensor(3.0), "exp_avg": parts["exp_avg"][g],
                                      "exp_avg_sq": parts["exp_avg_sq"][g]} for g in range(2)},
                        "param_groups": [{"lr": 1e-3, "weight_decay": wd, "betas": (0.9, 0.95), "params": [g]}
                                         for g, wd in enumerate((0.1, 0.0))]}
                osd = {"partition_count": [dp, dp], "base_optimizer_state": base,
                       "single_partition_of_fp32_groups": parts["fp32"]}
                if not bf16:  # DeepSpeed's bf16 optimizer names no ZeRO stage
                    osd["zero_stage"] = 1
                torch.save({"optimizer_state_dict": osd, "ds_config": {}, "ds_version": "0.14.0"},
                           folder / f"{'bf16_' if bf16 else ''}zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt")
            for i in held:
                torch.save({n: gqa_shard(n, full, tp, t).to(torch.bfloat16 if bf16 else torch.float32)
                            for n, full in model[i].items()}, folder / f"layer_{i:02d}-model_{t:02d}-model_states.pt")


@pytest.mark.parametrize("bf16, tied", [(False, True), (True, False)])
def test_zero_optimizer_of_tensor_and_pipeline_parallel_ranks_imports_consolidated(tmp_path, deepspeed_names, bf16,
                                                                                    tied):
    """2 tensor- x 2 pipeline- x 2 data-parallel ranks: each rank's ZeRO partitions are cut at the
    parameters, laid in place as the weights are (fused qkv per sub-parameter, gate and up, a
    row-parallel weight on dimension 1, the vocabulary padding dropped, replicated norms compared)
    and numbered as a one-rank run's optimizer numbers its parameters."""
    model = gqa_model(layers=2)
    g = torch.Generator().manual_seed(2)
    moments = {(i, n): {"exp_avg": torch.randn(t.shape, generator=g), "exp_avg_sq": torch.rand(t.shape, generator=g)}
               for i, layer in model.items() for n, t in layer.items()}
    for i, layer in model.items():  # replicated tensors' moments are the same on every rank
        for n in layer:
            if gqa_shard(n, layer[n], 2, 0).shape == layer[n].shape:
                assert bits(gqa_shard(n, moments[i, n]["exp_avg"], 2, 1)) == bits(moments[i, n]["exp_avg"])
    folder = tmp_path / "ds" / "global_step9"
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text(folder.name)
    zero_files(folder, model, moments, tp=2, pp=2, dp=2, stages=[[1, 3], [4, 6]], bf16=bf16, tied=tied)
    resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "ckpt", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "ckpt")
    trim = {(1, "word_embeddings.weight"): 30}  # args.vocab_size 30 of a vocabulary padded to 32
    order = [(i, n) for i in (1, 3, 4, 6) for n, t in model[i].items() if not (n.endswith("bias") or t.dim() == 1)]
    order += [(i, n) for i in (1, 3, 4, 6) for n, t in model[i].items() if n.endswith("bias") or t.dim() == 1]
    state = got["optimizer"]["state"]
    assert sorted(state) == list(range(len(order)))
    for number, (i, n) in enumerate(order):
        rows = trim.get((i, n))
        for k in ("exp_avg", "exp_avg_sq"):
            assert bits(state[number][k]) == bits(moments[i, n][k][:rows]), (i, n, k)
        assert state[number]["step"].item() == 3.0
        weight = model[i][n][:rows]
        assert bits(got["model"][f"{i}.{n}"]) == bits(weight.to(torch.bfloat16) if bf16 else weight), (i, n)
        if bf16:
            assert bits(got["optimizer"]["fp32_from_fp16_params"][f"{i}.{n}"]) == bits(weight), (i, n)
    assert ("fp32_from_fp16_params" in got["optimizer"]) is bf16
    groups = got["optimizer"]["param_groups"]
    assert [pg["weight_decay"] for pg in groups] == [0.1, 0.0]
    assert groups[0]["params"] + groups[1]["params"] == list(range(len(order)))
    # a replicated tensor's moments that differ between tensor-parallel ranks are refused when read
    prefix = f"{'bf16_' if bf16 else ''}zero_pp_rank_0_mp_rank_01"
    name = next(f for f in sorted(folder.iterdir()) if f.name.startswith(prefix))
    osd = torch.load(name, weights_only=False)
    osd["optimizer_state_dict"]["base_optimizer_state"]["state"][1]["exp_avg"] += 1
    torch.save(osd, name)
    with pytest.raises(CorruptCheckpointError, match=r"replicas must be equal"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "bad", source="deepspeed")
    osd["optimizer_state_dict"]["zero_stage"] = 3
    torch.save(osd, name)
    with pytest.raises(UnsupportedValueError, match=rf"{name.name}: ZeRO stage 3; .* the optimizer of ZeRO 1 and 2"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "bad", source="deepspeed")
    name.unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"global_step9/{name.name}: missing"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "bad", source="deepspeed")
    assert not (tmp_path / "bad").exists()


@pytest.mark.deepspeed
def test_sub_parameters_and_moments_merge_as_deepspeeds_ds_to_universal_merges_them(tmp_path):
    """DeepSpeed's own merge of tensor-parallel slices (ds_to_universal.merge_tp_slices, as it
    builds a universal checkpoint) gives the same fused qkv, gate/up and row-parallel tensors, weights
    and Adam moments, as the import of the same ranks' ZeRO files."""
    from deepspeed.checkpoint.ds_to_universal import merge_tp_slices

    model = gqa_model(layers=2)
    g = torch.Generator().manual_seed(4)
    moments = {(i, n): {"exp_avg": torch.randn(t.shape, generator=g), "exp_avg_sq": torch.rand(t.shape, generator=g)}
               for i, layer in model.items() for n, t in layer.items()}
    folder = tmp_path / "ds" / "global_step9"
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text(folder.name)
    info = ucp_info(as_dicts=True)
    zero_files(folder, model, moments, tp=2, pp=2, dp=2, stages=[[1, 3], [4, 6]], bf16=False, info=info)
    resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "ckpt", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "ckpt")
    order = [(i, n) for i in (1, 3, 4, 6) for n, t in model[i].items() if not (n.endswith("bias") or t.dim() == 1)]
    order += [(i, n) for i in (1, 3, 4, 6) for n, t in model[i].items() if n.endswith("bias") or t.dim() == 1]
    info["parameter_with_row_parallelism_patterns"] = [r"\d+.self_attention.dense.weight",
                                                       r"\d+.mlp.dense_4h_to_h.weight"]
    compared = 0
    for i, n in [(4, "self_attention.query_key_value.weight"), (4, "self_attention.query_key_value.bias"),
                 (3, "mlp.dense_h_to_4h.weight"), (3, "mlp.dense_h_to_4h.bias"), (4, "self_attention.dense.weight")]:
        name = f"{i}.{n}"
        shards = {"fp32": [gqa_shard(n, model[i][n], 2, t) for t in range(2)],
                  **{k: [gqa_shard(n, moments[i, n][k], 2, t) for t in range(2)] for k in ("exp_avg", "exp_avg_sq")}}
        for state, per_rank in shards.items():
            for t, shard_t in enumerate(per_rank):
                for d, fragment in enumerate(shard_t.reshape(-1).chunk(2)):  # two data-parallel fragments
                    path = tmp_path / "slices" / name / str(t) / f"{state}.{d:02d}"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(fragment.clone(), path)
        merge_tp_slices(info, str(tmp_path / "universal"), str(tmp_path / "slices"), 2,
                        (name, [list(s.shape) for s in shards["fp32"]]))
        number = order.index((i, n))
        for state, mine in (("fp32", got["model"][name]), ("exp_avg", got["optimizer"]["state"][number]["exp_avg"]),
                            ("exp_avg_sq", got["optimizer"]["state"][number]["exp_avg_sq"])):
            theirs = torch.load(tmp_path / "universal" / name / f"{state}.pt", weights_only=False)["param"]
            assert bits(mine) == bits(theirs), (name, state)
            compared += 1
    assert compared == 15
