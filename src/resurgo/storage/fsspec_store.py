"""Checkpoints on object stores and other fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...).

Commit protocol (no rename on object stores; docs/format.md section 3.2):

1. The save writes a *writer token* ``<url>/.resurgo-writers/<save id>`` (a conditional put that
   fails if it exists), then lists the tokens: if another save's token is there, two jobs are
   saving to the same checkpoint and this one is refused (CheckpointExistsError).
2. Every rank uploads its data objects, named ``data/<save id>-rank<R>-<I>.safetensors`` (unique
   per save, so an overwrite never touches the objects of the checkpoint it replaces). Large
   objects go up as multipart uploads whose parts are sent in parallel.
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
from concurrent.futures import Future
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
from resurgo.storage import ownership
from resurgo.storage.base import DATA_DIR, WRITERS_DIR, Listing, check_size
from resurgo.storage.ownership import DeclaredFiles
from resurgo.storage.retry import as_resurgo_error, is_precondition_failure, with_retries

PART_BYTES = 8 << 20  # multipart part size (S3: at least 5 MiB but the last)
PARTS_IN_FLIGHT = 2  # per object: bounds the memory of an upload to about this many parts
RANGE_SPLIT_BYTES = 16 << 20  # a larger ranged read is split into parallel requests of this size
BODY_READ_BYTES = 1 << 20  # a response body is read into its destination this much at a time


def split_url(url: str, storage_options: dict | None) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it (no trailing slash)."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError, TypeError) as e:
        raise StorageError(errno.EINVAL, f"{url}: cannot open this URL: {e}") from None
    return fs, path.rstrip("/")


def _is_s3(fs: Any) -> bool:
    return type(fs).__name__ == "S3FileSystem"


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
        if _is_s3(self.fs):
            self._get_into(offset, views)
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

    def _get_into(self, offset: int, views: list[memoryview]) -> None:
        """S3: ranged GETs of at most :data:`RANGE_SPLIT_BYTES`, sent concurrently, each response
        body read straight into the part of ``views`` it covers. A failed range cancels the others
        (nothing writes into the buffers once this returns or raises); the whole read is retried."""
        bucket, key, version = self.fs.split_path(self.full)
        extra = {"VersionId": version} if version else {}
        ranges = split_views(offset, views, RANGE_SPLIT_BYTES)
        stop = offset + sum(len(v) for v in views)

        async def get_range(start: int, end: int, dests: list[memoryview]) -> None:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                          **extra)
            body = resp["Body"]
            try:
                length = int(resp.get("ContentLength", end - start))
                if length != end - start:
                    raise CorruptCheckpointError(
                        f"{self.url}: data file {self.rel!r}: got {length} bytes at {start}, expected {end - start}")
                for dest in dests:
                    pos = 0
                    while pos < len(dest):
                        # Bounded reads: what the connection buffered is handed over in pieces of at
                        # most this size (reused memory), each copied once, into its place.
                        piece = await body.read(min(BODY_READ_BYTES, len(dest) - pos))
                        if not piece:
                            raise ConnectionError(f"the response ended {len(dest) - pos} bytes early")
                        dest[pos : pos + len(piece)] = piece
                        pos += len(piece)
            finally:
                body.close()

        async def get_all() -> None:
            tasks = [asyncio.ensure_future(get_range(a, b, d)) for a, b, d in ranges]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        with_retries(lambda: sync(self.fs.loop, get_all), self.url, f"reading {self.rel} bytes {offset}..{stop}")

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the object)."""
        stop = min(self.size, offset + n)
        return b"".join(self._fetch_pieces(offset, stop)) if stop > offset else b""

    def close(self) -> None:
        pass


def split_views(offset: int, views: list[memoryview], most: int) -> list[tuple[int, int, list[memoryview]]]:
    """Consecutive byte ranges of at most ``most`` bytes covering ``views`` (laid end to end from
    ``offset``), each with the slices of ``views`` it fills."""
    out: list[tuple[int, int, list[memoryview]]] = []
    start, dests, room = offset, [], most
    for v in views:
        pos = 0
        while pos < len(v):
            n = min(room, len(v) - pos)
            dests.append(v[pos : pos + n])
            pos, room = pos + n, room - n
            if not room:
                out.append((start, start + most, dests))
                start, dests, room = start + most, [], most
    if dests:
        out.append((start, start + most - room, dests))
    return out


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


