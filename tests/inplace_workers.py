"""Rank functions for the import-in-place tests: a checkpoint whose chunks lie in foreign files,
loaded on a layout of its own (rows split over the ranks)."""

from __future__ import annotations

import torch

import resurgo


def load_rows(rank: int, world: int, path: str, key: str, shape: tuple[int, int]) -> bytes:
    """Load tensor ``key`` split by rows over the ranks (resurgo.Shard); this rank's rows, as bytes."""
    rows = -(-shape[0] // world)
    lo, hi = rank * rows, min(shape[0], (rank + 1) * rows)
    local = torch.empty(hi - lo, shape[1])
    resurgo.load({key: resurgo.Shard(local, shape, (lo, 0))}, path, strict=False)
    return local.numpy().tobytes()
