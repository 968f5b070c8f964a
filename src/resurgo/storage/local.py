"""Local filesystem backend and its commit protocol.

A save writes into a temporary sibling directory (``.<name>.resurgo-tmp-<id>``), fsyncs every
data file, writes and fsyncs ``manifest.json`` last, fsyncs the directories, then atomically
renames the temporary directory onto the checkpoint path and fsyncs the parent. Overwriting
swaps the two directories atomically (``renameat2(RENAME_EXCHANGE)``) and only then deletes the
old one, so the path always names a complete checkpoint and the old one is never modified in
place. A crash at any moment leaves at worst a temporary directory, which readers ignore.

Only what resurgo can prove it wrote is replaced (:mod:`resurgo.storage.ownership`): the
directory at the path is checked when the save starts and again just before the swap, and the
old directory is then deleted entry by entry, through the directory descriptors it was proved
through (a folder swapped for a link meanwhile leads nowhere), so anything else stays where it is.

A root of checkpoints (:class:`LocalRoot`) deletes one the same way: once proven resurgo's, it is
renamed to a temporary name (``.NAME.resurgo-tmp-trash-*``): the rename is atomic, so it stops
being a checkpoint at once, and every reader treats the new name as temporary. The parent is
fsynced, and only then are the files removed, one by one (a file that appeared meanwhile stays,
and is reported). A crash before the rename leaves the checkpoint whole; a crash after it leaves
a temporary directory, which the manager's next start or ``resurgo gc`` removes. Never a
half-deleted checkpoint under its name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
import threading
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    ForeignFilesError,
    IncompleteCheckpointError,
    NotACheckpointError,
    storage_error,
    storage_errors,
)
from resurgo.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, TMP_MARKER
from resurgo.storage import ownership
from resurgo.storage.base import DATA_DIR, Listing, check_size
from resurgo.storage.direct_io import DirectWriteHandle
from resurgo.storage.local_files import MappedFile, ReadHandle, WriteHandle, open_for_read
from resurgo.storage.ownership import DeclaredFiles
from resurgo.storage.spare_pages import SparePages

assert ownership.MANIFEST == MANIFEST_NAME

TRASH_TAG = "trash-"  # after TMP_MARKER: a checkpoint renamed away to be deleted
_RENAME_EXCHANGE = 2


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_MEMORY_FS = frozenset({"tmpfs", "ramfs"})


def in_memory_fs(path: Path, mounts: str = "/proc/self/mounts") -> bool:
    """Whether ``path`` lies on a filesystem held in memory (tmpfs, ramfs: ``/dev/shm``), from
    the longest mount point above it in ``mounts`` (False where there is none)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return False
    return kind in _MEMORY_FS


def _exchange(a: str, b: str, dir_fd: int) -> bool:
    """Atomically swap the entries ``a`` and ``b`` of the directory ``dir_fd`` (Linux renameat2).
    False when the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


Prove = Callable[[int, str, Path], ownership.Proof]
"""``(parent's descriptor, name, path for messages) -> the proof`` that the directory ``name`` of the
parent is resurgo's (ForeignFilesError when not, nothing changed)."""


def _open_parent(path: Path) -> tuple[int, str]:
    """A descriptor of the directory holding ``path``, and ``path``'s name in it."""
    path = Path(os.path.abspath(path))
    return os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)), path.name


