"""Checkpoints on object stores and other fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...).

Commit protocol (no rename on object stores; docs/format.md section 3.2):

1. The save writes a *writer token* ``<url>/.resurgo-writers/<save id>`` (a conditional put that
   fails if it exists), then lists the tokens: if another save's token is there, two jobs are
   saving to the same checkpoint and this one is refused (CheckpointExistsError).
2. Every rank uploads its data objects, named ``data/<save id>-rank<R>-<I>.safetensors`` (unique
   per save, so an overwrite never touches the objects of the checkpoint it replaces). Large
   objects go up to S3 as multipart uploads whose parts are sent in parallel (:mod:`resurgo.storage.s3`).
3. Once every data object is complete, rank 0 lists the tokens again (refusing if another
   appeared), then puts ``manifest.json``: the commit point. A new checkpoint's manifest is put
   with ``If-None-Match: *`` so that a manifest written meanwhile by anyone is never replaced;
   an overwrite replaces the old manifest in one put (atomic on S3).
4. The token is deleted; on an overwrite, the old checkpoint's data objects are deleted.

An overwrite replaces a checkpoint only when every object under the prefix is resurgo's
(:mod:`resurgo.storage.ownership`: a manifest that verifies, the data objects it lists, data
objects and writer tokens of resurgo's saves); this is checked when the save starts and again
before the manifest is put, and only data objects the old manifest lists are deleted.

A save that dies leaves data objects and a token without a manifest: an incomplete checkpoint,
which readers refuse and ``gc`` removes. Transient errors are retried with backoff
(:mod:`resurgo.storage.retry`); permanent ones raise a ResurgoError naming the URL.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.asyn import sync

from resurgo.errors import (
    CheckpointExistsError,
    ResurgoError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    NotACheckpointError,
    StorageError,
)
from resurgo.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from resurgo.storage import ownership, s3
from resurgo.storage.base import DATA_DIR, WRITERS_DIR, Listing, check_size
from resurgo.storage.ownership import DeclaredFiles
from resurgo.storage.retry import as_resurgo_error, is_precondition_failure, with_retries
from resurgo.storage.s3 import S3MultipartWriteHandle, is_s3

RANGE_SPLIT_BYTES = 16 << 20  # a larger ranged read is split into parallel requests of this size


def split_url(url: str, storage_options: dict | None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it (no trailing slash)."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError, TypeError) as e:
        raise StorageError(errno.EINVAL, f"{url}: cannot open this URL: {e}") from None
    return fs, path.rstrip("/")


def _check_rel(url: str, rel: str) -> None:
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpointError(f"{url}: path {rel[:200]!r} leaves the checkpoint")


class ObjectReadHandle:
    """An object opened for ranged reads (each read is one or several parallel GET requests).

    On S3 the response bodies are streamed straight into the caller's buffers (no intermediate
    ``bytes`` per response, no second copy); other fsspec backends return ``bytes`` to copy from."""

    def __init__(self, fs: Any, full: str, rel: str, url: str, size: int | None = None):
        self.fs, self.full, self.rel, self.url = fs, full, rel, url
        if size is None:
            try:
                size = int(with_retries(lambda: fs.info(full)["size"], url, f"reading the size of {rel}"))
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{url}: data file {rel!r} listed in the manifest is missing") from None
        self.size = size

    def _fetch_pieces(self, start: int, stop: int) -> list[bytes]:
        """The bytes ``[start, stop)``: one request, or parallel ranged requests when large."""
        doing = f"reading {self.rel} bytes {start}..{stop}"
        if stop - start > RANGE_SPLIT_BYTES and getattr(self.fs, "async_impl", False):
            bounds = [(s, min(stop, s + RANGE_SPLIT_BYTES)) for s in range(start, stop, RANGE_SPLIT_BYTES)]

            async def gather() -> list[bytes]:
                return list(await asyncio.gather(*(self.fs._cat_file(self.full, start=a, end=b) for a, b in bounds)))

            return with_retries(lambda: sync(self.fs.loop, gather), self.url, doing)
        return [with_retries(lambda: self.fs.cat_file(self.full, start=start, end=stop), self.url, doing)]

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_into_many(offset, [buf])

    def read_into_many(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` in order from the contiguous range starting at ``offset``."""
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        total = sum(len(v) for v in views)
        if not total:
            return
        if offset + total > self.size:
            raise CorruptCheckpointError(
                f"{self.url}: data file {self.rel!r} ends at byte {self.size}, before the data the manifest lists")
        if is_s3(self.fs):
            s3.get_into(self.fs, self.full, self.rel, self.url, offset, views, RANGE_SPLIT_BYTES)
            return
        pieces = self._fetch_pieces(offset, offset + total)
        got = sum(len(p) for p in pieces)
        if got != total:
            raise CorruptCheckpointError(
                f"{self.url}: data file {self.rel!r}: got {got} bytes at {offset}, expected {total}")
        # Copy each response straight into the destinations (no joined copy of the whole range).
        vi = vpos = 0
        for piece in pieces:
            src = memoryview(piece)
            while len(src):
                n = min(len(src), len(views[vi]) - vpos)
                views[vi][vpos : vpos + n] = src[:n]
                src, vpos = src[n:], vpos + n
                if vpos == len(views[vi]):
                    vi, vpos = vi + 1, 0

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the object)."""
        stop = min(self.size, offset + n)
        return b"".join(self._fetch_pieces(offset, stop)) if stop > offset else b""

    def close(self) -> None:
        pass


class ObjectWriteHandle:
    """A new object written through fsspec's buffered file; ``fsync`` completes the upload."""

    def __init__(self, fs: Any, full: str, label: str):
        self.label = label
        self.bytes_written = 0
        self._done = False
        self._file = with_retries(lambda: fs.open(full, "wb"), label, "creating the object")

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            self._file.write(view)
        except Exception as e:  # noqa: BLE001
            raise as_resurgo_error(e, self.label, f"writing after {self.bytes_written} bytes") from e
        self.bytes_written += len(view)

    def fsync(self) -> None:
        try:
            self._file.close()
        except Exception as e:  # noqa: BLE001
            raise as_resurgo_error(e, self.label, "completing the upload") from e
        self._done = True

    def close(self) -> None:
        if not self._done:
            discard = getattr(self._file, "discard", None)
            if callable(discard):
                discard()


