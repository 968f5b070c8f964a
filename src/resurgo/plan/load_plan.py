"""Load plan: which byte ranges of which file to read, and where their bytes go.

Pure data. A *target* is a place of a global tensor that this rank fills (a whole tensor, or one
local piece of a sharded one). For every saved chunk overlapping a target, the layout geometry
(:func:`resurgo.layout.regions.byte_runs`) gives the byte runs they share:

- when the whole chunk lands as one contiguous run of the target (same place, a whole tensor, or
  a dim-0 shard of it), its bytes are read straight into the target's memory;
- otherwise only the checksum blocks holding shared bytes are read (nearby ranges coalesced),
  into a scratch buffer, verified, then scattered into the target. A rank never reads a chunk it
  does not overlap, nor materializes a tensor it does not own.

Large reads are split into block-aligned pieces so several threads share one big chunk and each
piece can be verified alone; small pieces back to back in a file are coalesced into one vectored
read (``preadv``), so a state of many small tensors costs few system calls.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from resurgo.format import dtypes
from resurgo.format.manifest import TensorEntry
from resurgo.layout.box import ChunkBox, Place
from resurgo.layout.regions import ByteRun, block_aligned_reads, byte_runs

MAX_PIECE_BYTES = 16 << 20
MAX_PARTS_PER_READ = 512  # well under IOV_MAX (1024 on Linux)
GAP_BYTES = 64 << 10  # reading a gap this small costs less than a second request


@dataclass(frozen=True)
class Target:
    """A place of tensor ``key`` that this rank fills; its bytes are ``place``'s, row-major."""

    key: str
    place: Place
    nbytes: int


@dataclass(frozen=True)
class Scatter:
    """Copy ``length`` bytes from ``src_offset`` of a part's scratch buffer to ``dst_offset`` of a target."""

    src_offset: int
    target: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class BoxCopy:
    """Copy a box of elements out of a part's scratch buffer in one strided copy: ``shape``
    elements of ``itemsize`` bytes, at byte ``src_offset`` with byte strides ``src_strides``, to
    byte ``dst_offset`` of target ``target`` with byte strides ``dst_strides``."""

    target: int
    shape: tuple[int, ...]
    itemsize: int
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]


@dataclass(frozen=True)
class ReadPart:
    """A block-aligned piece of chunk ``chunk`` of tensor ``key``, verifiable from ``first_block``.

    Direct (``target`` is not None): it lands at ``dst_offset`` of that target. Otherwise it is
    read into scratch and ``scatters`` (runs) or ``box`` (one strided box) copy the shared bytes out.
    """

    key: str
    chunk: int
    length: int
    first_block: int
    target: int | None
    dst_offset: int = 0
    scatters: tuple[Scatter, ...] = ()
    box: BoxCopy | None = None


@dataclass(frozen=True)
class ReadOp:
    """One vectored read: ``length`` bytes at ``file_offset``, laid over ``parts`` in order."""

    file: str
    file_offset: int
    length: int
    parts: tuple[ReadPart, ...]


