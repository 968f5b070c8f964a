"""The scale experiment for the frameworks other than PyTorch: starting 1, 2, 4 processes of a
framework on this machine, bounding them in time, and merging their timings into the results.

This module owns the launch and the merge; the measurement is ``workers/scale_driver.py``'s, run
by the framework's environment (``frameworks.ensure_env``). How processes find each other:

- TensorFlow: ``MultiWorkerMirroredStrategy`` reads ``TF_CONFIG`` (every worker's loopback
  address on a free port, and this process's index), one process per worker;
- JAX: ``jax.distributed.initialize`` with a coordinator on a free loopback port, the process
  id and count (``RESURGO_SCALE_*`` variables);
- Chainer: ChainerMN over MPI, one ``mpiexec -n N`` of the environment's MPI (PyPI's ``mpich``
  with ``mpi4py``, installed into the environment only when scale runs: ``Framework.scale_installs``).

Every process of a group runs in its own session and the group has one deadline: a process that
fails, or a group past its deadline, ends the whole group (SIGKILL to each session), and the
world size is recorded as "could not run" with the command and the error line, while the other
world sizes still run. A row's times are the slowest process's, as for PyTorch's ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from resurgo.errors import StudyError
from resurgo.study import frameworks
from resurgo.study.stats import pair_timings
from resurgo.wording import plural

__all__ = ["SCALE_DRIVER", "GROUP_TIMEOUT_S", "free_ports", "tf_config", "scale_config", "launch_commands",
           "run_group", "slowest_pairs", "merge_ranks", "run_framework_scale", "scale_status", "measure_framework_scale",
           "add_framework_scale"]

SCALE_DRIVER = Path(__file__).resolve().parent / "workers" / "scale_driver.py"
GROUP_TIMEOUT_S = 900.0  # one world size of one model: start-up, warm-up and every pair
LOOPBACK = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now: all held open together while the OS picks them, so
    that none is picked twice."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(ports: list[int], index: int) -> str:
    """``TF_CONFIG`` of worker ``index`` in a cluster of one worker per port on loopback (worker 0
    is the chief, as MultiWorkerMirroredStrategy makes it when no chief is named)."""
    if not 0 <= index < len(ports):
        raise StudyError(f"TF_CONFIG: worker index {index} is outside the cluster of {plural(len(ports), 'worker')}")
    return json.dumps({"cluster": {"worker": [f"{LOOPBACK}:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def scale_config(worker: dict[str, Any], cfg: Any, model: str) -> dict[str, Any]:
    """What a scale process reads: the worker config (``frameworks.worker_config``) and the scale
    run's own settings."""
    return {**worker, "model": model, "scale_steps": cfg.scale_steps, "scale_every": cfg.scale_every}


@dataclass(frozen=True)
class Process:
    """One command of a group: its argv, the environment variables it adds, its log file."""

    argv: list[str]
    env: dict[str, str]
    log: Path


def launch_commands(name: str, python: Path, world: int, config: Path, out: Path,
                    ports: Optional[list[int]] = None) -> list[Process]:
    """The processes of one group: one per rank (TensorFlow, JAX), or one ``mpiexec`` (Chainer)."""
    base = [str(python), str(SCALE_DRIVER), name, str(config), str(out)]
    if name == "chainer":
        mpiexec = Path(python).parent / "mpiexec"
        return [Process([str(mpiexec), "-n", str(world), *base], {}, out / "mpiexec.log")]
    ports = ports if ports is not None else free_ports(world if name == "tensorflow" else 1)
    procs = []
    for rank in range(world):
        env = {"RESURGO_SCALE_RANK": str(rank), "RESURGO_SCALE_WORLD": str(world)}
        if name == "tensorflow":
            env["TF_CONFIG"] = tf_config(ports, rank)
        elif name == "jax":
            env["RESURGO_SCALE_COORDINATOR"] = f"{LOOPBACK}:{ports[0]}"
        else:
            raise StudyError(f"no scale launch for framework {name!r}; expected tensorflow, jax or chainer")
        procs.append(Process(base, env, out / f"rank-{rank}.log"))
    return procs


def _error_line(log: Path) -> str:
    try:
        return frameworks._last_error_line(log.read_text(errors="replace"))
    except OSError:
        return "(no output)"


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL to each process's session: the process and whatever it started (an MPI launcher's
    proxies and ranks), even after the process itself has exited."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        p.wait()


