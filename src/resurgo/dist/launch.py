"""Running a function on N local processes joined by a gloo process group (CPU).

This module owns spawning ranks on one machine and collecting what they return; the study's
scale experiment and the multi-rank tests use it. ``run_ranks(world, target, *args)`` starts
``world`` fresh interpreters (``torch.multiprocessing`` spawn); rank r calls
``target(rank, world, *args)`` after ``init_process_group("gloo")``, with one intra-op thread so
N ranks compete for the cores like N jobs. ``target`` is a module-level function, or a
``"module:function"`` string resolved in the child after ``sys_path`` is prepended (for modules
that are not installed, like test helpers). Return values come back in rank order; a rank that
fails or hangs makes the call raise RankFailedError carrying every failing rank's traceback.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resurgo.errors import RankFailedError
from resurgo.wording import plural


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, target: Callable[..., Any] | str, args: tuple,
           sys_path: list[str], out_dir: str) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn: Callable[..., Any]
        if isinstance(target, str):
            module, name = target.split(":")
            fn = getattr(importlib.import_module(module), name)
        else:
            fn = target
        outcome = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        outcome = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)


def run_ranks(world: int, target: Callable[..., Any] | str, *args: Any, timeout: float = 1800,
              sys_path: list[str] | None = None) -> list[Any]:
    """``target(rank, world, *args)`` on ``world`` spawned processes; their results in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="resurgo-ranks-") as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, target, args, list(sys_path or []), out_dir))
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout)
        finally:  # also when this process is interrupted or told to exit: no rank outlives the call
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
            # written a moment ago by our own child process, in a private temporary directory
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise RankFailedError(f"{len(errors)} of {plural(world, 'rank')} failed:\n" + "\n".join(errors))
        return results
