"""Pure logic, tested with hypothesis: box geometry, tiling checks, save and load plans, headers."""

from __future__ import annotations

import math

import numpy as np
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.format.manifest import ChunkEntry, TensorEntry
from resurgo.format.safetensors_file import build_header
from resurgo.layout.box import ChunkBox, FlatRange, covers_exactly_once
from resurgo.layout.box import ChunkBox as _Box
from resurgo.plan.load_plan import Target, plan_reads
from resurgo.plan.save_plan import WriteItem, plan_files
from strategies import boxes_in

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


def mask(box: ChunkBox, shape) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[box.slices()] = True
    return m


@given(st.data())
def test_box_intersection_matches_brute_force(data):
    shape = data.draw(shapes)
    a, b = data.draw(boxes_in(shape)), data.draw(boxes_in(shape))
    expected = mask(a, shape) & mask(b, shape)
    got = a.intersect(b)
    if got is None:
        assert not expected.any()
    else:
        assert np.array_equal(mask(got, shape), expected)
        assert got.numel == expected.sum()
        rel = got.relative_to(a)
        assert ChunkBox(tuple(x + y for x, y in zip(rel.offsets, a.offsets)), rel.shape) == got


@given(st.integers(0, 100), st.integers(0, 100), st.integers(0, 100), st.integers(0, 100))
def test_flat_range_intersection(a0, a1, b0, b1):
    a, b = FlatRange(min(a0, a1), max(a0, a1)), FlatRange(min(b0, b1), max(b0, b1))
    got = a.intersect(b)
    expected = set(range(a.start, a.stop)) & set(range(b.start, b.stop))
    assert (set(range(got.start, got.stop)) if got else set()) == expected


@st.composite
def grid_tiling(draw):
    """A shape cut into a grid of boxes along every dimension."""
    shape = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3).map(tuple))
    cuts = [sorted(set(draw(st.lists(st.integers(1, d - 1), max_size=3)) if d > 1 else [])) for d in shape]
    bounds = [[0, *c, d] for c, d in zip(cuts, shape)]
    boxes = []
    for idx in np.ndindex(*[len(b) - 1 for b in bounds]):
        boxes.append(ChunkBox(tuple(bounds[k][i] for k, i in enumerate(idx)),
                              tuple(bounds[k][i + 1] - bounds[k][i] for k, i in enumerate(idx))))
    return shape, boxes


@given(grid_tiling(), st.data())
def test_tiling_check(tiling, data):
    shape, boxes = tiling
    assert covers_exactly_once(boxes, shape)
    if len(boxes) > 1:
        i = data.draw(st.integers(0, len(boxes) - 1))
        assert not covers_exactly_once(boxes[:i] + boxes[i + 1:], shape)  # a gap
        j = (i + 1) % len(boxes)
        grown = boxes[:j] + [boxes[i]] + boxes[j + 1:]
        if boxes[i] != boxes[j]:
            assert not covers_exactly_once(grown + [boxes[j]], shape)  # an overlap


@given(st.lists(st.integers(0, 50), min_size=1, max_size=20), st.integers(0, 50))
def test_flat_tiling_check(cuts, drop):
    n = max(cuts)
    points = sorted(set([0, n, *cuts]))
    ranges = [FlatRange(a, b) for a, b in zip(points, points[1:])]
    assert covers_exactly_once(ranges, (n,))
    if len(ranges) > 1:
        assert not covers_exactly_once(ranges[:-1], (n,))
        assert not covers_exactly_once(ranges + [ranges[0]], (n,))


@given(st.lists(st.integers(0, 1 << 30), min_size=0, max_size=40), st.integers(1, 8), st.integers(1, 1 << 28))
def test_save_plan_assigns_every_item_once_and_balances(sizes, max_files, min_file):
    items = [WriteItem(f"k{i}", f"k{i}", "uint8", ChunkBox.whole((n,)), n, 65536) for i, n in enumerate(sizes)]
    plan = plan_files(items, rank=3, max_files=max_files, min_file_bytes=min_file)
    placed = [i.key for f in plan.files for i in f.items]
    assert sorted(placed) == sorted(i.key for i in items)
    assert 1 <= len(plan.files) <= max_files
    assert all(f.path.startswith("data/rank00003-") for f in plan.files)
    if sizes:
        loads = [f.nbytes for f in plan.files]
        nfiles = len(plan.files)
        # LPT bound: no file exceeds the mean by more than the largest item.
        assert max(loads) <= sum(sizes) / nfiles + max(sizes)


