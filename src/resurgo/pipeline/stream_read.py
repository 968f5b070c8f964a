"""Streaming whole tensors out of a checkpoint, verified, within a memory budget.

:class:`TensorByteStream` hands the row-major bytes of a sequence of tensors, in order, as
consecutive pieces to a writer that appends them to a file (a callback, so no reference to a
piece outlives its write and each buffer is freed before the next is filled). Tensors are read in
batches whose bytes fit the budget, through :func:`~resurgo.pipeline.reader.read_destinations`,
which assembles tensors stored in several chunks and verifies every checksum. A tensor larger than
the budget is read a window of its flattened elements at a time: the window is a partial
destination (a :class:`~resurgo.layout.box.FlatRange` piece), so the reader fetches only the
checksum blocks that hold it. The reader reads a chunk straight into place when it lands there
as one contiguous run, else into scratch buffers it scatters from: such tensors (and windows)
count twice against the budget. Memory stays about the budget whatever the tensor sizes, and no
byte reaches the output unverified.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from resurgo.errors import MemoryBudgetError
from resurgo.format import dtypes
from resurgo.format.manifest import Manifest, TensorEntry
from resurgo.layout.box import ChunkBox, FlatRange
from resurgo.layout.regions import byte_runs
from resurgo.layout.shards import LocalPiece
from resurgo.pipeline.buffers import typed_view
from resurgo.pipeline.reader import read_destinations
from resurgo.plan.convert_plan import Batch, plan_batches
from resurgo.state.unflatten import Destination
from resurgo.storage.base import Checkpoint


def tensor_nbytes(entry: TensorEntry) -> int:
    return math.prod(entry.shape) * dtypes.itemsize(entry.dtype)


def read_cost(entry: TensorEntry) -> int:
    """Memory reading the whole tensor needs: its bytes when every chunk lands in it as one
    contiguous run (read straight into place), twice that otherwise (the reader's scratch)."""
    shape = tuple(entry.shape)
    itemsize = dtypes.itemsize(entry.dtype)
    whole = ChunkBox.whole(shape)
    for c in entry.chunks:
        runs = byte_runs(shape, itemsize, c.place, whole)
        if c.nbytes and not (len(runs) == 1 and runs[0].length == c.nbytes):
            return 2 * tensor_nbytes(entry)
    return tensor_nbytes(entry)


class TensorByteStream:
    """Reads tensors of one checkpoint; counts what it read and the most memory it needed."""

    def __init__(self, ckpt: Checkpoint, manifest: Manifest, budget: int, threads: int):
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

    def _read(self, destinations: list[Destination]) -> None:
        # fresh buffers, dropped if a read fails: verified where they land (no unit held back)
        result = read_destinations(self.ckpt, self.manifest, destinations, verify=True, threads=self.threads,
                                   atomic=False)
        self.bytes_read += result.bytes_read

    def _copy_batch(self, batch: Batch, write: Callable[[memoryview], None]) -> None:
        arena = np.empty(batch.nbytes, dtype=np.uint8)
        cost = sum(read_cost(self.manifest.tensors[k]) for k in batch.keys)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, cost)
        destinations = []
        offset = 0
        for key in batch.keys:
            entry = self.manifest.tensors[key]
            n = tensor_nbytes(entry)
            destinations.append(Destination(key, entry, arena[offset : offset + n]))
            offset += n
        self._read(destinations)
        write(arena.data)

    def _copy_windows(self, key: str, write: Callable[[memoryview], None]) -> None:
        entry = self.manifest.tensors[key]
        itemsize = dtypes.itemsize(entry.dtype)
        window = self.budget // 2 // itemsize  # elements: half for the window, half for the reads' scratch
        if window < 1:
            raise MemoryBudgetError(
                f"{self.ckpt.path}: tensor {key!r} has elements of {itemsize} bytes; buffer_bytes={self.budget} "
                f"cannot hold a window of one and its read (at least {2 * itemsize} bytes)")
        out = np.empty(window * itemsize, dtype=np.uint8)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, 2 * len(out))
        dtype = dtypes.TORCH_DTYPES[entry.dtype]
        numel = math.prod(entry.shape)
        for start in range(0, numel, window):
            stop = min(numel, start + window)
            nbytes = (stop - start) * itemsize
            view = typed_view(out[:nbytes], dtype, (stop - start,))
            self._read([Destination(key, entry, view, (LocalPiece(FlatRange(start, stop), view),))])
            write(out.data[:nbytes])
