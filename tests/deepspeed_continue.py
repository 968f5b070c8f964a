"""The end-to-end continuation for the DeepSpeed import tests.

:func:`deepspeed_job` (called by :mod:`deepspeed_workers` on each of its 2 gloo ranks): a
DeepSpeed ZeRO-2 job on CPU (``torch.optim.AdamW`` as client optimizer, a ``StepLR`` scheduler,
gradient clipping at 1.0, the model of :mod:`deepspeed_workers`) trains ``SAVED`` steps and saves
``OUT/global_step<SAVED>``; then a new engine loads that save and trains ``MORE`` steps. Rank 0
writes those steps' losses to ``OUT/continued.json``.

``python deepspeed_continue.py IMPORTED OUT_JSON PORT``: an FSDP2 (``fully_shard``) job on 3 gloo ranks with
``torch.optim.AdamW`` and the same scheduler ``resurgo.load``s the imported checkpoint (weights,
Adam moments and step, the optimizer's param groups, the scheduler) and trains the same ``MORE``
steps; rank 0 writes their losses to ``OUT_JSON``. Needs only resurgo.

Both see the same global batches (``BATCH`` rows, split evenly over the ranks: 3 rows each for
DeepSpeed, 2 for FSDP2); the loss is each rank's mean, and the reported loss their mean, which is
the global batch's mean since every rank holds as many rows.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepspeed_workers import Tiny  # noqa: E402

SAVED, MORE, BATCH, CLIP = 3, 4, 6, 1.0


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 11, (BATCH, 4), generator=torch.Generator().manual_seed(1000 + step))


def rows(step: int, rank: int, world: int) -> torch.Tensor:
    per = BATCH // world
    return global_batch(step)[rank * per:(rank + 1) * per]


def mean_loss(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def optimizer_and_scheduler(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, object]:
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return optim, torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)


def deepspeed_job(rank: int, world: int, out: str) -> None:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
              "steps_per_print": 1000, "gradient_clipping": CLIP, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}

    def engine() -> object:
        torch.manual_seed(0)
        model = Tiny()
        optim, sched = optimizer_and_scheduler(model)
        return deepspeed.initialize(model=model, optimizer=optim, lr_scheduler=sched, config=config)[0]

    first = engine()
    for step in range(SAVED):
        first.backward(first(rows(step, rank, world)))
        first.step()
    first.save_checkpoint(out, tag=f"global_step{SAVED}")
    second = engine()  # DeepSpeed's own continuation: a new engine loads the save
    second.load_checkpoint(out, tag=f"global_step{SAVED}")
    losses = []
    for step in range(SAVED, SAVED + MORE):
        loss = second(rows(step, rank, world))
        losses.append(mean_loss(loss, world))
        second.backward(loss)
        second.step()
    if rank == 0:
        with open(os.path.join(out, "continued.json"), "w") as f:
            json.dump({"losses": losses, "lr": second.get_lr()}, f)


def fsdp_job(rank: int, world: int, imported: str, out_json: str, port: int) -> None:
    import resurgo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(1)  # other initial weights than DeepSpeed's: the load must replace them all
    model = Tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim, sched = optimizer_and_scheduler(model)
    report = resurgo.load({"model": model, "optimizer": optim, "scheduler": sched}, imported, strict=False)
    losses = []
    for step in range(SAVED, SAVED + MORE):
        loss = model(rows(step, rank, world))
        losses.append(mean_loss(loss, world))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # as DeepSpeed clips (its default: 1.0)
        optim.step()
        optim.zero_grad()
        sched.step()
    if rank == 0:
        with open(out_json, "w") as f:
            json.dump({"losses": losses, "lr": sched.get_last_lr(), "missing": report.missing_keys,
                       "unexpected": report.unexpected_keys}, f)
    # Every rank past its last collective before any closes the group: gloo aborts a process
    # whose peer tears its connections down under it ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(fsdp_job, args=(3, sys.argv[1], sys.argv[2], int(sys.argv[3])), nprocs=3)
