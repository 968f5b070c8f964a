"""One process of the scale experiment for a framework other than PyTorch, run inside that
framework's environment: ``python scale_driver.py FRAMEWORK CONFIG.json OUT_DIR``.

This module imports only the standard library and ``driver.py`` beside it (whose timed run it
shares). It owns the measurement, the same as PyTorch's
``experiments.scale_worker``: per repetition, a timed run without checkpoints and, right after
it, its pair with a checkpoint every ``scale_every`` steps, every process in step (a barrier
before each run and after it); it writes this process's raw timings to ``OUT_DIR/rank-<r>.json``
(the study process takes the slowest rank's, as for PyTorch). The framework's scale module
(``scale_<framework>`` beside this file) owns joining the job and data-parallel training:

``start()`` joins the job (from the launcher's environment variables, or MPI) and returns an
object with ``rank``, ``world`` and ``barrier()``; ``build(model, config, dist)``,
``train(job, steps, on_step=None)``, ``MECHANISM``, ``LABEL``, ``versions()`` and
``Checkpointer(directory, dist)`` with ``save(job, step)``, ``wait()`` and ``close()``.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

if __package__:  # imported from resurgo (the tests)
    from .disk import NewFiles
    from .driver import timed_checkpoints, write_result
else:  # run as a script: its folder is on sys.path
    from disk import NewFiles  # type: ignore[no-redef]
    from driver import timed_checkpoints, write_result  # type: ignore[no-redef]

__all__ = ["SCALE_KEYS", "check_scale_config", "paired_runs", "main"]

# What the launcher adds to the worker config (``driver.CONFIG_KEYS``) for a scale run.
SCALE_KEYS = ("model", "scale_steps", "scale_every", "warmup_steps", "cost_repeats", "batch_size", "seed")


def check_scale_config(config: dict) -> dict:
    """The config, or ValueError naming the scale keys it lacks."""
    missing = [k for k in SCALE_KEYS if k not in config]
    if missing:
        raise ValueError(f"scale config: missing {missing}; expected at least the keys {list(SCALE_KEYS)}")
    return config


def paired_runs(sc: Any, dist: Any, config: dict, work: Path) -> list[dict[str, Any]]:
    """``cost_repeats`` pairs (without, then with checkpoints), all processes in step; rank 0
    counts the bytes of each run's checkpoints in the shared directory (``written_bytes``: the
    files that appeared or changed, an overwritten or pruned one included; 0 on the other ranks)
    and removes them once every process has finished the run."""
    job = sc.build(config["model"], config, dist)
    sc.train(job, config["warmup_steps"])
    pairs = []
    for repeat in range(config["cost_repeats"]):
        directory = work / f"run-{repeat}"
        dist.barrier()
        t0 = time.perf_counter()
        sc.train(job, config["scale_steps"])
        without = time.perf_counter() - t0
        dist.barrier()
        new_files = NewFiles(directory)
        written = [0]

        def count_new_files() -> None:  # a mechanism may prune or overwrite its earlier checkpoints
            written[0] += new_files.look()

        run = timed_checkpoints(sc.train, sc.Checkpointer(directory, dist), job, config["scale_steps"],
                                config["scale_every"], count_new_files if dist.rank == 0 else None)
        dist.barrier()
        if dist.rank == 0:
            count_new_files()
            shutil.rmtree(directory, ignore_errors=True)
        pairs.append({**run, "baseline_s": without, "written_bytes": written[0]})
    dist.barrier()
    return pairs


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: scale_driver.py FRAMEWORK CONFIG.json OUT_DIR", file=sys.stderr)
        return 2
    name, config_path, out_dir = argv
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sc = importlib.import_module(f"scale_{name}")
    config = check_scale_config(json.loads(Path(config_path).read_text()))
    t0 = time.perf_counter()
    dist = sc.start()
    out = Path(out_dir)
    pairs = paired_runs(sc, dist, config, out / "checkpoints")
    result = {"framework": name, "rank": dist.rank, "world": dist.world, "model": config["model"],
              "mechanism": sc.MECHANISM, "label": sc.LABEL, "versions": sc.versions(),
              "pairs": pairs, "duration_s": time.perf_counter() - t0}
    write_result(out / f"rank-{dist.rank}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
