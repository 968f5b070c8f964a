"""The study's training job: how a network, its optimizer and its data are built, and the loop.

This module owns what one training job is (:class:`Training`) and how steps run
(:func:`train_steps`). Every job is built the way a training script starts: seed the global RNG,
build the network, the optimizer (SGD with momentum and weight decay, as for CIFAR ResNets) and a
shuffled DataLoader. Training draws random numbers in three places, as real jobs do: the
DataLoader's shuffle, the data augmentation (random crop and flip) and dropout (VGG-16).

The objects are also wrapped in a :class:`resurgo.TrainState` from the start, because a plain
DataLoader must be tracked before its first iteration to be resumable; tracking changes neither
the batches nor their order, so every mechanism trains on exactly the same stream.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from resurgo.errors import StudyError
from resurgo.state.train_state import TrainState
from resurgo.study.models import build_model

__all__ = ["JobSpec", "Training", "build_training", "train_steps", "disturb_global_rng"]

LR = 0.01
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4


@dataclass(frozen=True)
class JobSpec:
    """What to train: network name and width, batch size, seed."""

    model: str
    width: int
    batch_size: int
    seed: int = 0
    device: str = "cpu"  # where the network, its optimizer state and each batch live


class Training:
    """A training script's live objects: ``model``, ``optimizer``, ``loader``, ``state`` (a
    TrainState holding all of them, the global RNGs unless ``rng=False``, plus ``step``). A
    benchmark's loop that feeds fixed batches has no loader."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Optional[DataLoader] = None,
                 rank: int = 0, world: int = 1, *, rng: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.rank = rank
        self.world = world
        self.state = TrainState(model=model, optimizer=optimizer, dataloader=loader, rng=rng, step=0)

    @property
    def step(self) -> int:
        return int(self.state.step)

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def unwrapped_model(self) -> nn.Module:
        """The network without a DistributedDataParallel wrapper (what users save weights of)."""
        module = getattr(self.model, "module", None)
        return module if isinstance(module, nn.Module) else self.model


def build_training(spec: JobSpec, dataset: Dataset, *, rank: int = 0, world: int = 1,
                   ddp: bool = False) -> Training:
    """A fresh job as a script builds it: seed, network, optimizer, shuffled loader."""
    torch.manual_seed(spec.seed)
    random.seed(spec.seed)
    np.random.seed(spec.seed)
    model: nn.Module = build_model(spec.model, spec.width).to(spec.device)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    if world > 1:
        sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=spec.seed)
        loader = DataLoader(dataset, batch_size=spec.batch_size, sampler=sampler, drop_last=True)
    else:
        loader = DataLoader(dataset, batch_size=spec.batch_size, shuffle=True, drop_last=True)
    return Training(model, optimizer, loader, rank, world)


StepHook = Callable[[Training], None]


def train_steps(job: Training, steps: int, on_step: Optional[StepHook] = None) -> list[float]:
    """Train ``steps`` more steps (across epochs as needed); the loss of each, in order.

    ``on_step(job)`` runs after each step, with ``job.step`` already counted: that is where a
    training script checkpoints. An epoch is restarted by iterating the loader again, so a loader
    restored mid-epoch (resurgo) continues where it was, and any other starts a new epoch.
    """
    if job.loader is None:
        raise StudyError("train_steps: this job has no loader to draw batches from; build it with "
                         "build_training, or give Training a DataLoader")
    loader = job.loader
    job.model.train()
    device = next(job.model.parameters()).device
    losses: list[float] = []
    until = job.step + steps
    while job.step < until:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(job.model(x), y)
            job.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            job.optimizer.step()
            job.step += 1
            losses.append(loss.item())
            if on_step is not None:
                on_step(job)
            if job.step >= until:
                break
    return losses


def timed_steps(job: Training, steps: int, on_step: Optional[StepHook] = None) -> float:
    """Seconds to train ``steps`` steps (with ``on_step`` inside the timed loop)."""
    t0 = time.perf_counter()
    train_steps(job, steps, on_step)
    return time.perf_counter() - t0


def disturb_global_rng(seed: int = 987654321) -> None:
    """Move every global RNG somewhere else, as a new process or unrelated code would."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.rand(1000)
    random.random()


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested dict/list/tuple (a state_dict)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
