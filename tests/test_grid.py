"""Regular layouts (resurgo.layout.grid): the rule, its description of chunk lists, overlaps."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.layout.box import ChunkBox, covers_exactly_once
from resurgo.layout.grid import Grid, describe, grid_cells, part_bounds


@st.composite
def grids(draw):  # type: ignore[no-untyped-def]
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 12)) for _ in range(ndim))
    parts = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    offset = draw(st.integers(0, 50))
    strides = tuple(draw(st.integers(0, 9)) if p > 1 else 0 for p in parts)
    return shape, Grid(parts, offset, strides)


@given(st.integers(0, 40), st.integers(1, 12))
def test_parts_follow_torch_chunk(size, parts):
    pieces = torch.arange(size).chunk(parts)
    got = [part_bounds(size, parts, i) for i in range(parts)]
    want = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
    assert [b for b in got if b[1] > b[0]] == want


@given(grids())
def test_cells_tile_the_tensor_once(case):
    shape, grid = case
    boxes = [grid.box(shape, c) for c in grid.cells(shape)]
    assert all(b.numel > 0 for b in boxes)
    assert covers_exactly_once(list(boxes), shape)


@given(grids())
def test_describe_finds_the_grid_of_its_own_cells(case):
    shape, grid = case
    chunks = [(grid.box(shape, c), grid.writer(c)) for c in grid.cells(shape)]
    found = describe(shape, chunks)
    assert found is not None
    def key(chunk):  # type: ignore[no-untyped-def]
        return chunk[0].offsets, chunk[0].shape, chunk[1]

    assert sorted(((found.box(shape, c), found.writer(c)) for c in found.cells(shape)), key=key) == sorted(chunks, key=key)
    lo, hi = found.writer_bounds(shape)
    assert (lo, hi) == (min(r for _, r in chunks), max(r for _, r in chunks))


@given(grids(), st.data())
def test_describe_never_returns_a_grid_that_disagrees_with_the_chunks(case, data):
    shape, grid = case
    chunks = [(grid.box(shape, c), grid.writer(c)) for c in grid.cells(shape)]
    i = data.draw(st.integers(0, len(chunks) - 1))
    how = data.draw(st.sampled_from(["drop", "writer", "twice", "move"]))
    box, rank = chunks[i]
    if how == "drop":
        del chunks[i]
    elif how == "writer":
        chunks[i] = (box, rank + data.draw(st.integers(1, 1000)))
    elif how == "twice":
        chunks.append((box, rank))
    else:
        chunks[i] = (ChunkBox(tuple(o + 1 for o in box.offsets), box.shape), rank)
    found = describe(shape, chunks)
    if how in ("twice", "move") and box.shape or how == "drop" and chunks:
        assert found is None  # a cell twice, out of place, or missing
    if found is not None:
        def key(chunk):  # type: ignore[no-untyped-def]
            return chunk[0].offsets, chunk[0].shape, chunk[1]

        assert sorted(((found.box(shape, c), found.writer(c)) for c in found.cells(shape)), key=key) == sorted(chunks, key=key)


def test_a_balanced_split_that_is_not_torch_chunk_is_not_a_grid():
    # 10 rows over 4 ranks as 3, 3, 2, 2 (divmod) is not torch.chunk's 3, 3, 3, 1
    rows = [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert describe((10, 4), [(ChunkBox((a, 0), (n, 4)), r) for r, (a, n) in enumerate(rows)]) is None


@settings(max_examples=200)
@given(grids(), st.data())
def test_cells_overlapping_a_box_are_exactly_those_sharing_an_element(case, data):
    shape, grid = case
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, offsets))
    box = ChunkBox(offsets, sizes)
    want = sorted(c for c in grid.cells(shape) if grid.box(shape, c).intersect(box) is not None
                  and math.prod(box.shape) > 0)
    assert sorted(grid.cells_overlapping(shape, box)) == want


def _describe_per_chunk(shape, chunks):  # type: ignore[no-untyped-def]
    """The per-chunk rule describe followed before it used arrays: the reference it must match."""
    shape = tuple(shape)
    ndim = len(shape)
    if not chunks or math.prod(shape) == 0 or any(len(b.offsets) != ndim for b, _ in chunks):
        return None
    bounds = []
    for d, n in enumerate(shape):
        starts = sorted({b.offsets[d] for b, _ in chunks})
        parts = [part_bounds(n, len(starts), i) for i in range(len(starts))]
        if [a for a, _ in parts] != starts:
            return None
        bounds.append({a: (i, z - a) for i, (a, z) in enumerate(parts)})
    parts_per_dim = tuple(len(b) for b in bounds)
    if len(chunks) != math.prod(parts_per_dim):
        return None
    writers = {}
    for b, rank in chunks:
        at = []
        for d in range(ndim):
            i, size = bounds[d][b.offsets[d]]
            if size != b.shape[d]:
                return None
            at.append(i)
        writers[tuple(at)] = rank
    if len(writers) != len(chunks):
        return None
    offset = writers[(0,) * ndim]
    strides = tuple(0 if p == 1 else writers[tuple(1 if e == d else 0 for e in range(ndim))] - offset
                    for d, p in enumerate(parts_per_dim))
    if any(offset + sum(c * s for c, s in zip(cell, strides)) != rank for cell, rank in writers.items()):
        return None
    return Grid(parts_per_dim, offset, strides)


@settings(max_examples=400)
@given(grids(), st.data())
def test_describe_with_arrays_gives_what_the_per_chunk_rule_gives(case, data):
    """On grids' own cells and on random edits of them (random layouts), the same answer, with
    Python ints (a manifest's JSON and a plan's pickle are byte-identical)."""
    shape, grid = case
    chunks = [(grid.box(shape, c), grid.writer(c)) for c in grid.cells(shape)]
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(chunks) - 1))
        box, rank = chunks[i]
        how = data.draw(st.sampled_from(["drop", "writer", "twice", "move", "grow", "swap"]))
        if how == "drop" and len(chunks) > 1:
            del chunks[i]
        elif how == "writer":
            chunks[i] = (box, rank + data.draw(st.integers(-3, 3)))
        elif how == "twice":
            chunks.append((box, rank))
        elif how == "move" and box.offsets:
            d = data.draw(st.integers(0, len(box.offsets) - 1))
            chunks[i] = (ChunkBox(tuple(o + (e == d) for e, o in enumerate(box.offsets)), box.shape), rank)
        elif how == "grow" and box.shape:
            chunks[i] = (ChunkBox(box.offsets, (box.shape[0] + 1,) + box.shape[1:]), rank)
        elif how == "swap":
            j = data.draw(st.integers(0, len(chunks) - 1))
            chunks[i], chunks[j] = (box, chunks[j][1]), (chunks[j][0], rank)
    found, reference = describe(shape, chunks), _describe_per_chunk(shape, chunks)
    assert found == reference
    if found is not None:
        assert all(type(v) is int for v in (found.offset, *found.parts, *found.strides))


@settings(max_examples=200)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), st.data())
def test_grid_cells_accepts_exactly_the_boxes_that_tile_once(shape, data):
    # cuts anywhere along each dimension (not only torch.chunk's), then perhaps one box spoilt
    cuts = [sorted({0} | set(data.draw(st.lists(st.integers(1, n - 1), max_size=3)) if n > 1 else set())) + [n]
            for n in shape]
    boxes = [ChunkBox(tuple(c[i] for c, i in zip(cuts, cell)), tuple(c[i + 1] - c[i] for c, i in zip(cuts, cell)))
             for cell in itertools.product(*(range(len(c) - 1) for c in cuts))]
    boxes = data.draw(st.permutations(boxes))
    how = data.draw(st.sampled_from(["keep", "drop", "twice", "grow", "shrink", "empty"]))
    i = data.draw(st.integers(0, len(boxes) - 1))
    b = boxes[i]
    if how == "drop":
        del boxes[i]
    elif how == "twice":
        boxes.append(b)
    elif how in ("grow", "shrink"):
        d = data.draw(st.integers(0, len(shape) - 1))
        boxes[i] = ChunkBox(b.offsets, tuple(s + (1 if how == "grow" else -1) * (e == d) for e, s in enumerate(b.shape)))
    elif how == "empty":
        boxes[i] = ChunkBox(b.offsets, (0,) + b.shape[1:])
    offsets = np.array([x.offsets for x in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    sizes = np.array([x.shape for x in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    found = grid_cells(shape, offsets, sizes)
    assert (found is not None) == (all(x.numel for x in boxes) and covers_exactly_once(list(boxes), shape))
    if found is not None:
        starts, cells = found
        assert [s.tolist() for s in starts] == [c[:-1] for c in cuts]
        assert [tuple(int(s[k]) for s, k in zip(starts, cell)) for cell in cells] == [x.offsets for x in boxes]