def run_group(procs: list[Process], env: dict[str, str], timeout_s: float, poll_s: float = 0.2) -> None:
    """Start every process, each in its own session with its output in its log, and wait for all.
    StudyError naming the command, its exit status and its error line when one fails (the others
    are ended at once), or the deadline when the group is still running at ``timeout_s``."""
    running: list[subprocess.Popen] = []
    try:
        for p in procs:
            p.log.parent.mkdir(parents=True, exist_ok=True)
            with open(p.log, "wb") as log:
                running.append(subprocess.Popen(p.argv, env={**env, **p.env}, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [r.poll() for r in running]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                raise StudyError(f"`{' '.join(procs[i].argv)}` ({_who(procs, i)}) exited with status {codes[i]}: "
                                 f"{_error_line(procs[i].log)}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                late = [_who(procs, i) for i, c in enumerate(codes) if c is None]
                raise StudyError(f"still running after {timeout_s:.0f} s ({', '.join(late)}); the group was ended. "
                                 f"Last line of {procs[codes.index(None)].log.name}: "
                                 f"{_error_line(procs[codes.index(None)].log)}")
            time.sleep(poll_s)
    finally:
        _kill(running)


def _who(procs: list[Process], i: int) -> str:
    rank = procs[i].env.get("RESURGO_SCALE_RANK")
    return f"rank {rank}" if rank is not None else "mpiexec"


def slowest_pairs(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pair, the slowest process's times: a step, and a checkpoint, end when the last rank's does."""
    counts = {len(r["pairs"]) for r in ranks}
    if len(counts) != 1:
        raise StudyError(f"the ranks measured different numbers of pairs: {sorted(counts)}")
    pairs = []
    for i, first in enumerate(ranks[0]["pairs"]):
        runs = [r["pairs"][i] for r in ranks]
        n = len(first["stall_s"])
        if any(len(r["stall_s"]) != n for r in runs):
            raise StudyError(f"pair {i}: the ranks saved different numbers of checkpoints")
        pairs.append({"baseline_s": max(r["baseline_s"] for r in runs), "seconds": max(r["seconds"] for r in runs),
                      "checkpoints": first["checkpoints"],
                      "stall_s": [max(r["stall_s"][j] for r in runs) for j in range(n)]})
    return pairs


def merge_ranks(name: str, world: int, out: Path, cfg: Any) -> dict[str, Any]:
    """The row of one group from its ``rank-<r>.json`` files (StudyError if one is missing)."""
    ranks = []
    for r in range(world):
        path = out / f"rank-{r}.json"
        if not path.is_file():
            raise StudyError(f"{path}: rank {r} of {world} wrote no result; expected one file per rank")
        ranks.append(json.loads(path.read_text()))
    if any(r["world"] != world for r in ranks):
        raise StudyError(f"{out}: ranks report worlds {sorted({r['world'] for r in ranks})}, expected {world}")
    first = ranks[0]
    pairs = slowest_pairs(ranks)
    written = [sum(r["pairs"][i].get("written_bytes", 0) for r in ranks) for i in range(len(pairs))]
    return {"framework": name, "model": first["model"], "ranks": world, "mechanism": first["mechanism"],
            "label": first["label"], "how": frameworks.FRAMEWORKS[name].scale, "steps": cfg.scale_steps,
            "every": cfg.scale_every, "global_batch": cfg.batch_size * world, "checkpoints": pairs[0]["checkpoints"],
            "written_bytes": sum(written), "run_bytes": max(written, default=0), **pair_timings(pairs)}


def scale_status(rows: list[dict[str, Any]], failures: dict[int, str]) -> str:
    """The report's scale cell for a framework: the world sizes it ran, and why the others did not."""
    worlds = sorted({r["ranks"] for r in rows})
    parts = []
    if worlds:
        parts.append(f"ran on {', '.join(map(str, worlds))} {'process' if worlds == [1] else 'processes'} "
                     f"({rows[0]['how']})")
    for world, why in sorted(failures.items()):
        parts.append(f"could not run on {plural(world, 'process', 'processes')}: {why}")
    return "; ".join(parts) if parts else "not run: no process counts were given"


def _child_env(cfg: Any) -> dict[str, str]:
    env = frameworks.worker_env(cfg)
    for key in ("TF_CONFIG", "RESURGO_SCALE_RANK", "RESURGO_SCALE_WORLD", "RESURGO_SCALE_COORDINATOR"):
        env.pop(key, None)
    return env


def run_framework_scale(name: str, cfg: Any, work: Path, root: Optional[Path] = None, log: Any = None,
                        timeout_s: float = GROUP_TIMEOUT_S) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Every (model, world size) of ``cfg``'s scale experiment for ``name``: the rows that ran, and
    per world size that did not, why (the environment's install error, or the group's)."""
    rows: list[dict[str, Any]] = []
    failures: dict[int, str] = {}
    try:
        python = frameworks.ensure_scale_env(name, root, log)
    except StudyError as e:
        return [], {w: str(e) for w in cfg.scale_worlds}
    worker = frameworks.worker_config(cfg)
    env = _child_env(cfg)
    for model in cfg.scale_models:
        for world in cfg.scale_worlds:
            if world in failures:
                continue
            out = Path(work) / f"{name}-scale-{model}-{world}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            config = out / "config.json"
            config.write_text(json.dumps(scale_config(worker, cfg, model)))
            t0 = time.perf_counter()
            try:
                run_group(launch_commands(name, python, world, config, out), env, timeout_s)
                row = merge_ranks(name, world, out, cfg)
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
            except StudyError as e:
                failures[world] = str(e)
            finally:
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return rows, failures


def measure_framework_scale(name: str, cfg: Any, work: Path, root: Optional[Path] = None, log: Any = None,
                            timeout_s: float = GROUP_TIMEOUT_S) -> dict[str, Any]:
    """``run_framework_scale`` as JSON (a resumable unit of the study): ``{"rows", "failures"}``,
    the failures keyed by the process count as a string."""
    rows, failures = run_framework_scale(name, cfg, work, root, log, timeout_s)
    return {"rows": rows, "failures": {str(w): why for w, why in sorted(failures.items())}}


def add_framework_scale(results: dict[str, Any], name: str, measured: dict[str, Any]) -> None:
    """Put ``name``'s scale rows (``measure_framework_scale``) into ``results["scale"]`` beside
    PyTorch's, and what ran or why not into its framework entry (which ``merge_framework`` made)."""
    results["scale"] += measured["rows"]
    entry = results["frameworks"][name]
    counted = [r for r in measured["rows"] if "written_bytes" in r]  # (a journal of an older run has none)
    disk = entry.get("disk")
    if counted and disk is not None:
        # one run's checkpoints are on disk at once; the groups run one after another
        disk["written"]["scale"] = sum(r["written_bytes"] for r in counted)
        disk["total"] = sum(disk["written"].values())
        disk["peak"] = max(disk["peak"], *(r["run_bytes"] for r in counted))
    entry["scale"] = scale_status(measured["rows"], {int(w): why for w, why in measured["failures"].items()})
    entry["scale_failures"] = dict(measured["failures"])
