"""Reading one version of a checkpoint that a save may replace meanwhile.

A load or a verification reads the manifest, then data files. An overwrite that commits in
between (``overwrite=True``, every few tens of milliseconds in a training loop that an evaluator
follows) would otherwise pair the manifest of one version with data of the next, which reads as
corruption. On a filesystem the read pins one directory (:class:`resurgo.storage.local.PinnedCheckpointDir`)
and a replacement raises CheckpointReplacedError; on any backend, a read that fails while the
manifest at the path has changed since it was read was a replacement too. Either way the read
starts again from the new manifest, at most :data:`ATTEMPTS` times; a failure with the manifest
unchanged is real and raised as it is.
"""

from __future__ import annotations

import os

from resurgo.errors import CheckpointReplacedError, ResurgoError
from resurgo.storage.open import open_checkpoint

ATTEMPTS = 5


def manifest_changed(path: str | os.PathLike, storage_options: dict | None, seen: bytes | None) -> bool:
    """Whether the manifest at ``path`` now differs from ``seen`` (the bytes a failed read used)."""
    if seen is None:
        return False
    ckpt = open_checkpoint(path, storage_options)
    try:
        return ckpt.read_manifest_bytes() != seen
    except ResurgoError:
        return False  # gone or unreadable now: the original error says more
    finally:
        ckpt.close()


def replaced_too_often(path: str | os.PathLike) -> CheckpointReplacedError:
    return CheckpointReplacedError(
        f"{path}: replaced by another save {ATTEMPTS} times while being read, so no complete version could be "
        "read; read it when saves are less frequent, or load a checkpoint that is not being overwritten "
        "(a CheckpointManager's step directories)")
