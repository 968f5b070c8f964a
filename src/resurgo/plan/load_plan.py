"""Load plan: which byte ranges to read from which file, into which buffer.

Pure data. A tensor stored as one whole chunk is read straight into its destination's memory;
a tensor stored in several chunks is read chunk by chunk into chunk buffers and assembled. Large
reads are split into block-aligned pieces so that several threads share one big tensor and each
piece can be verified on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from resurgo.format.manifest import TensorEntry
from resurgo.layout.box import ChunkBox, FlatRange

MAX_PIECE_BYTES = 16 << 20


@dataclass(frozen=True)
class ReadOp:
    key: str
    chunk: int
    file: str
    file_offset: int
    length: int
    into: str  # "dest": the destination's bytes; "chunk": a buffer holding the whole chunk
    buffer_offset: int
    first_block: int


def reads_whole_into_dest(entry: TensorEntry) -> bool:
    """True when one chunk holds the whole tensor, so its bytes are the destination's bytes."""
    if len(entry.chunks) != 1:
        return False
    place = entry.chunks[0].place
    if isinstance(place, ChunkBox):
        return place.is_whole(tuple(entry.shape))
    return isinstance(place, FlatRange) and place.start == 0


def plan_reads(entries: dict[str, TensorEntry], max_piece_bytes: int = MAX_PIECE_BYTES) -> list[ReadOp]:
    ops: list[ReadOp] = []
    for key, entry in entries.items():
        into = "dest" if reads_whole_into_dest(entry) else "chunk"
        for ci, chunk in enumerate(entry.chunks):
            block = chunk.block_bytes
            piece = max(block, max_piece_bytes // block * block)
            start, stop = chunk.byte_range
            for off in range(0, stop - start, piece):
                ops.append(ReadOp(key, ci, chunk.file, start + off, min(piece, stop - start - off),
                                  into, off, off // block))
    # Largest first keeps the thread pool busy to the end.
    ops.sort(key=lambda op: -op.length)
    return ops
