"""The study's four experiments (cost, formats and sizes, scale, determinism) and their plan.

This module owns what is measured and how; it returns plain JSON-ready dicts (rendering is
``report.py``'s job). :class:`StudyConfig` says what to run; :func:`run_study` runs everything,
calling ``on_progress(done, total, label)`` before each unit of work (one training run or one
group of spawned ranks) so that a caller can show progress.

1. Cost: per repetition and mechanism, the same job trains ``cost_steps`` steps without
   checkpoints and, right after (a pair: the same machine load), ``cost_steps`` steps with the
   mechanism checkpointing every ``checkpoint_every`` steps; the mechanisms run in rotated order.
   The overhead is computed from the pairs (``stats.paired_overhead``), with its interval. An
   asynchronous save still running at the end is waited for inside the timed run: a run is not
   done before its last checkpoint is.
2. Formats and sizes: after each cost run, the mechanism saves the job once more, alone (timed
   until complete), and loads it back (timed); the files are counted and measured.
3. Scale: the cost experiment (paired runs) on 1, 2, 4 data-parallel ranks (DDP, gloo, CPU), real processes;
   the other frameworks' processes are started by ``framework_scale``.
4. Determinism: an uninterrupted run of ``det_steps`` steps checkpoints with every mechanism at
   step ``det_restart``; then, per mechanism, fresh objects are built as a new training script
   builds them, the global RNGs are moved elsewhere, the checkpoint is loaded the way that
   mechanism's users load it, and training continues to ``det_steps``. The largest absolute
   difference between the restarted and the uninterrupted losses is recorded.

Disk: every checkpoint is deleted as soon as it is measured (a cost run's once the run ends, the
formats row's once loaded back, a determinism checkpoint once its restart has loaded it); the
bytes of each are counted first (``workers/disk.py``), per experiment, with the most on disk at
once: ``results["disk"]``.
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from resurgo.errors import StudyError
from resurgo.study.data import make_dataset
from resurgo.study.framework_scale import add_framework_scale, measure_framework_scale
from resurgo.study.frameworks import FRAMEWORKS, could_not_run, merge_framework, run_framework
from resurgo.study.mechanisms import MECHANISMS, Mechanism, make_mechanism, quiet_single_process
from resurgo.study.models import MODELS
from resurgo.study.machine import describe as describe_machine
from resurgo.study.resume import Journal
from resurgo.study.stats import pair_timings, spread
from resurgo.study.workers.disk import Ledger, remove, tree_bytes
from resurgo.dist.launch import run_ranks
from resurgo.errors import RankFailedError
from resurgo.study.training import (
    JobSpec, Training, build_training, disturb_global_rng, tensor_bytes, timed_steps, train_steps,
)
from resurgo.wording import plural

__all__ = ["StudyConfig", "quick_config", "full_config", "with_steps", "run_study", "count_units"]

ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class StudyConfig:
    """Everything that decides what the study runs. Step counts are optimizer steps."""

    models: tuple[str, ...] = tuple(MODELS)
    mechanisms: tuple[str, ...] = tuple(MECHANISMS)
    width: int = 64  # channels of the first stage (64: the published networks)
    batch_size: int = 32
    samples: int = 4096  # images in the training set (synthetic), or the first N real ones
    warmup_steps: int = 3
    cost_steps: int = 60
    cost_repeats: int = 3  # pairs (without, with checkpoints) per mechanism, in cost and scale runs
    checkpoint_every: int = 15
    scale_worlds: tuple[int, ...] = (1, 2, 4)
    scale_models: tuple[str, ...] = tuple(MODELS)
    scale_steps: int = 20
    scale_every: int = 10
    det_steps: int = 60
    det_restart: int = 30
    data_dir: Optional[str] = None
    seed: int = 0
    threads: int = 1  # torch intra-op threads of the study process (each scale rank uses one)
    device: str = "cpu"  # PyTorch's: "cpu", or "cuda" (scale rank r on GPU r modulo the GPUs)
    preset: str = "custom"
    frameworks: tuple[str, ...] = ()  # others beside PyTorch, each in its own environment (frameworks.py)

    def check(self) -> None:
        """Raise StudyError naming the first option that cannot work."""
        for m in self.models + self.scale_models:
            if m not in MODELS:
                raise StudyError(f"unknown model {m!r}; expected one of {', '.join(MODELS)}")
        for m in self.mechanisms:
            if m not in MECHANISMS:
                raise StudyError(f"unknown mechanism {m!r}; expected one of {', '.join(MECHANISMS)}")
        for f in self.frameworks:
            if f not in FRAMEWORKS:
                raise StudyError(f"unknown framework {f!r}; expected pytorch or one of {', '.join(FRAMEWORKS)}")
        if not self.models or not self.mechanisms:
            raise StudyError("the study needs at least one model and one mechanism")
        if any(w < 1 for w in self.scale_worlds):
            raise StudyError(f"scale worlds must be >= 1, got {self.scale_worlds}")
        if not 0 < self.det_restart < self.det_steps:
            raise StudyError(f"the restart step must be inside the run: 0 < {self.det_restart} < {self.det_steps}")
        if self.device != "cpu":
            if self.device != "cuda":
                raise StudyError(f"unknown device {self.device!r}; expected cpu or cuda")
            if not torch.cuda.is_available():
                raise StudyError("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False; "
                                 f"torch {torch.__version__}); run on a GPU machine with a CUDA build of torch")
        if self.threads < 1:
            raise StudyError(f"threads must be >= 1, got {self.threads}")
        if self.cost_repeats < 2:
            raise StudyError(f"an overhead's interval needs at least 2 repeats (pairs of runs), got {self.cost_repeats}")
        if self.width < 1 or self.batch_size < 1 or self.checkpoint_every < 1 or self.scale_every < 1:
            raise StudyError("width, repeats, batch size and checkpoint intervals must be >= 1")
        if self.samples < self.batch_size * max(self.scale_worlds + (1,)):
            raise StudyError(f"{self.samples} samples cannot fill one batch of {self.batch_size} per rank "
                             f"on {plural(max(self.scale_worlds + (1,)), 'rank')}")


def full_config(**overrides: Any) -> StudyConfig:
    """The published networks (width 64) at batch 32: the paper's setting, scaled to one machine."""
    return replace(StudyConfig(preset="full"), **overrides)


