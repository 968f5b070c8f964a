"""Staging buffers: where an asynchronous save snapshots the tensors before writing them.

One buffer per tensor key, allocated once and reused by every later save of a tensor of the same
size, so steady-state checkpointing allocates nothing and memory stays at the state's size (plus
at most 0.4%: a tensor of 1 MiB or more gets one extra block so that its snapshot starts at the
same offset within a device block as its bytes have in the data file, and direct I/O writes it
with no further copy; smaller ones pass through the writer's bounce buffer).

On a machine with CUDA the buffers are page-locked and device tensors are copied on a side stream
(:class:`DeviceOrder`): the side stream starts after everything the caller had queued when the
save was called, and the training stream waits for the copies only where it must, right after
the call (or, with a guard, before ``optimizer.step()``), so the Python call returns at once and
the snapshot is still exact.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from resurgo.format import checksum
from resurgo.pipeline.buffers import as_copyable, source_for_write, typed_view
from resurgo.pipeline.host_copy import Task, memmove_tasks
from resurgo.state.flatten import TensorLeaf
from resurgo.storage.direct_io import ALIGN


PHASED_MIN_BYTES = 1 << 20


def staging_bytes(nbytes: int) -> int:
    """The staging memory a tensor of ``nbytes`` takes."""
    return nbytes + (ALIGN if nbytes >= PHASED_MIN_BYTES else 0)


def page_locked(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory as flat uint8, exactly that many.

    torch's ``pin_memory`` allocator rounds every block up to a power of two and keeps freed
    blocks: on an H200 the staging of a 1.2 GB state took 2.26 GB that way (a 64 MiB weight plus
    one alignment block became 128 MiB). This is anonymous memory registered with CUDA instead;
    it is unregistered when the tensor goes and returned to the system with its last view.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mem = mmap.mmap(-1, nbytes)  # page-aligned
    buf = torch.frombuffer(mem, dtype=torch.uint8)
    ptr = buf.data_ptr()
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) != 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # e.g. a lock limit
    # The finalizer holds the mapping: it is unregistered before it can be unmapped.
    done = weakref.finalize(buf, _unregister, ptr, mem)
    done.atexit = False  # at exit the process goes, and its registrations with it
    return buf


def _unregister(ptr: int, mem: mmap.mmap) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - a finalizer must not raise; the memory is freed anyway
        pass


class Staged(NamedTuple):
    """One tensor's staging buffer, the tasks that fill it, and its block digests once they ran."""

    flat: np.ndarray
    tasks: list[Task]
    digests: list[str] | None


def _host_copy(flat: np.ndarray, src: np.ndarray, block_bytes: int) -> Staged:
    if not block_bytes:
        return Staged(flat, memmove_tasks(flat, src), None)
    digests = [""] * checksum.block_count(src.nbytes, block_bytes)
    return Staged(flat, memmove_tasks(flat, src, digests, block_bytes), digests)


class DeviceOrder:
    """Orders one save's device-to-host copies against the caller's CUDA streams.

    The first copy from a device, staged during the call, makes that device's side stream wait for
    everything the caller's current stream had queued: the snapshot is of that moment, whichever
    thread later issues the copy. ``training_waits`` then makes the caller's current streams wait
    for the copies issued since it last ran; it must run before anything that changes a copied
    tensor is queued (right after the call, or in the guard's hook before ``optimizer.step()``).
    Until then the copies overlap the training kernels. With no copies issued it does nothing:
    after a guarded call whose copies are all deferred, the training stream waits for nothing.
    """

    def __init__(self, pool: StagingPool):
        self._pool = pool
        self._sides: dict[torch.device, torch.cuda.Stream] = {}
        self._issued: set[torch.device] = set()  # devices with copies training has not waited for

    def side(self, device: torch.device) -> torch.cuda.Stream:
        side = self._sides.get(device)
        if side is None:
            side = self._pool.side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            self._sides[device] = side
        return side

    def issued(self, device: torch.device) -> None:
        self._issued.add(device)

    def training_waits(self) -> None:
        for device in list(self._issued):
            self._issued.discard(device)
            torch.cuda.current_stream(device).wait_stream(self._sides[device])


class StagingPool:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, key: str, nbytes: int, pinned: bool, phase: int) -> torch.Tensor:
        """``nbytes`` of the key's buffer; a phased one starts at an address that is ``phase`` mod ALIGN."""
        with self._lock:
            buf = self._buffers.get(key)
            size = staging_bytes(nbytes)
            if buf is None or buf.numel() != size or (pinned and not buf.is_pinned()):
                buf = page_locked(size) if pinned else torch.empty(size, dtype=torch.uint8)
                self._buffers[key] = buf
        if size == nbytes:
            return buf
        start = (phase - buf.data_ptr()) % ALIGN
        return buf[start:start + nbytes]

    def retain_only(self, keys: Iterable[str]) -> None:
        """Free the buffers of tensors the state no longer has."""
        keep = set(keys)
        with self._lock:
            for key in [k for k in self._buffers if k not in keep]:
                del self._buffers[key]

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The device's copy stream, made once."""
        with self._lock:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device=device)
            return side

    def stage(self, leaf: TensorLeaf, order: DeviceOrder, phase: int = 0, block_bytes: int = 0) -> Staged:
        """The tensor's staging buffer, as flat uint8 whose address is ``phase`` modulo ALIGN (give
        the bytes' offset in their data file), and the copy tasks that fill it (not yet run).

        With ``block_bytes``, host copies also hash each block as it lands (``Staged.digests``
        is filled in as the tasks run); other copies leave hashing to the writer (None).
        A device tensor is copied on the side stream of ``order``."""
        value = leaf.value
        on_cuda = isinstance(value, torch.Tensor) and value.device.type == "cuda"
        flat = self._buffer(leaf.key, leaf.nbytes, pinned=on_cuda, phase=phase).numpy()
        host = source_for_write(value)
        if isinstance(host, np.ndarray):  # one flat host buffer: memmove slices
            return _host_copy(flat, host, block_bytes)
        src = host.tensor  # detached, any lazy conjugation resolved
        dst = typed_view(flat, src.dtype, tuple(src.shape))
        if not on_cuda:
            def host_copy() -> None:  # a strided or lazily conjugated host tensor
                as_copyable(dst).copy_(as_copyable(src))
            return Staged(flat, [host_copy], None)

        side = order.side(src.device)  # now, in the caller's thread: it waits for the caller's stream

        def copy() -> None:
            with torch.cuda.stream(side):
                as_copyable(dst).copy_(as_copyable(src), non_blocking=True)
                src.record_stream(side)  # the caching allocator keeps src until the copy ran
            order.issued(src.device)
        return Staged(flat, [copy], None)

    def synchronize(self) -> None:
        """Wait until every copy issued so far has landed in host memory."""
        with self._lock:
            streams = list(self._streams.values())
        for side in streams:
            side.synchronize()