def _open_for_write(fs: Any, full: str, label: str) -> "ObjectWriteHandle | S3MultipartWriteHandle":
    return S3MultipartWriteHandle(fs, full, label) if is_s3(fs) else ObjectWriteHandle(fs, full, label)


def _mtime(info: dict) -> float:
    value: Any = info.get("LastModified", info.get("mtime", info.get("created")))
    if value is not None and hasattr(value, "timestamp"):
        return float(value.timestamp())
    return float(value) if isinstance(value, (int, float)) else 0.0


def list_prefix(fs: Any, root: str, url: str) -> dict[str, dict]:
    """Every object under ``root`` (recursively) by its path relative to ``root``."""
    def find() -> dict:
        fs.invalidate_cache(root)  # other processes write here too: list what is there now
        try:
            return fs.find(root, detail=True)
        except FileNotFoundError as e:
            if "bucket" in str(e).lower():
                raise
            return {}

    found = with_retries(find, url, "listing")
    return {name[len(root) + 1:]: info for name, info in found.items() if name.startswith(root + "/")}


def listing_of(objects: dict[str, dict], name: str = ".") -> Listing:
    out = Listing(name)
    for rel, info in objects.items():
        out.files[rel] = int(info.get("size") or 0)
        out.newest = max(out.newest, _mtime(info))
    return out


