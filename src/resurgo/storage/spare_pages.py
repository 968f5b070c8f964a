"""A memory root's pool of freed data files, whose pages the next save's files take over.

On tmpfs (``/dev/shm``) a new file's pages are allocated and zeroed when first written and freed
when the file is deleted, so a memory tier that keeps one step spends much of every save faulting
in the pages it freed a moment before. Instead, when a checkpoint of such a root is deleted (once
proven resurgo's, see :mod:`resurgo.storage.ownership`), its data files are renamed into
``.resurgo-spare-pages`` in the root; a new data file of a later save in that root takes one over
by rename and is written over its pages (cut to its own size when done).

Only what resurgo put in the pool is taken or deleted: entries named ``page-<12 hex>``, regular
files with a single link, owned by this user. A data file with other links (a checkpoint that
hard-links it holds its pages) never enters the pool, and anything else found in the pool stays
where it is. The pool holds the files of the checkpoint deleted last: putting a checkpoint's files
in it first deletes what an earlier one left.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from pathlib import Path

from resurgo.errors import storage_error

SPARE_DIR = ".resurgo-spare-pages"
_POOL_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_SPARE_NAME = re.compile(r"page-[0-9a-f]{12}")


class SparePages:
    """The pool of the memory root ``root`` (``root/.resurgo-spare-pages``)."""

    def __init__(self, root: Path):
        self.path = root / SPARE_DIR

    @classmethod
    def beside(cls, checkpoint: Path) -> "SparePages | None":
        """The pool of the root that holds ``checkpoint`` (a checkpoint or staging directory),
        when that root has one."""
        pool = cls(checkpoint.parent)
        return pool if pool.path.is_dir() else None

    def files(self) -> list[tuple[int, str]]:
        """``(size, name)`` of the files resurgo put in the pool, largest first."""
        found = []
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    if _SPARE_NAME.fullmatch(e.name) and _single_regular(e.stat(follow_symlinks=False)):
                        found.append((e.stat(follow_symlinks=False).st_size, e.name))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise storage_error(e, self.path, "cannot list the spare pages") from None
        return sorted(found, reverse=True)

    def nbytes(self) -> int:
        return sum(size for size, _ in self.files())

    def keep_at(self, dir_fd: int, name: str) -> bool:
        """Move the data file ``name`` of the open folder ``dir_fd`` (a checkpoint proven resurgo's
        and renamed away for deletion) into the pool; False, leaving it where it is, when it is not
        a regular file with a single link."""
        try:
            if not _single_regular(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
                return False
            self.path.mkdir(exist_ok=True)
            pool = os.open(self.path, _POOL_FLAGS)
            try:
                os.rename(name, f"page-{uuid.uuid4().hex[:12]}", src_dir_fd=dir_fd, dst_dir_fd=pool)
            finally:
                os.close(pool)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise storage_error(e, name, f"cannot move it into {self.path}") from None
        return True

    def take(self, dest: Path, size: int | None = None) -> bool:
        """Rename a pool file to ``dest`` (a new path in a save's staging): the smallest of at least
        ``size`` bytes, else the largest. False when the pool has none (another process of the
        node may take the same file first: then the next is tried)."""
        candidates = self.files()
        if size is not None:
            large = [f for f in candidates if f[0] >= size]
            candidates = sorted(large) + [f for f in candidates if f[0] < size]
        for _, name in candidates:
            try:
                os.rename(self.path / name, dest)
                return True
            except FileNotFoundError:
                continue
            except OSError as e:
                raise storage_error(e, dest, f"cannot take {self.path / name} over") from None
        return False

    def clear(self) -> None:
        """Delete the files resurgo put in the pool (anything else stays), through one descriptor of
        the pool opened without following a link: never in a folder a link leads to."""
        try:
            pool = os.open(self.path, _POOL_FLAGS)
        except FileNotFoundError:
            return
        except OSError as e:
            raise storage_error(e, self.path, "cannot open the spare pages") from None
        try:
            with os.scandir(pool) as it:
                names = [e.name for e in it
                         if _SPARE_NAME.fullmatch(e.name) and _single_regular(e.stat(follow_symlinks=False))]
            for name in names:
                try:
                    os.unlink(name, dir_fd=pool)
                except FileNotFoundError:
                    pass
        except OSError as e:
            raise storage_error(e, self.path, "cannot delete the spare pages") from None
        finally:
            os.close(pool)


def _single_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.getuid()
