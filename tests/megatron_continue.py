"""The end-to-end continuation for the Megatron import tests.

:class:`MiniGPT` is a GPT in plain torch with Megatron-Core's parameter names, shapes and order
(tests/megatron_files.py's ``gpt_names``), and Megatron-Core's layouts: the fused QKV by query group
([q heads of the group; k; v]), a gated fc1 as [gate; up] (SwiGLU), pre-LayerNorm layers, an
untied output layer. torch.optim.AdamW gets Megatron's two param groups: weight decay for the
matrices, none for biases and 1-D tensors.

``python megatron_continue.py one CONSOLIDATED OUT_JSON``: one process loads the consolidated
state (``torch.save`` of ``{"model": ..., "optimizer": ...}``, what a run on one rank holds) and
trains ``MORE`` steps. ``python megatron_continue.py fsdp IMPORTED OUT_JSON PORT``: an FSDP2
(``fully_shard``) job on 3 gloo ranks ``resurgo.load``s the imported checkpoint and trains the
same steps on the same global batches (2 rows a rank). ``python megatron_continue.py megatron
IMPORTED OUT_JSON PORT``: the same FSDP2 job continuing a real Megatron run's import, with its
distributed optimizer's state (:func:`fsdp_from_distributed_optimizer`). Each writes its losses to
OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_files import FFN, GROUPS, HEADS, HIDDEN  # noqa: E402

MORE, BATCH, SEQ, VOCAB, LAYERS = 4, 6, 6, 32, 4
HEAD = HIDDEN // HEADS


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_proj = nn.Linear(HIDDEN, HIDDEN)
        self.linear_qkv = nn.Linear(HIDDEN, (HEADS + 2 * GROUPS) * HEAD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        per = HEADS // GROUPS
        qkv = self.linear_qkv(x).view(b, s, GROUPS, per + 2, HEAD)
        q = qkv[:, :, :, :per].reshape(b, s, HEADS, HEAD).transpose(1, 2)
        k = qkv[:, :, :, per].repeat_interleave(per, dim=2).transpose(1, 2)
        v = qkv[:, :, :, per + 1].repeat_interleave(per, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, HIDDEN))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, 2 * FFN)
        self.linear_fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = _Attention()
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(16, HIDDEN)


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.final_layernorm = nn.LayerNorm(HIDDEN)


class MiniGPT(nn.Module):
    """``tied``: the output layer is the word embeddings (Megatron's share_embeddings_and_output_weights)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embedding = _Embedding()
        self.decoder = _Decoder()
        if not tied:
            self.output_layer = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens[:, :-1]) + self.embedding.position_embeddings.weight[:SEQ - 1]
        for layer in self.decoder.layers:
            x = layer(x)
        x = self.decoder.final_layernorm(x)
        head = self.output_layer.weight if hasattr(self, "output_layer") else self.embedding.word_embeddings.weight
        logits = F.linear(x, head)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    decay = [p for n, p in named if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in named if n.endswith(".bias") or p.dim() == 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2)


def rows(step: int, rank: int, world: int) -> torch.Tensor:
    batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(500 + step))
    per = BATCH // world
    return batch[rank * per:(rank + 1) * per]


def one_rank(consolidated: str, out_json: str) -> None:
    state = torch.load(consolidated)
    model = MiniGPT()
    model.load_state_dict(state["model"])
    optim = optimizer(model)
    optim.load_state_dict(state["optimizer"])
    losses = []
    for step in range(MORE):
        loss = model(rows(step, 0, 1))
        losses.append(loss.item())
        loss.backward()
        optim.step()
        optim.zero_grad()
    with open(out_json, "w") as f:
        json.dump({"losses": losses}, f)


def fsdp_job(rank: int, world: int, imported: str, out_json: str, port: int) -> None:
    import resurgo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(1)  # other initial weights: the load must replace them all
    model = MiniGPT()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = optimizer(model)
    report = resurgo.load({"model": model, "optimizer": optim}, imported, strict=False)
    train_and_report(model, optim, rank, world, out_json, report)


def train_and_report(model: nn.Module, optim: torch.optim.Optimizer, rank: int, world: int, out_json: str,
                     report) -> None:
    """MORE steps of the FSDP2 job on its rows of each global batch; rank 0 writes the mean losses
    and what the load left out, then the group closes."""
    losses = []
    for step in range(MORE):
        loss = model(rows(step, rank, world))
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        loss.backward()
        optim.step()
        optim.zero_grad()
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump({"losses": losses, "missing": report.missing_keys, "unexpected": report.unexpected_keys}, f)
    dist.barrier()  # every rank past its last collective before any closes the group
    dist.destroy_process_group()


def fsdp_from_distributed_optimizer(rank: int, world: int, imported: str, out_json: str, port: int) -> None:
    """The FSDP2 job continuing a real Megatron run (tests/megatron_optimizer_workers.py, tied
    embeddings) from its import: the weights into the model, the distributed optimizer's state
    (under each parameter's name) into AdamW's state of that parameter, AdamW's groups from the
    param groups Megatron saved: their hyperparameters as the optimizer last applied them (weight
    decay included: ``wd_mult`` is applied by Megatron-LM's scheduler, which this run has not),
    their members by Megatron's rule (``wd_mult`` 0: biases and 1-D tensors)."""
    import resurgo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(1)  # other initial weights: the load must replace them all
    model = MiniGPT(tied=True)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    named = dict(model.named_parameters())
    moments = {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for n, p in named.items()}
    report = resurgo.load({"model": model, "optimizer": {"state": moments}}, imported, strict=False)
    saved = resurgo.load_dict(imported)["optimizer"]["optimizer"]["param_groups"]
    decay, no_decay = (next(g for g in saved if g["wd_mult"] == m) for m in (1.0, 0.0))
    groups = [{"params": [p for n, p in named.items() if (n.endswith(".bias") or p.dim() == 1) is none],
               "lr": g["lr"], "weight_decay": g["weight_decay"], "betas": tuple(g["betas"]),
               "eps": g["eps"]} for g, none in ((decay, False), (no_decay, True))]
    optim = torch.optim.AdamW(groups)
    for n, p in named.items():
        optim.state[p] = {"step": torch.tensor(float(decay["step"])), **moments[n]}
    train_and_report(model, optim, rank, world, out_json, report)


if __name__ == "__main__":
    if sys.argv[1] == "one":
        one_rank(sys.argv[2], sys.argv[3])
    else:
        job = fsdp_job if sys.argv[1] == "fsdp" else fsdp_from_distributed_optimizer
        mp.spawn(job, args=(3, sys.argv[2], sys.argv[3], int(sys.argv[4])), nprocs=3)
