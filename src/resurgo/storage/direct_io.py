"""Writing new files around the page cache (``O_DIRECT``), from whatever memory the bytes are in.

Buffered writes copy every byte into the page cache; the kernel then allocates pages (evicting
others) and writes them back, which on a busy machine costs more CPU time than the training
loop can spare and makes durable times wildly variable. Direct writes go from user memory to the
device. They need the memory address, the file offset and the length aligned to the device's
block (:data:`ALIGN` covers 512-byte and 4 KiB devices). A write of memory whose address is
aligned the same way as its file position goes straight to the device; other bytes (headers,
tensors whose memory is not so aligned, the end of the file) pass through one small aligned
bounce buffer. The file's last partial block is written padded and the file then truncated to
its exact size.

:func:`plan_direct_write` decides those steps and is pure; :class:`DirectWriteHandle` carries
them out. A filesystem that refuses ``O_DIRECT`` (tmpfs, some network filesystems, macOS) gets
ordinary buffered writes, at open or at the first refused write; ``RESURGO_DIRECT_IO=0`` asks
for buffered writes everywhere.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from resurgo import faults
from resurgo.errors import storage_error

ALIGN = 4096
BOUNCE_BYTES = 2 << 20  # a multiple of ALIGN; large enough for full-speed device writes
MAX_DIRECT_BYTES = 64 << 20  # one write call at most (a multiple of ALIGN)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class DirectStep:
    """One step of writing ``data[start:stop]``: copy it into the bounce buffer ("stage"), write
    it from its own memory ("direct"), or write out the bounce buffer's aligned content ("flush",
    no data range)."""

    kind: Literal["stage", "direct", "flush"]
    start: int = 0
    stop: int = 0


def plan_direct_write(pending: int, address: int, length: int,
                      bounce_bytes: int = BOUNCE_BYTES, align: int = ALIGN) -> list[DirectStep]:
    """The steps that append ``length`` bytes at memory ``address`` to a file whose written part
    ends on a block boundary and whose bounce buffer holds ``pending`` more bytes.

    Invariants the steps keep: every flush writes a whole number of blocks, so the written part
    stays block-aligned; a direct step starts where both its memory and its file position are
    block-aligned, and is a whole number of blocks; the bounce never holds more than
    ``bounce_bytes``. Bytes reach the file in order.
    """
    steps: list[DirectStep] = []
    i = 0
    while i < length:
        fill = -pending % align  # bytes that complete the bounce's last block
        rest = length - i - fill
        if rest >= align and (address + i + fill) % align == 0:
            if fill:
                steps.append(DirectStep("stage", i, i + fill))
                i += fill
            if pending + fill:
                steps.append(DirectStep("flush"))
                pending = 0
            n = rest - rest % align
            for lo in range(i, i + n, MAX_DIRECT_BYTES):
                steps.append(DirectStep("direct", lo, min(lo + MAX_DIRECT_BYTES, i + n)))
            i += n
            continue
        n = min(length - i, bounce_bytes - pending)
        steps.append(DirectStep("stage", i, i + n))
        pending += n
        i += n
        if pending == bounce_bytes:
            steps.append(DirectStep("flush"))
            pending = 0
    return steps


def direct_io_enabled() -> bool:
    return bool(_O_DIRECT) and os.environ.get("RESURGO_DIRECT_IO", "1") != "0"


def _address(view: memoryview) -> int:
    if len(view) == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class DirectWriteHandle:
    """A new file written sequentially, with ``O_DIRECT`` where the filesystem allows it and
    ``direct`` is asked for (``direct=False``: ordinary buffered writes, for small files).

    ``write``, ``fsync`` (which first writes the bounce buffer's tail), ``close``,
    ``bytes_written`` (the file's logical size so far). ``reuse``: the file is one already at
    ``path`` (a memory root's spare pages), written over from its start and cut to its new size
    by ``fsync``.
    """

    def __init__(self, path: Path, label: str | None = None, direct: bool = True, reuse: bool = False):
        self.path = path
        self.label = label or str(path)
        self.reuse = reuse
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | (0 if reuse else os.O_CREAT | os.O_EXCL)
        self.direct = direct and direct_io_enabled()
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(path, flags | _O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # this filesystem refuses O_DIRECT
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)
        self.bytes_written = 0
        self._flushed = 0  # bytes already in the file; a multiple of ALIGN while direct
        self._pending = 0  # bytes waiting in the bounce buffer
        self.bytes_bounced = 0  # bytes copied through the bounce buffer (the rest went direct)
        self._bounce: memoryview | None = None  # block-aligned

    def _bounce_view(self) -> memoryview:
        if self._bounce is None:
            raw = np.empty(BOUNCE_BYTES + ALIGN, dtype=np.uint8)
            start = -raw.ctypes.data % ALIGN
            self._bounce = raw[start:start + BOUNCE_BYTES].data
        return self._bounce

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        try:
            faults.point("save.write")
            done = 0  # bytes of view staged or written
            steps = plan_direct_write(self._pending, _address(view), len(view)) if self.direct else []
            for s in steps:
                if s.kind == "stage":
                    n = s.stop - s.start
                    self._bounce_view()[self._pending:self._pending + n] = view[s.start:s.stop]
                    self._pending += n
                    self.bytes_bounced += n
                elif s.kind == "flush":
                    self._flush_bounce()
                else:
                    self._write_direct(view[s.start:s.stop])
                done = max(done, s.stop)
                if not self.direct:  # refused mid-way: the rest goes buffered
                    break
            if not self.direct:
                self._write_all(view[done:])
        except OSError as e:
            # count what reached the file, not what waits in the bounce buffer
            raise storage_error(e, self.label, f"write failed after {self._flushed} bytes") from None
        self.bytes_written += len(view)

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            n = os.write(self.fd, view)
            view = view[n:]
            self._flushed += n

    def _write_direct(self, view: memoryview) -> None:
        try:
            while len(view):
                n = os.write(self.fd, view)
                view = view[n:]
                self._flushed += n
                if n % ALIGN and len(view):
                    raise OSError(errno.EINVAL, "short unaligned direct write")
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._go_buffered()
            self._write_all(view)

    def _flush_bounce(self) -> None:
        if self._pending == 0:
            return
        data = self._bounce_view()[:self._pending]
        self._pending = 0
        if self.direct:
            self._write_direct(data)
        else:
            self._write_all(data)

    def _go_buffered(self) -> None:
        """The device refused a direct write (alignment it needs is larger than ours): drop
        O_DIRECT on this file and write what is left buffered."""
        import fcntl  # here: only Unix has it, and only Linux has O_DIRECT to drop

        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self.direct = False
        if self._pending:
            data = self._bounce_view()[:self._pending]
            self._pending = 0
            self._write_all(data)

    def _finish_tail(self) -> None:
        """Write the last partial block padded with zeros, then cut the file to its true size."""
        if not self._pending:
            return
        if not self.direct:
            self._flush_bounce()
            return
        size = self._flushed + self._pending
        padded = -(-self._pending // ALIGN) * ALIGN
        bounce = self._bounce_view()
        bounce[self._pending:padded] = bytes(padded - self._pending)
        self._pending = padded
        self._flush_bounce()
        os.ftruncate(self.fd, size)
        self._flushed = size

    def fsync(self) -> None:
        try:
            self._finish_tail()
            if self.reuse:
                os.ftruncate(self.fd, self._flushed)  # a longer file's old tail goes
        except OSError as e:
            raise storage_error(e, self.label, f"write failed after {self._flushed} bytes") from None
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise storage_error(e, self.label, "fsync failed") from None

    def close(self) -> None:
        if self.fd >= 0:
            try:
                if self._pending:  # closed without fsync (an error path): keep the bytes anyway
                    self._finish_tail()
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1
        self._bounce = None
