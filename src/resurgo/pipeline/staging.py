"""Staging buffers: where an asynchronous save snapshots the tensors before writing them.

One buffer per tensor key, allocated once and reused by every later save of a tensor of the same
size, so steady-state checkpointing allocates nothing and memory stays at the state's size (plus
at most 0.4%: a tensor of 1 MiB or more gets one extra block so that its snapshot starts at the
same offset within a device block as its bytes have in the data file, and direct I/O writes it
with no further copy; smaller ones pass through the writer's bounce buffer).

Host tensors are copied in spans of a few MiB by several threads, and each span's block checksums
are computed right after it is copied, while it is still in cache (:class:`StagedBytes`): hashing
then costs no second pass over memory, and the background writer has nothing left to do but
hand buffers to the device. On a machine with CUDA the buffers are page-locked and device tensors
are copied on a side stream; the training stream waits for that copy before it runs anything
else, so the snapshot is exact while the Python call returns at once (the writer hashes those).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from resurgo.format import checksum
from resurgo.pipeline.buffers import as_copyable, source_for_write, typed_view
from resurgo.state.flatten import TensorLeaf
from resurgo.storage.direct_io import ALIGN


PHASED_MIN_BYTES = 1 << 20
SPAN_BYTES = 8 << 20  # one copy-and-hash task: large enough to amortize, small enough to balance
STAGE_THREADS = max(1, min(8, os.cpu_count() or 1))  # memory bandwidth saturates within a few


@dataclass
class StagedBytes:
    """A tensor's snapshot with the checksums of its blocks, computed as it was copied."""

    data: np.ndarray  # flat uint8
    block_bytes: int
    digests: list[str]


@dataclass(frozen=True)
class StageRequest:
    """One tensor to snapshot: where its bytes start in their data file (the buffer's phase) and
    the block size of its checksums."""

    leaf: TensorLeaf
    file_offset: int
    block_bytes: int


def staging_bytes(nbytes: int) -> int:
    """The staging memory a tensor of ``nbytes`` takes."""
    return nbytes + (ALIGN if nbytes >= PHASED_MIN_BYTES else 0)


class StagingPool:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, key: str, nbytes: int, pinned: bool, phase: int) -> torch.Tensor:
        """``nbytes`` of the key's buffer; a phased one starts at an address that is ``phase`` mod ALIGN."""
        with self._lock:
            buf = self._buffers.get(key)
            size = staging_bytes(nbytes)
            if buf is None or buf.numel() != size or (pinned and not buf.is_pinned()):
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
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

    def stage(self, requests: Sequence[StageRequest], parallel: bool = True) -> dict[str, "np.ndarray | StagedBytes"]:
        """Snapshot every requested tensor. Host bytes are copied and hashed span by span, by
        several threads when ``parallel``; device and strided tensors are copied whole (their
        blocks are hashed by the writer)."""
        out: dict[str, np.ndarray | StagedBytes] = {}
        spans: list[tuple[np.ndarray, np.ndarray, int]] = []  # (dst, src, block_bytes) slices
        owners: list[tuple[str, int]] = []  # (key, number of spans) in order
        for r in requests:
            leaf = r.leaf
            src = source_for_write(leaf.value)
            if not isinstance(src, np.ndarray):
                out[leaf.key] = self.copy_in(leaf, r.file_offset % ALIGN)
                continue
            dst = self._buffer(leaf.key, leaf.nbytes, pinned=False, phase=r.file_offset % ALIGN).numpy()
            step = max(1, SPAN_BYTES // r.block_bytes) * r.block_bytes
            starts = range(0, leaf.nbytes, step)
            spans += [(dst[lo:lo + step], src[lo:lo + step], r.block_bytes) for lo in starts]
            owners.append((leaf.key, len(starts)))
            out[leaf.key] = StagedBytes(dst, r.block_bytes, [])
        if parallel and len(spans) > 1 and STAGE_THREADS > 1:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(STAGE_THREADS, thread_name_prefix="resurgo-stage")
            digests = iter(list(self._executor.map(_copy_and_hash, spans)))
        else:
            digests = iter([_copy_and_hash(sp) for sp in spans])
        for key, count in owners:
            staged = out[key]
            assert isinstance(staged, StagedBytes)
            for _ in range(count):
                staged.digests += next(digests)
        return out

    def copy_in(self, leaf: TensorLeaf, phase: int = 0) -> np.ndarray:
        """Copy one tensor's bytes into its staging buffer; return them as flat uint8 whose
        address is ``phase`` modulo ALIGN (give the bytes' offset in their data file)."""
        value = leaf.value
        if isinstance(value, np.ndarray):
            buf = self._buffer(leaf.key, leaf.nbytes, pinned=False, phase=phase)
            flat = buf.numpy()
            np.copyto(flat.view(value.dtype).reshape(value.shape), value)
            return flat
        src = value.detach()
        on_cuda = src.device.type == "cuda"
        buf = self._buffer(leaf.key, leaf.nbytes, pinned=on_cuda, phase=phase)
        dst = typed_view(buf.numpy(), src.dtype, tuple(src.shape))
        if src.is_conj() or src.is_neg():
            src = src.resolve_conj().resolve_neg()
        if on_cuda:
            self._copy_from_cuda(dst, src)
        else:
            as_copyable(dst).copy_(as_copyable(src))
        return buf.numpy()

    def _copy_from_cuda(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Side stream: the copy overlaps whatever the host does next; the training stream then
        # waits on it, so kernels queued after this call cannot change the tensor before it is read.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)
        side = self._stream
        main = torch.cuda.current_stream(src.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            as_copyable(dst).copy_(as_copyable(src), non_blocking=True)
            src.record_stream(side)
        main.wait_stream(side)

    def synchronize(self) -> None:
        """Wait until every copy issued so far has landed in host memory."""
        if self._stream is not None:
            self._stream.synchronize()


def _copy_and_hash(span: tuple[np.ndarray, np.ndarray, int]) -> list[str]:
    dst, src, block_bytes = span
    np.copyto(dst, src)  # releases the GIL, as xxhash does for large buffers
    return checksum.block_digests(dst.data, block_bytes)
