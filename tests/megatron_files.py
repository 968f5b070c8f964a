"""Megatron-LM checkpoints in the legacy layout (``iter_<N>/mp_rank_XX[_YYY]/model_optim_rng.pt``),
written with torch.save in Megatron's structure from a consolidated (one-rank) model: the dict keys
of Megatron-LM's ``generate_state_dict`` (``args``, ``checkpoint_version``, ``iteration``, ``model``,
``optimizer``, ``opt_param_scheduler``, ``rng_state``, ``num_floating_point_operations_so_far``) and
Megatron-Core's GPT parameter names. The split is written here from Megatron's rules, apart from
the importer: column-parallel tensors split on dim 0 (a gated fc1 as [gate_t; up_t] per rank, the
vocabulary padded to a multiple of the ranks), row-parallel weights on dim 1, the rest copied.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch

HIDDEN, HEADS, GROUPS, FFN = 8, 4, 2, 12


def gpt_names(layers: int) -> list[str]:
    names = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_proj.weight",
                                  "self_attention.linear_proj.bias", "self_attention.linear_qkv.weight",
                                  "self_attention.linear_qkv.bias", "pre_mlp_layernorm.weight",
                                  "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                                  "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")]
    return names + ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]


def gpt_model(layers: int, padded_vocab: int, gated: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A consolidated GPT state dict (float32) of Megatron-Core's names and shapes."""
    g = torch.Generator().manual_seed(seed)
    qkv = (HEADS + 2 * GROUPS) * (HIDDEN // HEADS)
    fc1 = FFN * (2 if gated else 1)
    shapes = {"word_embeddings": (padded_vocab, HIDDEN), "position_embeddings": (16, HIDDEN),
              "linear_proj.weight": (HIDDEN, HIDDEN), "linear_qkv.weight": (qkv, HIDDEN), "linear_qkv.bias": (qkv,),
              "linear_fc1.weight": (fc1, HIDDEN), "linear_fc1.bias": (fc1,), "linear_fc2.weight": (HIDDEN, FFN),
              "output_layer": (padded_vocab, HIDDEN)}
    out = {}
    for name in gpt_names(layers):
        shape = next((s for k, s in shapes.items() if k in name), (HIDDEN,))
        out[name] = torch.randn(shape, generator=g)
    return out


def split_rule(name: str) -> int | None:
    """The partition dimension Megatron gives ``name`` (None: replicated)."""
    if any(k in name for k in ("word_embeddings", "output_layer", "linear_qkv", "linear_fc1")):
        return 0
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return 1
    return None


def shard(name: str, full: torch.Tensor, tp: int, t: int, gated: bool) -> torch.Tensor:
    dim = split_rule(name)
    if dim is None:
        return full.clone()
    if gated and "linear_fc1" in name:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[t], up.chunk(tp, dim=0)[t]]).clone()
    return full.chunk(tp, dim=dim)[t].clone()


def stage_names(names: list[str], layers: int, pp: int, s: int) -> list[tuple[str, str]]:
    """(global name, the name on stage ``s``) of the tensors stage ``s`` holds, layers renumbered from 0."""
    per = layers // pp
    out = []
    for n in names:
        if n.startswith("decoder.layers."):
            i = int(n.split(".")[2])
            if i // per == s:
                out.append((n, n.replace(f"layers.{i}.", f"layers.{i - s * per}.", 1)))
        elif (n.startswith("embedding.") and s == 0
              or not n.startswith(("embedding.", "decoder.layers.")) and s == pp - 1):
            out.append((n, n))
    return out


def no_decay(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".bias") or t.dim() == 1


def write_legacy(root: Path, model: dict[str, torch.Tensor], *, tp: int, pp: int, layers: int, gated: bool,
                 iteration: int = 7, moments: dict[str, dict[str, torch.Tensor]] | None = None,
                 step: float = 3.0, vocab_size: int | None = None, bf16: bool = False) -> Path:
    """The checkpoint of ``model`` split over ``tp`` x ``pp`` ranks under ``root``; with ``moments``
    (per global name: exp_avg, exp_avg_sq of the consolidated shape), an FP32Optimizer's Adam state
    in two param groups (weight decay first, as Megatron sorts them). ``bf16``: the model saved in
    bfloat16, the fp32 weights as Float16OptimizerWithFloat16Params keeps them (fp32_from_fp16_params)."""
    names = list(model)
    folder = root / f"iter_{iteration:07d}"
    for s in range(pp):
        for t in range(tp):
            local = stage_names(names, layers, pp, s)
            sd: dict = {}
            for g, n in local:
                sd[n] = shard(g, model[g], tp, t, gated).to(torch.bfloat16 if bf16 else torch.float32)
                if n.endswith(".weight") and any(k in n for k in ("linear_", "output_layer")):
                    sd[n.rsplit(".", 1)[0] + "._extra_state"] = None
            args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=layers,
                                      hidden_size=HIDDEN, swiglu=gated, params_dtype=torch.float32, lr=1e-3,
                                      padded_vocab_size=model["output_layer.weight"].shape[0], seed=1234,
                                      train_iters=100, save="/somewhere/ckpt")
            if vocab_size is not None:
                args.vocab_size = vocab_size
            state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": sd,
                     "num_floating_point_operations_so_far": 12345,
                     "opt_param_scheduler": {"max_lr": 1e-3, "min_lr": 0.0, "num_steps": iteration * 4,
                                             "decay_style": "cosine", "warmup_steps": 0},
                     "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                    "torch_rng_state": torch.get_rng_state(),
                                    "cuda_rng_state": torch.get_rng_state(),  # a CPU stand-in of the same shape
                                    "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]}
            if moments is not None:
                groups: list[list[str]] = [[g for g, n in local if not no_decay(g, model[g])],
                                           [g for g, n in local if no_decay(g, model[g])]]
                opt_state, params_ids, i = {}, [], 0
                for members in groups:
                    ids = []
                    for g in members:
                        opt_state[i] = {"step": torch.tensor(step),
                                        "exp_avg": shard(g, moments[g]["exp_avg"], tp, t, gated),
                                        "exp_avg_sq": shard(g, moments[g]["exp_avg_sq"], tp, t, gated)}
                        ids.append(i)
                        i += 1
                    params_ids.append(ids)
                state["optimizer"] = {"state": opt_state, "param_groups": [
                    {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
                     "wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": False, "params": ids}
                    for wd, ids in zip((1.0, 0.0), params_ids)]}
                if bf16:
                    state["optimizer"] = {"optimizer": state["optimizer"], "grad_scaler": None,
                                          "fp32_from_fp16_params": [[shard(g, model[g], tp, t, gated) for g in members]
                                                                    for members in groups]}
            rank = f"mp_rank_{t:02d}_{s:03d}" if pp > 1 else f"mp_rank_{t:02d}"
            (folder / rank).mkdir(parents=True)
            torch.save(state, folder / rank / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def consolidated_optimizer(model: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]],
                           vocab_size: int | None) -> dict[int, dict[str, torch.Tensor]]:
    """The Adam state a one-rank run numbers: weight-decayed parameters first, each group in model order."""
    order = [n for n in model if not no_decay(n, model[n])] + [n for n in model if no_decay(n, model[n])]
    out = {}
    for i, n in enumerate(order):
        out[i] = {k: trim(n, v, vocab_size) for k, v in moments[n].items()}
    return out


def trim(name: str, t: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    if vocab_size is not None and any(k in name for k in ("word_embeddings", "output_layer")):
        return t[:vocab_size]
    return t
