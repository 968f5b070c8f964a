"""Geometry of chunks in a global tensor: boxes, flat ranges, intersections. No I/O, no torch.distributed."""

from resurgo.layout.box import ChunkBox, FlatRange, Place
from resurgo.layout.regions import (
    AlignedRead,
    ByteRun,
    ReadRange,
    align_to_blocks,
    block_aligned_reads,
    byte_runs,
    coalesce,
)

__all__ = [
    "ChunkBox",
    "FlatRange",
    "Place",
    "ByteRun",
    "ReadRange",
    "AlignedRead",
    "byte_runs",
    "coalesce",
    "align_to_blocks",
    "block_aligned_reads",
]
