"""Writing data files: header first, then each chunk's bytes straight from memory, hashed as they pass.

One thread per data file; each writes large slices with ``os.write`` (which releases the GIL),
computes the block checksums of each slice just before writing it (while it is in cache), and
fsyncs its own file, so fsyncs overlap the other files' writes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from resurgo.dist import liveness
from resurgo.format import checksum
from resurgo.format.manifest import Span
from resurgo.format.safetensors_file import build_header
from resurgo.pipeline.buffers import TensorStream
from resurgo.plan.reuse_plan import Segment
from resurgo.plan.save_plan import FilePlan, SavePlan, WriteItem
from resurgo.storage.base import Staging

SLICE_BYTES = 8 << 20  # a multiple of every block size we use


@dataclass
class WrittenChunk:
    item: WriteItem
    file: str
    byte_range: tuple[int, int]
    block_bytes: int
    checksums: list[str]
    extents: list[Span] | None = None  # a chunk partly or wholly reused: where all its bytes are


def reused_extents(segments: list[Segment], file: str, start: int) -> list[Span]:
    """The extents of a chunk whose written segments lie back to back from ``start`` of ``file``;
    neighbours in one file that continue each other merge."""
    out: list[Span] = []
    for seg in segments:
        n = seg.stop - seg.start
        if seg.reference is None:
            span = (file, start, start + n)
            start += n
        else:
            span = (seg.reference, seg.offset, seg.offset + n)
        if out and out[-1][0] == span[0] and out[-1][2] == span[1]:
            out[-1] = (span[0], out[-1][1], span[2])
        else:
            out.append(span)
    return out


def digests_of(source: "np.ndarray | TensorStream", nbytes: int, block_bytes: int) -> list[str]:
    """The block digests of a source's bytes, slice by slice (compared with a base's before the
    save decides what to write)."""
    if not isinstance(source, TensorStream):
        return checksum.block_digests(source.data.cast("B"), block_bytes)
    unit = math.lcm(block_bytes, source.tensor.element_size())
    step = max(unit, SLICE_BYTES // unit * unit)
    buf = np.empty(min(step, nbytes), dtype=np.uint8)
    out: list[str] = []
    for off in range(0, nbytes, step):
        out.extend(checksum.block_digests(source.read_into(off, buf[:min(step, nbytes - off)]), block_bytes))
    return out


def sampled_digests(source: "np.ndarray | TensorStream", nbytes: int, block_bytes: int, picks: list[int]) -> list[str]:
    """The digests of blocks ``picks`` of a source's bytes, reading only those blocks."""
    if not isinstance(source, TensorStream):
        view = source.data.cast("B")
        return [checksum.digest(view[i * block_bytes : min((i + 1) * block_bytes, nbytes)]) for i in picks]
    out = []
    for i in picks:
        start, stop = i * block_bytes, min((i + 1) * block_bytes, nbytes)
        size = source.tensor.element_size()  # a stream reads whole elements
        lo, hi = start // size * size, -(-stop // size) * size
        out.append(checksum.digest(source.read_into(lo, np.empty(hi - lo, dtype=np.uint8))[start - lo : stop - lo]))
    return out


@dataclass
class WrittenFile:
    path: str
    nbytes: int
    header_bytes: int
    header_checksum: str
    chunks: list[WrittenChunk]
    seconds: dict[str, float] = field(default_factory=dict)


def chunk_file_offsets(plan: SavePlan) -> dict[str, tuple[int, int]]:
    """(where its bytes start in its data file, its block size) of each chunk, by name: where its
    staging buffer aligns, and how to hash it if it is hashed as it is staged."""
    return {item.name: (start, item.block_bytes) for f in plan.files
            for item, (start, _) in zip(f.items, build_header(f.header_entries)[1])}


def _streamed(source: TensorStream, parts: list[tuple[int, int]], step: int, buffer: np.ndarray) -> Iterator[memoryview]:
    """Bytes ``parts`` of a streamed tensor, slice by slice through ``buffer``."""
    for begin, end in parts:
        for off in range(begin, end, step):
            yield source.read_into(off, buffer[: min(step, end - off)])


