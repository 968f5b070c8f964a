"""S3's own paths of the object store backend: multipart uploads whose parts are sent
concurrently, and ranged GETs whose response bodies are read straight into the caller's buffers.

Other fsspec backends go through fsspec's buffered files and ``cat_file``
(:mod:`resurgo.storage.fsspec_store`); these need s3fs's client calls (``_call_s3``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

from fsspec.asyn import sync

from resurgo.errors import CorruptCheckpointError
from resurgo.storage.retry import as_resurgo_error, with_retries

PART_BYTES = 8 << 20  # multipart part size (S3: at least 5 MiB but the last)
PARTS_IN_FLIGHT = 2  # per object: bounds the memory of an upload to about this many parts
BODY_READ_BYTES = 1 << 20  # a response body is read into its destination this much at a time


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem (told by name: s3fs is imported only where used)."""
    return type(fs).__name__ == "S3FileSystem"


def get_into(fs: Any, full: str, rel: str, url: str, offset: int, views: list[memoryview],
             range_bytes: int) -> None:
    """Fill ``views`` (laid end to end from ``offset``) from the object ``full``: ranged GETs of
    at most ``range_bytes``, sent concurrently, each response body read straight into the part of
    ``views`` it covers. A failed range cancels the others (nothing writes into the buffers once
    this returns or raises); the whole read is retried."""
    bucket, key, version = fs.split_path(full)
    extra = {"VersionId": version} if version else {}
    ranges = split_views(offset, views, range_bytes)
    stop = offset + sum(len(v) for v in views)

    async def get_range(start: int, end: int, dests: list[memoryview]) -> None:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                 **extra)
        body = resp["Body"]
        try:
            length = int(resp.get("ContentLength", end - start))
            if length != end - start:
                raise CorruptCheckpointError(
                    f"{url}: data file {rel!r}: got {length} bytes at {start}, expected {end - start}")
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

    with_retries(lambda: sync(fs.loop, get_all), url, f"reading {rel} bytes {offset}..{stop}")


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
