"""Geometry of chunks in a global tensor: boxes, flat ranges, intersections. No I/O, no torch.distributed."""

from resurgo.layout.box import ChunkBox, FlatRange, Place

__all__ = ["ChunkBox", "FlatRange", "Place"]
