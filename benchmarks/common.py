"""Shared helpers for resurgo benchmarks: synthetic states, durability, cache eviction, stats.

Benchmarks here compare mechanisms *within one run*, as ratios, because absolute numbers on a
shared or virtualised disk move by 2-5x from run to run. Everything in this module is careful
to stay outside the timed regions except :func:`fsync_tree`, which is part of every save.
"""

from __future__ import annotations

import ctypes
import dataclasses
import ctypes.util
import gc
import math
import mmap
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

KiB = 1024
MiB = 1024 * KiB
GB = 1e9  # throughputs are reported in GB/s (10^9 bytes per second)

# --------------------------------------------------------------------------------------------
# synthetic training state
# --------------------------------------------------------------------------------------------

# (name, dtype, fraction of the total size): at --size-mib 1024 these are 256, 128, 128, 64, 64 MiB.
LARGE_TENSORS: tuple[tuple[str, torch.dtype, float], ...] = (
    ("embed.weight", torch.float32, 1 / 4),
    ("lm_head.weight", torch.bfloat16, 1 / 8),
    ("layers.0.mlp.up.weight", torch.float32, 1 / 8),
    ("data.token_ids", torch.int64, 1 / 16),
    ("layers.0.attn.qkv.weight", torch.bfloat16, 1 / 16),
)
SMALL_MIN_BYTES = 4 * KiB
SMALL_MAX_BYTES = 1 * MiB
# dtype of the small tensors, by cumulative probability
SMALL_DTYPES: tuple[tuple[float, torch.dtype], ...] = (
    (0.6, torch.float32),
    (0.9, torch.bfloat16),
    (1.0, torch.int64),
)
SMALL_PARAM_NAMES = ("weight", "bias", "norm.weight", "exp_avg", "exp_avg_sq", "step_table")


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(tensor_nbytes(t) for t in state.values())


