"""Streaming whole tensors out of a checkpoint, verified, within a memory budget.

:class:`TensorByteStream` hands the row-major bytes of a sequence of tensors, in order, as
consecutive pieces to a writer that appends them to a file (a callback, so no reference to a
piece outlives its write and each buffer is freed before the next is filled). Tensors are read in batches whose bytes fit
the budget, through :func:`~resurgo.pipeline.reader.read_destinations` (which assembles tensors
stored in several chunks and verifies every checksum). A tensor too large for the budget is read
a window of its flattened elements at a time: each window's bytes in every chunk
(:func:`~resurgo.layout.regions.byte_runs`), widened to whole checksum blocks, are read and
verified through ``read_destinations`` too, then scattered into the window. So memory stays
about the budget whatever the sizes, and no byte reaches the output unverified.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from resurgo.errors import MemoryBudgetError
from resurgo.format import dtypes
from resurgo.format.manifest import BoxPlace, ChunkEntry, Manifest, TensorEntry
from resurgo.layout.box import FlatRange
from resurgo.layout.regions import ByteRun, block_aligned_reads, byte_runs
from resurgo.pipeline.reader import read_destinations
from resurgo.plan.convert_plan import Batch, plan_batches
from resurgo.plan.load_plan import reads_whole_into_dest
from resurgo.state.unflatten import Destination
from resurgo.storage.local import CheckpointDir


def tensor_nbytes(entry: TensorEntry) -> int:
    return math.prod(entry.shape) * dtypes.itemsize(entry.dtype)


def read_cost(entry: TensorEntry) -> int:
    """Memory ``read_destinations`` needs for the whole tensor: its bytes, twice when its chunks
    are read into buffers and assembled."""
    n = tensor_nbytes(entry)
    return n if reads_whole_into_dest(entry) else 2 * n


class TensorByteStream:
    """Reads tensors of one checkpoint; counts what it read and the most memory it held."""

    def __init__(self, ckpt: CheckpointDir, manifest: Manifest, budget: int, threads: int):
        self.ckpt = ckpt
        self.manifest = manifest
        self.budget = budget
        self.threads = threads
        self.bytes_read = 0
        self.peak_buffer_bytes = 0

    def copy_to(self, keys: Sequence[str], write: Callable[[memoryview], None]) -> None:
        """Call ``write`` with the bytes of ``keys``' tensors, in order, back to back. A piece is
        valid only during its call (its buffer is then freed or reused)."""
        entries = self.manifest.tensors
        plan = plan_batches([(k, tensor_nbytes(entries[k]), read_cost(entries[k])) for k in keys], self.budget)
        for batch in plan:
            if batch.windowed:
                self._copy_windows(batch.keys[0], write)
            else:
                self._copy_batch(batch, write)

    # -- batches of whole tensors ---------------------------------------------------------------
    def _copy_batch(self, batch: Batch, write: Callable[[memoryview], None]) -> None:
        arena = np.empty(batch.nbytes, dtype=np.uint8)
        destinations = []
        offset = 0
        for key in batch.keys:
            entry = self.manifest.tensors[key]
            n = tensor_nbytes(entry)
            destinations.append(Destination(key, entry, arena[offset : offset + n]))
            offset += n
        self._hold(sum(read_cost(self.manifest.tensors[k]) for k in batch.keys))
        self.bytes_read += read_destinations(self.ckpt, self.manifest, destinations, verify=True,
                                             threads=self.threads).bytes_read
        write(arena.data)

    # -- one large tensor, window by window -----------------------------------------------------
    def _copy_windows(self, key: str, write: Callable[[memoryview], None]) -> None:
        entry = self.manifest.tensors[key]
        itemsize = dtypes.itemsize(entry.dtype)
        shape = tuple(entry.shape)
        numel = math.prod(shape)
        # Reading a window's bytes may widen each chunk's part by up to a block at either end.
        reserve = 2 * sum(min(c.block_bytes, c.nbytes) for c in entry.chunks)
        window = (self.budget - reserve) // 2 // itemsize  # elements; the reads, then the window
        if window < 1:
            raise MemoryBudgetError(
                f"{self.ckpt.path}: tensor {key!r} ({tensor_nbytes(entry)} bytes in {len(entry.chunks)} chunks, "
                f"checksum blocks of up to {max(c.block_bytes for c in entry.chunks)} bytes) cannot be read and "
                f"verified within memory_budget={self.budget}; it needs at least {reserve + 2 * itemsize} bytes")
        out = np.empty(window * itemsize, dtype=np.uint8)
        for start in range(0, numel, window):
            stop = min(numel, start + window)
            write(self._read_window(key, entry, FlatRange(start, stop), out, itemsize))

    def _read_window(self, key: str, entry: TensorEntry, window: FlatRange, out: np.ndarray,
                     itemsize: int) -> memoryview:
        shape = tuple(entry.shape)
        destinations: list[Destination] = []
        scatter: list[tuple[np.ndarray, int, list[ByteRun]]] = []  # (buffer, its chunk offset, runs)
        for ci, chunk in enumerate(entry.chunks):
            runs = byte_runs(shape, itemsize, chunk.place, window)
            for read in block_aligned_reads(runs, chunk.block_bytes, chunk.nbytes):
                buf = np.empty(read.length, dtype=np.uint8)
                part = _byte_range_entry(chunk, read.start, read.stop, read.first_block)
                # read_destinations numbers the blocks of this part from 0: the name says from where.
                name = f"{key} (chunk {ci}; blocks counted from its block {read.first_block})"
                destinations.append(Destination(name, part, buf))
                scatter.append((buf, read.start, [r for r in runs if read.start <= r.src_offset < read.stop]))
        self._hold(len(out) + sum(len(b) for b, _, _ in scatter))
        self.bytes_read += read_destinations(self.ckpt, self.manifest, destinations, verify=True,
                                             threads=self.threads).bytes_read
        for buf, base, runs in scatter:
            for r in runs:
                out[r.dst_offset : r.dst_stop] = buf[r.src_offset - base : r.src_stop - base]
        return out.data[: window.numel * itemsize]

    def _hold(self, nbytes: int) -> None:
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, nbytes)


def _byte_range_entry(chunk: ChunkEntry, start: int, stop: int, first_block: int) -> TensorEntry:
    """Bytes ``[start, stop)`` of a chunk (block-aligned) as a tensor entry of its own: a uint8
    vector in one whole chunk, with the chunk's checksums of those blocks, so reading it
    through ``read_destinations`` verifies it."""
    count = -(-(stop - start) // chunk.block_bytes)
    first = chunk.byte_range[0]
    return TensorEntry(kind="torch", dtype="uint8", shape=[stop - start], chunks=[ChunkEntry(
        box=BoxPlace(offsets=[0], shape=[stop - start]), file=chunk.file,
        byte_range=[first + start, first + stop], block_bytes=chunk.block_bytes,
        checksums=list(chunk.checksums[first_block : first_block + count]))])
