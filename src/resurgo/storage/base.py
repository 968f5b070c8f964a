"""The backend interface every storage implements, and checks shared by all backends.

A backend gives a checkpoint location (:class:`Checkpoint`: read the manifest, open data files
for positional reads, check their sizes, start a save) and a save in progress (:class:`Staging`:
create data files, commit with the manifest last, abort). The local filesystem
(:mod:`resurgo.storage.local`) and fsspec URLs (:mod:`resurgo.storage.fsspec_store`) implement
it; :func:`resurgo.storage.open.open_checkpoint` picks one for a path or URL.
"""

from __future__ import annotations

from typing import Protocol

from resurgo.errors import CorruptCheckpointError
from resurgo.storage.ownership import DeclaredFiles


class ReadHandle(Protocol):
    """A data file opened for positional reads; safe to use from several threads at once."""

    rel: str
    size: int

    def read_into(self, offset: int, buf: memoryview) -> None: ...

    def read_into_many(self, offset: int, bufs: list[memoryview]) -> None: ...

    def read_at(self, offset: int, n: int) -> bytes: ...

    def close(self) -> None: ...


class WriteHandle(Protocol):
    """A new data file being written; ``fsync`` makes every byte written so far durable."""

    bytes_written: int

    def write(self, data: memoryview) -> None: ...

    def fsync(self) -> None: ...

    def close(self) -> None: ...


class Staging(Protocol):
    """A save in progress. Picklable: rank 0 starts it and the other ranks attach to the same one.

    ``file_tag`` prefixes the names of this save's data files (empty on a filesystem, where the
    save writes into its own temporary directory; unique per save on object stores)."""

    file_tag: str

    def create(self, rel: str) -> WriteHandle: ...

    def commit(self, manifest: bytes) -> None: ...

    def abort(self) -> None: ...


class Checkpoint(Protocol):
    """A checkpoint location: a directory or a URL prefix.

    ``coalesce_reads`` is ``(max_gap, max_bytes)``: readers merge reads of one file less than
    ``max_gap`` bytes apart into requests of at most ``max_bytes`` (``(0, 0)``: never, where a
    request costs no round trip)."""

    coalesce_reads: tuple[int, int]

    @property
    def path(self) -> object: ...

    def describe(self, rel: str) -> str: ...

    def read_manifest_bytes(self) -> bytes: ...

    def pinned(self) -> "Checkpoint":
        """This location read as one version where the backend can (a filesystem directory held
        open), else itself; ``close()`` releases it."""
        ...

    def close(self) -> None: ...

    def open_read(self, rel: str) -> ReadHandle: ...

    def check_sizes(self, sizes: dict[str, int]) -> None: ...

    def stage(self, overwrite: bool, declared_files: DeclaredFiles | None = None) -> Staging: ...


def check_size(where: object, rel: str, actual: int, expected: int) -> None:
    """A data file of another size than the manifest says is corrupt (truncated or altered)."""
    if actual != expected:
        claimed = str(expected) if len(str(expected)) <= 40 else str(expected)[:40] + "..."
        raise CorruptCheckpointError(
            f"{where}: data file {rel} has {actual} bytes, the manifest says {claimed} (truncated or altered)")
