"""Functions the multi-rank incremental tests run on every rank (see dist_harness.run_ranks).

The state at version v is a pure function of v (:func:`full_state`); each rank holds its share:
``emb`` in uneven row blocks (resurgo.Shard), ``flat`` in ranges of the flattened tensor
(resurgo.FlatShard), ``frozen`` replicated on every rank (written once).
"""

from __future__ import annotations

import torch

import resurgo

ROWS, WIDTH = 4099, 128  # uneven on 2 and 3 ranks


def full_state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    state = {"emb": torch.randn(ROWS, WIDTH, generator=g), "flat": torch.randn(300_000, generator=g),
             "frozen": torch.randn(512, 1024, generator=g)}
    for v in range(1, version + 1):
        state["emb"][(v * 997) % ROWS] += float(v)  # one row: scattered over the ranks' shards
        state["flat"][(v * 65_537) % 300_000] -= float(v)
    return state


def _bounds(n: int, parts: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def held(version: int, rank: int, world: int) -> dict:
    full = full_state(version)
    r0, r1 = _bounds(ROWS, world, rank)
    f0, f1 = _bounds(300_000, world, rank)
    return {"emb": resurgo.Shard(full["emb"][r0:r1].clone(), (ROWS, WIDTH), (r0, 0)),
            "flat": resurgo.FlatShard(full["flat"][f0:f1].clone(), (300_000,), f0),
            "frozen": full["frozen"]}


def save_versions(rank: int, world: int, root: str, versions: int) -> list[int]:
    """Version 0 in full, then each version with the previous one as base (odd ones async)."""
    resurgo.save(held(0, rank, world), f"{root}/v0", as_base=True)
    written = []
    for v in range(1, versions + 1):
        state, path, base = held(v, rank, world), f"{root}/v{v}", f"{root}/v{v - 1}"
        report = (resurgo.async_save(state, path, base=base).wait() if v % 2 else
                  resurgo.save(state, path, base=base))
        written.append(report.bytes_written)
    return written


def load_resharded(rank: int, world: int, path: str, version: int) -> bool:
    """Load ``path`` into this world's shards; True when every byte is as saved."""
    target = held(0, rank, world)
    resurgo.load(target, path)
    expect = held(version, rank, world)

    def local(v: object) -> torch.Tensor:
        return getattr(v, "local", v).view(torch.int32)  # type: ignore[union-attr]

    return all(torch.equal(local(target[k]), local(expect[k])) for k in target)
