"""The bytes a saved chunk and a destination share, and the reads that fetch them.

This module owns the byte-level geometry of a resharded copy. A *place* (a :class:`ChunkBox`
or a :class:`FlatRange` of a global tensor) is stored as the row-major bytes of its elements;
given two places, :func:`byte_runs` lists the contiguous :class:`ByteRun` s that copy every
element they share from the first place's storage (a saved chunk) to the second's (a
destination). :func:`coalesce` and :func:`align_to_blocks` then turn the source side of those
runs into reads: nearby ranges merged, whole checksum blocks so each read can be verified.
Pure arithmetic: no I/O, no torch, no torch.distributed.

Why runs come out sorted in both src and dst: a place's storage keeps its elements in global
row-major order, so the shared elements appear in the same order in both storages.

Where it plugs in (issue 3, universal load): ``plan/load_plan.py`` today reads whole saved
chunks. For a target whose local shard is place ``dst``, the load plan will, for each saved
chunk whose place overlaps ``dst``, call ``byte_runs(shape, itemsize, chunk.place, dst)``, take
the runs' source intervals, ``align_to_blocks`` each one to ``chunk.block_bytes`` (clipped to
``chunk.nbytes``) and ``coalesce`` them with a small gap (or use :func:`block_aligned_reads`,
which does both): those are the byte ranges to read, relative to ``chunk.byte_range[0]``, each
verifiable against ``chunk.checksums[first_block:]``. After verification the runs scatter the
read bytes into the destination's storage, so no rank reads or materializes a chunk it does not
need.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable

from resurgo.layout.box import ChunkBox, FlatRange, Place


@dataclass(frozen=True)
class ByteRun:
    """Copy ``length`` bytes from ``src_offset`` of the saved chunk to ``dst_offset`` of the destination."""

    src_offset: int
    dst_offset: int
    length: int

    @property
    def src_stop(self) -> int:
        return self.src_offset + self.length

    @property
    def dst_stop(self) -> int:
        return self.dst_offset + self.length


@dataclass(frozen=True)
class ReadRange:
    """Bytes ``[start, stop)`` of a saved chunk's storage."""

    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class AlignedRead:
    """Bytes ``[start, stop)`` of a chunk made of whole checksum blocks, from block ``first_block``.

    ``start`` is a multiple of the block size; ``stop`` is one too, or the chunk's end.
    """

    start: int
    stop: int
    first_block: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class _Piece:
    """A box of the global tensor whose elements sit in a storage at ``base + sum(index * strides)``.

    Both kinds of place reduce to a few pieces: a box is one, a flat range a handful (its partial
    rows and its full slabs), and offsets stay affine inside each piece.
    """

    box: ChunkBox
    strides: tuple[int, ...]  # in elements
    base: int  # in elements


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


def flat_range_boxes(flat: FlatRange, shape: tuple[int, ...]) -> list[ChunkBox]:
    """The boxes that tile ``flat``, in global order: at most ``2 * ndim - 1`` of them.

    At each dimension the range splits into a partial head slice, whole slices, and a partial tail
    slice; only head and tail recurse, so each side is a chain of at most ``ndim`` boxes.
    """
    ndim = len(shape)
    if flat.stop <= flat.start:
        return []
    if ndim == 0:
        return [ChunkBox((), ())]
    strides = _row_major_strides(shape)
    boxes: list[ChunkBox] = []

    def split(lo: int, hi: int, d: int, prefix: tuple[int, ...]) -> None:
        # [lo, hi) is a range of the sub-tensor shape[d:] at index ``prefix`` of the outer dims.
        if hi <= lo:
            return
        fixed = (1,) * d
        if d == ndim - 1:
            boxes.append(ChunkBox(prefix + (lo,), fixed + (hi - lo,)))
            return
        first, head = divmod(lo, strides[d])
        last, tail = divmod(hi, strides[d])
        if first == last:
            split(head, tail, d + 1, prefix + (first,))
            return
        if head:
            split(head, strides[d], d + 1, prefix + (first,))
            first += 1
        if last > first:
            rest = shape[d + 1 :]
            boxes.append(ChunkBox(prefix + (first,) + (0,) * len(rest), fixed + (last - first,) + rest))
        split(0, tail, d + 1, prefix + (last,))

    split(flat.start, flat.stop, 0, ())
    return boxes


def _pieces(place: Place, shape: tuple[int, ...]) -> list[_Piece]:
    if isinstance(place, ChunkBox):
        strides = _row_major_strides(place.shape)
        base = -sum(o * s for o, s in zip(place.offsets, strides))
        return [_Piece(place, strides, base)]
    strides = _row_major_strides(shape)
    return [_Piece(box, strides, -place.start) for box in flat_range_boxes(place, shape)]


def _check_place(place: Place, shape: tuple[int, ...], role: str) -> None:
    if not isinstance(place, (ChunkBox, FlatRange)):
        raise TypeError(f"{role} place must be a ChunkBox or a FlatRange, got {type(place).__name__}")
    if not place.fits_in(shape):
        raise ValueError(f"{role} place {place} does not fit in global shape {shape}")


