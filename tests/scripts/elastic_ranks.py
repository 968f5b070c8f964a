"""One rank of the gloo test of ElasticSampler (tests/test_elastic_sampler.py), run by mp.spawn.

"train": a world of 2 under torch.distributed; the sampler takes its world size and rank from the
process group; STEPS batches of epoch 0; the process group is destroyed, then each rank saves its
own TrainState with resurgo.save to <dir>/rank<r> (per-rank files, outside any collective).
"resume": a world of 3; rank r loads <dir>/rank<r % 2> before joining the group, then finishes the
epoch, checking after every step (all_gather) that every rank holds the same global position.
Each rank writes what its loop received to <dir>/<phase><r>.json.

collective_train / collective_resume run under tests/dist_harness.py: every rank calls the
collective resurgo.save / resurgo.load of one checkpoint.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
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


def run_rank(rank: int, world: int, phase: str, workdir: str) -> None:
    root = Path(workdir)
    store = f"file://{root / ('store-' + phase)}"
    torch.manual_seed(rank)
    batches: list[list[int]] = []
    out: dict = {}
    if phase == "train":
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
        loader = _loader()  # world size and rank from the process group
        sampler = loader.sampler
        out["world"] = [sampler.num_replicas, sampler.rank]
        ts = resurgo.TrainState(dataloader=loader, epoch=0)
        sampler.set_epoch(0)
        for batch in loader:
            batches.append(batch.tolist())
            dist.barrier()  # lockstep, as data-parallel training is
            if len(batches) == STEPS:
                break
        dist.destroy_process_group()
        resurgo.save(ts, root / f"rank{rank}")
        out["position"] = resurgo.elastic_state(loader)
    else:
        loader = _loader(world, rank)
        ts = resurgo.TrainState(dataloader=loader, epoch=-1)
        resurgo.load(ts, root / f"rank{rank % 2}")
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
        loader.sampler.set_epoch(ts.epoch)
        agree = True
        for batch in loader:
            batches.append(batch.tolist())
            positions: list = [None] * world
            dist.all_gather_object(positions, resurgo.elastic_state(loader))
            agree = agree and all(p == positions[0] for p in positions)
        dist.destroy_process_group()
        out["positions_agree"] = agree
    out["batches"] = batches
    (root / f"{phase}{rank}.json").write_text(json.dumps(out))


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def collective_train(rank: int, world: int, path: str) -> dict:
    """Under the harness's process group: STEPS batches, then ONE collective resurgo.save of the TrainState."""
    _seed_all(rank)  # ranks seeded differently: their RNG states are per rank, the position is not
    loader = _loader()
    ts = resurgo.TrainState(dataloader=loader, epoch=0)
    loader.sampler.set_epoch(0)
    batches = [b.tolist() for b in itertools.islice(loader, STEPS)]
    resurgo.save(ts, path)
    return {"batches": batches, "position": resurgo.elastic_state(loader)}


def collective_resume(rank: int, world: int, path: str) -> dict:
    _seed_all(1000 + rank)
    loader = _loader()
    ts = resurgo.TrainState(dataloader=loader, epoch=-1)
    resurgo.load(ts, path)
    loader.sampler.set_epoch(ts.epoch)
    return {"batches": [b.tolist() for b in loader], "position": resurgo.elastic_state(loader)}


if __name__ == "__main__":  # manual run: python tests/scripts/elastic_ranks.py DIR
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mp.spawn(run_rank, args=(2, "train", sys.argv[1]), nprocs=2)
    mp.spawn(run_rank, args=(3, "resume", sys.argv[1]), nprocs=3)