class S3MultipartWriteHandle:
    """A new S3 object: a single PUT when small, else a multipart upload whose parts are sent
    concurrently (up to :data:`PARTS_IN_FLIGHT` at once) on s3fs's event loop while the writer
    thread keeps hashing and copying. A part's buffer is reused once its upload is done (no new
    allocation, zeroing and page faults per part). ``fsync`` completes the upload; ``close``
    before that aborts it, so no part is left behind."""

    def __init__(self, fs: Any, full: str, label: str, part_bytes: int = PART_BYTES):
        self.fs = fs
        self.label = label
        self.bucket, self.key, _ = fs.split_path(full)
        self.part_bytes = part_bytes
        self.bytes_written = 0
        self._buffer = bytearray(part_bytes)  # the part being filled: one copy of each byte
        self._filled = 0
        self._upload_id: str | None = None
        self._parts: list[tuple[int, Future]] = []
        self._sending: list[tuple[Future, bytearray]] = []  # parts in flight and their buffers
        self._spare: list[bytearray] = []  # buffers of parts already sent
        self._done = False

    def _call(self, method: str, doing: str, **kwargs: Any) -> Any:
        return with_retries(lambda: sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket, Key=self.key,
                                         **kwargs), self.label, doing)

    def _send_part(self, body: bytes | bytearray) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload", "starting a multipart upload")["UploadId"]
        if sum(not f.done() for f, _ in self._sending) >= PARTS_IN_FLIGHT:
            next(f for f, _ in self._sending if not f.done()).result()
        for f, buf in [s for s in self._sending if s[0].done()]:
            f.result()  # a failed part raises here, before its buffer is refilled
            self._sending.remove((f, buf))
            self._spare.append(buf)
        number = len(self._parts) + 1
        coro = self.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                PartNumber=number, Body=body)
        future = asyncio.run_coroutine_threadsafe(coro, self.fs.loop)
        self._parts.append((number, future))
        if isinstance(body, bytearray):
            self._sending.append((future, body))

    def _next_buffer(self) -> bytearray:
        size = self._part_size()
        while self._spare:
            buf = self._spare.pop()
            if len(buf) == size:
                return buf
        return bytearray(size)

    def _part_size(self) -> int:
        # S3 allows 10 000 parts: grow the part size so objects of any size fit.
        return self.part_bytes * (1 + len(self._parts) // 1000)

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            while len(view):
                n = min(len(view), len(self._buffer) - self._filled)
                self._buffer[self._filled : self._filled + n] = view[:n]
                self._filled += n
                self.bytes_written += n
                view = view[n:]
                if self._filled == len(self._buffer):
                    self._send_part(self._buffer)  # handed over whole until its upload is done
                    self._buffer, self._filled = self._next_buffer(), 0
        except Exception as e:  # noqa: BLE001
            raise as_resurgo_error(e, self.label, f"uploading after {self.bytes_written} bytes") from e

    def fsync(self) -> None:
        try:
            rest = self._buffer if self._filled == len(self._buffer) else bytes(self._buffer[: self._filled])
            if self._upload_id is None:
                self._call("put_object", "uploading the object", Body=rest)
            else:
                if self._filled:
                    self._send_part(rest)
                parts = [{"PartNumber": n, "ETag": f.result()["ETag"]} for n, f in self._parts]
                self._call("complete_multipart_upload", "completing the multipart upload",
                           UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        except Exception as e:  # noqa: BLE001
            raise as_resurgo_error(e, self.label, f"uploading {self.bytes_written} bytes") from e
        self._buffer, self._filled = bytearray(), 0
        self._sending.clear()
        self._spare.clear()
        self._done = True

    def close(self) -> None:
        if self._done or self._upload_id is None:
            return
        for _, f in self._parts:
            f.cancel()
        try:  # best effort: the server may be what failed
            sync(self.fs.loop, self.fs._call_s3, "abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                 UploadId=self._upload_id)
        except Exception:  # noqa: BLE001
            pass


def _open_for_write(fs: Any, full: str, label: str) -> "ObjectWriteHandle | S3MultipartWriteHandle":
    return S3MultipartWriteHandle(fs, full, label) if _is_s3(fs) else ObjectWriteHandle(fs, full, label)


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


class ObjectCheckpoint:
    """A checkpoint under a URL prefix: ``<url>/manifest.json`` and ``<url>/data/*``."""

    # Readers group reads of one object less than 1 MiB apart into ranged requests of up to
    # 64 MiB (each fetched as parallel 16 MiB ranges): a request costs a round trip.
    coalesce_reads = (1 << 20, 64 << 20)

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = split_url(self.url, self.storage_options)
        self._sizes: dict[str, int] = {}  # from the listing check_sizes made: no HEAD per open

    @property
    def path(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url

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

    def __init__(self, url: str, storage_options: dict, save_id: str, overwrite: bool,
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


class ObjectRoot:
    """A root of checkpoints under a URL prefix: each checkpoint is a prefix below it, with its
    ``manifest.json``; a prefix with data objects or a writer token but no manifest is an
    incomplete save (one that died, or one still running). Listed in one request.

    Deletion removes only what resurgo can prove it wrote, the manifest first, so a deletion cut
    short leaves an incomplete checkpoint, never a committed one with objects missing."""

    saves_in_place = True  # no rename: a save writes under the checkpoint's own prefix
    size_words = "stored"

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.name = self.url
        self.storage_options: dict | None = dict(storage_options or {})
        self.fs, self.prefix = split_url(self.url, self.storage_options)

    @property
    def path(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url

    def require(self, expected: str) -> None:
        pass  # a prefix exists as soon as an object is put below it

    def location(self, name: str) -> str:
        return self.url if name == "." else f"{self.url}/{name}"

    def open(self, name: str) -> ObjectCheckpoint:
        return ObjectCheckpoint(self.location(name), self.storage_options)

    def _objects(self, name: str) -> dict[str, dict]:
        prefix = self.prefix if name == "." else f"{self.prefix}/{name}"
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
            prefix = self.prefix if name == "." else f"{self.prefix}/{name}"
            remove_prefix(self.fs, prefix, self.location(name), sorted(objects))
        return True
