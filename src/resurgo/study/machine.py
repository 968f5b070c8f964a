"""The machine a study ran on: what is read of it (CPU model, cores, memory, the disk under the
output directory, library versions, the date) and the report's section that shows it.

This module owns the description only; every field that cannot be read on this system is None,
and the section says "unknown" for it rather than guessing.
"""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

__all__ = ["describe", "cpu_model", "memory_bytes", "disk_of", "library_versions", "machine_section"]

LIBRARIES = ("torch", "numpy", "safetensors", "resurgo", "matplotlib")


def _read(path: str | Path) -> Optional[str]:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def cpu_model() -> Optional[str]:
    """The CPU's model name (Linux /proc/cpuinfo), else platform.processor(), else None."""
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.lower().startswith(("model name", "hardware", "cpu model")) and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def memory_bytes() -> Optional[int]:
    """Physical memory in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _block_device(path: Path) -> Optional[str]:
    """The /sys/block name of the disk holding ``path`` (Linux), or None."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    try:
        real = sys_dev.resolve(strict=True)
    except OSError:
        return None
    # a partition's directory sits inside its disk's: vda1 -> vda
    disk = real.parent if (real / "partition").exists() else real
    return disk.name


def disk_of(path: Path) -> dict[str, Any]:
    """The disk under ``path``: device, model, kind (SSD/HDD from the rotational flag), total
    and free bytes; fields that cannot be read are None."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    info: dict[str, Any] = {"device": None, "model": None, "kind": None, "total_bytes": None, "free_bytes": None}
    try:
        st = os.statvfs(path)
        info["total_bytes"], info["free_bytes"] = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    except (OSError, AttributeError):
        pass
    name = _block_device(path)
    if name:
        info["device"] = name
        block = Path("/sys/block") / name
        info["model"] = (_read(block / "device" / "model") or "").strip() or None
        rotational = (_read(block / "queue" / "rotational") or "").strip()
        # as the kernel reports it: a virtual disk may call itself rotational whatever backs it
        info["kind"] = {"0": "not rotational (SSD, or virtual)", "1": "rotational (HDD, or virtual)"}.get(rotational)
    return info


def library_versions() -> dict[str, Optional[str]]:
    """Installed versions of the libraries the study's PyTorch side uses (None: not installed)."""
    out: dict[str, Optional[str]] = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def describe(out: Optional[Path] = None) -> dict[str, Any]:
    """What the report says of the machine; ``out``: where the checkpoints are written."""
    return {"cpu_model": cpu_model(), "memory_bytes": memory_bytes(),
            "disk": disk_of(Path(out) if out is not None else Path.cwd()),
            "libraries": library_versions(), "os": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _gib(n: Optional[int]) -> str:
    return "unknown" if n is None else f"{n / (1 << 30):.1f} GiB"


def machine_section(results: dict) -> list[str]:
    """The report's section "Machine": CPU, cores, memory, disk, library versions, date."""
    env = results["environment"]
    disk = env.get("disk") or {}
    libs = ", ".join(f"{k} {v}" for k, v in (env.get("libraries") or {}).items() if v)
    for fw in results.get("frameworks", {}).values():
        if fw.get("versions"):
            libs += "; " + ", ".join(f"{k} {v}" for k, v in fw["versions"].items())
    disk_text = ", ".join(x for x in (disk.get("device"), disk.get("model"), disk.get("kind")) if x) or "unknown"
    rows = [["CPU", env.get("cpu_model") or "unknown"], ["cores", str(env.get("cpu_count") or "unknown")],
            ["memory", _gib(env.get("memory_bytes"))],
            ["disk", f"{disk_text}; {_gib(disk.get('total_bytes'))} total, {_gib(disk.get('free_bytes'))} free"],
            ["operating system", env.get("os") or env.get("platform") or "unknown"],
            ["Python", env.get("python") or "unknown"], ["libraries", libs or "unknown"],
            ["date", env.get("date") or "unknown"]]
    table = ["| part | this machine |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return ["## Machine\n", "\n".join(table) + "\n"]
