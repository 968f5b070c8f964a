"""Writes a real DeepSpeed ZeRO checkpoint for the import tests (run as a script, with deepspeed on
the path; see ``make test-deepspeed``): 2 gloo ranks on CPU, ``torch.optim.AdamW``, a model with
odd numels (so partitions are padded), a frozen layer and tied weights, three steps, then
``engine.save_checkpoint``. Also writes DeepSpeed's own views as references: ``zero_to_fp32.pt``
(``get_fp32_state_dict_from_zero_checkpoint``) and ``live.pt`` (each parameter's full fp32 weight
and Adam moments gathered from the live engine with ``safe_get_full_*``).

    python deepspeed_workers.py STAGE OUT_DIR PORT [GROUPS]

GROUPS 2 puts the biases in a second parameter group (no weight decay); then only
``zero_to_fp32.pt`` is written, since DeepSpeed 0.19.8's ``safe_get_full_optimizer_state`` fails
with two groups ("exp_avg not found in optimizer state fragment").
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp
from torch import nn


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.fc1 = nn.Linear(7, 5)
        self.frozen = nn.Linear(5, 5)
        self.fc2 = nn.Linear(5, 3)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        return self.head(h).square().mean() + self.fc2(self.frozen(torch.relu(self.fc1(h)))).square().mean()


def worker(rank: int, world: int, stage: int, out: str, port: int, groups: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Tiny()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups == 1:
        optim = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    else:
        optim = torch.optim.AdamW([{"params": [p for n, p in trainable if not n.endswith("bias")]},
                                   {"params": [p for n, p in trainable if n.endswith("bias")], "weight_decay": 0.0}],
                                  lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        engine.backward(engine(torch.randint(0, 11, (2, 4), generator=g)))
        engine.step()
    engine.save_checkpoint(out, tag="global_step3")
    if groups != 1:
        return
    live = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:  # collectives: every rank calls them
            live[f"model.{name}"] = safe_get_full_fp32_param(p).clone()
            for moment in ("exp_avg", "exp_avg_sq"):
                live[f"optim.state.{name}.{moment}"] = safe_get_full_optimizer_state(p, moment).clone()
    if rank == 0:
        torch.save(live, os.path.join(out, "live.pt"))


if __name__ == "__main__":
    stage, out, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    groups = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    mp.spawn(worker, args=(2, stage, out, port, groups), nprocs=2)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    torch.save(get_fp32_state_dict_from_zero_checkpoint(out), os.path.join(out, "zero_to_fp32.pt"))
