"""Deleting checkpoints so that a crash at any moment leaves nothing that reads as valid.

A checkpoint is first renamed to a temporary name (``.step_N.resurgo-tmp-trash-*``): the rename is
atomic, so it stops being a checkpoint at once, and every reader and the catalog treat the new
name as temporary. The parent directory is fsynced, and only then are the files removed. A crash
before the rename leaves the checkpoint whole; a crash after it leaves a temporary directory that
the next manager start or ``resurgo gc`` removes. Never a half-deleted checkpoint under its name.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from resurgo.errors import StorageError
from resurgo.manager.catalog import trash_name
from resurgo.storage.local import _fsync_dir, is_temporary


def remove_checkpoint(path: Path) -> bool:
    """Delete the checkpoint (or incomplete checkpoint) at ``path``; False when it was already gone."""
    if is_temporary(path):
        return remove_temporary(path)
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
    remove_temporary(trash)
    return True


def remove_temporary(path: Path) -> bool:
    """Delete a temporary directory (an interrupted save, a checkpoint being deleted)."""
    if not path.exists():
        return False
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass  # removed at the same time by someone else (another gc)
    except OSError as e:
        raise StorageError(e.errno, f"{path}: could not be deleted: {e.filename}: {e.strerror}") from None
    return True
