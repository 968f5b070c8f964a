"""Regular layouts: a tensor cut into a grid of boxes by a rule, each box written by a rank given
by another rule, described in O(dimensions) instead of one entry per chunk.

Along each dimension of size ``n`` split in ``p`` parts, part ``i`` covers
``[min(i*c, n), min((i+1)*c, n))`` with ``c = ceil(n / p)``: ``torch.chunk``'s rule, which DTensor's
``Shard`` placements follow (even splits are the special case; trailing parts may be empty). The
cells of the grid are the products of the parts; cell ``(c_0, ..., c_k)`` is written by rank
``offset + sum(c_d * strides[d])`` (a device mesh laid out row-major gives such ranks). Cells with
no elements are stored nowhere.

:func:`describe` finds the grid of a list of chunk boxes and their writers, or says there is
none (FlatShard ranges, hand-made boxes, writers chosen by balancing): those stay listed chunk by
chunk. Pure geometry: no I/O, no torch (numpy for the arrays of chunks).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from resurgo.layout.box import ChunkBox


def part_bounds(size: int, parts: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``i`` of a dimension of ``size`` split in ``parts`` (torch.chunk)."""
    step = -(-size // parts) if size else 0
    start = min(i * step, size)
    return start, min(start + step, size)


@dataclass(frozen=True)
class Grid:
    """``parts[d]`` parts along dimension ``d``; cell ``c`` is written by ``offset + c . strides``."""

    parts: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]

    def box(self, shape: Sequence[int], cell: Sequence[int]) -> ChunkBox:
        bounds = [part_bounds(n, p, i) for n, p, i in zip(shape, self.parts, cell)]
        return ChunkBox(tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds))

    def writer(self, cell: Sequence[int]) -> int:
        return self.offset + sum(c * s for c, s in zip(cell, self.strides))

    def cells(self, shape: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """Every cell holding elements, in row-major order."""
        return itertools.product(*(range(_nonempty_parts(n, p)) for n, p in zip(shape, self.parts)))

    def cells_overlapping(self, shape: Sequence[int], box: ChunkBox) -> Iterator[tuple[int, ...]]:
        """The cells holding elements that share an element with ``box``, found per dimension by
        bisection: the cost grows with the cells returned, not with the grid."""
        return itertools.product(*self.cell_ranges(shape, box))

    def count(self, shape: Sequence[int]) -> int:
        """How many cells hold elements (computed, not enumerated: a grid may declare 2**40)."""
        return math.prod(_nonempty_parts(n, p) for n, p in zip(shape, self.parts))

    def cell_ranges(self, shape: Sequence[int], box: ChunkBox | None = None) -> list[range]:
        """Per dimension, the cells holding elements (of those sharing an element with ``box``):
        the grid's cells (overlapping ``box``) are their product."""
        if box is None:
            return [range(_nonempty_parts(n, p)) for n, p in zip(shape, self.parts)]
        ranges = []
        for n, p, o, s in zip(shape, self.parts, box.offsets, box.shape):
            step = -(-n // p) if n else 0
            if s <= 0 or step == 0:
                return [range(0)] * len(self.parts)
            ranges.append(range(o // step, min(_nonempty_parts(n, p), -(-(o + s) // step))))
        return ranges

    def writers(self, ranges: Sequence[range]) -> list[int]:
        """The ranks writing the cells of the product of ``ranges`` (one per dimension), sorted,
        without enumerating the cells: the sums ``offset + sum(c_d * strides[d])`` are a sumset of
        arithmetic progressions, built on a bitset by doubling. The cost grows with the span of
        ranks (a manifest's grid writes inside its world) and the log of the cells, not with them."""
        if not ranges or any(len(r) == 0 for r in ranges):
            return [self.offset] if not ranges else []
        low = self.offset + sum(min(r[0] * s, r[-1] * s) for r, s in zip(ranges, self.strides))
        bits = 1  # bit i: rank low + i writes a cell
        for r, s in zip(ranges, self.strides):
            step, n = abs(s), len(r)
            if step == 0 or n == 1:
                continue
            covered = 1  # bits holds the sums with {0, 1, ..., covered - 1} * step added
            while covered * 2 <= n:
                bits |= bits << (covered * step)
                covered *= 2
            if covered < n:  # {0..covered-1} and {n-covered..n-1} together are {0..n-1}
                bits |= bits << ((n - covered) * step)
        digits = bin(bits)[:1:-1]  # lowest bit first
        return [low + i for i, d in enumerate(digits) if d == "1"]

    def writer_bounds(self, shape: Sequence[int]) -> tuple[int, int]:
        """The lowest and highest rank writing a cell (an affine rule peaks at corners of the grid)."""
        spans = [s * (_nonempty_parts(n, p) - 1) for n, p, s in zip(shape, self.parts, self.strides)]
        return self.offset + sum(min(0, x) for x in spans), self.offset + sum(max(0, x) for x in spans)


def _nonempty_parts(size: int, parts: int) -> int:
    step = -(-size // parts) if size else 0
    return min(parts, -(-size // step)) if step else 0


def describe(shape: Sequence[int], chunks: Sequence[tuple[ChunkBox, int]]) -> Grid | None:
    """The grid whose cells holding elements are exactly ``chunks`` (boxes, with their writers),
    or None when there is none. Among the part counts that give the same cells the smallest is
    chosen, and a stride along a dimension of one part is 0 (:func:`describe_arrays`)."""
    shape = tuple(shape)
    ndim = len(shape)
    if not chunks or math.prod(shape) == 0 or any(len(b.offsets) != ndim or len(b.shape) != ndim for b, _ in chunks):
        return None
    if ndim == 0:
        return Grid((), chunks[0][1], ()) if len(chunks) == 1 else None
    offsets = np.array([b.offsets for b, _ in chunks], dtype=np.int64)
    sizes = np.array([b.shape for b, _ in chunks], dtype=np.int64)
    return describe_arrays(shape, offsets, sizes, np.array([r for _, r in chunks], dtype=np.int64))


def describe_arrays(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, writers: np.ndarray) -> Grid | None:
    """:func:`describe` of chunks given as arrays: ``offsets`` and ``sizes`` (chunks x dimensions,
    at least one dimension; the tensor has elements) and ``writers`` (one per chunk). Array
    operations, no Python object per chunk: a job's plan has one chunk per rank per tensor."""
    n, ndim = offsets.shape
    found = grid_cells(shape, offsets, sizes)
    if found is None:
        return None
    starts, cells = found
    parts = [len(s) for s in starts]
    for size, p, s in zip(shape, parts, starts):
        if not np.array_equal(s, np.minimum(np.arange(p, dtype=np.int64) * -(-size // p), size)):
            return None  # cut elsewhere than torch.chunk's rule
    flat = np.ravel_multi_index(tuple(cells.T), parts)
    by_cell = np.empty(n, dtype=np.int64)
    by_cell[flat] = np.arange(n)
    first = writers[by_cell]  # the writer of each cell, row-major
    unit: list[int] = np.asarray(np.ravel_multi_index(tuple(np.eye(ndim, dtype=np.int64)), parts,
                                                       mode="clip")).tolist()  # cell 1 along each dimension
    offset = int(first[0])
    strides = tuple(0 if p == 1 else int(first[u]) - offset for p, u in zip(parts, unit))
    if not np.array_equal(offset + cells @ np.array(strides, dtype=np.int64), writers):
        return None
    return Grid(tuple(parts), offset, strides)


def grid_cells(shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> tuple[list[np.ndarray], np.ndarray] | None:
    """When the boxes (``offsets`` and ``sizes``: boxes x dimensions, at least one dimension) are
    the cells of one grid over the whole of ``shape``, cut anywhere along each dimension, each
    cell exactly once: the cuts (each dimension's ascending cell starts) and each box's cell
    (boxes x dimensions); else None. Such boxes tile the tensor exactly once (an empty box is no
    cell: with one, the answer is None)."""
    n, ndim = offsets.shape
    if n == 0 or ndim != len(shape):
        return None
    cells = np.empty((n, ndim), dtype=np.int64)
    starts = []
    for d, size in enumerate(shape):
        cuts = np.unique(offsets[:, d])
        if cuts[0] != 0 or cuts[-1] >= size:
            return None
        at = np.searchsorted(cuts, offsets[:, d])
        if not np.array_equal(sizes[:, d], (np.append(cuts[1:], size) - cuts)[at]):
            return None  # a box ends elsewhere than at the next cut (or past the tensor)
        cells[:, d] = at
        starts.append(cuts)
    if n != math.prod(len(c) for c in starts):
        return None
    seen = np.zeros(n, dtype=bool)
    seen[np.ravel_multi_index(tuple(cells.T), [len(c) for c in starts])] = True
    return (starts, cells) if seen.all() else None  # else a cell twice, and so another one missing