def quick_config(**overrides: Any) -> StudyConfig:
    """The published networks (width 64) at batch 2, a few steps: a checkpoint (188 MiB of weights
    and momentum for ResNet-50) costs far more than a step's noise, and the PyTorch mechanisms
    finish in minutes on 2 cores. The scale experiment uses VGG-16, the faster step."""
    return replace(StudyConfig(width=64, batch_size=2, samples=256, warmup_steps=1, cost_steps=4,
                               checkpoint_every=2, cost_repeats=3, scale_models=("vgg16",), scale_steps=2,
                               scale_every=2, det_steps=6, det_restart=3, preset="quick"), **overrides)


def with_steps(cfg: StudyConfig, steps: int) -> StudyConfig:
    """``cfg`` with every run ``steps`` long (scale runs half as long), about four checkpoints
    per run and the determinism restart half-way."""
    if steps < 4:
        raise StudyError(f"--steps must be at least 4 (a checkpoint, a restart and steps after it), got {steps}")
    return replace(cfg, cost_steps=steps, checkpoint_every=max(1, steps // 4), det_steps=steps,
                   det_restart=steps // 2, scale_steps=max(2, steps // 2), scale_every=max(1, steps // 4))


def count_units(cfg: StudyConfig) -> int:
    """Units of work reported to ``on_progress``: training runs and spawned rank groups."""
    per_model = cfg.cost_repeats * len(cfg.mechanisms) + (1 + len(cfg.mechanisms))
    return len(cfg.models) * per_model + len(cfg.scale_models) * len(cfg.scale_worlds) + len(cfg.frameworks)


class _Progress:
    def __init__(self, total: int, fn: Optional[ProgressFn], journal: Optional[Journal], ledger: Ledger) -> None:
        self.total, self.done, self.fn, self.journal, self.ledger = total, 0, fn, journal, ledger

    def unit(self, key: str, measure: Callable[[], Any]) -> Any:
        """A unit of measurement: ``measure()``, or its result recorded by an earlier run
        (resume.py), the bytes it wrote then counted again in the ledger."""
        if self.journal is None:
            return measure()
        ledger = self.ledger

        def measured() -> dict[str, Any]:
            mark = ledger.mark()
            result = measure()
            return {"result": result, "disk": ledger.since(mark)}

        replayed = self.journal.has(key)
        record = self.journal.unit(key, measured, self)
        if replayed:
            ledger.replay(record["disk"])
        return record["result"]

    def start(self, label: str) -> None:
        if self.fn is not None:
            self.fn(self.done, self.total, label)
        self.done += 1

    def finish(self) -> None:
        if self.fn is not None:
            self.fn(self.total, self.total, "done")


# -- files ------------------------------------------------------------------------------------
def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def _state_bytes(job: Training) -> tuple[int, int]:
    """Raw bytes of the model's state_dict tensors and of the optimizer's state tensors."""
    return tensor_bytes(job.unwrapped_model.state_dict()), tensor_bytes(job.optimizer.state_dict()["state"])


# -- experiment 1 + 2: cost, formats and sizes --------------------------------------------------
def _format_timings(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One formats row from a mechanism's repetitions: the facts of the first (every repetition
    writes the same files), the spreads of the save and load times."""
    return {**rows[0], "save": spread([r["save_s"] for r in rows]), "load": spread([r["load_s"] for r in rows]),
            "save_s": [r["save_s"] for r in rows], "load_s": [r["load_s"] for r in rows]}


def _checkpointing_run(job: Training, mech: Mechanism, steps: int, every: int, root: Path,
                       cleanup: bool = True, ledger: Optional[Ledger] = None) -> dict[str, Any]:
    """Train ``steps`` steps saving every ``every``; seconds, and the time blocked in each save.
    The checkpoints are counted in ``ledger`` and removed afterwards if ``cleanup`` (ranks other
    than 0 leave it to rank 0)."""
    start = job.step
    stalls: list[float] = []
    saved: list[Path] = []

    def checkpoint(j: Training) -> None:
        if (j.step - start) % every == 0:
            path = root / f"step_{j.step:07d}"
            t0 = time.perf_counter()
            mech.save(j, path)
            stalls.append(time.perf_counter() - t0)
            saved.append(path)

    t0 = time.perf_counter()
    train_steps(job, steps, checkpoint)
    mech.wait()  # the run is finished when its last checkpoint is
    seconds = time.perf_counter() - t0
    if cleanup:
        ledger = ledger or Ledger(root)
        for p in saved:
            ledger.wrote("cost", p)
        ledger.observe()
        for p in saved:
            remove(p)
    return {"seconds": seconds, "checkpoints": len(stalls), "stall_s": stalls}


def _format_row(job: Training, mech: Mechanism, path: Path, ledger: Optional[Ledger] = None) -> dict[str, Any]:
    """Save once alone (timed to completion), measure the files, load back (timed)."""
    t0 = time.perf_counter()
    mech.save(job, path)
    mech.wait()
    save_s = time.perf_counter() - t0
    files = _files(path)
    total = sum(f.stat().st_size for f in files)
    ledger = ledger or Ledger(path)
    ledger.add("formats", total)
    ledger.observe()
    model_bytes, optim_bytes = _state_bytes(job)
    raw = model_bytes + (optim_bytes if mech.stores.optimizer else 0)
    t0 = time.perf_counter()
    mech.load(job, path)
    load_s = time.perf_counter() - t0
    remove(path)
    return {
        "mechanism": mech.name, "label": mech.label, "files": len(files),
        "file_names": [str(f.relative_to(path)) for f in files], "bytes": total, "raw_tensor_bytes": raw,
        "size_over_raw": total / raw, "stores": asdict(mech.stores), "format": mech.file_format,
        "executes_code": mech.executes_code, "executes_code_note": mech.executes_code_note,
        "fsync": mech.fsync, "save_s": save_s, "load_s": load_s,
    }


def cost_and_formats(cfg: StudyConfig, model: str, dataset: Any, work: Path,
                     progress: _Progress, ledger: Optional[Ledger] = None) -> tuple[list[dict], list[dict], dict]:
    spec = JobSpec(model, cfg.width, cfg.batch_size, cfg.seed, cfg.device)
    job = build_training(spec, dataset)
    model_bytes, _ = _state_bytes(job)
    params = sum(p.numel() for p in job.model.parameters())
    train_steps(job, cfg.warmup_steps)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.mechanisms}
    formats: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.mechanisms}
    for repeat in range(cfg.cost_repeats):
        # rotate the order between repeats so that no mechanism always runs first or last
        order = list(cfg.mechanisms[repeat % len(cfg.mechanisms):] + cfg.mechanisms[:repeat % len(cfg.mechanisms)])
        for name in order:
            def measure(name: str = name) -> dict[str, Any]:
                progress.start(f"{model}: cost, {name} ({repeat + 1}/{cfg.cost_repeats})")
                without = timed_steps(job, cfg.cost_steps)  # its pair, just before: the same machine load
                mech = make_mechanism(name)
                try:
                    run = _checkpointing_run(job, mech, cfg.cost_steps, cfg.checkpoint_every, work / name,
                                             ledger=ledger)
                    return {"run": {**run, "baseline_s": without},
                            "format": _format_row(job, mech, work / name / "alone", ledger)}
                finally:
                    mech.close()
            unit = progress.unit(f"{model}: cost, {name}, pair {repeat + 1}", measure)
            runs[name].append(unit["run"])
            formats[name].append(unit["format"])
    cost = [{"model": model, "mechanism": name, "label": MECHANISMS[name].label, "steps": cfg.cost_steps,
             "every": cfg.checkpoint_every, "checkpoints": runs[name][0]["checkpoints"],
             **pair_timings(runs[name])} for name in cfg.mechanisms]
    _, optim_bytes = _state_bytes(job)
    info = {"parameters": params, "model_state_bytes": model_bytes, "optimizer_state_bytes": optim_bytes}
    return cost, [{"model": model, **_format_timings(formats[name])} for name in cfg.mechanisms], info


# -- experiment 3: scale ----------------------------------------------------------------------
def rank_device(device: str, rank: int) -> str:
    """Where scale rank ``rank`` trains: the CPU, or GPU ``rank`` modulo the GPUs (several ranks
    share one GPU where there are fewer; their gradients are averaged over gloo either way)."""
    return device if device == "cpu" else f"cuda:{rank % max(1, torch.cuda.device_count())}"


def scale_worker(rank: int, world: int, arg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the scale experiment: per repetition and mechanism, a run without checkpoints
    and its pair with them, back to back, all ranks in step."""
    import torch.distributed as dist

    cfg: StudyConfig = arg["config"]
    dataset = make_dataset(cfg.samples, cfg.data_dir, cfg.seed)
    spec = JobSpec(arg["model"], cfg.width, cfg.batch_size, cfg.seed, rank_device(cfg.device, rank))
    job = build_training(spec, dataset, rank=rank, world=world, ddp=True)
    train_steps(job, cfg.warmup_steps)
    root = Path(arg["work"])
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.mechanisms}
    for repeat in range(cfg.cost_repeats):
        order = list(cfg.mechanisms[repeat % len(cfg.mechanisms):] + cfg.mechanisms[:repeat % len(cfg.mechanisms)])
        for name in order:
            dist.barrier()
            without = timed_steps(job, cfg.scale_steps)
            mech = make_mechanism(name)
            dist.barrier()
            try:
                run = _checkpointing_run(job, mech, cfg.scale_steps, cfg.scale_every, root / name, cleanup=False)
            finally:
                mech.close()
            dist.barrier()
            written = 0
            if rank == 0:  # every rank's files are in: count them once, then remove them
                written = tree_bytes(root / name)
                remove(root / name)
            out[name].append({**run, "baseline_s": without, "written_bytes": written})
    dist.barrier()
    return out


def scale(cfg: StudyConfig, work: Path, progress: _Progress, ledger: Optional[Ledger] = None) -> list[dict]:
    ledger = ledger or Ledger(work)
    rows = []
    for model in cfg.scale_models:
        for world in cfg.scale_worlds:
            def measure(model: str = model, world: int = world) -> list[dict[str, Any]]:
                progress.start(f"{model}: scale, {world} rank{'s' if world > 1 else ''}")
                try:
                    return run_ranks(world, scale_worker, {"config": cfg, "model": model,
                                                           "work": str(work / f"{model}-{world}")})
                except RankFailedError as e:
                    raise StudyError(f"the scale experiment failed on {plural(world, 'rank')}: {e}") from None
                finally:
                    remove(work / f"{model}-{world}")
            ranks = progress.unit(f"{model}: scale, {world} ranks", measure)
            for name in cfg.mechanisms:
                for run_ in (r for rank_runs in ranks for r in rank_runs[name]):
                    ledger.add("scale", run_["written_bytes"])
                    ledger.observe(run_["written_bytes"])  # one run's checkpoints are on disk at once
                # a step (and a checkpoint) finishes when its slowest rank does: the maximum over ranks
                pairs = []
                for i, first in enumerate(ranks[0][name]):
                    runs = [r[name][i] for r in ranks]
                    pairs.append({"baseline_s": max(r["baseline_s"] for r in runs),
                                  "seconds": max(r["seconds"] for r in runs), "checkpoints": first["checkpoints"],
                                  "stall_s": [max(r["stall_s"][j] for r in runs) for j in range(len(first["stall_s"]))]})
                rows.append({"model": model, "ranks": world, "mechanism": name, "label": MECHANISMS[name].label,
                             "steps": cfg.scale_steps, "every": cfg.scale_every, "global_batch": cfg.batch_size * world,
                             "checkpoints": pairs[0]["checkpoints"], **pair_timings(pairs)})
    return rows


# -- experiment 4: determinism ------------------------------------------------------------------
def determinism(cfg: StudyConfig, model: str, dataset: Any, work: Path, progress: _Progress,
                ledger: Optional[Ledger] = None) -> dict[str, Any]:
    spec = JobSpec(model, cfg.width, cfg.batch_size, cfg.seed, cfg.device)
    k = cfg.det_restart
    mechs = [make_mechanism(name) for name in cfg.mechanisms]

    def checkpoint_all(job: Training) -> None:
        if job.step == k:
            for m in mechs:
                m.save(job, work / m.name)
                m.wait()

    progress.start(f"{model}: determinism, uninterrupted run")
    reference = train_steps(build_training(spec, dataset), cfg.det_steps, checkpoint_all)
    ledger = ledger or Ledger(work)
    for m in mechs:
        ledger.wrote("determinism", work / m.name)
    ledger.observe()  # every mechanism's checkpoint waits for its restart
    restarts: dict[str, Any] = {}
    for m in mechs:
        progress.start(f"{model}: determinism, restart with {m.name}")
        job = build_training(spec, dataset)  # a new script: seeds, builds, then other code runs
        disturb_global_rng()
        step = m.load(job, work / m.name)
        job.step = k if step is None else step  # weights-only users know the step from the file name
        losses = train_steps(job, cfg.det_steps - k)
        m.close()
        if job.step != cfg.det_steps:
            raise StudyError(f"{m.name}: the checkpoint of step {k} restored step {step}")
        diffs = [abs(a - b) for a, b in zip(losses, reference[k:])]
        restarts[m.name] = {"label": m.label, "restored_step": step, "losses": losses,
                            "max_abs_diff": max(diffs), "identical": losses == reference[k:],
                            "stores": asdict(m.stores)}
        remove(work / m.name)
    return {"model": model, "steps": cfg.det_steps, "restart_step": k, "reference": reference,
            "restarts": restarts}


# -- the whole study --------------------------------------------------------------------------
@contextmanager
def deterministic_kernels(device: str) -> Iterator[None]:
    """On a GPU, kernels that compute the same result on every run (cuDNN's deterministic
    convolutions without autotuning, cuBLAS's deterministic workspace, PyTorch's deterministic
    algorithms where it has them), so that the determinism experiment measures what a restart
    changes rather than the GPU's scheduling; the flags are restored afterwards. Nothing on the CPU."""
    if device == "cpu":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS at its first call
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    algorithms = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without such a kernel still runs
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
            yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        torch.use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])