def _gathered(data: memoryview, parts: list[tuple[int, int]], step: int, buffer: np.ndarray) -> Iterator[memoryview]:
    """Bytes ``parts`` of ``data``, back to back, in pieces of at most ``step`` bytes. Parts
    smaller than that are copied together into ``buffer`` (``step`` bytes at least), so that a
    chunk's scattered changed blocks cost a few writes, not one each (a write has a fixed cost far
    above a 4 KiB copy)."""
    array = np.frombuffer(data, dtype=np.uint8)
    group: list[np.ndarray] = []
    size = 0
    for begin, end in parts:
        for off in range(begin, end, step):
            n = min(step, end - off)
            if group and size + n > step:
                yield _joined(group, size, buffer)
                group, size = [], 0
            group.append(array[off : off + n])
            size += n
    if group:
        yield _joined(group, size, buffer)


def _joined(group: list[np.ndarray], size: int, buffer: np.ndarray) -> memoryview:
    return group[0].data if len(group) == 1 else np.concatenate(group, out=buffer[:size]).data


def write_data_file(staging: Staging, plan: FilePlan,
                    sources: Mapping[str, "np.ndarray | TensorStream"],
                    digests: Mapping[str, list[str]] | None = None,
                    reuse: Mapping[str, list[Segment]] | None = None,
                    sampled: Mapping[str, dict[int, str]] | None = None) -> WrittenFile:
    """Write one data file and fsync it. ``digests``: block digests already computed for some
    chunks (hashed as they were staged); the others are hashed here, but for blocks in
    ``sampled`` (chunk name -> block index -> digest, hashed to compare them with a base's).
    ``reuse``: of a partial chunk, its segments: only those the base lacks are written."""
    t_write = t_hash = 0.0
    slice_buffer: np.ndarray | None = None  # reused by every streamed or partial tensor of this file
    header, ranges = build_header(plan.header_entries)
    handle = staging.create(plan.path)
    try:
        t0 = time.perf_counter()
        handle.write(memoryview(header))
        t_write += time.perf_counter() - t0
        chunks = []
        for item, byte_range in zip(plan.items, ranges):
            source = sources[item.name]
            block_bytes = item.block_bytes
            # Streamed slices must also hold whole elements.
            unit = math.lcm(block_bytes, source.tensor.element_size()) if isinstance(source, TensorStream) else block_bytes
            step = max(unit, SLICE_BYTES // unit * unit)
            if (isinstance(source, TensorStream) or item.partial) and (slice_buffer is None or len(slice_buffer) < step):
                slice_buffer = np.empty(step, dtype=np.uint8)
            known = digests.get(item.name) if digests else None
            chunk_digests: list[str] = list(known) if known is not None else []
            hashed = sampled.get(item.name) if sampled else None
            segments = reuse.get(item.name) if reuse and item.partial else None
            assert segments is None or known is not None, "a partial chunk was hashed to compare it"
            parts = [(0, item.nbytes)] if segments is None else [(g.start, g.stop) for g in segments if g.reference is None]
            if isinstance(source, TensorStream):
                assert slice_buffer is not None
                pieces = _streamed(source, parts, step, slice_buffer)
            else:
                pieces = _gathered(source.data.cast("B"), parts, step, slice_buffer)  # type: ignore[arg-type]
            for piece in pieces:
                t0 = time.perf_counter()
                if known is None and hashed:  # then the chunk is one part: each piece starts on a block
                    chunk_digests.extend(checksum.block_digests_reusing(piece, block_bytes, hashed, len(chunk_digests)))
                elif known is None:
                    chunk_digests.extend(checksum.block_digests(piece, block_bytes))
                t1 = time.perf_counter()
                handle.write(piece)
                t_write += time.perf_counter() - t1
                liveness.progress()  # slow storage is not a stalled rank
                t_hash += t1 - t0
            extents = None if segments is None else reused_extents(segments, plan.path, byte_range[0])
            chunks.append(WrittenChunk(item, plan.path, byte_range, block_bytes, chunk_digests, extents))
        t0 = time.perf_counter()
        handle.fsync()
        t_fsync = time.perf_counter() - t0
        nbytes = handle.bytes_written
    finally:
        handle.close()
    return WrittenFile(plan.path, nbytes, len(header), checksum.digest(header), chunks, {"write": t_write, "checksum": t_hash, "fsync": t_fsync})
