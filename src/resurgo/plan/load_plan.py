"""Load plan: which byte ranges to read from which file, into which buffer.

Pure data. A tensor stored as one whole chunk is read straight into its destination's memory;
a tensor stored in several chunks is read chunk by chunk into chunk buffers and assembled. Large
chunks are split into block-aligned pieces so that several threads share one big tensor and each
piece can be verified on its own; small chunks that lie back to back in a file are coalesced
into one vectored read (``preadv``), so a state of many small tensors costs few system calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from resurgo.format.manifest import TensorEntry
from resurgo.layout.box import ChunkBox, FlatRange

MAX_PIECE_BYTES = 16 << 20
MAX_PARTS_PER_READ = 512  # well under IOV_MAX (1024 on Linux)


@dataclass(frozen=True)
class ReadPart:
    """A block-aligned piece of one chunk, landing at ``buffer_offset`` of its buffer."""

    key: str
    chunk: int
    into: str  # "dest": the destination's bytes; "chunk": a buffer holding the whole chunk
    buffer_offset: int
    length: int
    first_block: int


@dataclass(frozen=True)
class ReadOp:
    """One vectored read: ``length`` bytes at ``file_offset``, scattered over ``parts`` in order."""

    file: str
    file_offset: int
    length: int
    parts: tuple[ReadPart, ...]


def reads_whole_into_dest(entry: TensorEntry) -> bool:
    """True when one chunk holds the whole tensor, so its bytes are the destination's bytes."""
    if len(entry.chunks) != 1:
        return False
    place = entry.chunks[0].place
    if isinstance(place, ChunkBox):
        return place.is_whole(tuple(entry.shape))
    return isinstance(place, FlatRange) and place.start == 0


def plan_reads(entries: dict[str, TensorEntry], max_piece_bytes: int = MAX_PIECE_BYTES) -> list[ReadOp]:
    pieces: list[tuple[str, int, ReadPart]] = []  # (file, file offset, part)
    for key, entry in entries.items():
        into = "dest" if reads_whole_into_dest(entry) else "chunk"
        for ci, chunk in enumerate(entry.chunks):
            block = chunk.block_bytes
            step = max(block, max_piece_bytes // block * block)
            start, stop = chunk.byte_range
            for off in range(0, stop - start, step):
                n = min(step, stop - start - off)
                pieces.append((chunk.file, start + off, ReadPart(key, ci, into, off, n, off // block)))
    pieces.sort(key=lambda p: (p[0], p[1]))
    ops: list[ReadOp] = []
    group: list[tuple[str, int, ReadPart]] = []

    def flush() -> None:
        if group:
            ops.append(ReadOp(group[0][0], group[0][1], sum(p[2].length for p in group), tuple(p[2] for p in group)))
            group.clear()

    for piece in pieces:
        if group:
            file, offset, _ = group[-1]
            contiguous = piece[0] == file and piece[1] == offset + group[-1][2].length
            fits = sum(p[2].length for p in group) + piece[2].length <= max_piece_bytes
            if not (contiguous and fits and len(group) < MAX_PARTS_PER_READ):
                flush()
        group.append(piece)
    flush()
    # Largest first keeps the thread pool busy to the end.
    ops.sort(key=lambda op: -op.length)
    return ops
