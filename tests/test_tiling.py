"""Whether chunk boxes tile a tensor exactly once, at the cost of one pass over them: checked
against pairwise comparison on small generated layouts, and bounded on the layout that made a
sweep quadratic (n tall columns beside n wide rows, a manifest of a few MB)."""

from __future__ import annotations

import itertools
import math
import time
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.errors import ManifestError
from resurgo.format.manifest import TensorEntry, check_coverage
from resurgo.layout.box import ChunkBox, covers_exactly_once


def _brute_force(boxes: list[ChunkBox], shape: tuple[int, ...]) -> bool:
    """Every element of the tensor counted: the definition itself."""
    if not all(b.fits_in(shape) for b in boxes):
        return False
    count = dict.fromkeys(itertools.product(*(range(n) for n in shape)), 0)
    for b in boxes:
        for cell in itertools.product(*(range(o, o + s) for o, s in zip(b.offsets, b.shape))):
            count[cell] += 1
    return all(v == 1 for v in count.values())


@st.composite
def layouts(draw) -> tuple[list[ChunkBox], tuple[int, ...]]:
    """A tiling by recursive cuts, then perhaps edited: a box moved, grown, shrunk, dropped or doubled."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    boxes = [ChunkBox((0,) * ndim, shape)]
    for _ in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        dims = [d for d in range(ndim) if b.shape[d] > 1]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, b.shape[d] - 1))
        lo = ChunkBox(b.offsets, b.shape[:d] + (cut,) + b.shape[d + 1:])
        hi = ChunkBox(b.offsets[:d] + (b.offsets[d] + cut,) + b.offsets[d + 1:], b.shape[:d] + (b.shape[d] - cut,) + b.shape[d + 1:])
        boxes[i:i + 1] = [lo, hi]
    edit = draw(st.sampled_from(["none", "none", "move", "grow", "drop", "double", "swap-sizes"]))
    if edit != "none" and boxes:
        i = draw(st.integers(0, len(boxes) - 1))
        b = boxes[i]
        if edit == "drop":
            boxes.pop(i)
        elif edit == "double":
            boxes.append(b)
        elif ndim:
            d = draw(st.integers(0, ndim - 1))
            delta = draw(st.sampled_from([-1, 1]))
            if edit == "move":
                boxes[i] = ChunkBox(b.offsets[:d] + (max(0, b.offsets[d] + delta),) + b.offsets[d + 1:], b.shape)
            elif edit == "grow":
                boxes[i] = ChunkBox(b.offsets, b.shape[:d] + (max(0, b.shape[d] + delta),) + b.shape[d + 1:])
            else:
                boxes[i] = ChunkBox(b.offsets, tuple(reversed(b.shape)))
    return boxes, shape


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_agrees_with_counting_every_element(layout):
    boxes, shape = layout
    assert covers_exactly_once(list(boxes), shape) == _brute_force(boxes, shape)


def test_overlaps_that_keep_the_total_are_caught():
    """Two boxes overlapping where a hole is elsewhere: the element count alone is right."""
    shape = (4, 4)
    boxes = [ChunkBox((0, 0), (2, 2)), ChunkBox((1, 1), (2, 2)), ChunkBox((0, 2), (2, 2)), ChunkBox((2, 0), (2, 2))]
    assert sum(b.numel for b in boxes) == 16 - 0 and not covers_exactly_once(boxes, shape)
    fixed = [ChunkBox((0, 0), (2, 2)), ChunkBox((2, 2), (2, 2)), ChunkBox((0, 2), (2, 2)), ChunkBox((2, 0), (2, 2))]
    assert covers_exactly_once(fixed, shape)


def _columns_and_rows(n: int) -> tuple[list[ChunkBox], tuple[int, int]]:
    """n columns of n rows, then n rows of n columns below them: a tensor of (2n, n)."""
    return ([ChunkBox((0, j), (n, 1)) for j in range(n)] + [ChunkBox((n + i, 0), (1, n)) for i in range(n)], (2 * n, n))


def test_tall_columns_beside_wide_rows_cost_one_pass():
    """The issue's bound: about 1 s per MB of manifest. A manifest listing 16,000 chunks is several MB;
    its tiling is checked (and its overlapping twin refused) in well under a second each."""
    n = 8000
    boxes, shape = _columns_and_rows(n)
    t = TensorEntry(kind="torch", dtype="float32", shape=list(shape))
    tracemalloc.start()
    t0 = time.perf_counter()
    check_coverage("w", t, boxes, lambda msg: (_ for _ in ()).throw(ManifestError(msg)))
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 5 and peak < 300 << 20, (seconds, peak)
    overlapping = boxes[:-1] + [ChunkBox((2 * n - 2, 0), (1, n))]  # the last row moved onto the one above it
    assert sum(b.numel for b in overlapping) == math.prod(shape)
    t0 = time.perf_counter()
    assert not covers_exactly_once(overlapping, shape)
    assert time.perf_counter() - t0 < 5
