"""A framework's retention of old checkpoints (the Trainer's ``save_total_limit``, Accelerate's
``total_limit``) applied by resurgo: only after the new checkpoint is committed, crash-safely,
and deleting only what resurgo wrote or the framework wrote before resurgo was added."""

from __future__ import annotations

import shutil
from pathlib import Path

from resurgo.format.manifest import MANIFEST_NAME
from resurgo.manager.catalog import remove
from resurgo.storage.open import open_root


def is_resurgo_checkpoint(path: str | Path) -> bool:
    return Path(path, MANIFEST_NAME).is_file()


def prune(checkpoints: list[Path], keep: int, protected: set[Path], framework_marker: str) -> None:
    """Delete the first of ``checkpoints`` (oldest first) until ``keep`` are left, never one in
    ``protected``. A folder holding ``framework_marker`` and no manifest was written by the
    framework itself before resurgo: it is deleted as the framework's own retention deletes it.
    Any other goes through resurgo (crash-safe; ForeignFilesError, nothing deleted, if resurgo did
    not write every file in it)."""
    remaining = len(checkpoints)
    for checkpoint in checkpoints:
        if remaining <= keep:
            break
        if checkpoint in protected:
            continue
        if Path(checkpoint, framework_marker).is_file() and not is_resurgo_checkpoint(checkpoint):
            shutil.rmtree(checkpoint)
        else:
            remove(open_root(checkpoint.parent), checkpoint.name)
        remaining -= 1
