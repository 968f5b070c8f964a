"""A tiny Accelerate training loop for tests/test_accelerate.py, in one process or on each rank
of a gloo group (``two_processes``): a seeded model with dropout, a shuffled stateful loader, a
scheduler and a custom object registered for checkpointing, saved with ``save_state()``."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

from resurgo.integrations.accelerate import ResurgoAccelerator

STEPS = 12


class Counter:
    """A custom object (``register_for_checkpointing``): the optimizer steps taken."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def train(project_dir, *, resurgo: bool = True, save_every: int | None = None, stop: int | None = None,
          resume: bool = False, total_limit: int | None = None, on_save=None) -> dict:
    """Trains to ``STEPS`` (or ``stop``), resuming first from the latest checkpoint if asked."""
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(123)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    cls = ResurgoAccelerator if resurgo else Accelerator
    accelerator = cls(cpu=True, project_config=ProjectConfiguration(project_dir=str(project_dir),
                                                                     automatic_checkpoint_naming=True,
                                                                     total_limit=total_limit),
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=True))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    if resume:
        accelerator.load_state()
    losses = []
    while counter.step < (stop or STEPS):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
            counter.step += 1
            if save_every and counter.step % save_every == 0:
                accelerator.save_state()
                if on_save is not None:
                    on_save(counter.step)
            if counter.step == (stop or STEPS):
                break
    params = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"losses": losses, "params": params, "optimizer": optimizer.state_dict(), "accelerator": accelerator}


def two_processes(rank: int, world: int, root: str) -> dict:
    """On each of 2 ranks: the uninterrupted run, and the same run stopped at step 6 and resumed."""
    os.environ["LOCAL_RANK"] = str(rank)
    whole = train(Path(root, "whole"))
    first = train(Path(root, "ckpt"), save_every=3, stop=6, total_limit=2)
    resumed = train(Path(root, "ckpt"), save_every=3, resume=True, total_limit=2)
    return {"whole": (whole["losses"], whole["params"]),
            "resumed": (first["losses"] + resumed["losses"], resumed["params"]),
            "checkpoints": sorted(os.listdir(Path(root, "ckpt", "checkpoints")))}
