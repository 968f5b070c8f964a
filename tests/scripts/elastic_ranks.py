"""Ranks of the gloo test of ElasticSampler (tests/test_elastic_sampler.py), run by tests/dist_harness.py.

``train`` (2 ranks): the sampler takes its world size and rank from the process group; STEPS
batches of epoch 0 in lockstep; then the TrainState is saved twice: once collectively into
``<dir>/ckpt`` (one checkpoint, every rank calling resurgo.save), and, after the process group is
destroyed, by each rank alone into its own ``<dir>/rank<r>`` (no collective involved).
``resume`` (3 ranks): loads ``<dir>/ckpt`` collectively and finishes the epoch, gathering every
rank's position after every step; then, outside the process group, a second loader loads
``<dir>/rank<r % 2>`` and finishes the epoch again. Ranks are seeded differently, as is common.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import resurgo

N, B, SEED, STEPS = 50, 3, 7, 4


def _loader(world: int | None = None, rank: int | None = None) -> DataLoader:
    sampler = resurgo.ElasticSampler(list(range(N)), num_replicas=world, rank=rank, seed=SEED)
    return DataLoader(list(range(N)), batch_size=B, sampler=sampler)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(rank: int, world: int, workdir: str) -> dict:
    root = Path(workdir)
    _seed_all(rank)
    loader = _loader()  # world size and rank from the process group
    sampler = loader.sampler
    ts = resurgo.TrainState(dataloader=loader, epoch=0)
    sampler.set_epoch(0)
    batches = []
    for batch in itertools.islice(loader, STEPS):
        batches.append(batch.tolist())
        dist.barrier()  # lockstep, as data-parallel training is
    resurgo.save(ts, root / "ckpt")  # collective: one checkpoint
    position = resurgo.elastic_state(loader)
    dist.destroy_process_group()
    resurgo.save(ts, root / f"rank{rank}")  # this rank's own file
    return {"world": [sampler.num_replicas, sampler.rank], "batches": batches, "position": position}


def _finish_epoch(loader: DataLoader, gather: bool) -> tuple[list[list[int]], bool]:
    batches, agree = [], True
    for batch in loader:
        batches.append(batch.tolist())
        if gather:
            positions: list = [None] * dist.get_world_size()
            dist.all_gather_object(positions, resurgo.elastic_state(loader))
            agree = agree and all(p == positions[0] for p in positions)
    return batches, agree


def resume(rank: int, world: int, workdir: str) -> dict:
    root = Path(workdir)
    _seed_all(1000 + rank)
    loader = _loader()
    ts = resurgo.TrainState(dataloader=loader, epoch=-1)
    resurgo.load(ts, root / "ckpt")  # collective
    loader.sampler.set_epoch(ts.epoch)
    collective, agree = _finish_epoch(loader, gather=True)
    end_position = resurgo.elastic_state(loader)
    dist.destroy_process_group()

    own = _loader(world, rank)
    ts = resurgo.TrainState(dataloader=own, epoch=-1)
    resurgo.load(ts, root / f"rank{rank % 2}")  # any old rank's file: the position is global
    own.sampler.set_epoch(ts.epoch)
    from_file, _ = _finish_epoch(own, gather=False)
    return {"collective": collective, "positions_agree": agree, "end_position": end_position,
            "from_file": from_file}
