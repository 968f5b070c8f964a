"""The study's experiments for one framework other than PyTorch, run inside that framework's own
environment: ``python driver.py FRAMEWORK CONFIG.json OUT.json``.

This module imports only the standard library (that environment has neither torch nor resurgo).
It owns what is measured, the same quantities as ``resurgo.study.experiments`` measures for
PyTorch, and the JSON written to OUT.json; the framework module (``<framework>_worker`` beside
this file, imported by name) owns the network, the training loop and the checkpoint calls. The
raw timings are written, not summaries: the study process computes the spreads, intervals and
paired overheads with the same code as PyTorch's (``resurgo.study.stats``). Every checkpoint is
deleted once measured, its bytes counted first (``disk.py``, beside this file).

A framework module provides: ``MECHANISM``, ``LABEL``, ``FORMAT``, ``STORES`` (weights,
optimizer, rng, data_position), ``EXECUTES_CODE`` and ``EXECUTES_CODE_NOTE``, ``FSYNC``,
``versions()``, ``setup(threads)``, ``build(model, config)`` (a job, built and seeded as a
training script builds it), ``train(job, steps, on_step=None)`` (losses; ``on_step(step)`` after
each step), ``set_step(job, step)``, ``parameters(job)`` (trainable parameters, as PyTorch's
``parameters()`` counts them: BatchNorm's scale and shift, not its running statistics),
``state_bytes(job)`` (raw bytes of the model's and the optimizer's stored arrays),
``describe(model)``, ``stock(model)`` (the framework's own network of that name, ``{"definition",
"parameters"}``, or None), ``disturb_rng()`` and ``Checkpointer(directory)`` with ``save(job, step)``, ``wait()``, ``load(job)`` (the restored step,
None when not stored) and ``close()``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

if __package__:  # imported from resurgo (the tests)
    from .disk import Ledger, NewFiles, remove
else:  # run as a script: its folder is on sys.path
    from disk import Ledger, NewFiles, remove  # type: ignore[no-redef]

__all__ = ["CONFIG_KEYS", "check_config", "timed_checkpoints", "checkpointing_run", "format_row", "cost_and_formats", "determinism",
           "write_result", "run", "main"]

# What the study process sends (StudyConfig's fields that apply outside PyTorch).
CONFIG_KEYS = ("models", "width", "batch_size", "samples", "warmup_steps", "cost_steps", "cost_repeats",
               "checkpoint_every", "det_steps", "det_restart", "seed", "threads")


def check_config(config: dict) -> dict:
    """The config with exactly CONFIG_KEYS, or ValueError naming what is missing or unknown."""
    missing = [k for k in CONFIG_KEYS if k not in config]
    extra = sorted(set(config) - set(CONFIG_KEYS))
    if missing or extra:
        raise ValueError(f"worker config: missing {missing}, unknown {extra}; expected the keys {list(CONFIG_KEYS)}")
    if not 0 < config["det_restart"] < config["det_steps"]:
        raise ValueError(f"worker config: 0 < det_restart {config['det_restart']} < det_steps {config['det_steps']}")
    return config


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def timed_checkpoints(train: Callable[..., Any], ckpt: Any, job: Any, steps: int, every: int,
                      after_save: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Train ``steps`` steps (``train(job, steps, on_step)``) saving with ``ckpt`` every ``every``;
    seconds (the last save waited for, time in ``after_save`` left out: it is not the mechanism's)
    and the time blocked in each save. ``ckpt`` is closed afterwards."""
    stalls: list[float] = []
    count = [0]
    outside = [0.0]

    def on_step(step: int) -> None:
        count[0] += 1
        if count[0] % every == 0:
            t0 = time.perf_counter()
            ckpt.save(job, step)
            t1 = time.perf_counter()
            stalls.append(t1 - t0)
            if after_save is not None:
                after_save()
                outside[0] += time.perf_counter() - t1

    t0 = time.perf_counter()
    train(job, steps, on_step)
    ckpt.wait()  # the run is finished when its last checkpoint is
    seconds = time.perf_counter() - t0 - outside[0]
    ckpt.close()
    return {"seconds": seconds, "checkpoints": len(stalls), "stall_s": stalls}


def checkpointing_run(fw: Any, job: Any, steps: int, every: int, directory: Path,
                      ledger: Ledger) -> dict[str, Any]:
    """Train ``steps`` steps checkpointing every ``every``; seconds (the last save included), and
    the time blocked in each save. The checkpoints are counted in ``ledger``, then removed."""
    ckpt = fw.Checkpointer(directory)
    new_files = NewFiles(directory)

    def count_new_files() -> None:  # a mechanism may prune or overwrite its earlier checkpoints
        ledger.add("cost", new_files.look())

    run = timed_checkpoints(fw.train, ckpt, job, steps, every, count_new_files)
    ledger.add("cost", new_files.look())
    ledger.observe()
    remove(directory)
    return run


def format_row(fw: Any, job: Any, directory: Path, step: int, ledger: Ledger) -> dict[str, Any]:
    """Save once alone (timed until complete), measure the files, load back (timed)."""
    ckpt = fw.Checkpointer(directory)
    t0 = time.perf_counter()
    ckpt.save(job, step)
    ckpt.wait()
    save_s = time.perf_counter() - t0
    ckpt.close()
    files = _files(directory)
    model_bytes, optim_bytes = fw.state_bytes(job)
    raw = model_bytes + (optim_bytes if fw.STORES["optimizer"] else 0)
    total = sum(f.stat().st_size for f in files)
    ledger.add("formats", total)
    ledger.observe()
    reader = fw.Checkpointer(directory)
    t0 = time.perf_counter()
    reader.load(job)
    load_s = time.perf_counter() - t0
    reader.close()
    remove(directory)
    return {"files": len(files), "file_names": [str(f.relative_to(directory)) for f in files], "bytes": total,
            "raw_tensor_bytes": raw, "size_over_raw": total / raw, "save_s": save_s, "load_s": load_s}


