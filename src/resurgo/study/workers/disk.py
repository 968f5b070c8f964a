"""The bytes of the checkpoints the study writes: per experiment, in total, and the most present
on disk at once.

Standard library only: the study process (``resurgo.study.experiments``) and the other
frameworks' driver (``driver.py``, in their own environments) count with it. A checkpoint's bytes
are counted once it is complete and before it is deleted; ``NewFiles`` counts the files that
appear or change in a directory a mechanism writes into again and again (one that keeps its last
checkpoints, or overwrites one file), so an overwritten or pruned checkpoint still counts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["tree_bytes", "remove", "Ledger", "NewFiles"]


def _sizes(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under ``path`` (or ``path`` itself): its size, modification time (ns) and inode."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        return {str(path): (st.st_size, st.st_mtime_ns, st.st_ino)}
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except FileNotFoundError:  # removed meanwhile (a mechanism's temporary file)
                continue
            out[full] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (0 when it does not exist)."""
    return sum(entry[0] for entry in _sizes(path).values())


def remove(path: Path) -> None:
    """Delete a checkpoint, a file or a directory; nothing when it does not exist."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class Ledger:
    """Bytes written per experiment, and the most bytes seen on disk at once under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.written: dict[str, int] = {}
        self.peak = 0

    def add(self, experiment: str, nbytes: int) -> int:
        self.written[experiment] = self.written.get(experiment, 0) + nbytes
        return nbytes

    def wrote(self, experiment: str, path: Path) -> int:
        """Count the checkpoint at ``path``, complete: its bytes."""
        return self.add(experiment, tree_bytes(path))

    def observe(self, present: int = -1) -> None:
        """Note what is on disk now: ``present`` bytes, or everything under the root."""
        self.peak = max(self.peak, tree_bytes(self.root) if present < 0 else present)

    def mark(self) -> dict[str, int]:
        """The bytes written so far per experiment, for :meth:`since`."""
        return dict(self.written)

    def since(self, mark: dict[str, int]) -> dict[str, Any]:
        """The bytes written per experiment since ``mark`` and the most on disk at once so far:
        what a unit of measurement adds when a resumed run replays it (:meth:`replay`)."""
        added = {k: n - mark.get(k, 0) for k, n in self.written.items() if n != mark.get(k, 0)}
        return {"written": added, "peak": self.peak}

    def replay(self, recorded: dict[str, Any]) -> None:
        """Count again what a unit measured by an earlier run wrote (:meth:`since`'s record)."""
        for experiment, nbytes in recorded["written"].items():
            self.add(experiment, nbytes)
        self.peak = max(self.peak, recorded["peak"])

    def summary(self) -> dict[str, Any]:
        return {"written": dict(self.written), "total": sum(self.written.values()), "peak": self.peak}


def _temporary(relative: str) -> bool:
    """A file still being written: under a folder or name that says so (Orbax writes into
    ``<step>.orbax-checkpoint-tmp-*`` and renames it when complete; TensorFlow into ``*_temp``)."""
    return any("tmp" in part.lower() or "temp" in part.lower() for part in Path(relative).parts)


class NewFiles:
    """The bytes of the files that appeared or changed (size, time or inode) under a directory
    since the last look; files still being written are counted once renamed to their names."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.seen: dict[str, tuple[int, int, int]] = {}

    def look(self) -> int:
        now = {name: entry for name, entry in _sizes(self.directory).items()
               if not _temporary(os.path.relpath(name, self.directory))} if self.directory.exists() else {}
        new = sum(entry[0] for name, entry in now.items() if self.seen.get(name) != entry)
        self.seen.update(now)
        return new