def _replace_directory(tmp: Path, final: Path, prove: Prove) -> None:
    """Put directory ``tmp`` at ``final`` (which exists and ``prove`` accepts: else it raises and
    nothing changes), atomically where the system can, then delete what ``prove`` found to be
    ours in the old one, through the descriptors it was proved through. Without renameat2 the old
    one is first renamed aside, so ``final`` names either directory at every moment but one rename
    apart."""
    parent_fd, name = _open_parent(final)
    try:
        with prove(parent_fd, name, final) as proof:
            if _exchange(tmp.name, name, parent_fd):
                old = tmp.name  # now holds the old directory
            else:
                old = f".{name}{TMP_MARKER}old-{uuid.uuid4().hex[:12]}"
                os.rename(name, old, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                os.rename(tmp.name, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            left = proof.remove_from(parent_fd, old)
    finally:
        os.close(parent_fd)
    if left:  # appeared between the check and the swap: never deleted
        warnings.warn(f"resurgo: {final} was replaced; its old directory, now {final.parent / old}, kept {left[0]!r}, "
                      "which resurgo did not write; it is left there", RuntimeWarning, stacklevel=3)


def publish(tmp: Path, final: Path, overwrite: bool, doing: str, prove: Prove | None) -> None:
    """Rename the finished ``tmp`` (a durable file or directory) onto ``final``, replacing an
    existing one atomically when ``overwrite`` (a directory only when ``prove`` accepts it), then
    fsync the parent. ``doing`` names the operation in the message when ``final`` appeared meanwhile."""
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise CheckpointExistsError(f"{final}: appeared while {doing}; refusing to replace it")
        if tmp.is_dir():
            if prove is None or final.is_symlink() or not final.is_dir():
                raise CheckpointExistsError(f"{final}: appeared while {doing} and is not one resurgo may replace")
            _replace_directory(tmp, final, prove)
        else:
            os.replace(tmp, final)  # atomic for a file
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)


def open_child(parent_fd: int, name: str, where: Path, doing: str) -> int:
    """The directory ``name`` of ``parent_fd`` opened without following a link (FileNotFoundError
    when absent, ForeignFilesError when a link or not a directory)."""
    try:
        return ownership.open_dir(name, parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ForeignFilesError(f"{where}: is not a directory resurgo wrote (a link or a file); refusing to {doing}, "
                                    "nothing was changed") from None
        raise


def prove_checkpoint_at(parent_fd: int, name: str, where: Path, declared_files: DeclaredFiles | None,
                        doing: str) -> ownership.Proof:
    """The proof that the checkpoint directory ``name`` of ``parent_fd`` (``where``, for messages)
    is all resurgo's: its manifest read and its entries listed through one descriptor of it; else
    ForeignFilesError. A staging directory's leftovers are resurgo's (see ownership)."""
    with storage_errors(where, "cannot list it", passing=FileNotFoundError):
        fd = open_child(parent_fd, name, where, doing)
        try:
            raw = ownership.read_regular(fd, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        except BaseException:
            os.close(fd)
            raise
        temporary = is_temporary(where)
        claim = ownership.Claim(raw, declared_files, str(where), leftovers=temporary, staging=temporary)
        proof = ownership.Proof(fd, claim)
    try:
        ownership.refuse_foreign(where, proof.foreign(), doing, claim.why)
    except BaseException:
        proof.close()
        raise
    return proof


def prove_checkpoint_dir(path: Path, declared_files: DeclaredFiles | None, doing: str) -> None:
    """ForeignFilesError unless all of the directory ``path`` is resurgo's (a check: nothing is kept open)."""
    prove_with(lambda parent_fd, name, where: prove_checkpoint_at(parent_fd, name, where, declared_files, doing), path)


def prove_with(prove: Prove, path: Path) -> None:
    """Run ``prove`` on the directory ``path`` as a check, keeping nothing open."""
    try:
        parent_fd, name = _open_parent(path)
    except OSError as e:
        raise storage_error(e, path.parent, "cannot open it") from None
    try:
        prove(parent_fd, name, path).close()
    except FileNotFoundError:
        pass  # gone meanwhile: nothing to replace
    finally:
        os.close(parent_fd)


def through(dir_fd: int, name: str) -> Path:
    """A path that reaches the entry ``name`` of the open directory ``dir_fd`` without resolving
    the directory's own path again (Linux's /proc/self/fd)."""
    return Path(f"/proc/self/fd/{dir_fd}/{name}")


def remove_checkpoint_dir(path: Path, proof: ownership.Proof) -> None:
    """Delete what ``proof`` proved resurgo's of a checkpoint already renamed away (to ``path``,
    ``proof.at``), through the descriptors it was proved through; ForeignFilesError when something
    else appeared in it meanwhile (it stays)."""
    assert proof.at is not None
    try:
        left = proof.remove_from(*proof.at)
    except OSError as e:
        raise storage_error(e, path, f"could not be deleted: {e.filename}") from None
    ownership.refuse_foreign(path, left, "delete it (the rest of it was deleted)")


def is_temporary(path: Path) -> bool:
    return TMP_MARKER in path.name


def trash_name(name: str) -> str:
    """The name a checkpoint is renamed to before it is deleted: a temporary directory."""
    return f".{name}{TMP_MARKER}{TRASH_TAG}{uuid.uuid4().hex[:12]}"


def _listing(path: Path, name: str) -> Listing:
    """What is stored under the directory ``path`` (links not followed)."""
    files: dict[str, int] = {}
    folders: set[str] = set()
    newest = 0.0
    for top, dirs, names in os.walk(path, onerror=lambda e: None):
        rel_top = os.path.relpath(top, path)
        for entry in [*dirs, *names, ""]:
            full = os.path.join(top, entry) if entry else top
            try:
                st = os.lstat(full)
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if not entry:
                continue
            rel = entry if rel_top == "." else f"{rel_top}/{entry}".replace(os.sep, "/")
            if entry in dirs:
                folders.add(rel)
            else:
                files[rel] = st.st_size
    return Listing(name, files, newest, frozenset(folders))


class LocalRoot:
    """A directory of checkpoints (each a directory below it) and the temporary directories of
    their saves and deletions; deletion as the module docstring says."""

    saves_in_place = False  # a save writes into a temporary sibling and renames it
    size_words = "on disk"
    storage_options: dict | None = None

    def __init__(self, path: str | os.PathLike, *, spare_pages: bool = False):
        self.path = Path(path)
        self.name = str(self.path.absolute())
        # A memory root keeps the data files of a deleted checkpoint for the next save (spare_pages.py).
        self.spares = SparePages(self.path) if spare_pages else None

    def __str__(self) -> str:
        return str(self.path)

    def require(self, expected: str = "a directory") -> None:
        if not self.path.exists():
            raise CheckpointNotFoundError(f"{self.path}: no such directory")
        if not self.path.is_dir():
            raise NotACheckpointError(f"{self.path}: is a file, expected {expected}")

    def location(self, name: str) -> Path:
        return self.path if name == "." else self.path / name

    def open(self, name: str) -> "CheckpointDir":
        return CheckpointDir(self.location(name))

    def listing(self, name: str) -> Listing | None:
        path = self.location(name)
        if not (path.exists() or path.is_symlink()):
            return None
        if path.is_symlink() or not path.is_dir():
            return Listing(name, is_dir=False)
        return _listing(path, name)

    def listings(self, select: Callable[[str], bool] | None = None) -> list[Listing]:
        try:
            names = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []
        found = [self.listing(n) for n in names if select is None or select(n)]
        return [f for f in found if f is not None]

    def walk(self) -> list[Listing]:
        """Does not descend into a checkpoint-like directory, nor follow links to directories."""
        found: list[Listing] = []
        stack = [self.path]
        while stack:
            d = stack.pop()
            if is_temporary(d) or (d / MANIFEST_NAME).exists() or (d / DATA_DIR).is_dir():
                found.append(_listing(d, d.relative_to(self.path).as_posix()))
                continue
            try:
                with os.scandir(d) as it:
                    stack.extend(Path(entry.path) for entry in it if entry.is_dir(follow_symlinks=False))
            except OSError:
                continue
        return found

    def _open_parent_of(self, name: str) -> tuple[int, str]:
        """A descriptor of the directory holding the checkpoint ``name`` and its name in it: the
        folders between the root and it are opened one by one without following a link."""
        if name == ".":
            return _open_parent(self.path)
        *folders, leaf = name.split("/")
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            for folder in folders:
                sub = ownership.open_dir(folder, fd)
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd, leaf

    def remove(self, name: str, declared_files: DeclaredFiles | None, *, dry_run: bool = False) -> bool:
        path = self.location(name)
        try:
            parent_fd, leaf = self._open_parent_of(name)
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ForeignFilesError(f"{path}: a folder above it is a link or a file; refusing to delete it") from None
            raise storage_error(e, path, "cannot open the folder holding it") from None
        try:
            try:
                proof = prove_checkpoint_at(parent_fd, leaf, path, declared_files, "delete it")
            except FileNotFoundError:
                return False  # removed at the same time by someone else (another gc)
            with proof:
                if dry_run:
                    return True
                if is_temporary(path):  # an interrupted save or deletion: no reader takes it for a checkpoint
                    proof.at = (parent_fd, leaf)
                    remove_checkpoint_dir(path, proof)
                    return True
                return self._remove_renamed(path, parent_fd, leaf, proof)
        finally:
            os.close(parent_fd)

    def _remove_renamed(self, path: Path, parent_fd: int, leaf: str, proof: ownership.Proof) -> bool:
        """Rename the proved checkpoint ``leaf`` of ``parent_fd`` away, durably, then delete it."""
        trash = trash_name(leaf)
        try:
            os.rename(leaf, trash, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise storage_error(e, path, "cannot rename it away for deletion") from None
        if not proof.holds_at(parent_fd, trash):  # replaced between the proof and the rename
            raise ForeignFilesError(
                f"{path}: was replaced while being deleted; nothing was deleted, and what was renamed to "
                f"{path.parent / trash} is not what resurgo proved it wrote")
        try:
            os.fsync(parent_fd)  # the rename is durable before any file goes
        except OSError as e:
            raise storage_error(e, path.parent, f"fsync failed after renaming {leaf} away") from None
        if self.spares is not None:
            self._keep_pages(proof)
        proof.at = (parent_fd, trash)
        remove_checkpoint_dir(path.parent / trash, proof)
        return True

    def _keep_pages(self, proof: ownership.Proof) -> None:
        """Move the data files of a proved checkpoint, renamed away, into the spare pages (first
        emptied of what an older deletion left), through the descriptor of its data folder."""
        assert self.spares is not None
        self.spares.clear()
        data_fd = proof.fds.get(f"{DATA_DIR}/")
        if data_fd is None:
            return
        for rel, kind in sorted(proof.entries):
            if kind == ownership.FILE and rel.startswith(f"{DATA_DIR}/") and proof.owns(rel, kind):
                self.spares.keep_at(data_fd, rel[len(DATA_DIR) + 1:])


class CheckpointDir:
    """A checkpoint path on the local filesystem: read side and the start of a save."""

    coalesce_reads = (0, 0)  # positional reads cost no round trip: each read is its own

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def describe(self, rel: str) -> str:
        """How messages name ``rel`` inside this checkpoint."""
        return str(self.path / rel)

    # -- reading ------------------------------------------------------------------------------
    def pinned(self) -> "PinnedCheckpointDir":
        """This checkpoint as one version: see :class:`PinnedCheckpointDir`. ``close()`` it."""
        return PinnedCheckpointDir(self.path)

    def close(self) -> None:
        pass

    def read_manifest_bytes(self) -> bytes:
        return self.manifest_path().read_bytes()

    def manifest_path(self) -> Path:
        """The manifest's path, once the checkpoint is known to be one (else the error saying what it is)."""
        if not self.path.exists():
            raise CheckpointNotFoundError(f"{self.path}: no such checkpoint")
        if is_temporary(self.path):
            raise IncompleteCheckpointError(
                f"{self.path}: a temporary directory of a save that did not finish; it is not a checkpoint")
        if not self.path.is_dir():
            raise NotACheckpointError(f"{self.path}: is a file, a checkpoint is a directory with {MANIFEST_NAME}")
        mpath = self.resolve(MANIFEST_NAME)  # a symlink may not lead out of the checkpoint
        if not mpath.is_file():
            if (self.path / "data").is_dir():
                raise IncompleteCheckpointError(
                    f"{self.path}: has data files but no {MANIFEST_NAME}: the save never committed")
            raise NotACheckpointError(f"{self.path}: not a resurgo checkpoint (no {MANIFEST_NAME})")
        size = mpath.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            from resurgo.errors import ManifestError

            raise ManifestError(f"{mpath}: {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")
        return mpath

    def resolve(self, rel: str) -> Path:
        """The absolute path of ``rel``, refusing anything that leaves the checkpoint."""
        try:
            root = os.path.realpath(self.path)
            full = os.path.realpath(os.path.join(root, rel))
        except OSError as e:  # a symlink on the way replaced by a file while it was followed (EINVAL)
            raise storage_error(e, self.path, f"path {rel[:200]!r} could not be resolved",
                                "was the checkpoint changed while it was read?") from None
        if os.path.isabs(rel) or not full.startswith(root + os.sep):
            raise CorruptCheckpointError(f"{self.path}: path {rel[:200]!r} leaves the checkpoint directory")
        return Path(full)

    def open_read(self, rel: str) -> ReadHandle:
        return ReadHandle(self.resolve(rel), rel)

    def map_read(self, rel: str) -> MappedFile:
        """The data file ``rel`` mapped into memory, read-only (sent to a peer without a copy)."""
        return MappedFile(self.resolve(rel), self.describe(rel))

    def sibling(self, name: str) -> "CheckpointDir":
        """The checkpoint ``name`` in the same directory as this one (unpinned)."""
        return CheckpointDir(self.path.parent / name)

    def check_sizes(self, sizes: dict[str, int]) -> None:
        """Every file is a regular file inside the checkpoint, of the size given; else CorruptCheckpointError.

        Loads call this before allocating anything, so sizes claimed by a manifest are bounded by
        the bytes really on disk.
        """
        for rel, expected in sizes.items():
            h = self.open_read(rel)
            try:
                check_size(self.path, rel, h.size, expected)
            finally:
                h.close()

    # -- writing ------------------------------------------------------------------------------
    def stage(self, overwrite: bool, declared_files: DeclaredFiles | None = None) -> "LocalStaging":
        """Start a save at this path. ``overwrite``: replace what is there, if resurgo can prove it
        wrote it (``declared_files`` reads the data files its manifest lists); else ForeignFilesError."""
        if self.path.exists() or self.path.is_symlink():
            if not overwrite:
                raise CheckpointExistsError(f"{self.path}: already exists; pass overwrite=True to replace it")
            if self.path.is_symlink() or not self.path.is_dir():
                raise CheckpointExistsError(f"{self.path}: exists and is not a directory; refusing to replace it")
            prove_checkpoint_dir(self.path, declared_files, "replace it")
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp = parent / f".{self.path.name}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
            (tmp / "data").mkdir(parents=True)
        except OSError as e:
            raise storage_error(e, self.path, "cannot create a temporary directory") from None
        return LocalStaging(self.path, tmp, overwrite, declared_files)


class PinnedCheckpointDir(CheckpointDir):
    """A checkpoint directory read as one version, even while a save replaces it.

    The directory is opened once; the manifest and every data file are then opened by path and
    accepted only when they are the very files of that directory (same inode as seen through it),
    and each stays open for the rest of the read, so the old files stay readable after an overwrite
    swaps the directories and deletes the old one. When a file is missing or another one, and the
    path names another directory now, the checkpoint was replaced: CheckpointReplacedError, which
    the load retries from the start (never reported as corruption).
    """

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._dir_fd = -1
        self._dir_id: tuple[int, int] | None = None
        self._fds: dict[str, int] = {}  # rel -> an open file of the pinned directory
        self._lock = threading.Lock()

    def pinned(self) -> "PinnedCheckpointDir":
        return self

    def _pin(self) -> None:
        if self._dir_fd >= 0:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return  # not a directory, or gone: manifest_path() says what it is
        st = os.fstat(fd)
        self._dir_fd, self._dir_id = fd, (st.st_dev, st.st_ino)

    def _raise_if_replaced(self, rel: str) -> None:
        try:
            st = os.stat(self.path)
            now: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            now = None
        if now != self._dir_id:
            raise CheckpointReplacedError(f"{self.path}: replaced by another save while {rel} was being opened")

    def _open_pinned(self, rel: str) -> int:
        """An open file of ``rel`` in the pinned directory (cached: opened once per read)."""
        with self._lock:
            fd = self._fds.get(rel)
            if fd is not None:
                return fd
            self._pin()
            path = self.resolve(rel)  # a symlink may not lead out of the checkpoint
            try:
                fd = open_for_read(path, rel)
            except CorruptCheckpointError:
                self._raise_if_replaced(rel)
                raise
            opened = os.fstat(fd)
            try:
                st = os.stat(rel, dir_fd=self._dir_fd)
                mine = (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)
            except OSError:
                mine = False
            if not mine:
                os.close(fd)
                self._raise_if_replaced(rel)
                raise CheckpointReplacedError(f"{self.path}: {rel} was replaced while being opened")
            self._fds[rel] = fd
            return fd

    def read_manifest_bytes(self) -> bytes:
        self._pin()
        self.manifest_path()  # what the path is, if not a checkpoint
        return ownership.read_from_start(self._open_pinned(MANIFEST_NAME), MAX_MANIFEST_BYTES)

    def open_read(self, rel: str) -> ReadHandle:
        return ReadHandle(self.path / rel, rel, fd=os.dup(self._open_pinned(rel)))

    def check_sizes(self, sizes: dict[str, int]) -> None:
        """As :meth:`CheckpointDir.check_sizes`, through the pinned directory, opening nothing (a
        rank keeps open only the files it reads)."""
        self._pin()
        for rel, expected in sizes.items():
            path = self.resolve(rel)
            try:
                st = os.stat(rel, dir_fd=self._dir_fd) if self._dir_fd >= 0 else path.stat()
            except FileNotFoundError:
                self._raise_if_replaced(rel)
                raise CorruptCheckpointError(f"{path}: data file {rel!r} listed in the manifest is missing") from None
            except OSError as e:
                raise storage_error(e, path, f"cannot open data file {rel!r}") from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{path}: data file {rel!r} is not a regular file")
            check_size(self.path, rel, st.st_size, expected)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1


class LocalStaging:
    """A save in progress: files go into a temporary directory until :meth:`commit`."""

    def __init__(self, final: Path, tmp: Path, overwrite: bool, declared_files: DeclaredFiles | None = None):
        self.final = final
        self.tmp = tmp
        self.overwrite = overwrite
        self.declared_files = declared_files  # a module-level function: the staging still pickles
        self.file_tag = ""  # the temporary directory is this save's own
        self._in_memory: bool | None = None  # whether tmp is on tmpfs: found at the first create
        self._spares: SparePages | None = None  # the root's spare pages, if any: found then too

    def _prove(self, parent_fd: int, name: str, final: Path) -> ownership.Proof:
        return prove_checkpoint_at(parent_fd, name, final, self.declared_files, "replace it")

    def create(self, rel: str) -> DirectWriteHandle:
        # Data files bypass the page cache (see storage/direct_io.py); the manifest does not. In
        # memory (tmpfs) there is no device to go around: O_DIRECT would only add a bounce copy.
        reuse = self._take_spare(rel, None)
        try:
            return DirectWriteHandle(self.tmp / rel, label=f"{self.final} (saving {rel})", direct=not self._in_memory,
                                     reuse=reuse)
        except OSError as e:
            raise storage_error(e, self.final, f"cannot create {rel}") from None

    def create_mapped(self, rel: str, size: int) -> MappedFile:
        """A new data file of ``size`` bytes mapped into memory, to be filled in place (a replica
        received from a peer); ``fsync`` it once filled."""
        reuse = self._take_spare(rel, size)
        return MappedFile(self.tmp / rel, f"{self.final} (saving {rel})", create=True, size=size, reuse=reuse)

    def _take_spare(self, rel: str, size: int | None) -> bool:
        """Whether the new data file ``rel`` took over a file of the root's spare pages (in memory only)."""
        if self._in_memory is None:
            self._in_memory = in_memory_fs(self.tmp)
            self._spares = SparePages.beside(self.tmp) if self._in_memory else None
        return self._spares is not None and self._spares.take(self.tmp / rel, size)

    def map_read(self, rel: str) -> MappedFile:
        """A file this save wrote, mapped read-only before the commit (a memory tier sends it to a peer)."""
        return CheckpointDir(self.tmp).map_read(rel)

    def adopt(self, rel: str, source: Path) -> None:
        """``source`` (a committed data file on the same filesystem, never modified in place) as
        the data file ``rel`` of this save: a hard link, else a durable copy."""
        dest = self.tmp / rel
        try:
            try:
                os.link(source, dest)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                shutil.copyfile(source, dest)
                fd = os.open(dest, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            raise storage_error(e, self.final, f"cannot take {rel} from {source}") from None

    def commit(self, manifest: bytes) -> None:
        """Write the manifest last, make everything durable, and publish atomically."""
        with storage_errors(self.final, "commit failed"):
            h = WriteHandle(self.tmp / MANIFEST_NAME, label=f"{self.final} (saving {MANIFEST_NAME})")
            try:
                h.write(memoryview(manifest))
                h.fsync()
            finally:
                h.close()
            fsync_dir(self.tmp / "data")
            fsync_dir(self.tmp)
            publish(self.tmp, self.final, self.overwrite, "saving", self._prove)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
