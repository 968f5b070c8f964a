"""What resurgo may replace or delete: only what it can prove it wrote.

Every path that replaces or deletes a location (``save``/``async_save`` with ``overwrite=True``,
the manager's retention and leftover clean-up, ``resurgo gc``, tier copies, object-store
overwrites, ``convert --overwrite``) first lists what is there and refuses, touching nothing,
when any entry is not one resurgo writes (:class:`~resurgo.errors.ForeignFilesError`, naming one
such entry and how many more). What counts as resurgo's, for a checkpoint location:

- ``manifest.json``, when it verifies (it parses and matches its own seal); in a staging
  directory (``.<name>.resurgo-tmp-<id>``) any ``manifest.json``, which a save cut short writes;
- the ``data/`` folder, and the data files a verifying manifest lists;
- where there is no verifying manifest to list them (an incomplete checkpoint, a staging
  directory) and on object stores (where aborted saves leave objects beside a checkpoint): data
  files named as resurgo names them (``data/[<save id>-]rank<R>-<I>.safetensors``) and, on object
  stores, writer tokens (``.resurgo-writers/<save id>``).

Anything else (a file of another name, a folder, a symbolic link, a manifest that does not verify)
is foreign. Storage does not parse manifests: the caller passes a :data:`DeclaredFiles` function
(:func:`resurgo.format.manifest.declared_files`) that turns a manifest's bytes into the data files it
lists, or raises when the manifest does not verify. Deletion then removes the entries this proof
accepted one by one (never a recursive delete of a folder), so a file that appears meanwhile stays.

On a local filesystem the proof and the deletion go through directory descriptors (a
:class:`Proof`): the directory is opened once without following a link, its manifest read and its
entries listed through that descriptor, each folder it holds opened the same way, and every file is
unlinked relative to the descriptor of the folder that was listed. Swapping a folder for a link to
somewhere else, at any moment, then changes nothing: path strings are never resolved again.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Collection, Iterable

from resurgo.errors import ForeignFilesError, ResurgoError

MANIFEST = "manifest.json"  # format.manifest.MANIFEST_NAME (asserted equal in local.py)
DATA = "data"
DIR, FILE, OTHER = "dir", "file", "other"  # kinds of entries: symbolic links and devices are OTHER

DeclaredFiles = Callable[[bytes, str], Collection[str]]
"""``(manifest bytes, how to name it) -> the data files it lists``; raises a ResurgoError when the
manifest does not verify. Supplied by the layers that may parse manifests."""

Owned = Callable[[str, str], bool]
"""``(relative path, kind) -> True when resurgo wrote it``; a folder it accepts is looked into."""

_RESURGO_DATA_FILE = re.compile(r"data/(?:[0-9a-f]{12}-)?rank\d{5,}-(?:\d{3,}|index)\.safetensors")  # data files, indexes
_WRITER_TOKEN = re.compile(r"\.resurgo-writers/[0-9a-f]{12}")


class Claim:
    """Which entries of a checkpoint location are resurgo's (an :data:`Owned` predicate), given the
    bytes of its manifest (None: it has none). ``leftovers``: also resurgo-named data files and
    writer tokens no manifest lists (always so where there is no manifest). ``staging``: a staging
    directory, whose manifest is resurgo's even unverified. ``declared``: the data files the
    manifest lists; ``why``: why ``manifest.json`` is not resurgo's ("" when it is)."""

    def __init__(self, manifest: bytes | None, declared_files: DeclaredFiles | None, where: str, *,
                 leftovers: bool, staging: bool = False):
        self.declared: Collection[str] = frozenset()
        self.manifest_ok, self.why = staging, ""
        if manifest is not None:
            if declared_files is None:
                self.why = "its manifest was not checked"
            else:
                try:
                    self.declared = declared_files(manifest, f"{where}/{MANIFEST}")  # answers `in`; never copied
                    self.manifest_ok = True
                except ResurgoError as e:
                    self.why = f"it does not verify: {e}"
        self.loose = leftovers or manifest is None

    def __call__(self, rel: str, kind: str) -> bool:
        if kind == DIR:
            return rel == DATA
        if kind != FILE:
            return False
        if rel == MANIFEST:
            return self.manifest_ok
        return rel in self.declared or (self.loose and (_RESURGO_DATA_FILE.fullmatch(rel) is not None
                                                        or _WRITER_TOKEN.fullmatch(rel) is not None))


def foreign(entries: Iterable[tuple[str, str]], owned: Owned) -> list[str]:
    """The entries (``(relative path, kind)``) that ``owned`` does not accept, sorted."""
    return sorted(rel for rel, kind in entries if not owned(rel, kind))


def refuse_foreign(where: object, found: list[str], doing: str, why_manifest: str = "") -> None:
    """Raise ForeignFilesError for ``found`` (foreign entries of ``where``), if any."""
    if not found:
        return
    if MANIFEST in found:  # the cause: without a verifying manifest its data files are not listed
        found = [MANIFEST] + [f for f in found if f != MANIFEST]
    first = found[0]
    reason = f" ({why_manifest})" if first == MANIFEST and why_manifest else ""
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    raise ForeignFilesError(
        f"{where}: holds {first!r}{reason}{more}, which resurgo did not write; refusing to {doing}, nothing "
        "was changed. resurgo replaces or deletes only what it wrote itself: move those files away or use "
        "another path.")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd``), never through a link:
    OSError (ELOOP, ENOTDIR) when it is a link or not a directory."""
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def read_regular(dir_fd: int, name: str, limit: int) -> bytes | None:
    """The bytes of ``name`` in the directory ``dir_fd`` when it is a regular file of at most ``limit``
    bytes (not followed if a link, never blocking on a FIFO); None otherwise or when absent."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        return read_from_start(fd, limit)
    finally:
        os.close(fd)


