"""``resurgo bench``: what a checkpoint costs on your storage, and how often to take one.

Saves and loads a synthetic state of the size you give (random float32 tensors) in a scratch
directory or prefix under the location, a few times, and reports medians: ``resurgo.save`` until
committed, ``resurgo.async_save``'s stall and its time until committed, ``resurgo.load`` (every
checksum verified; the files were just written, so local reads may come from the page cache),
and, on a local filesystem, ``torch.save`` (with fsync) and ``torch.load`` of the same state as a
reference. Given the mean time between failures of the job, it adds Daly's optimal interval for
a synchronous and an asynchronous save (:func:`~resurgo.manager.daly.daly_interval`). The scratch
checkpoints are deleted at the end, also when a measurement fails.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from resurgo.api import async_save, load, save
from resurgo.errors import CheckpointNotFoundError
from resurgo.manager.daly import daly_interval
from resurgo.manager.catalog import checkpoint_name, remove
from resurgo.storage.base import Root
from resurgo.storage.open import is_url, join, local_path, open_root

MECHANISMS = ("save", "async_stall", "async_durable", "load", "torch_save", "torch_load")


@dataclass
class BenchReport:
    location: str
    state_bytes: int
    tensors: int
    repeats: int
    seconds: dict[str, list[float]] = field(default_factory=dict)  # mechanism -> one per repetition
    medians: dict[str, float] = field(default_factory=dict)
    gb_per_s: dict[str, float] = field(default_factory=dict)  # state bytes / median, for the I/O mechanisms
    mtbf_seconds: float | None = None
    interval_seconds: dict[str, float] = field(default_factory=dict)  # Daly: "save" and "async_save"


def synthetic_state(nbytes: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``nbytes`` of random float32 in ``tensors`` tensors (random: nothing compresses)."""
    if tensors < 1 or nbytes < 4 * tensors:
        raise ValueError(f"need at least 1 tensor and 4 bytes a tensor, got {tensors} tensors for {nbytes} bytes")
    gen = torch.Generator().manual_seed(seed)
    per = nbytes // 4 // tensors
    return {f"t{i:04d}": torch.randn(per, generator=gen) for i in range(tensors)}


def bench_storage(location: str | os.PathLike, *, size: int = 1 << 30, tensors: int = 16, repeats: int = 3,
                  mtbf_seconds: float | None = None, storage_options: dict | None = None,
                  reference: bool = True, create: bool = False) -> BenchReport:
    """Measure checkpoint costs under ``location`` (a directory or a URL).

    A local directory that does not exist is refused (a typo would otherwise create a tree of
    directories) unless ``create=True``, which makes it and its parents."""
    if not is_url(location) and not Path(location).exists():
        if not create:
            raise CheckpointNotFoundError(f"{location}: no such directory; create it, or pass --create "
                                          "(create=True) to have it made")
        Path(location).mkdir(parents=True)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    if mtbf_seconds is not None:
        daly_interval(0.0, mtbf_seconds)  # validates it before minutes of measuring
    state = synthetic_state(size, tensors)
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    scratch = join(location, f"resurgo-bench-{secrets.token_hex(4)}")
    if not is_url(scratch):
        Path(local_path(scratch)).mkdir(parents=True)
    root = open_root(scratch, storage_options)
    report = BenchReport(str(location), state_bytes, len(state), repeats)
    times: dict[str, list[float]] = {m: [] for m in MECHANISMS}
    with_torch = reference and not is_url(scratch)
    try:
        for rep in range(repeats):
            sync_at, async_at = root.location(checkpoint_name(2 * rep)), root.location(checkpoint_name(2 * rep + 1))
            t = time.perf_counter()
            save(state, sync_at, storage_options=storage_options)
            times["save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            handle = async_save(state, async_at, storage_options=storage_options)
            times["async_stall"].append(time.perf_counter() - t)
            handle.wait()
            times["async_durable"].append(time.perf_counter() - t)
            t = time.perf_counter()
            load(state, sync_at, storage_options=storage_options)
            times["load"].append(time.perf_counter() - t)
            for step in (2 * rep, 2 * rep + 1):
                remove(root, checkpoint_name(step))
            if with_torch:
                reference_file = Path(local_path(scratch)) / "reference.pt"
                times["torch_save"].append(_torch_save(state, reference_file))
                t = time.perf_counter()
                torch.load(reference_file, weights_only=True)
                times["torch_load"].append(time.perf_counter() - t)
                reference_file.unlink()
    finally:
        _remove_scratch(root, scratch, repeats)
    report.seconds = {m: ts for m, ts in times.items() if ts}
    report.medians = {m: statistics.median(ts) for m, ts in report.seconds.items()}
    report.gb_per_s = {m: state_bytes / 1e9 / s for m, s in report.medians.items() if m != "async_stall" and s > 0}
    if mtbf_seconds is not None:
        report.mtbf_seconds = float(mtbf_seconds)
        report.interval_seconds = {"save": daly_interval(report.medians["save"], mtbf_seconds),
                                   "async_save": daly_interval(report.medians["async_stall"], mtbf_seconds)}
    return report


def _torch_save(state: dict, path: Path) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def _remove_scratch(root: Root, scratch: str | os.PathLike, repeats: int) -> None:
    for step in range(2 * repeats):
        remove(root, checkpoint_name(step))
    if not is_url(scratch):
        path = Path(local_path(scratch))
        (path / "reference.pt").unlink(missing_ok=True)
        for leftover in path.iterdir():  # a save cut short by an error leaves its temporary directory
            remove(root, leftover.name)
        path.rmdir()