def byte_runs(global_shape: tuple[int, ...], itemsize: int, src: Place, dst: Place) -> list[ByteRun]:
    """The contiguous byte runs that copy every element ``src`` and ``dst`` share.

    ``src`` is a saved chunk's place and ``dst`` a destination's; each storage holds the row-major
    bytes of its place. Runs are sorted by src offset (and so by dst offset), disjoint in both,
    and maximally merged: no two consecutive runs continue each other in both src and dst. The
    cost is proportional to the number of runs, not of elements.
    """
    shape = tuple(global_shape)
    if itemsize <= 0:
        raise ValueError(f"itemsize must be positive, got {itemsize}")
    _check_place(src, shape, "src")
    _check_place(dst, shape, "dst")
    if isinstance(src, FlatRange) and isinstance(dst, FlatRange):
        overlap = src.intersect(dst)
        if overlap is None:
            return []
        start = overlap.start
        return [ByteRun((start - src.start) * itemsize, (start - dst.start) * itemsize, overlap.numel * itemsize)]

    merged: list[list[int]] = []  # [src, dst, length] in elements, extended in place while merging
    # Pieces of each place come in global order, so this nested loop emits runs in global order.
    for src_piece in _pieces(src, shape):
        for dst_piece in _pieces(dst, shape):
            common = src_piece.box.intersect(dst_piece.box)
            if common is not None:
                _append_box_runs(merged, common, src_piece, dst_piece)
    return [ByteRun(a * itemsize, b * itemsize, n * itemsize) for a, b, n in merged]


def _append_box_runs(merged: list[list[int]], common: ChunkBox, src: _Piece, dst: _Piece) -> None:
    """Append the runs of ``common`` (inside both pieces), one per index of its outer dimensions."""
    # Fold trailing dimensions into one run while the run so far spans a whole stride in both
    # storages (a dimension of extent 1 always folds): the longest possible contiguous copy.
    run, outer_ndim = 1, len(common.shape)
    while outer_ndim > 0:
        dim = outer_ndim - 1
        extent = common.shape[dim]
        if extent != 1 and not (src.strides[dim] == run and dst.strides[dim] == run):
            break
        run *= extent
        outer_ndim -= 1
    src_first = src.base + sum(o * s for o, s in zip(common.offsets, src.strides))
    dst_first = dst.base + sum(o * s for o, s in zip(common.offsets, dst.strides))
    for index in itertools.product(*(range(n) for n in common.shape[:outer_ndim])):
        src_at = src_first + sum(i * s for i, s in zip(index, src.strides))
        dst_at = dst_first + sum(i * s for i, s in zip(index, dst.strides))
        last = merged[-1] if merged else None
        if last is not None and last[0] + last[2] == src_at and last[1] + last[2] == dst_at:
            last[2] += run  # continues the previous run in both storages (e.g. across pieces)
        else:
            merged.append([src_at, dst_at, run])


def _bounds(interval: ReadRange | AlignedRead | tuple[int, int]) -> tuple[int, int]:
    if isinstance(interval, (ReadRange, AlignedRead)):
        return interval.start, interval.stop
    start, stop = interval
    return start, stop


def coalesce(intervals: Iterable[ReadRange | AlignedRead | tuple[int, int]], gap: int) -> list[ReadRange]:
    """Merge byte intervals that overlap or lie at most ``gap`` bytes apart, sorted by start.

    Reading a small gap costs less than issuing a second request. Empty intervals are dropped.
    """
    if gap < 0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    bounds = sorted(b for b in map(_bounds, intervals) if b[1] > b[0])
    out: list[list[int]] = []
    for start, stop in bounds:
        if out and start - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [ReadRange(a, b) for a, b in out]


def align_to_blocks(
    interval: ReadRange | tuple[int, int], block_bytes: int, chunk_nbytes: int
) -> AlignedRead:
    """Widen ``interval`` to whole checksum blocks of the chunk, the last one clipped to its end.

    The result can be verified against the chunk's block digests from ``first_block`` on.
    """
    start, stop = _bounds(interval)
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    if not 0 <= start <= stop <= chunk_nbytes:
        raise ValueError(f"interval [{start}, {stop}) is not inside a chunk of {chunk_nbytes} bytes")
    first_block = start // block_bytes
    aligned_start = first_block * block_bytes
    if stop == start:
        return AlignedRead(aligned_start, aligned_start, first_block)  # nothing to read or verify
    aligned_stop = min(-(-stop // block_bytes) * block_bytes, chunk_nbytes)
    return AlignedRead(aligned_start, aligned_stop, first_block)


def block_aligned_reads(
    runs: Iterable[ByteRun], block_bytes: int, chunk_nbytes: int, gap: int = 0
) -> list[AlignedRead]:
    """The verifiable reads that cover the src side of ``runs``: block-aligned, then coalesced.

    Aligning first keeps merged reads aligned (their ends are ends of aligned reads) and makes
    runs that share a block share one read.
    """
    aligned = [align_to_blocks((r.src_offset, r.src_stop), block_bytes, chunk_nbytes) for r in runs if r.length]
    return [AlignedRead(r.start, r.stop, r.start // block_bytes) for r in coalesce(aligned, gap)]