def _pieces(start: int, stop: int, block: int, max_piece_bytes: int) -> list[tuple[int, int]]:
    step = max(block, max_piece_bytes // block * block)
    return [(off, min(off + step, stop)) for off in range(start, stop, step)]


def _scatters(runs: list[ByteRun], starts: list[int], lo: int, hi: int, target: int) -> tuple[Scatter, ...]:
    """The parts of ``runs`` (sorted by source) that fall in source bytes ``[lo, hi)``."""
    out = []
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(runs) and runs[i].src_offset < hi:
        r = runs[i]
        a, b = max(r.src_offset, lo), min(r.src_stop, hi)
        if b > a:
            out.append(Scatter(a - lo, target, r.dst_offset + (a - r.src_offset), b - a))
        i += 1
    return tuple(out)


def _strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, acc = [], itemsize
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _lands_contiguously(src: ChunkBox, dst: ChunkBox) -> bool:
    """Whether box ``src`` (inside ``dst``) is one contiguous byte range of ``dst``'s storage: past
    its first dimension of extent > 1, it spans ``dst`` fully."""
    dims = [d for d, n in enumerate(src.shape) if n > 1]
    return not dims or all(src.shape[d] == dst.shape[d] for d in range(dims[0] + 1, len(src.shape)))


def _box_slabs(src: ChunkBox, dst: ChunkBox, itemsize: int, block: int, chunk_nbytes: int, gap: int,
               max_piece_bytes: int, target: int) -> list[tuple[int, int, BoxCopy]] | None:
    """Reads of a box-to-box overlap as slabs of its outer dimension, each one block-aligned span
    (start, stop) copied out with one strided copy; or None when the shared bytes are too sparse in the chunk
    (a gap between two runs wider than ``gap``: reading per run wastes less)."""
    common = src.intersect(dst)
    if common is None or not common.shape:
        return None
    s_str, d_str = _strides(src.shape, itemsize), _strides(dst.shape, itemsize)
    inner = [(c - 1) * st for c, st in zip(common.shape, s_str)]
    for d in range(len(common.shape)):  # the widest jump between runs, dimension by dimension
        if common.shape[d] > 1 and s_str[d] - sum(inner[d + 1:]) - itemsize > gap:
            return None
    src0 = sum((o - b) * st for o, b, st in zip(common.offsets, src.offsets, s_str))
    dst0 = sum((o - b) * st for o, b, st in zip(common.offsets, dst.offsets, d_str))
    rows_per_slab = max(1, max_piece_bytes // max(1, s_str[0]))
    tail = sum(inner[1:]) + itemsize  # bytes from a row's first shared element to past its last
    out = []
    for a in range(0, common.shape[0], rows_per_slab):
        b = min(common.shape[0], a + rows_per_slab)
        first = src0 + a * s_str[0]
        last = first + (b - a - 1) * s_str[0] + tail
        start = first // block * block
        stop = min(-(-last // block) * block, chunk_nbytes)
        copy = BoxCopy(target, (b - a,) + common.shape[1:], itemsize, first - start, s_str,
                       dst0 + a * d_str[0], d_str)
        out.append((start, stop, copy))
    return out


def plan_reads(targets: list[Target], entries: dict[str, TensorEntry], max_piece_bytes: int = MAX_PIECE_BYTES,
               gap: int = GAP_BYTES) -> list[ReadOp]:
    pieces: list[tuple[str, int, ReadPart]] = []  # (file, file offset, part)
    for ti, t in enumerate(targets):
        entry = entries[t.key]
        shape = tuple(entry.shape)
        itemsize = dtypes.itemsize(entry.dtype)
        for ci, chunk in enumerate(entry.chunks):
            block = chunk.block_bytes
            src, dst = chunk.place, t.place

            def add(a: int, b: int, part_for) -> None:  # type: ignore[no-untyped-def]
                # A chunk stored in several extents (reused bytes) is read extent by extent.
                for file, offset, lo, hi in chunk.locate(a, b):
                    pieces.append((file, offset, part_for(lo, hi)))

            def direct(dst_offset: int):  # type: ignore[no-untyped-def]
                return lambda lo, hi: ReadPart(t.key, ci, hi - lo, lo // block, ti, dst_offset + lo)

            if isinstance(src, ChunkBox) and isinstance(dst, ChunkBox):
                # Boxes: decided from the intersection, without listing every run.
                common = src.intersect(dst)
                if common is None:
                    continue
                if common == src and _lands_contiguously(src, dst):
                    dst_offset = sum((a - b) * st for a, b, st in zip(src.offsets, dst.offsets, _strides(dst.shape, itemsize)))
                    for a, b in _pieces(0, chunk.nbytes, block, max_piece_bytes):
                        add(a, b, direct(dst_offset))
                    continue
                slabs = _box_slabs(src, dst, itemsize, block, chunk.nbytes, gap, max_piece_bytes, ti)
                if slabs is not None and chunk.extents is None:  # a slab is one read of one file
                    for start, stop, copy in slabs:
                        pieces.append((chunk.spans[0][0], chunk.spans[0][1] + start,
                                       ReadPart(t.key, ci, stop - start, start // block, None, box=copy)))
                    continue
            runs = byte_runs(shape, itemsize, src, dst)
            if not runs:
                continue
            if len(runs) == 1 and runs[0].length == chunk.nbytes:
                for a, b in _pieces(0, chunk.nbytes, block, max_piece_bytes):
                    add(a, b, direct(runs[0].dst_offset))
                continue
            starts = [r.src_offset for r in runs]
            for read in block_aligned_reads(runs, block, chunk.nbytes, gap):
                for a, b in _pieces(read.start, read.stop, block, max_piece_bytes):
                    add(a, b, lambda lo, hi: ReadPart(t.key, ci, hi - lo, lo // block, None, 0, _scatters(runs, starts, lo, hi, ti)))
    pieces.sort(key=lambda p: (p[0], p[1]))
    ops: list[ReadOp] = []
    group: list[tuple[str, int, ReadPart]] = []
    group_bytes = 0

    def flush() -> None:
        if group:
            ops.append(ReadOp(group[0][0], group[0][1], group_bytes, tuple(p[2] for p in group)))
            group.clear()

    for piece in pieces:
        if group:
            file, offset, last = group[-1]
            contiguous = piece[0] == file and piece[1] == offset + last.length
            fits = group_bytes + piece[2].length <= max_piece_bytes
            if not (contiguous and fits and len(group) < MAX_PARTS_PER_READ):
                flush()
                group_bytes = 0
        group.append(piece)
        group_bytes += piece[2].length
    flush()
    # Largest first keeps the thread pool busy to the end.
    ops.sort(key=lambda op: -op.length)
    return ops
