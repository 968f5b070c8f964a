"""Which files of a foreign source an import may read.

Every path an importer takes from a source (a DCP storage entry, an index's shard, a DeepSpeed
tag) or a spec names is resolved here, symlinks followed, and must stay inside the source
directory: a path whose real location lies elsewhere, or that is not a regular file, raises
ImportSpecError naming the source, the entry and where it leads. The directory the caller names
is trusted as given (it is resolved first); only what it holds is not.

A path is checked, then opened: :func:`open_inside` opens the very file checked (not a link, and
the kernel names it by the checked path), so a folder or file swapped for a link to elsewhere in
between is a StorageError, never a read outside.

One exception is structural, not a flag: a Hugging Face cache snapshot
(``<cache>/models--<org>--<name>/snapshots/<revision>/``) holds its files as symlinks into its
repository's blob store (``../../blobs/<hash>``), so for a source directory of that shape the
repository's ``blobs/`` folder is inside too, and nothing else of the cache is.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path, PurePosixPath

from resurgo.errors import CheckpointNotFoundError, ImportSpecError, StorageError, storage_error

# The cache folders huggingface_hub creates per repository: models--, datasets--, spaces--.
_HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def check_relative(rel: object, what: str) -> str:
    """``rel`` if it is a relative path without '..'; ImportSpecError naming ``what`` otherwise
    (a check of the text only: :func:`resolve_inside` also follows symlinks)."""
    if not isinstance(rel, str):
        raise ImportSpecError(f"{what}: found a {type(rel).__name__}, expected a relative path (a str)")
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or "\0" in rel:
        raise ImportSpecError(f"{what}: {rel[:200]!r} must be a relative path inside the source directory "
                              "(no leading '/', no '..')")
    return rel


def real_root(root: str | os.PathLike) -> Path:
    """The source directory as the caller named it, symlinks resolved."""
    try:
        return Path(os.path.realpath(root))
    except OSError as e:  # a component swapped while it was resolved
        raise storage_error(e, root, "could not be resolved") from None


def allowed_areas(root: Path) -> tuple[Path, ...]:
    """The folders whose files a source at ``root`` (resolved) may read: itself and, for a Hugging
    Face cache snapshot, its repository's ``blobs/``."""
    snapshots, repo = root.parent, root.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith(_HF_REPO_PREFIXES) and (repo / "blobs").is_dir():
        return (root, repo / "blobs")
    return (root,)


def _within(path: str, area: Path) -> bool:
    a = str(area)
    return path == a or path.startswith(a.rstrip(os.sep) + os.sep)


def resolve_inside(root: str | os.PathLike, rel: object, what: str) -> Path:
    """The real path of the regular file ``rel`` under the source directory ``root``.

    ImportSpecError naming ``what`` when ``rel`` is not a relative path, when it (or a symlink on
    its way) leads outside the allowed areas (:func:`allowed_areas`), or when it is not a regular
    file; CheckpointNotFoundError when it does not exist."""
    rel = check_relative(rel, what)
    base = real_root(root)
    try:
        full = os.path.realpath(os.path.join(base, rel))
    except OSError as e:  # a symlink swapped for a file while it was followed (EINVAL from readlink)
        raise storage_error(e, base / rel, f"{what}: could not be resolved",
                            "was the source changed during the import?") from None
    areas = allowed_areas(base)
    if not any(_within(full, a) for a in areas):
        allowed = " or ".join(str(a) for a in areas)
        raise ImportSpecError(f"{base}: {what}: {rel[:200]!r} leads to {full}, outside the source directory "
                              f"({allowed}); symlinks out of a source are not followed")
    try:
        mode = os.stat(full).st_mode
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{base / rel}: {what}: not found") from None
    except OSError as e:
        raise storage_error(e, base / rel, what) from None
    if not stat.S_ISREG(mode):
        raise ImportSpecError(f"{base / rel}: {what}: not a regular file")
    return Path(full)


def open_inside(path: Path) -> int:
    """A read-only descriptor of the file ``path`` that :func:`resolve_inside` returned, checked to
    be that file still: opened without following a link, a regular file, and (where ``/proc``
    says) at that very path. StorageError when the source changed between the check and the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: not found (was the source changed during the import?)") from None
    except OSError as e:  # ELOOP: the file became a link after it was checked
        raise storage_error(e, path, "could not be opened as the file checked",
                            "was the source changed during the import?") from None
    try:
        now = _opened_path(fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or (now is not None and now != str(path)):
            raise StorageError(f"{path}: opened as {now or 'something else'}, not the file checked inside the source; "
                               "was the source changed during the import?")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file_inside(path: Path) -> io.BufferedReader:
    """:func:`open_inside` as a binary file object."""
    return os.fdopen(open_inside(path), "rb")


def _opened_path(fd: int) -> str | None:
    """Where the kernel says the open file ``fd`` is (Linux), None where it cannot say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
