"""Other frameworks in the study (TensorFlow, JAX/Orbax, Chainer): their pinned environments, the
run of their worker, and their rows beside PyTorch's.

This module owns three things. (1) The environments: each framework gets a virtualenv, created on
first use under a cache directory (``$RESURGO_STUDY_ENVS``, else ``$XDG_CACHE_HOME/resurgo/
study-envs`` or ``~/.cache/resurgo/study-envs``) in a folder named by the framework and a hash of
its pinned requirements and the Python version, and reused while that folder exists; resurgo's
own install gains none of these packages. (2) The run: the environment's Python runs
``workers/driver.py`` (standard library + that framework only) which writes JSON. (3) The merge:
the raw timings become the same summaries as PyTorch's (``stats.pair_timings``) and the rows join
``results["cost"]`` and ``results["formats"]``; a framework that cannot be installed or run is
kept as "could not run" with the exact error line, and the study goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from resurgo.errors import StudyError
from resurgo.study.stats import pair_timings, spread

__all__ = ["Framework", "FRAMEWORKS", "env_key", "env_root", "ensure_env", "ensure_scale_env", "worker_config",
           "run_framework", "merge_framework", "could_not_run", "DRIVER"]

DRIVER = Path(__file__).resolve().parent / "workers" / "driver.py"
ENVS_VARIABLE = "RESURGO_STUDY_ENVS"
READY = "resurgo-env.json"  # written last: an environment without it is incomplete and made again
SCALE_READY = "resurgo-scale-env.json"  # the scale installs present in an environment


@dataclass(frozen=True)
class Framework:
    """A framework the study can add: its label, the pip installs (in order) of its environment,
    how its scale experiment runs several processes, and what that needs installed besides
    (added to the environment when scale runs, so that a failed install costs only scale)."""

    name: str
    label: str
    installs: tuple[tuple[str, ...], ...]  # each a pip install command line, pinned
    scale: str  # how its processes train together in the scale experiment
    scale_installs: tuple[str, ...] = ()  # one pip install command line, pinned


FRAMEWORKS: dict[str, Framework] = {
    "tensorflow": Framework("tensorflow", "TensorFlow", (("tensorflow-cpu==2.21.0",),),
                            "MultiWorkerMirroredStrategy, TF_CONFIG on loopback, one process per worker"),
    "jax": Framework("jax", "JAX/Orbax", (("jax[cpu]==0.10.2", "flax==0.12.8", "orbax-checkpoint==0.12.8"),),
                     "jax.distributed.initialize on loopback, CPU collectives over gloo, one process per rank"),
    # chainer 7.8.1 is a source package whose setup.py imports pkg_resources: it builds against
    # the pinned setuptools already installed, not in pip's isolated build environment
    "chainer": Framework("chainer", "Chainer", (("setuptools==69.5.1", "wheel==0.43.0", "numpy==1.26.4"),
                                                ("--no-build-isolation", "chainer==7.8.1")),
                         "ChainerMN over MPI (mpiexec -n N; PyPI's mpich with mpi4py)",
                         scale_installs=("mpi4py==4.1.2", "mpich==5.0.2")),
}


def _framework(name: str) -> Framework:
    try:
        return FRAMEWORKS[name]
    except KeyError:
        raise StudyError(f"unknown framework {name!r}; expected pytorch or one of {', '.join(FRAMEWORKS)}") from None


def env_key(fw: Framework, python: str = platform.python_version()) -> str:
    """The environment's folder name: framework, then a hash of its pins and the Python version
    (a change of either makes a new environment instead of reusing a stale one)."""
    digest = hashlib.sha256(json.dumps([list(map(list, fw.installs)), python]).encode()).hexdigest()[:12]
    return f"{fw.name}-{digest}"


def env_root(override: Optional[Path] = None) -> Path:
    """Where the environments live: ``override``, ``$RESURGO_STUDY_ENVS``, or the user's cache."""
    if override is not None:
        return Path(override)
    if os.environ.get(ENVS_VARIABLE):
        return Path(os.environ[ENVS_VARIABLE])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "resurgo" / "study-envs"


