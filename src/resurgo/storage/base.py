"""The backend interface every storage implements, and checks shared by all backends.

A backend gives a checkpoint location (:class:`Checkpoint`: read the manifest, open data files
for positional reads, check their sizes, start a save), a save in progress (:class:`Staging`:
create data files, commit with the manifest last, abort) and a root of checkpoints (:class:`Root`:
list what is stored in each entry, open one, delete one crash-safely). The local filesystem
(:mod:`resurgo.storage.local`) and fsspec URLs (:mod:`resurgo.storage.fsspec_store`) implement
them; :mod:`resurgo.storage.open` picks one for a path or URL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from resurgo.errors import CorruptCheckpointError
from resurgo.storage.ownership import DATA, MANIFEST, DeclaredFiles

DATA_DIR = DATA  # a checkpoint's folder of data files
WRITERS_DIR = ".resurgo-writers"  # object stores: the tokens of the saves writing a checkpoint


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

    def sibling(self, name: str) -> "Checkpoint":
        """The checkpoint ``name`` of the same root (the same parent directory or URL prefix)."""
        ...

    def check_sizes(self, sizes: dict[str, int]) -> None: ...

    def stage(self, overwrite: bool, declared_files: DeclaredFiles | None = None) -> Staging: ...


@dataclass
class Listing:
    """What is stored in one checkpoint-like entry of a :class:`Root` (a directory or a URL
    prefix), from a listing: nothing is read."""

    name: str  # relative to the root, "/"-separated; "." for the root itself
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size (links not followed)
    newest: float = 0.0  # the latest modification time under it, seconds since the epoch (0: unknown)
    folders: frozenset[str] = frozenset()  # its folders, empty ones too (object stores have none)
    is_dir: bool = True  # False: a file or a link where a checkpoint (a directory) would be

    @property
    def has_manifest(self) -> bool:
        return MANIFEST in self.files

    @property
    def writers(self) -> list[str]:
        return sorted(r.split("/", 1)[1] for r in self.files if r.startswith(WRITERS_DIR + "/"))

    @property
    def has_data(self) -> bool:
        return DATA_DIR in self.folders or any(r.startswith(DATA_DIR + "/") for r in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


class Root(Protocol):
    """A place holding checkpoints: a directory, or a URL prefix of an object store.

    ``name`` is how manifests record it (an absolute path or the URL); ``path`` is as it was given.
    ``saves_in_place``: a save writes under the checkpoint's own name (object stores: no rename),
    so one that died leaves an incomplete entry there; else it writes into a temporary sibling.
    ``size_words`` says where listed sizes come from, in messages ("on disk", "stored")."""

    name: str
    storage_options: dict | None
    saves_in_place: bool
    size_words: str

    @property
    def path(self) -> Path | str: ...

    def require(self, expected: str) -> None:
        """CheckpointNotFoundError or NotACheckpointError when the root is not there (a directory);
        a URL prefix always is."""
        ...

    def location(self, name: str) -> Path | str:
        """The path or URL of the entry ``name`` ("." for the root itself)."""
        ...

    def listings(self, select: Callable[[str], bool] | None = None) -> list[Listing]:
        """Each entry directly below the root whose name ``select`` accepts (default: all)."""
        ...

    def listing(self, name: str) -> Listing | None:
        """The entry ``name`` ("." for the root itself), or None when nothing is stored there."""
        ...

    def walk(self) -> list[Listing]:
        """Every checkpoint-like entry at any depth: one with a manifest, data files or writer
        tokens, or a temporary directory; never one inside another."""
        ...

    def open(self, name: str) -> Checkpoint: ...

    def remove(self, name: str, declared_files: DeclaredFiles | None, *, dry_run: bool = False) -> bool:
        """Delete the entry ``name`` when everything in it is resurgo's (:mod:`resurgo.storage.ownership`;
        else ForeignFilesError, nothing deleted), so that a crash at any moment leaves nothing that
        reads as a committed checkpoint; False when nothing is there. ``dry_run``: only check."""
        ...


def check_size(where: object, rel: str, actual: int, expected: int) -> None:
    """A data file of another size than the manifest says is corrupt (truncated or altered)."""
    if actual != expected:
        claimed = str(expected) if len(str(expected)) <= 40 else str(expected)[:40] + "..."
        raise CorruptCheckpointError(
            f"{where}: data file {rel} has {actual} bytes, the manifest says {claimed} (truncated or altered)")
