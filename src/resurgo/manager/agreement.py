"""How the ranks of a job agree, for the manager: combined save decisions, one step to restore.

Alone (torch.distributed not initialized, or a world of one) every function is local and free.
Otherwise the collectives run on a gloo group (the default group when its backend is gloo, else
one created at the first call, which every rank makes at the same point of the program), so
they need no accelerator and never interleave with the training's own NCCL collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_lock = threading.Lock()
_gloo: dict[str, Any] = {}


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    dist = _dist()
    if dist is None:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _group() -> Any:
    dist = _dist()
    if dist.get_backend() == "gloo":
        return None  # the default group
    with _lock:
        if "group" not in _gloo:
            _gloo["group"] = dist.new_group(backend="gloo")
        return _gloo["group"]


def max_over_ranks(values: Sequence[int]) -> list[int]:
    """The element-wise maximum of ``values`` over all ranks (every rank gets the same list)."""
    if world()[1] == 1:
        return list(values)
    dist = _dist()
    t = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group())
    return [int(v) for v in t.tolist()]


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """For each flag, True when it is True on at least one rank."""
    return [v > 0 for v in max_over_ranks([int(bool(f)) for f in flags])]


def from_rank0(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (small picklable values only)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=0, group=_group())
    return box[0]
