"""Restore: loading one candidate checkpoint into the caller's state, and telling a checkpoint that
cannot be read (an older one is tried) from an error the caller must fix (raised at once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resurgo.api import DEFAULT_IO_THREADS, load
from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    NotACheckpointError,
    ResurgoError,
    StorageError,
)
from resurgo.pipeline.load import restore as restore_into
from resurgo.pipeline.peer_read import PeerFiles

# A checkpoint that cannot be read: restore tries an older one. Any other error (the caller's
# state has other keys, dtypes or shapes) is the caller's to fix and is raised at once.
UNREADABLE = (NotACheckpointError, ManifestError, CorruptCheckpointError, CheckpointNotFoundError, StorageError)
OK, UNREADABLE_HERE, FATAL = 0, 1, 2


def try_load(state: Any, path: Path | str, step: int, strict: bool, storage_options: dict | None,
             peers: PeerFiles | None = None) -> tuple[int, ResurgoError | None]:
    try:
        if peers is None:
            report = load(state, path, strict=strict, verify=True, storage_options=storage_options)
        else:  # the files this rank's node lacks are read from peers' memory
            _, report = restore_into(state, path, strict=strict, verify=True, allow_pickle=False,
                                     io_threads=DEFAULT_IO_THREADS, peers=peers)
    except UNREADABLE as e:
        return UNREADABLE_HERE, e
    except ResurgoError as e:
        return FATAL, e
    if report.step != step:
        return UNREADABLE_HERE, CorruptCheckpointError(
            f"{path}: its manifest says step {report.step}, its name says step {step}")
    return OK, None