@given(st.lists(st.tuples(st.integers(0, 3 << 20), st.sampled_from([4096, 65536, 1 << 20])), min_size=1, max_size=6),
       st.integers(1, 8 << 20))
def test_read_plan_covers_every_byte_once_block_aligned(chunks, piece):
    entries = {}
    pos = 64
    for i, (nbytes, block) in enumerate(chunks):
        entries[f"t{i}"] = TensorEntry(kind="torch", dtype="uint8", shape=[nbytes], chunks=[ChunkEntry(
            box={"offsets": [0], "shape": [nbytes]}, file="data/x.safetensors", name=f"t{i}",
            byte_range=[pos, pos + nbytes], block_bytes=block, checksums=["0" * 32] * math.ceil(nbytes / block))])
        pos += nbytes
    targets = [Target(k, _Box.whole(tuple(e.shape)), e.chunks[0].nbytes) for k, e in entries.items()]
    ops = plan_reads(targets, entries, max_piece_bytes=piece)
    parts = []
    for op in ops:
        assert op.length == sum(p.length for p in op.parts)
        assert op.length <= max(piece, max(c[1] for c in chunks)) or len(op.parts) == 1
        offset = op.file_offset
        for p in op.parts:  # the parts of one read are back to back in the file
            parts.append((p, offset))
            offset += p.length
    for key, e in entries.items():
        c = e.chunks[0]
        mine = sorted(((p, off) for p, off in parts if p.key == key), key=lambda x: x[0].dst_offset)
        covered = 0
        for p, off in mine:
            assert p.target is not None and not p.scatters  # one whole chunk: read straight into place
            assert p.dst_offset == covered and off == c.byte_range[0] + covered
            assert p.dst_offset % c.block_bytes == 0 and p.first_block == p.dst_offset // c.block_bytes
            covered += p.length
        assert covered == c.nbytes
    # Coalescing: back-to-back small chunks share reads.
    if all(n <= piece for n, _ in chunks) and 0 < sum(n for n, _ in chunks) <= piece:
        assert len(ops) == 1


@settings(max_examples=30)
@given(st.lists(st.tuples(st.sampled_from(["float32", "bfloat16", "int64", "bool", "float8_e4m3fn", "complex128", "bits8"]),
                          st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6))
def test_header_is_valid_safetensors(specs):
    from resurgo.format import dtypes

    items, tensors = [], {}
    for i, (dt, shape) in enumerate(specs):
        t = torch.zeros(shape, dtype=torch.uint8).view(-1)
        n = math.prod(shape) * dtypes.itemsize(dt)
        items.append(WriteItem(f"k{i}", f"k{i}", dt, ChunkBox.whole(tuple(shape)), n, 65536))
        tensors[f"k{i}"] = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
    header, ranges = build_header([i.header_entry for i in items])
    blob = header + b"".join(tensors[f"k{i}"] for i in range(len(items)))
    assert len(header) % 8 == 0
    loaded = safetensors.torch.load(blob)
    for i, ((start, stop), item) in enumerate(zip(ranges, items)):
        assert blob[start:stop] == tensors[f"k{i}"]
        assert loaded[item.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes() == tensors[f"k{i}"]


@given(st.integers(0, 1 << 34))
def test_default_block_size(nbytes):
    from resurgo.format import checksum

    b = checksum.block_bytes_for(nbytes)
    assert b & (b - 1) == 0 and (1 << 12) <= b <= (1 << 20)
    if nbytes < 1 << 20:
        assert b == 1 << 16  # small tensors: at most 16 blocks
    else:
        # at most 1/256 of the tensor (the resharded-read bound); 256 to 512 blocks below the cap
        assert b * 256 <= nbytes
        assert checksum.block_count(nbytes, b) <= 512 or b == 1 << 20
        assert checksum.block_count(nbytes, b) >= 256


def test_boxes_of_different_rank_do_not_intersect():
    import pytest

    with pytest.raises(ValueError, match="rank"):
        ChunkBox((), ()).intersect(ChunkBox((1,), (3,)))
    assert ChunkBox((), ()).intersect(ChunkBox((), ())) == ChunkBox((), ())