def read_from_start(fd: int, limit: int) -> bytes:
    """The bytes of the open file ``fd`` from its start to its end, or until more than ``limit``
    were read (a file longer than ``limit`` then reads as longer). pread: a shared descriptor keeps
    its position."""
    parts, offset = [], 0
    while offset <= limit:
        part = os.pread(fd, 1 << 24, offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
    return b"".join(parts)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class Proof:
    """What one opened directory holds, listed through its descriptor ``fd`` (the Proof owns it):
    its entries, and those of each folder ``owned`` accepts, opened relative to its parent's
    descriptor without following a link and on the same filesystem (else the entry counts as
    foreign). :meth:`remove` then deletes through the same descriptors, so what is deleted is what
    was proved. Close it (or use it as a context manager)."""

    def __init__(self, fd: int, owned: Owned, check_file: Callable[[int, str], bool] | None = None):
        self.owned = owned
        self.fds: dict[str, int] = {"": fd}  # folder prefix ("" or "data/") -> its descriptor
        self.identity = _identity(os.fstat(fd))
        self.entries: list[tuple[str, str]] = []
        self.at: tuple[int, str] | None = None  # where it is now: (parent's descriptor, name), set by the caller
        try:
            self._list()
            # Decided once, here: what is deleted later is what was proved now. ``check_file``:
            # a further test of a file's content, reading it as ``(its folder's descriptor, name)``.
            self.accepted = frozenset(
                (rel, kind) for rel, kind in self.entries if owned(rel, kind) and (
                    kind != FILE or check_file is None or check_file(self.fds[_prefix(rel)], rel.rpartition("/")[2])))
        except BaseException:
            self.close()
            raise

    def _list(self) -> None:
        pending = [""]
        while pending:
            prefix = pending.pop()
            with os.scandir(self.fds[prefix]) as it:
                for e in it:
                    rel = f"{prefix}{e.name}"
                    kind = DIR if e.is_dir(follow_symlinks=False) else FILE if e.is_file(follow_symlinks=False) else OTHER
                    if kind == DIR and self.owned(rel, kind):
                        try:
                            sub = open_dir(e.name, self.fds[prefix])
                        except OSError:
                            kind = OTHER  # replaced by a link or a file since it was listed
                        else:
                            if os.fstat(sub).st_dev != self.identity[0]:
                                os.close(sub)
                                kind = OTHER  # another filesystem mounted there
                            else:
                                self.fds[rel + "/"] = sub
                                pending.append(rel + "/")
                    self.entries.append((rel, kind))

    @property
    def fd(self) -> int:
        return self.fds[""]

    def foreign(self) -> list[str]:
        return sorted(rel for rel, kind in self.entries if (rel, kind) not in self.accepted)

    def owns(self, rel: str, kind: str) -> bool:
        return (rel, kind) in self.accepted

    def holds_at(self, parent_fd: int, name: str) -> bool:
        """Whether ``name`` in the directory ``parent_fd`` is still the directory proved (not followed)."""
        try:
            return _identity(os.stat(name, dir_fd=parent_fd, follow_symlinks=False)) == self.identity
        except OSError:
            return False

    def remove(self) -> list[str]:
        """Delete the entries proved resurgo's, each relative to the descriptor of the folder it was
        listed in, then those folders once empty (each only while it is still the folder opened);
        returns the entries left in place (foreign ones, folders not empty). The directory itself
        stays: its parent removes it (:meth:`remove_from`)."""
        left = self.foreign()
        for rel, kind in sorted(self.entries, key=lambda e: -e[0].count("/")):  # files before their folder
            if kind == OTHER or (rel, kind) not in self.accepted:
                continue
            name = rel.rpartition("/")[2]
            parent = self.fds[_prefix(rel)]
            try:
                if kind == DIR:
                    sub = self.fds.get(rel + "/")
                    if sub is None or _identity(os.stat(name, dir_fd=parent, follow_symlinks=False)) != _identity(os.fstat(sub)):
                        left.append(f"{rel}/ (replaced while being deleted)")
                        continue
                    os.rmdir(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
            except FileNotFoundError:
                pass
            except OSError as e:
                if kind != DIR:
                    raise
                left.append(f"{rel}/ (not empty: {e.strerror})")
        return left

    def remove_from(self, parent_fd: int, name: str) -> list[str]:
        """:meth:`remove`, then the directory itself, ``name`` in ``parent_fd``, when nothing is
        left in it and it is still the directory proved; returns what was left."""
        left = self.remove()
        if not left:
            if not self.holds_at(parent_fd, name):
                return [] if not _exists(parent_fd, name) else ["(the folder itself: replaced while being deleted)"]
            try:
                os.rmdir(name, dir_fd=parent_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                left.append(f"(the folder itself: {e.strerror})")
        return left

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def __enter__(self) -> "Proof":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prefix(rel: str) -> str:
    """The folder prefix (a key of :attr:`Proof.fds`) of the entry ``rel``."""
    folder = rel.rpartition("/")[0]
    return folder + "/" if folder else ""


def _exists(parent_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        return True
    except OSError:
        return False
