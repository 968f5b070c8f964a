"""Writes every real DeepSpeed checkpoint the import tests use, in one run (a script, with deepspeed
on the path; see ``make test``): 2 gloo ranks on CPU, ``torch.optim.AdamW``, a model with odd
numels (so partitions are padded), a frozen layer and tied weights. Starting deepspeed costs far
more than these tiny trainings, so one pair of processes trains them all, one engine each:

- ``zero<S>-1`` (S = 1, 2, 3) and ``zero<S>-2`` (S = 1, 3; the biases in a second parameter
  group without weight decay): three steps, then ``engine.save_checkpoint``;
- ``bf16-zero<S>`` (S = 2, 3): the same with bf16 enabled, so DeepSpeed writes
  ``bf16_zero_pp_rank_*`` optimizer files (fp32 master weights and moments, bf16 model weights);
  ZeRO-2's with ``parameter_alignment`` on, so alignment gaps lie between its parameters;
- ``continued``: :func:`deepspeed_continue.deepspeed_job` (ZeRO-2 with a scheduler, saved, then
  continued by a new engine that loads the save).

Beside each save, DeepSpeed's own views as references: ``zero_to_fp32.pt``
(``get_fp32_state_dict_from_zero_checkpoint``) and, for the fp32 one-group runs, ``live.pt``
(each trained parameter's full fp32 weight and Adam moments gathered from the live engine with
``safe_get_full_*``, as ``{"model": {name: w}, "optimizer": {number: {moment: m}}}``, the number
being the parameter's place in the optimizer). DeepSpeed 0.19.8's ``safe_get_full_optimizer_state``
fails with two groups ("exp_avg not found in optimizer state fragment"), so those runs have
``zero_to_fp32.pt`` only. ``<run>/universal`` is ``ds_to_universal``'s output for ``<run>``, of the
runs in ``UNIVERSAL`` (ZeRO-2; ZeRO-3, with one and with two parameter groups).

    python deepspeed_workers.py OUT_ROOT PORT
"""

from __future__ import annotations

import collections
import os
import sys
from argparse import Namespace

import torch
import torch.multiprocessing as mp
from torch import nn

# name: (ZeRO stage, parameter groups, bf16)
RUNS = {"zero1-1": (1, 1, False), "zero2-1": (2, 1, False), "zero3-1": (3, 1, False), "zero1-2": (1, 2, False),
        "zero3-2": (3, 2, False), "bf16-zero2": (2, 1, True), "bf16-zero3": (3, 1, True)}
UNIVERSAL = ("zero2-1", "zero3-1", "zero3-2")
TAG = "global_step3"


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


def train_and_save(rank: int, out: str, stage: int, groups: int, bf16: bool) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = Tiny()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups == 1:
        optim = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    else:
        optim = torch.optim.AdamW([{"params": [p for n, p in trainable if not n.endswith("bias")]},
                                   {"params": [p for n, p in trainable if n.endswith("bias")], "weight_decay": 0.0}],
                                  lr=1e-2)
    zero = {"stage": stage, **({"parameter_alignment": True} if bf16 and stage < 3 else {})}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        engine.backward(engine(torch.randint(0, 11, (2, 4), generator=g)))
        engine.step()
    engine.save_checkpoint(out, tag=TAG)
    if groups != 1 or bf16:
        return
    live: dict = {"model": {}, "optimizer": {}}
    for i, (name, p) in enumerate(trainable):  # collectives: every rank calls them
        live["model"][name] = safe_get_full_fp32_param(p).clone()
        live["optimizer"][i] = {m: safe_get_full_optimizer_state(p, m).clone() for m in ("exp_avg", "exp_avg_sq")}
    if rank == 0:
        torch.save(live, os.path.join(out, "live.pt"))


def worker(rank: int, world: int, root: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed
    import deepspeed.ops

    from deepspeed_continue import deepspeed_job

    # No compiled ops: marking every op incompatible skips probing compilers and the shared-memory
    # collectives DeepSpeed would otherwise build for CPU; gloo does the collectives.
    deepspeed.ops.__compatible_ops__ = collections.defaultdict(bool)
    deepspeed.init_distributed(dist_backend="gloo")
    for name, (stage, groups, bf16) in RUNS.items():
        train_and_save(rank, os.path.join(root, name), stage, groups, bf16)
    deepspeed_job(rank, world, os.path.join(root, "continued"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    root, port = sys.argv[1], int(sys.argv[2])
    mp.spawn(worker, args=(2, root, port), nprocs=2)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for name in RUNS:
        out = os.path.join(root, name)
        torch.save(get_fp32_state_dict_from_zero_checkpoint(out), os.path.join(out, "zero_to_fp32.pt"))
    for name in UNIVERSAL:
        ds_to_universal(Namespace(input_folder=os.path.join(root, name, TAG),
                                  output_folder=os.path.join(root, name, "universal", TAG), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
