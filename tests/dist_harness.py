"""Run a function on N real processes joined by a gloo process group (CPU), collect the results.

``run_ranks(world, "module:function", *args)`` spawns ``world`` fresh interpreters; rank r calls
``function(rank, world, *args)`` after ``init_process_group("gloo")``. The return values come
back as a list in rank order; an exception on any rank fails the call with every rank's traceback.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp

TESTS = str(Path(__file__).resolve().parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target: str, args: tuple, out_dir: str) -> None:
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: tuple[str, object]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name)
        outcome = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        outcome = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)


def run_ranks(world: int, target: str, *args: object, timeout: float = 240) -> list:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, target, args, out_dir)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                errors.append(f"rank {r}: exited with code {p.exitcode} and no result")
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("\n".join(errors))
        return results
