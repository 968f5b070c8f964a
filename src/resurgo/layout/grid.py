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
chunk. Pure geometry: no I/O, no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
        ranges = []
        for n, p, o, s in zip(shape, self.parts, box.offsets, box.shape):
            if s <= 0:
                return iter(())
            step = -(-n // p) if n else 0
            if step == 0:
                return iter(())
            ranges.append(range(o // step, min(_nonempty_parts(n, p), -(-(o + s) // step))))
        return itertools.product(*ranges)

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
    chosen, and a stride along a dimension of one part is 0. One pass over the chunks, each
    checked against the rule (a job's plan has one per rank per tensor)."""
    shape = tuple(shape)
    ndim = len(shape)
    if not chunks or math.prod(shape) == 0 or any(len(b.offsets) != ndim for b, _ in chunks):
        return None
    bounds: list[dict[int, tuple[int, int]]] = []  # per dimension: start -> (part, size)
    for d, n in enumerate(shape):
        starts = sorted({b.offsets[d] for b, _ in chunks})
        p = len(starts)
        parts = [part_bounds(n, p, i) for i in range(p)]
        if [a for a, _ in parts] != starts:
            return None
        bounds.append({a: (i, z - a) for i, (a, z) in enumerate(parts)})
    parts_per_dim = tuple(len(b) for b in bounds)
    if len(chunks) != math.prod(parts_per_dim):
        return None
    writers: dict[tuple[int, ...], int] = {}
    for b, rank in chunks:
        at = []
        for d in range(ndim):
            i, size = bounds[d][b.offsets[d]]
            if size != b.shape[d]:
                return None
            at.append(i)
        writers[tuple(at)] = rank
    if len(writers) != len(chunks):
        return None  # a cell twice
    offset = writers[(0,) * ndim]
    strides = tuple(0 if p == 1 else writers[tuple(1 if e == d else 0 for e in range(ndim))] - offset
                    for d, p in enumerate(parts_per_dim))
    for cell, rank in writers.items():
        if offset + sum(c * s for c, s in zip(cell, strides)) != rank:
            return None
    return Grid(parts_per_dim, offset, strides)