class _AtUrl:
    """A place named by a URL: the URL without its trailing slash, the storage options given for
    it, and the filesystem and path fsspec resolves it to (``root``)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        # always a dict; typed as Root declares it, for which a local root has none
        self.storage_options: dict | None = dict(storage_options or {})
        self.fs, self.root = split_url(self.url, self.storage_options)

    @property
    def path(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url


class ObjectCheckpoint(_AtUrl):
    """A checkpoint under a URL prefix: ``<url>/manifest.json`` and ``<url>/data/*``."""

    # Readers group reads of one object less than 1 MiB apart into ranged requests of up to
    # 64 MiB (each fetched as parallel 16 MiB ranges): a request costs a round trip.
    coalesce_reads = (1 << 20, 64 << 20)

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url, storage_options)
        self._sizes: dict[str, int] = {}  # from the listing check_sizes made: no HEAD per open

    def describe(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def full(self, rel: str) -> str:
        _check_rel(self.url, rel)
        return f"{self.root}/{rel}"

    def listing(self) -> Listing:
        return listing_of(list_prefix(self.fs, self.root, self.url))

    def pinned(self) -> "ObjectCheckpoint":
        """Itself: an object store cannot pin a version; a read that fails is retried when the
        manifest changed meanwhile (:mod:`resurgo.pipeline.consistent`)."""
        return self

    def close(self) -> None:
        pass

    # -- reading ------------------------------------------------------------------------------
    def read_manifest_bytes(self) -> bytes:
        full = self.full(MANIFEST_NAME)
        try:
            raw = with_retries(lambda: self.fs.cat_file(full, start=0, end=MAX_MANIFEST_BYTES + 1), self.url,
                               f"reading {MANIFEST_NAME}")
        except FileNotFoundError as e:
            if "bucket" in str(e).lower():
                raise
            found = self.listing()
            if found.has_data or found.writers:
                raise IncompleteCheckpointError(
                    f"{self.url}: has data objects but no {MANIFEST_NAME}: the save never committed "
                    f"(or is still running)") from None
            if found.files:
                raise NotACheckpointError(f"{self.url}: not a resurgo checkpoint (no {MANIFEST_NAME})") from None
            raise as_resurgo_error(FileNotFoundError("no such checkpoint"), self.url, f"reading {MANIFEST_NAME}") from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{self.describe(MANIFEST_NAME)}: more than the {MAX_MANIFEST_BYTES} bytes a manifest may have")
        return bytes(raw)

    def open_read(self, rel: str, size: int | None = None) -> ObjectReadHandle:
        return ObjectReadHandle(self.fs, self.full(rel), rel, self.url, size if size is not None else self._sizes.get(rel))

    def sibling(self, name: str) -> "ObjectCheckpoint":
        """The checkpoint ``name`` under the same prefix as this one."""
        return ObjectCheckpoint(f"{self.url.rsplit('/', 1)[0]}/{name}", self.storage_options)

    def check_sizes(self, sizes: dict[str, int]) -> None:
        """Every data object exists with the size the manifest says (one listing, no reads)."""
        found = self.listing().files
        for rel, expected in sizes.items():
            _check_rel(self.url, rel)
            if rel not in found:
                raise CorruptCheckpointError(f"{self.url}: data file {rel!r} listed in the manifest is missing")
            check_size(self.url, rel, found[rel], expected)
            self._sizes[rel] = found[rel]

    # -- writing ------------------------------------------------------------------------------
    def stage(self, overwrite: bool, declared_files: DeclaredFiles | None = None) -> "ObjectStaging":
        """Start a save at this prefix. ``overwrite``: replace the checkpoint there, if every object
        under the prefix is resurgo's (``declared_files`` reads the data files its manifest lists)."""
        staging = ObjectStaging(self.url, self.storage_options, uuid.uuid4().hex[:12], overwrite, declared_files)
        staging.begin()
        return staging

    def prove(self, found: Listing, declared_files: DeclaredFiles | None, doing: str) -> ownership.Claim:
        """Which objects of the prefix (listed in ``found``) are resurgo's, when all are; else
        ForeignFilesError naming one that is not."""
        raw = self.read_manifest_bytes() if found.has_manifest else None
        claim = ownership.Claim(raw, declared_files, self.url, leftovers=True)
        entries = [(rel, ownership.FILE) for rel in found.files]
        ownership.refuse_foreign(self.url, ownership.foreign(entries, claim), doing, claim.why)
        return claim


class ObjectStaging:
    """A save in progress at a URL. Pickles as its URL, options and save id (for other ranks)."""

    def __init__(self, url: str, storage_options: dict | None, save_id: str, overwrite: bool,
                 declared_files: DeclaredFiles | None = None):
        self.url = url
        self.storage_options = storage_options
        self.save_id = save_id
        self.overwrite = overwrite
        self.declared_files = declared_files  # a module-level function: the staging still pickles
        self.file_tag = f"{save_id}-"
        self._ckpt: ObjectCheckpoint | None = None
        self._created: list[str] = []  # by this process (a copy keeps the source's names)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_ckpt"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._ckpt = None

    @property
    def ckpt(self) -> ObjectCheckpoint:
        if self._ckpt is None:
            self._ckpt = ObjectCheckpoint(self.url, self.storage_options)
        return self._ckpt

    @property
    def token(self) -> str:
        return f"{WRITERS_DIR}/{self.save_id}"

    def _refuse_other_writers(self, found: Listing, when: str) -> None:
        others = [w for w in found.writers if w != self.save_id]
        if others:
            raise CheckpointExistsError(
                f"{self.url}: another save is writing this checkpoint (writer token {WRITERS_DIR}/{others[0]}); "
                f"{when}. Two jobs must not save to the same path. If no other job is running, the token is "
                f"left by a save that died: remove the incomplete checkpoint (`resurgo gc`) and save again.")

    def begin(self) -> None:
        """Claim the path: refuse an existing checkpoint (unless overwriting) or another writer."""
        ck = self.ckpt
        found = ck.listing()
        if found.has_manifest and not self.overwrite:
            raise CheckpointExistsError(f"{self.url}: already exists; pass overwrite=True to replace it")
        self._refuse_other_writers(found, "refusing to start a second one")
        if self.overwrite and found.files:
            ck.prove(found, self.declared_files, "replace it")
        body = json.dumps({"save_id": self.save_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "started_at": time.time()}).encode()
        full = ck.full(self.token)
        with_retries(lambda: ck.fs.pipe_file(full, body, mode="create"), self.url, "writing the writer token")
        self._refuse_other_writers_then_release(ck.listing(), "refusing to start a second one")

    def _refuse_other_writers_then_release(self, found: Listing, when: str) -> None:
        try:
            self._refuse_other_writers(found, when)
        except CheckpointExistsError:
            self.abort()
            raise

    def create(self, rel: str) -> "ObjectWriteHandle | S3MultipartWriteHandle":
        self._created.append(rel)
        return _open_for_write(self.ckpt.fs, self.ckpt.full(rel), f"{self.url}/{rel}")

    def commit(self, manifest: bytes) -> None:
        """Put the manifest (the commit point) once every data object is complete."""
        ck = self.ckpt
        found = ck.listing()
        self._refuse_other_writers_then_release(found, "not committing this one")
        if self.save_id not in found.writers:
            self.abort()
            raise StorageError(errno.EBUSY, f"{self.url}: this save's writer token {self.token} was removed while "
                                            "it ran (by `resurgo gc` or another job); not committing")
        old_files: frozenset[str] = frozenset()
        if found.has_manifest:
            if not self.overwrite:
                self.abort()
                raise CheckpointExistsError(f"{self.url}: appeared while saving; refusing to replace it")
            try:
                declared = ck.prove(found, self.declared_files, "replace it").declared
                old_files = frozenset(f for f in found.files if f in declared)  # what is stored, not all it names
            except ResurgoError:
                self.abort()
                raise
        full = ck.full(MANIFEST_NAME)
        try:
            with_retries(lambda: ck.fs.pipe_file(full, manifest, mode="overwrite" if self.overwrite else "create"),
                         self.url, f"putting {MANIFEST_NAME}")
        except Exception as e:
            if is_precondition_failure(e) or is_precondition_failure(e.__cause__ or e):
                self.abort()
                raise CheckpointExistsError(f"{self.url}: appeared while saving; refusing to replace it") from None
            raise
        self._delete([self.token] + self._stale(old_files, manifest))

    def _stale(self, old_files: frozenset[str], manifest: bytes) -> list[str]:
        """The old checkpoint's data files that this save's manifest does not list (to delete)."""
        if not old_files or self.declared_files is None:
            return []
        try:
            new_files = self.declared_files(manifest, f"{self.url}/{MANIFEST_NAME}")
        except ResurgoError:  # not for a manifest resurgo built; then delete nothing, gc may
            return []
        return sorted(f for f in old_files if f not in new_files)

    def _delete(self, rels: list[str]) -> None:
        """Best effort: what is left is harmless (unlisted objects, a stale token) and gc removes it."""
        ck = self.ckpt
        paths = [ck.full(r) for r in rels]
        if not paths:
            return
        try:
            ck.fs.rm(paths)
        except Exception:  # noqa: BLE001
            pass

    def abort(self) -> None:
        """Delete this save's data objects and its token (best effort)."""
        try:
            mine = [r for r in self.ckpt.listing().files if r.startswith(f"{DATA_DIR}/{self.file_tag}")]
        except Exception:  # noqa: BLE001
            mine = []
        self._delete(sorted(set(mine + self._created)) + [self.token])


def remove_prefix(fs: Any, root: str, url: str, rels: list[str]) -> None:
    """Delete the objects ``rels`` under ``root``: the manifest first, so that a deletion cut short
    leaves an incomplete checkpoint, never a committed one with objects missing."""
    first = [r for r in rels if r == MANIFEST_NAME]
    rest = [r for r in rels if r != MANIFEST_NAME]
    for group in (first, rest):
        if group:
            paths = [f"{root}/{r}" for r in group]
            with_retries(lambda: fs.rm(paths), url, "deleting")


class ObjectRoot(_AtUrl):
    """A root of checkpoints under a URL prefix: each checkpoint is a prefix below it, with its
    ``manifest.json``; a prefix with data objects or a writer token but no manifest is an
    incomplete save (one that died, or one still running). Listed in one request.

    Deletion removes only what resurgo can prove it wrote, the manifest first, so a deletion cut
    short leaves an incomplete checkpoint, never a committed one with objects missing."""

    saves_in_place = True  # no rename: a save writes under the checkpoint's own prefix
    size_words = "stored"

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url, storage_options)
        self.name = self.url

    def require(self, expected: str) -> None:
        pass  # a prefix exists as soon as an object is put below it

    def location(self, name: str) -> str:
        return self.url if name == "." else f"{self.url}/{name}"

    def open(self, name: str) -> ObjectCheckpoint:
        return ObjectCheckpoint(self.location(name), self.storage_options)

    def _objects(self, name: str) -> dict[str, dict]:
        prefix = self.root if name == "." else f"{self.root}/{name}"
        return list_prefix(self.fs, prefix, self.location(name))

    def listings(self, select: Callable[[str], bool] | None = None) -> list[Listing]:
        groups: dict[str, dict[str, dict]] = {}
        for rel, info in self._objects(".").items():
            name, _, inner = rel.partition("/")
            if inner and (select is None or select(name)):
                groups.setdefault(name, {})[inner] = info
        return [listing_of(objects, name) for name, objects in sorted(groups.items())]

    def listing(self, name: str) -> Listing | None:
        objects = self._objects(name)
        return listing_of(objects, name) if objects else None

    def walk(self) -> list[Listing]:
        groups: dict[str, dict[str, dict]] = {}
        for rel, info in self._objects(".").items():
            parts = rel.split("/")
            for i, part in enumerate(parts):
                if part in (DATA_DIR, WRITERS_DIR) and i < len(parts) - 1 or (part == MANIFEST_NAME and i == len(parts) - 1):
                    groups.setdefault("/".join(parts[:i]), {})["/".join(parts[i:])] = info
                    break
        return [listing_of(objects, prefix or ".") for prefix, objects in sorted(groups.items())]

    def remove(self, name: str, declared_files: DeclaredFiles | None, *, dry_run: bool = False) -> bool:
        objects = self._objects(name)
        if not objects:
            return False
        self.open(name).prove(listing_of(objects, name), declared_files, "delete it")
        if not dry_run:
            prefix = self.root if name == "." else f"{self.root}/{name}"
            remove_prefix(self.fs, prefix, self.location(name), sorted(objects))
        return True