def environment(out: Optional[Path] = None) -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15": list(load) if load else None,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, **describe_machine(out)}


def run_study(cfg: StudyConfig, out: Path, on_progress: Optional[ProgressFn] = None,
              envs: Optional[Path] = None, restart: bool = False) -> dict[str, Any]:
    """Run every experiment; returns the results (what ``results.json`` holds). Checkpoints are
    written under ``out/checkpoints`` and removed as soon as they are measured. The frameworks of
    ``cfg.frameworks`` run last, in their environments under ``envs`` (``frameworks.env_root``).
    Each completed unit of measurement is recorded in ``out``'s journal (``resume.py``): a run of
    the same ``cfg`` after one that was killed measures only what the journal lacks; ``restart``
    measures everything again."""
    cfg.check()
    out = Path(out)
    journal = Journal(out, asdict(cfg), environment(out), restart)
    work = out / "checkpoints"
    remove(work)
    work.mkdir(parents=True)
    ledger = Ledger(work)
    progress = _Progress(count_units(cfg), on_progress, journal, ledger)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    dataset = make_dataset(cfg.samples, cfg.data_dir, cfg.seed)
    results: dict[str, Any] = {"config": asdict(cfg), "environment": journal.environment, "models": {},
                               "cost": [], "formats": [], "scale": [], "determinism": {}, "frameworks": {}}
    try:
        with quiet_single_process(), deterministic_kernels(cfg.device):
            for model in cfg.models:
                cost, formats, info = cost_and_formats(cfg, model, dataset, work / "cost" / model, progress, ledger)
                results["models"][model] = info
                results["cost"] += cost
                results["formats"] += formats
                results["determinism"][model] = progress.unit(
                    f"{model}: determinism", lambda: determinism(cfg, model, dataset, work / "det" / model, progress,
                                                      ledger))
            results["scale"] = scale(cfg, work / "scale", progress, ledger)
        results["disk"] = ledger.summary()
        for name in cfg.frameworks:
            def measure(name: str = name) -> dict[str, Any]:
                progress.start(f"{FRAMEWORKS[name].label}: environment and experiments")
                return run_framework(name, cfg, work / "frameworks", envs)
            try:
                def measure_scale(name: str = name) -> dict[str, Any]:
                    return measure_framework_scale(name, cfg, work / "frameworks", envs)
                merge_framework(results, name, progress.unit(f"framework {name}", measure))
                add_framework_scale(results, name, progress.unit(f"framework {name}: scale", measure_scale))
            except StudyError as e:  # the row says why; the other frameworks still run
                results.setdefault("frameworks", {})[name] = could_not_run(name, str(e))
    finally:
        remove(work)
        torch.set_num_threads(threads_before)
    results["environment"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results["duration_s"] = time.perf_counter() - t0 + journal.replayed_s
    results["journal"] = journal.summary()
    progress.finish()
    return results