def _env_python(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _last_error_line(text: str) -> str:
    """The line a reader needs from pip's or Python's output: the last one naming an error."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or ln.startswith(("error:", "ERROR:")):
            return ln
    return lines[-1] if lines else "(no output)"


def ensure_env(name: str, root: Optional[Path] = None, log: Any = None) -> Path:
    """The Python of ``name``'s environment, created (venv + pinned pip installs) if absent.
    Raises StudyError with pip's error line when an install fails; the half-made folder is removed."""
    fw = _framework(name)
    env = env_root(root) / env_key(fw)
    if (env / READY).is_file():
        return _env_python(env)
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", str(env)]]
    steps += [[str(_env_python(env)), "-m", "pip", "install", "--quiet", *args] for args in fw.installs]
    for cmd in steps:
        if log is not None:
            log(f"{fw.label}: {' '.join(cmd[2:] if cmd[1] == '-m' else cmd)}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(env, ignore_errors=True)
            raise StudyError(f"{fw.label} environment {env}: `{' '.join(cmd[2:])}` failed: "
                             f"{_last_error_line(done.stdout + done.stderr)}")
    freeze = subprocess.run([str(_env_python(env)), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    (env / READY).write_text(json.dumps({"framework": name, "installs": fw.installs, "python": platform.python_version(),
                                         "freeze": freeze.split()}, indent=1))
    return _env_python(env)


def ensure_scale_env(name: str, root: Optional[Path] = None, log: Any = None) -> Path:
    """``ensure_env``'s Python, with ``name``'s scale installs added to that environment (once;
    recorded in SCALE_READY). StudyError with pip's error line when they fail; the environment,
    which the other experiments still use, is kept."""
    fw = _framework(name)
    python = ensure_env(name, root, log)
    if not fw.scale_installs:
        return python
    env = env_root(root) / env_key(fw)
    marker = env / SCALE_READY
    wanted = json.dumps(list(fw.scale_installs))
    if marker.is_file() and marker.read_text() == wanted:
        return python
    cmd = [str(python), "-m", "pip", "install", "--quiet", *fw.scale_installs]
    if log is not None:
        log(f"{fw.label} scale: {' '.join(cmd[2:])}")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise StudyError(f"{fw.label} environment {env}: `{' '.join(cmd[2:])}` failed: "
                         f"{_last_error_line(done.stdout + done.stderr)}")
    marker.write_text(wanted)
    return python


def worker_config(cfg: Any) -> dict[str, Any]:
    """What the driver needs from a StudyConfig (its CONFIG_KEYS)."""
    from resurgo.study.workers.driver import CONFIG_KEYS

    fields = asdict(cfg)
    return {k: (list(fields[k]) if isinstance(fields[k], tuple) else fields[k]) for k in CONFIG_KEYS}


def worker_env(cfg: Any) -> dict[str, str]:
    """The environment of a framework's worker process: ``cfg.threads`` threads in every library
    that reads its own variable, CPU only, and nothing of this process's Python path."""
    threads = str(cfg.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=" + threads,
           "JAX_PLATFORMS": "cpu", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # the worker must not see resurgo or torch
    return env


def run_framework(name: str, cfg: Any, work: Path, root: Optional[Path] = None, log: Any = None) -> dict[str, Any]:
    """Run ``name``'s worker on ``cfg`` in its environment; the JSON it wrote.
    StudyError (with the error line) when the environment or the worker fails."""
    python = ensure_env(name, root, log)
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    config, out = work / f"{name}-config.json", work / f"{name}-results.json"
    config.write_text(json.dumps(worker_config(cfg)))
    done = subprocess.run([str(python), str(DRIVER), name, str(config), str(out)], capture_output=True, text=True,
                          env=worker_env(cfg))
    if done.returncode != 0 or not out.is_file():
        raise StudyError(f"{FRAMEWORKS[name].label} worker failed (exit {done.returncode}): "
                         f"{_last_error_line(done.stderr or done.stdout)}")
    return json.loads(out.read_text())


def could_not_run(name: str, why: str) -> dict[str, Any]:
    """The entry of a framework that could not run, with the reason shown in the report."""
    fw = _framework(name)
    return {"label": fw.label, "ran": False, "why": why, "scale": "not run: the framework could not run"}


def merge_framework(results: dict[str, Any], name: str, worker: dict[str, Any]) -> None:
    """Put ``worker``'s rows (the driver's JSON) into ``results`` beside PyTorch's: cost rows with
    the same paired summaries, formats rows with the spreads of their save and load times;
    models and determinism under ``results["frameworks"][name]``."""
    fw = _framework(name)
    for row in worker["cost"]:
        results["cost"].append({**{k: v for k, v in row.items() if k != "runs"}, "framework": name,
                                **pair_timings(row["runs"])})
    for row in worker["formats"]:
        results["formats"].append({**row, "framework": name, "save": spread(row["save_s"]),
                                   "load": spread(row["load_s"])})
    results.setdefault("frameworks", {})[name] = {
        "label": fw.label, "ran": True, "versions": worker["versions"], "models": worker["models"],
        "determinism": worker["determinism"], "scale": "not run: no process counts were given",
        "duration_s": worker["duration_s"], "disk": worker["disk"]}
