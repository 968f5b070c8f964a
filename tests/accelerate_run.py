"""A tiny Accelerate training loop for tests/test_accelerate.py, in one process or on each rank
of a gloo group (``two_processes``): a seeded model with dropout, a shuffled stateful loader, a
scheduler and a custom object registered for checkpointing, saved with ``save_state()``.

    python tests/accelerate_run.py PROJECT_DIR --hang-in-save STEP

(the SIGKILL test) trains with a save every 3 steps and total_limit=2, resuming from the latest
checkpoint if there is one, printing ``STEP n`` after each step; the save at STEP writes its data
files, prints ``SAVING``, and waits to be killed before its commit.
"""

from __future__ import annotations

import argparse
import os
import sys
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
          resume: bool = False, total_limit: int | None = None, on_step=None, scaler: bool = False) -> dict:
    """Trains to ``STEPS`` (or ``stop``), resuming first from the latest checkpoint if asked.
    ``scaler``: the steps go through a grad scaler whose scale doubles every 2 steps (set on the
    Accelerator before ``prepare``, as Accelerate does for fp16 on a GPU: on CPU it makes none)."""
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
    if scaler:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    if resume:
        accelerator.load_state()
    losses, scaler_trace = [], []  # the scaler's state after each step (when there is one)
    while counter.step < (stop or STEPS):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
            if accelerator.scaler is not None:
                scaler_trace.append(accelerator.scaler.state_dict())
            counter.step += 1
            if on_step is not None:  # before this step's save
                on_step(counter.step)
            if save_every and counter.step % save_every == 0:
                accelerator.save_state()
            if counter.step == (stop or STEPS):
                break
    params = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"losses": losses, "scaler_trace": scaler_trace, "params": params, "optimizer": optimizer.state_dict(),
            "accelerator": accelerator}


def two_processes(rank: int, world: int, root: str) -> dict:
    """On each of 2 ranks: the uninterrupted run, and the same run stopped at step 6 and resumed."""
    os.environ["LOCAL_RANK"] = str(rank)
    whole = train(Path(root, "whole"))
    first = train(Path(root, "ckpt"), save_every=3, stop=6, total_limit=2)
    resumed = train(Path(root, "ckpt"), save_every=3, resume=True, total_limit=2)
    return {"whole": (whole["losses"], whole["params"]),
            "resumed": (first["losses"] + resumed["losses"], resumed["params"]),
            "checkpoints": sorted(os.listdir(Path(root, "ckpt", "checkpoints")))}


if __name__ == "__main__":
    from kill_harness import hang_before_commit

    parser = argparse.ArgumentParser()
    parser.add_argument("project_dir")
    parser.add_argument("--hang-in-save", type=int)
    opts = parser.parse_args()
    step_now = [0]
    hang_before_commit(lambda: step_now[0] == opts.hang_in_save, "SAVING")

    def echo(step: int) -> None:
        step_now[0] = step
        print(f"STEP {step}", flush=True)

    train(opts.project_dir, save_every=3, total_limit=2, on_step=echo,
          resume=os.path.isdir(os.path.join(opts.project_dir, "checkpoints")))
    sys.exit(0)
