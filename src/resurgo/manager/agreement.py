"""How the ranks of a job agree, for the manager: combined save decisions, one step to restore.

Alone (torch.distributed not initialized, or a world of one) every function is local and free.
Otherwise they use resurgo's "control" gloo group (:mod:`resurgo.dist.comm`): no accelerator
needed, and never paired with the training's collectives or with those an asynchronous save makes
from its background thread (the "io" group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from resurgo.dist import comm as dist_comm

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    comm = dist_comm.current("control")
    return comm.rank, comm.size


def max_over_ranks(values: Sequence[int]) -> list[int]:
    """The element-wise maximum of ``values`` over all ranks (every rank gets the same list)."""
    everyone = dist_comm.current("control").all_gather([int(v) for v in values])
    return [max(column) for column in zip(*everyone)] if values else []


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """For each flag, True when it is True on at least one rank."""
    return [v > 0 for v in max_over_ranks([int(bool(f)) for f in flags])]


def from_rank0(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (small picklable values only)."""
    return dist_comm.current("control").broadcast(obj)
