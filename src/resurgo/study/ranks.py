"""Run a function on N real processes joined by a gloo process group (CPU), for the scale
experiment.

This module owns spawning the ranks and collecting their results. ``run_ranks(world, fn, arg)``
starts ``world`` fresh interpreters (``torch.multiprocessing`` spawn); rank r calls
``fn(rank, world, arg)`` after ``init_process_group("gloo")``; the return values (picklable)
come back in rank order. A rank that fails or hangs fails the call with every rank's traceback.
Each rank uses one intra-op thread, so N ranks compete for the machine's cores like N jobs.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from resurgo.errors import StudyError

__all__ = ["run_ranks"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[[int, int, Any], Any], arg: Any, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        outcome = ("ok", fn(rank, world, arg))
    except BaseException:  # noqa: BLE001 - reported to the parent
        outcome = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)


def run_ranks(world: int, fn: Callable[[int, int, Any], Any], arg: Any, timeout: float = 1800) -> list[Any]:
    """``fn(rank, world, arg)`` on ``world`` spawned processes; their results in rank order."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="resurgo-study-ranks-") as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, arg, out_dir)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                errors.append(f"rank {r}: exited with code {p.exitcode} and no result")
                continue
            # written by our own child process a moment ago, in a private temporary directory
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise StudyError(f"the scale experiment failed on {world} ranks:\n" + "\n".join(errors))
        return results