def _shape_for(numel: int) -> tuple[int, ...]:
    for cols in (4096, 1024, 128):
        if numel % cols == 0 and numel >= cols:
            return (numel // cols, cols)
    return (numel,)


def _random_tensor(nbytes: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = nbytes // itemsize
    shape = _shape_for(numel)
    if dtype.is_floating_point:
        # generate in float32, then cast: randn has no bfloat16 kernel on every build
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        return t if dtype == torch.float32 else t.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


def make_state(size_mib: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A flat ``{name: tensor}`` state of about ``size_mib`` MiB of random data.

    5/8 of the bytes are in five large tensors (64-256 MiB at 1 GiB), the rest in many small ones
    of 4 KiB-1 MiB (log-uniform), in float32, bfloat16 and int64. Random data: nothing compresses.
    Every tensor's byte size is a multiple of 1 KiB. Deterministic for a given (size, seed).
    """
    total = int(size_mib * MiB)
    gen = torch.Generator().manual_seed(seed)
    pyrng = __import__("random").Random(seed)
    state: dict[str, torch.Tensor] = {}
    used = 0
    for name, dtype, frac in LARGE_TENSORS:
        nbytes = max(KiB, int(total * frac) // KiB * KiB)
        state[name] = _random_tensor(nbytes, dtype, gen)
        used += nbytes
    i = 0
    lo, hi = math.log(SMALL_MIN_BYTES), math.log(SMALL_MAX_BYTES)
    while total - used >= SMALL_MIN_BYTES:
        nbytes = int(math.exp(pyrng.uniform(lo, hi))) // KiB * KiB
        nbytes = max(SMALL_MIN_BYTES, min(nbytes, (total - used) // KiB * KiB))
        u = pyrng.random()
        dtype = next(d for p, d in SMALL_DTYPES if u <= p)
        name = f"blocks.{i // len(SMALL_PARAM_NAMES)}.{SMALL_PARAM_NAMES[i % len(SMALL_PARAM_NAMES)]}"
        state[name] = _random_tensor(nbytes, dtype, gen)
        used += nbytes
        i += 1
    return state


def describe_state(state: dict[str, torch.Tensor]) -> dict:
    by_dtype: dict[str, dict[str, int]] = {}
    for t in state.values():
        d = by_dtype.setdefault(str(t.dtype).removeprefix("torch."), {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += tensor_nbytes(t)
    sizes = sorted(tensor_nbytes(t) for t in state.values())
    return {
        "tensor_bytes": sum(sizes),
        "n_tensors": len(sizes),
        "n_large": sum(1 for s in sizes if s > SMALL_MAX_BYTES),
        "largest_bytes": sizes[-1] if sizes else 0,
        "smallest_bytes": sizes[0] if sizes else 0,
        "by_dtype": by_dtype,
    }


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preallocated, zero-filled (so pages are faulted in) targets for in-place loads."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


def zero_state(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        t.zero_()


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat, zero-copy uint8 memoryview of a contiguous CPU tensor (writable)."""
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def bitwise_mismatches(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> list[str]:
    """Keys whose dtype, shape or bytes differ (torch.equal on uint8 views), plus missing keys."""
    bad = []
    if set(expected) != set(got):
        missing = sorted(set(expected) - set(got))[:5]
        extra = sorted(set(got) - set(expected))[:5]
        bad.append(f"key sets differ: missing={missing} extra={extra}")
    for k, e in expected.items():
        g = got.get(k)
        if g is None:
            continue
        if g.dtype != e.dtype or g.shape != e.shape:
            bad.append(f"{k}: got {g.dtype}{tuple(g.shape)}, expected {e.dtype}{tuple(e.shape)}")
        elif not torch.equal(g.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)):
            bad.append(f"{k}: bytes differ")
    return bad


# --------------------------------------------------------------------------------------------
# files: durability, page cache, sizes
# --------------------------------------------------------------------------------------------


def iter_files(root: Path) -> Iterator[Path]:
    """Regular files under root (or root itself if it is a file), sorted, symlinks skipped."""
    root = Path(root)
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            p = Path(dirpath, f)
            if p.is_file() and not p.is_symlink():
                yield p


def iter_dirs(root: Path) -> Iterator[Path]:
    root = Path(root)
    if root.is_dir():
        for dirpath, dirnames, _ in os.walk(root):
            dirnames.sort()
            yield Path(dirpath)


def fsync_path(p: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0)
    fd = os.open(p, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path, *, parent: bool = True) -> None:
    """fsync every file and directory under root, then root's parent directory (the entry)."""
    root = Path(root)
    for f in iter_files(root):
        fsync_path(f)
    for d in iter_dirs(root):
        fsync_path(d)
    if parent:
        fsync_path(root.parent)


def evict(root: Path) -> None:
    """Drop root's files from the page cache: fsync (so pages are clean), then FADV_DONTNEED."""
    for f in iter_files(root):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prewarm(root: Path, chunk: int = 64 * MiB) -> None:
    """Read every file under root once so that its pages are in the page cache."""
    buf = bytearray(chunk)
    for f in iter_files(root):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def heat_page_cache(scratch: Path, buffers: Iterable[memoryview]) -> None:
    """Write the buffers into a scratch file (no fsync) and delete it: untimed, before each timer.

    On the dev VM the first ~1 GiB of page cache allocated after a pause, or after a phase that
    freed no memory, was written 3-8x slower than the next (0.3 s vs 1.2-2.6 s for 1 GiB), which
    made whichever mechanism ran after an in-place loader look slow. Freshly freed page-cache
    pages are fast to reuse, so this puts every mechanism in the same state. Dirty pages are
    dropped by the unlink before writeback picks them up (well under dirty_background_ratio).
    """
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for view in buffers:
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos:])
    finally:
        os.close(fd)
        os.unlink(scratch)


def file_sizes(root: Path) -> list[dict]:
    """[{path (relative to root), bytes (st_size), allocated (st_blocks*512)}] of every file."""
    root = Path(root)
    base = root.parent if root.is_file() else root
    out = []
    for f in iter_files(root):
        st = f.stat()
        out.append(
            {"path": str(f.relative_to(base)), "bytes": st.st_size, "allocated": st.st_blocks * 512}
        )
    return out


def remove(p: Path) -> None:
    p = Path(p)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


_libc = None


def _get_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def resident_fraction(root: Path) -> float | None:
    """Fraction of root's file pages that are in the page cache (mincore), or None if unknown.

    Used to check that :func:`evict` worked, so that "cold" loads really read from the device.
    """
    if sys.platform != "linux":
        return None
    try:
        libc = _get_libc()
    except OSError:
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for f in iter_files(root):
        size = f.stat().st_size
        if size == 0:
            continue
        npages = (size + page - 1) // page
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * npages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += npages
    return resident / total if total else 0.0


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding path (from /proc/mounts), or 'unknown'."""
    try:
        path = Path(path).resolve()
        best, best_type = "", "unknown"
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(
                    mnt
                ) >= len(best):
                    best, best_type = mnt, parts[2]
        return best_type
    except OSError:
        return "unknown"


# --------------------------------------------------------------------------------------------
# timing and statistics
# --------------------------------------------------------------------------------------------


@dataclass
class Timed:
    seconds: float
    value: object = None


def timed(fn: Callable[[], object]) -> Timed:
    """Run fn once after a full GC, return (seconds, result). GC is left enabled.

    Call :func:`freeze_gc` once after the imports so that these collections are cheap.
    """
    gc.collect()
    t0 = time.perf_counter()
    value = fn()
    return Timed(time.perf_counter() - t0, value)


def freeze_gc() -> None:
    """Collect once, then move every live object to the permanent generation (gc.freeze), so
    later collections only walk what the benchmark allocates (torch's import graph is large)."""
    gc.collect()
    gc.freeze()


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """num[i] / den[i] for repetitions where both exist (same repetition = same disk weather)."""
    return [n / d for n, d in zip(num, den) if n is not None and d]


def rotated(items: list, k: int) -> list:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def environment() -> dict:
    import numpy

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }
    try:
        import safetensors

        env["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            env["mem_total_kib"] = int(fh.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return env


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def jsonable(obj, depth: int = 0):
    """Best-effort JSON form of a report object (dataclass, pydantic model, plain object)."""
    if depth > 6:
        return repr(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [jsonable(x, depth + 1) for x in obj]
    if isinstance(obj, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)}
    if hasattr(obj, "model_dump"):
        try:
            return jsonable(obj.model_dump(), depth + 1)
        except Exception:  # noqa: BLE001
            pass
    if hasattr(obj, "__dict__"):
        return {k: jsonable(v, depth + 1) for k, v in vars(obj).items() if not k.startswith("_")}
    return repr(obj)
