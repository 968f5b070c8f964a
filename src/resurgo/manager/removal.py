"""Deleting checkpoints so that a crash at any moment leaves nothing that reads as valid, and
nothing resurgo did not write is ever deleted.

Before anything changes, the directory is checked to hold only what resurgo writes
(:mod:`resurgo.storage.ownership`: a verifying manifest and the data files it lists; for an
incomplete checkpoint or a temporary directory, only data files named as resurgo names them);
otherwise ForeignFilesError names a file that is not, and nothing is touched. A checkpoint is
then renamed to a temporary name (``.step_N.resurgo-tmp-trash-*``): the rename is atomic, so it
stops being a checkpoint at once, and every reader and the catalog treat the new name as
temporary. The parent directory is fsynced, and only then are the files removed, one by one (a
file that appeared meanwhile stays, and is reported). A crash before the rename leaves the
checkpoint whole; a crash after it leaves a temporary directory that the next manager start or
``resurgo gc`` removes. Never a half-deleted checkpoint under its name.
"""

from __future__ import annotations

from pathlib import Path

from resurgo.errors import ForeignFilesError, StorageError
from resurgo.format.manifest import declared_files
from resurgo.manager.catalog import trash_name
from resurgo.storage.local import _fsync_dir, is_temporary, prove_checkpoint_dir, remove_checkpoint_dir
from resurgo.storage.ownership import Owned


def _prove(path: Path) -> Owned | None:
    """What of ``path`` is resurgo's (ForeignFilesError unless all of it); None when it is gone."""
    if not (path.exists() or path.is_symlink()):
        return None
    if path.is_symlink() or not path.is_dir():
        raise ForeignFilesError(f"{path}: is not a directory resurgo wrote (a link or a file); refusing to delete it")
    try:
        return prove_checkpoint_dir(path, declared_files, "delete it")
    except StorageError as e:
        if not path.exists():
            return None  # removed at the same time by someone else (another gc)
        raise e


def remove_checkpoint(path: Path, *, dry_run: bool = False) -> bool:
    """Delete the checkpoint (or incomplete checkpoint, or temporary directory) at ``path``; False
    when it was already gone. ``dry_run``: only check that it may be deleted."""
    if is_temporary(path):
        return remove_temporary(path, dry_run=dry_run)
    owned = _prove(path)
    if owned is None:
        return False
    if dry_run:
        return True
    trash = path.parent / trash_name(path.name)
    try:
        path.rename(trash)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise StorageError(e.errno, f"{path}: cannot rename it away for deletion: {e.strerror}") from None
    try:
        _fsync_dir(path.parent)  # the rename is durable before any file goes
    except OSError as e:
        raise StorageError(e.errno, f"{path.parent}: fsync failed after renaming {path.name} away: {e.strerror}") from None
    remove_checkpoint_dir(trash, owned)
    return True


def remove_temporary(path: Path, *, dry_run: bool = False) -> bool:
    """Delete a temporary directory (an interrupted save, a checkpoint being deleted)."""
    owned = _prove(path)
    if owned is None:
        return False
    if not dry_run:
        remove_checkpoint_dir(path, owned)
    return True
