"""One data file on a local filesystem: opened for positional reads and mapped views
(:class:`ReadHandle`), mapped into memory whole to be filled or sent (:class:`MappedFile`), or
written with ordinary buffered writes (:class:`WriteHandle`). Where the file lies, and how a
checkpoint's files are committed, is :mod:`resurgo.storage.local`'s concern.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
import threading
from pathlib import Path

import numpy as np

from resurgo.errors import CorruptCheckpointError, ResurgoError, storage_error, storage_errors
from resurgo.storage.direct_io import DirectWriteHandle

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


class WriteHandle(DirectWriteHandle):
    """A new file written with ordinary buffered writes (manifests, conversions); writes loop
    until every byte is written."""

    def __init__(self, path: Path, label: str | None = None):
        super().__init__(path, label, direct=False)


def open_for_read(path: Path, rel: str) -> int:
    try:  # O_NONBLOCK: opening a FIFO planted in place of a data file must not hang
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: data file {rel!r} listed in the manifest is missing") from None
    except OSError as e:
        raise storage_error(e, path, f"cannot open data file {rel!r}") from None


class MappedFile:
    """A data file's bytes mapped into this process's memory: a new file of a known size to fill
    in place (``create=True``: the blocks are allocated first, so a full filesystem raises
    StorageError here rather than a SIGBUS mid-copy), or an existing one to read (a private
    mapping: nothing written to ``view`` reaches the file). ``view``: the bytes; ``fsync`` makes
    a new file durable; ``close`` unmaps once nothing holds ``view`` any more. ``reuse``: the new
    file is one already at ``path`` (spare pages taken over), cut or grown to ``size``.

    A new file is mapped with its pages populated at once (one call, instead of a fault per page
    as the bytes arrive)."""

    def __init__(self, path: Path, label: str, *, create: bool = False, size: int = 0, reuse: bool = False):
        self.path, self.label = path, label
        with storage_errors(label, "cannot open"):
            if create:
                flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | (0 if reuse else os.O_CREAT | os.O_EXCL)
                fd = os.open(path, flags, 0o644)
            else:
                fd = open_for_read(path, label)
        try:
            if create:
                if reuse:
                    os.ftruncate(fd, size)
                self._allocate(fd, size)
            else:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptCheckpointError(f"{label}: not a regular file")
                size = st.st_size
            self.size = size
            self._map: mmap.mmap | None = None
            if size and create:
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
            elif size:
                self._map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except OSError as e:
            if isinstance(e, ResurgoError):
                raise
            raise storage_error(e, label, f"cannot map {size} bytes") from None
        finally:
            os.close(fd)  # the mapping keeps the file
        self.view = memoryview(self._map) if self._map is not None else memoryview(bytearray())

    @staticmethod
    def _allocate(fd: int, size: int) -> None:
        if size == 0:
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, size)  # no fallocate here: the blocks come as they are written

    def fsync(self) -> None:
        try:
            if self._map is not None:
                self._map.flush()  # msync: nothing to do in memory, the write-back on a disk
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)  # the file's size and blocks
            finally:
                os.close(fd)
        except OSError as e:
            raise storage_error(e, self.label, "fsync failed") from None

    def close(self) -> None:
        try:
            self.view.release()
            if self._map is not None:
                self._map.close()
        except BufferError:  # something over the bytes is still alive: unmapped when it goes
            pass
        self._map = None


class ReadHandle:
    """A data file opened for positional reads (thread-safe: pread keeps no file position).
    ``fd``: already open (the handle owns it), else ``path`` is opened."""

    def __init__(self, path: Path, rel: str, fd: int | None = None):
        self.rel = rel
        self.fd = open_for_read(path, rel) if fd is None else fd
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            self.fd = -1
            raise CorruptCheckpointError(f"{path}: data file {rel!r} is not a regular file")
        self.size = st.st_size
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._bytes: memoryview | None = None
        self._address = 0

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_into_many(offset, [buf])

    def view(self, offset: int, n: int) -> memoryview:
        """Bytes ``[offset, offset + n)`` of the file where the page cache holds them, without a
        copy: a read-only shared mapping, the range's pages populated first in one call that lets
        other threads run, not a fault per page. A loader hashes them there, then copies them
        into place: the same passes over memory as reading into place and hashing there. (The
        file must keep its size meanwhile: a data file truncated under a live mapping faults the
        process, as any mapped read does.)"""
        address, data = self._mapping(offset, n)
        _populate(address + offset, n, f"data file {self.rel!r} bytes {offset}..{offset + n}")
        return data[offset : offset + n]

    def _mapping(self, offset: int, n: int) -> tuple[int, memoryview]:
        """The file's mapping (made on first use) and its address; ``[offset, offset + n)`` must
        lie in the file."""
        if offset < 0 or offset + n > self.size:
            raise CorruptCheckpointError(f"data file {self.rel!r}: ends at byte {self.size}, before the data the manifest lists")
        if not self.size:
            return 0, memoryview(b"")
        with self._lock:
            if self._bytes is None:
                if self.fd < 0:
                    raise ValueError(f"data file {self.rel!r}: read after close")
                self._map = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
                self._bytes = memoryview(self._map)
                self._address = int(np.frombuffer(self._map, dtype=np.uint8).ctypes.data)
            return self._address, self._bytes

    def read_into_many(self, offset: int, bufs: list[memoryview]) -> None:
        """Fill ``bufs`` in order from the contiguous file range starting at ``offset`` (preadv)."""
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        while views:
            n = os.preadv(self.fd, views, offset)
            if n == 0:
                raise CorruptCheckpointError(f"data file {self.rel!r}: ends at byte {offset}, before the data the manifest lists")
            offset += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the file)."""
        return os.pread(self.fd, n, offset)

    def unmap(self) -> None:
        """Let the file's mapping go (the munmap lets other threads run); a later ``view`` maps
        the file again."""
        with self._lock:
            data, mapping = self._bytes, self._map
            self._bytes = self._map = None
            self._address = 0
        if data is not None:
            try:
                data.release()
                assert mapping is not None
                mapping.close()
            except BufferError:  # a view of the bytes is still alive: unmapped when it goes
                pass

    def close(self) -> None:
        self.unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_MADV_POPULATE_READ = 22  # Linux 5.14+
_populating = [True]  # False once the kernel refused: pages then fault in as they are read


def _populate(address: int, n: int, what: str) -> None:
    """Map the pages of ``[address, address + n)`` (a read-only file mapping) in one madvise call,
    reading those not cached; through ctypes, which lets other threads run meanwhile."""
    if not n or not _populating[0]:
        return
    start = address // mmap.PAGESIZE * mmap.PAGESIZE
    libc = _libc()
    if libc is None or libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + n - start),
                                    _MADV_POPULATE_READ) == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
        _populating[0] = False
        return
    raise storage_error(OSError(err, os.strerror(err)), what, "cannot read")


_libc_handle: list = []


def _libc() -> ctypes.CDLL | None:
    if not _libc_handle:
        try:
            _libc_handle.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True))
        except OSError:
            _libc_handle.append(None)
    return _libc_handle[0]