def _facts(fw: Any) -> dict[str, Any]:
    return {"mechanism": fw.MECHANISM, "label": fw.LABEL}


def cost_and_formats(fw: Any, model: str, config: dict, work: Path, progress: Callable[[str], None],
                     ledger: Ledger) -> tuple[dict, dict, dict]:
    """Experiments 1 and 2 for one network: ``cost_repeats`` pairs (without, then with
    checkpoints, back to back), each followed by one save alone, its load, and untimed warm-up
    steps."""
    job = fw.build(model, config)
    fw.train(job, config["warmup_steps"])
    runs, formats = [], []
    step = config["warmup_steps"]
    for repeat in range(config["cost_repeats"]):
        progress(f"{model}: cost ({repeat + 1}/{config['cost_repeats']})")
        t0 = time.perf_counter()
        fw.train(job, config["cost_steps"])
        without = time.perf_counter() - t0  # its pair, just before: the same machine load
        run_ = checkpointing_run(fw, job, config["cost_steps"], config["checkpoint_every"], work / "cost", ledger)
        runs.append({**run_, "baseline_s": without})
        step += 2 * config["cost_steps"]
        formats.append(format_row(fw, job, work / "alone", step, ledger))
        # the first steps after a restore may compile again (jit sees restored arrays as new
        # inputs): that belongs to no pair, so it happens here, untimed
        fw.train(job, config["warmup_steps"])
        step += config["warmup_steps"]
    model_bytes, optim_bytes = fw.state_bytes(job)
    info = {"parameters": fw.parameters(job), "model_state_bytes": model_bytes, "optimizer_state_bytes": optim_bytes,
            "architecture": fw.describe(model), "stock": fw.stock(model)}
    cost = {"model": model, **_facts(fw), "steps": config["cost_steps"], "every": config["checkpoint_every"],
            "checkpoints": runs[0]["checkpoints"], "runs": runs}
    first = formats[0]
    fmt = {"model": model, **_facts(fw), **{k: v for k, v in first.items() if k not in ("save_s", "load_s")},
           "stores": dict(fw.STORES), "format": fw.FORMAT, "executes_code": fw.EXECUTES_CODE,
           "executes_code_note": fw.EXECUTES_CODE_NOTE, "fsync": fw.FSYNC,
           "save_s": [f["save_s"] for f in formats], "load_s": [f["load_s"] for f in formats]}
    return cost, fmt, info


def determinism(fw: Any, model: str, config: dict, work: Path, progress: Callable[[str], None],
                ledger: Ledger) -> dict[str, Any]:
    """Experiment 4: an uninterrupted run checkpoints at ``det_restart``; a new job, built as a new
    script builds it, with the global RNGs moved elsewhere, loads it as users do and continues."""
    k, steps = config["det_restart"], config["det_steps"]
    progress(f"{model}: determinism, uninterrupted run")
    job = fw.build(model, config)
    ckpt = fw.Checkpointer(work / "det")

    def at_restart(step: int) -> None:
        if step == k:
            ckpt.save(job, step)
            ckpt.wait()

    reference = fw.train(job, steps, at_restart)
    ckpt.close()
    ledger.wrote("determinism", work / "det")
    ledger.observe()
    progress(f"{model}: determinism, restart")
    job = fw.build(model, config)
    fw.disturb_rng()
    reader = fw.Checkpointer(work / "det")
    restored = reader.load(job)
    reader.close()
    fw.set_step(job, k if restored is None else restored)  # otherwise users know it from the file name
    losses = fw.train(job, steps - k)
    remove(work / "det")
    diffs = [abs(a - b) for a, b in zip(losses, reference[k:])]
    return {"model": model, "steps": steps, "restart_step": k, "reference": reference,
            "restarts": {fw.MECHANISM: {"label": fw.LABEL, "restored_step": restored, "losses": losses,
                                        "max_abs_diff": max(diffs), "identical": losses == reference[k:],
                                        "stores": dict(fw.STORES)}}}


def run(fw: Any, config: dict, work: Path, progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Every experiment this worker runs, as the JSON-ready dict written to OUT.json."""
    check_config(config)
    say = progress or (lambda label: print(label, file=sys.stderr, flush=True))
    fw.setup(config["threads"])
    t0 = time.perf_counter()
    ledger = Ledger(work)
    out: dict[str, Any] = {"versions": fw.versions(), "mechanism": fw.MECHANISM, "label": fw.LABEL, "models": {},
                           "cost": [], "formats": [], "determinism": {}}
    for model in config["models"]:
        cost, fmt, info = cost_and_formats(fw, model, config, work / model, say, ledger)
        out["models"][model] = info
        out["cost"].append(cost)
        out["formats"].append(fmt)
        out["determinism"][model] = determinism(fw, model, config, work / model, say, ledger)
    out["disk"] = ledger.summary()
    out["duration_s"] = time.perf_counter() - t0
    return out


def write_result(path: Path, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``path``, whole or not at all (the study process reads it after the exit)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(result, allow_nan=False))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: driver.py FRAMEWORK CONFIG.json OUT.json", file=sys.stderr)
        return 2
    name, config_path, out_path = argv
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    fw = importlib.import_module(f"{name}_worker")
    config = json.loads(Path(config_path).read_text())
    work = Path(out_path).parent / f"{name}-checkpoints"
    try:
        result = run(fw, config, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(Path(out_path), {"framework": name, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
