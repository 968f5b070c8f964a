"""The load plan executed against an in-memory file: any saved tiling (row blocks, column blocks,
flat ranges) read into any target place (a box or a flat range) gives exactly the target's bytes;
every read is whole checksum blocks; nothing outside the overlapping chunks is read."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.format.manifest import ChunkEntry, TensorEntry
from resurgo.layout.box import ChunkBox, FlatRange
from resurgo.layout.regions import byte_runs
from resurgo.pipeline.reader import copy_box, scatter
from resurgo.plan.load_plan import Target, plan_reads
from strategies import boxes_in

ITEMSIZE = 4


def _split(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = sorted({0, n, *[c % (n + 1) for c in cuts]})
    return list(zip(points, points[1:]))


@st.composite
def saved_tiling(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    kind = draw(st.sampled_from(["rows", "cols", "flat", "grid"]))
    cuts = draw(st.lists(st.integers(0, 100), max_size=4))
    if kind == "flat":
        return shape, [FlatRange(a, b) for a, b in _split(math.prod(shape), cuts)]
    dims = [0] if kind == "rows" or len(shape) == 1 else [len(shape) - 1] if kind == "cols" else [0, len(shape) - 1]
    per_dim = [_split(shape[d], cuts) if d in dims else [(0, shape[d])] for d in range(len(shape))]
    places = [()]
    for spans in per_dim:
        places = [p + (s,) for p in places for s in spans]
    return shape, [ChunkBox(tuple(a for a, _ in p), tuple(b - a for a, b in p)) for p in places]


def _elements(place, shape) -> np.ndarray:
    """Global flat indices of a place's elements, in its storage order."""
    idx = np.arange(math.prod(shape)).reshape(shape)
    if isinstance(place, FlatRange):
        return idx.reshape(-1)[place.start:place.stop]
    return idx[place.slices()].reshape(-1)


@settings(max_examples=600)
@given(saved_tiling(), st.data(), st.sampled_from([4, 8, 16, 64]), st.sampled_from([0, 8, 1 << 16]),
       st.sampled_from([16, 64, 1 << 20]))
def test_any_tiling_into_any_target(tiling, data, block, gap, max_piece):
    shape, places = tiling
    values = (np.arange(math.prod(shape), dtype=np.int64) * 2654435761 % (1 << 32)).astype(np.uint32)
    # the "file": chunks back to back after a fake header, each its elements in storage order
    file = bytearray(b"\xee" * 40)
    chunks = []
    for p in places:
        raw = values[_elements(p, shape)].astype("<u4").tobytes()
        start = len(file)
        file += raw
        box = {"offsets": list(p.offsets), "shape": list(p.shape)} if isinstance(p, ChunkBox) else None
        flat = {"start": p.start, "stop": p.stop} if isinstance(p, FlatRange) else None
        chunks.append(ChunkEntry(box=box, flat=flat, file="data/f.safetensors", byte_range=[start, len(file)],
                                 block_bytes=block, checksums=["0" * 32] * -(-len(raw) // block)))
    entry = TensorEntry(kind="numpy", dtype="uint32", shape=list(shape), chunks=chunks)
    if data.draw(st.booleans()):
        target_place = data.draw(boxes_in(shape))
    else:
        a = data.draw(st.integers(0, math.prod(shape)))
        target_place = FlatRange(a, data.draw(st.integers(a, math.prod(shape))))
    nbytes = target_place.numel * ITEMSIZE
    ops = plan_reads([Target("t", target_place, nbytes)], {"t": entry}, max_piece_bytes=max_piece, gap=gap)
    buf = np.full(nbytes, 0xAB, dtype=np.uint8)
    for op in ops:
        raw = np.frombuffer(bytes(file[op.file_offset:op.file_offset + op.length]), dtype=np.uint8)
        pos = 0
        for part in op.parts:
            c = chunks[part.chunk]
            rel = op.file_offset + pos - c.byte_range[0]
            assert 0 <= rel and rel + part.length <= c.nbytes  # inside its chunk
            assert rel == part.first_block * block  # starts on a block
            assert (rel + part.length) % block == 0 or rel + part.length == c.nbytes  # ends on one
            assert byte_runs(shape, ITEMSIZE, c.place, target_place)  # only overlapping chunks are read
            piece = raw[pos:pos + part.length].copy()
            if part.target is not None:
                buf[part.dst_offset:part.dst_offset + part.length] = piece
            if part.scatters:
                scatter(piece, part.scatters, [buf])
            if part.box is not None:
                copy_box(piece, part.box, [buf])
            pos += part.length
        assert pos == op.length
    expected = values[_elements(target_place, shape)].astype("<u4").view(np.uint8)
    assert bytes(buf) == bytes(expected)
