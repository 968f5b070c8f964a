"""Run a test worker on N real processes joined by a gloo process group (CPU).

``run_ranks(world, "module:function", *args)``: rank r calls ``function(rank, world, *args)``
from a module of this tests directory (see :mod:`resurgo.dist.launch`). An exception on any rank
fails the call with every failing rank's traceback.
"""

from __future__ import annotations

from pathlib import Path

from resurgo.dist import launch

TESTS = str(Path(__file__).resolve().parent)


def run_ranks(world: int, target: str, *args: object, timeout: float = 240) -> list:
    return launch.run_ranks(world, target, *args, timeout=timeout, sys_path=[TESTS])
