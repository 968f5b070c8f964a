"""Outputs that appear only once complete: a file or a directory of files written under a
temporary sibling, then renamed onto its final name (conversions write through it). Replacing an
existing output goes through the same proofs and atomic swap as a checkpoint
(:mod:`resurgo.storage.local`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from resurgo.errors import CheckpointExistsError, ForeignFilesError, storage_error, storage_errors
from resurgo.format.manifest import TMP_MARKER
from resurgo.storage import ownership
from resurgo.storage.local import fsync_dir, open_child, prove_with, publish, through
from resurgo.storage.local_files import WriteHandle
from resurgo.storage.ownership import Owned


class AtomicOutput:
    """A file or a directory of files that appears at ``final`` only once complete (conversions).

    Everything is written under a temporary sibling (``.<name>.resurgo-tmp-<id>``: the same
    filesystem, so the final rename is atomic), fsynced, then renamed onto ``final``; replacing
    an existing output (``overwrite=True``) swaps it atomically like a checkpoint. A crash or an
    error leaves at worst the temporary sibling, never a half-written file under the final name.
    A directory is replaced only when every entry in it is one ``owned`` accepts (what this kind of
    output writes), a file only when ``owned_file`` recognises it as one this kind of output wrote
    (its producer mark); else ForeignFilesError, before anything is written, and again just before
    the swap.
    """

    def __init__(self, final: str | os.PathLike, *, directory: bool, overwrite: bool, owned: Owned | None = None,
                 owned_file: Callable[[Path], bool] | None = None):
        self.final = Path(final)
        self.directory = directory
        self.overwrite = overwrite
        self.owned: Owned = owned or (lambda rel, kind: False)
        self.owned_file = owned_file
        kind = "directory" if directory else "file"
        if self.final.exists() or self.final.is_symlink():
            if not overwrite:
                raise CheckpointExistsError(f"{self.final}: already exists; pass overwrite=True (--overwrite) to replace it")
            if self.final.is_dir() != directory or self.final.is_symlink():
                raise CheckpointExistsError(
                    f"{self.final}: exists and is not a {kind}; refusing to replace it with a {kind}")
            if directory:
                prove_with(self._prove, self.final)
            else:
                self._prove_file()
        parent = self.final.parent
        self.tmp = parent / f".{self.final.name}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
        try:
            parent.mkdir(parents=True, exist_ok=True)
            if directory:
                self.tmp.mkdir()
        except OSError as e:
            raise storage_error(e, self.final, f"cannot create a temporary {kind}") from None

    def _prove(self, parent_fd: int, name: str, final: Path) -> ownership.Proof:
        """Every entry of the directory ``name`` of ``parent_fd`` (``final``) is this output's (by
        name, and by content where ``owned_file`` is given, each file read through the descriptor
        of its folder), else ForeignFilesError; the proof, whose entries are the only ones the
        replacement deletes."""
        owned_file = self.owned_file
        check = None if owned_file is None else lambda dir_fd, entry: owned_file(through(dir_fd, entry))
        with storage_errors(final, "cannot list it"):
            proof = ownership.Proof(open_child(parent_fd, name, final, "replace it"), self.owned, check)
        try:
            ownership.refuse_foreign(final, proof.foreign(), "replace it")
        except BaseException:
            proof.close()
            raise
        return proof

    def _prove_file(self) -> None:
        if self.owned_file is None or not self.owned_file(self.final):
            raise ForeignFilesError(
                f"{self.final}: exists and is not a file resurgo wrote (it lacks the mark resurgo's conversions "
                f"leave in their output); refusing to replace it, nothing was changed. Remove it yourself, or "
                f"convert into another path")

    def path(self, rel: str | None = None) -> Path:
        """Where to write: the temporary file itself, or ``rel`` inside the temporary directory."""
        return self.tmp if rel is None else self.tmp / rel

    def create(self, rel: str | None = None) -> WriteHandle:
        label = f"{self.final} (writing {rel})" if rel else f"{self.final} (writing)"
        try:
            return WriteHandle(self.path(rel), label=label)
        except OSError as e:
            raise storage_error(e, label, "cannot create the file") from None

    def publish(self) -> None:
        """Make the files durable (each was fsynced by its writer), then rename onto ``final``."""
        with storage_errors(self.final, "publishing the output failed"):
            if self.directory:
                fsync_dir(self.tmp)
            elif self.final.is_file() and not self.final.is_symlink():
                self._prove_file()  # it may have been replaced since the start
            publish(self.tmp, self.final, self.overwrite, "converting", self._prove)

    def abort(self) -> None:
        if self.tmp.is_dir():
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            self.tmp.unlink(missing_ok=True)
