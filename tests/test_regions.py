"""Byte runs between places, and the block-aligned reads that cover them, against numpy oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.format.checksum import block_digests, first_bad_block
from resurgo.layout.box import ChunkBox, FlatRange
from resurgo.layout.regions import (
    AlignedRead,
    ByteRun,
    ReadRange,
    align_to_blocks,
    block_aligned_reads,
    byte_runs,
    coalesce,
)

from strategies import boxes_in  # noqa: E402

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)
itemsizes = st.sampled_from([1, 2, 4, 8])


@st.composite
def flat_ranges_in(draw, shape):
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return FlatRange(start, draw(st.integers(start, n)))


def places_in(shape):
    return st.one_of(boxes_in(shape), flat_ranges_in(shape))


def element_ids(place, shape) -> np.ndarray:
    """Global row-major ids of the place's elements, in the order its storage holds them."""
    ids = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    if isinstance(place, ChunkBox):
        return ids[place.slices()].reshape(-1)
    return ids.reshape(-1)[place.start : place.stop]


def byte_labels(ids: np.ndarray, itemsize: int) -> np.ndarray:
    """One distinct label per byte: (element id, byte within the element), so a misplaced byte shows."""
    return (np.repeat(ids, itemsize) * itemsize + np.tile(np.arange(itemsize), len(ids))).astype(np.int64)


def check_runs(shape, itemsize, src, dst) -> list[ByteRun]:
    runs = byte_runs(shape, itemsize, src, dst)
    src_ids, dst_ids = element_ids(src, shape), element_ids(dst, shape)
    src_bytes = byte_labels(src_ids, itemsize)
    dst_bytes = np.full(len(dst_ids) * itemsize, -1, dtype=np.int64)
    for r in runs:
        assert r.length > 0
        assert r.src_offset % itemsize == r.dst_offset % itemsize == r.length % itemsize == 0
        assert 0 <= r.src_offset and r.src_stop <= len(src_bytes)
        assert 0 <= r.dst_offset and r.dst_stop <= len(dst_bytes)
        dst_bytes[r.dst_offset : r.dst_stop] = src_bytes[r.src_offset : r.src_stop]

    # Every shared element copied to its place in dst; everything else untouched.
    shared = np.isin(dst_ids, src_ids)
    expected = np.where(np.repeat(shared, itemsize), byte_labels(dst_ids, itemsize), -1)
    assert np.array_equal(dst_bytes, expected)
    assert sum(r.length for r in runs) == int(shared.sum()) * itemsize

    # Sorted and disjoint in src and in dst; maximally merged.
    for a, b in zip(runs, runs[1:]):
        assert a.src_stop <= b.src_offset
        assert a.dst_stop <= b.dst_offset
        assert not (a.src_stop == b.src_offset and a.dst_stop == b.dst_offset), (a, b)

    # As few runs as possible: one per maximal stretch contiguous in both storages.
    common = np.intersect1d(src_ids, dst_ids)
    src_pos, dst_pos = np.searchsorted(src_ids, common), np.searchsorted(dst_ids, common)
    breaks = (np.diff(src_pos) != 1) | (np.diff(dst_pos) != 1)
    assert len(runs) == (int(breaks.sum()) + 1 if len(common) else 0)
    return runs


@st.composite
def run_cases(draw):
    shape = draw(shapes)
    return shape, draw(itemsizes), draw(places_in(shape)), draw(places_in(shape))


@settings(max_examples=1000, deadline=None)
@given(run_cases())
def test_byte_runs_match_numpy(case):
    check_runs(*case)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None)
@given(run_cases())
def test_byte_runs_match_numpy_soak(case):
    check_runs(*case)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_byte_runs_of_each_pairing(data):
    """Every combination of kinds gets exercised, not only what one_of happens to draw."""
    shape, itemsize = data.draw(shapes), data.draw(itemsizes)
    kinds = {"box": boxes_in(shape), "flat": flat_ranges_in(shape)}
    for src_kind in kinds:
        for dst_kind in kinds:
            check_runs(shape, itemsize, data.draw(kinds[src_kind]), data.draw(kinds[dst_kind]))


def test_dim0_shard_to_dim0_shard_is_one_run():
    # rows 0-1 saved, rows 1-2 wanted: row 1 is 6 contiguous float32s in both
    runs = check_runs((4, 6), 4, ChunkBox((0, 0), (2, 6)), ChunkBox((1, 0), (2, 6)))
    assert runs == [ByteRun(src_offset=24, dst_offset=0, length=24)]


def test_dim0_shard_to_dim1_shard_is_one_run_per_row():
    runs = check_runs((4, 6), 4, ChunkBox((0, 0), (2, 6)), ChunkBox((0, 3), (4, 3)))
    assert runs == [ByteRun(12, 0, 12), ByteRun(36, 12, 12)]


def test_full_trailing_dims_fold_into_one_run():
    # 3-d dim-0 shards: each run spans whole (6, 5) slabs, not rows
    runs = check_runs((4, 6, 5), 2, ChunkBox((0, 0, 0), (3, 6, 5)), ChunkBox((1, 0, 0), (3, 6, 5)))
    assert runs == [ByteRun(60, 0, 120)]
    # a dim-1 split inside: one run per index of dim 0, each of 3 rows of 5
    runs = check_runs((4, 6, 5), 2, ChunkBox((0, 0, 0), (4, 6, 5)), ChunkBox((1, 3, 0), (2, 3, 5)))
    assert runs == [ByteRun(2 * (30 + 15), 0, 30), ByteRun(2 * (60 + 15), 30, 30)]


def test_flat_half_matrix_to_column_box():
    # elements [0, 12) of a (4, 6) matrix are rows 0-1; columns 2-3 of those two rows
    runs = check_runs((4, 6), 8, FlatRange(0, 12), ChunkBox((0, 2), (4, 2)))
    assert runs == [ByteRun(16, 0, 16), ByteRun(64, 16, 16)]
    # starting and ending mid-row: [9, 21) holds row 1 cols 3-5, row 2, row 3 cols 0-2;
    # columns 2-3 of that are one element of row 1, two of row 2, one of row 3
    runs = check_runs((4, 6), 1, FlatRange(9, 21), ChunkBox((0, 2), (4, 2)))
    assert runs == [ByteRun(0, 3, 1), ByteRun(5, 4, 2), ByteRun(11, 6, 1)]
    # and the other way round: a box saved, a flat range wanted
    runs = check_runs((4, 6), 1, ChunkBox((0, 2), (4, 2)), FlatRange(9, 21))
    assert runs == [ByteRun(3, 0, 1), ByteRun(4, 5, 2), ByteRun(6, 11, 1)]


def test_flat_to_flat_is_one_run():
    assert check_runs((4, 6), 4, FlatRange(5, 17), FlatRange(10, 24)) == [ByteRun(20, 0, 28)]
    assert check_runs((4, 6), 4, FlatRange(0, 5), FlatRange(5, 24)) == []


def test_zero_dim_and_zero_size():
    assert check_runs((), 8, ChunkBox((), ()), FlatRange(0, 1)) == [ByteRun(0, 0, 8)]
    assert check_runs((), 8, ChunkBox((), ()), ChunkBox((), ())) == [ByteRun(0, 0, 8)]
    assert check_runs((), 8, FlatRange(0, 0), ChunkBox((), ())) == []
    assert check_runs((0, 3), 4, ChunkBox((0, 0), (0, 3)), FlatRange(0, 0)) == []
    assert check_runs((4, 6), 4, ChunkBox((1, 0), (0, 6)), ChunkBox.whole((4, 6))) == []


def test_work_scales_with_runs_not_elements():
    """Shards of a tensor with 10**12 elements: a per-element loop would never finish."""
    shape, half = (10**6, 10**6), 5 * 10**5
    top, bottom = ChunkBox((0, 0), (half, 10**6)), ChunkBox((half - 1, 0), (half + 1, 10**6))
    assert byte_runs(shape, 2, top, bottom) == [ByteRun(2 * (half - 1) * 10**6, 0, 2 * 10**6)]
    flat = FlatRange(half * 10**6 - 3, half * 10**6 + 5)
    assert byte_runs(shape, 1, flat, bottom) == [ByteRun(0, 10**6 - 3, 8)]
    assert byte_runs(shape, 1, bottom, flat) == [ByteRun(10**6 - 3, 0, 8)]


def test_rejects_places_outside_the_tensor():
    with pytest.raises(ValueError, match="does not fit"):
        byte_runs((4, 6), 4, ChunkBox((3, 0), (2, 6)), ChunkBox.whole((4, 6)))
    with pytest.raises(ValueError, match="does not fit"):
        byte_runs((4, 6), 4, ChunkBox.whole((4, 6)), FlatRange(0, 25))
    with pytest.raises(ValueError, match="does not fit"):
        byte_runs((4, 6), 4, ChunkBox((0,), (4,)), ChunkBox.whole((4, 6)))
    with pytest.raises(ValueError, match="itemsize"):
        byte_runs((4, 6), 0, ChunkBox.whole((4, 6)), ChunkBox.whole((4, 6)))


# ---- reads: coalescing and block alignment ----

intervals = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])), max_size=12)


@settings(max_examples=300, deadline=None)
@given(intervals, st.integers(0, 30))
def test_coalesce_covers_inputs_and_only_skips_big_gaps(spans, gap):
    reads = coalesce(spans, gap)
    inputs = [(a, b) for a, b in spans if b > a]
    for a, b in inputs:
        assert sum(1 for r in reads if r.start <= a and b <= r.stop) == 1
    for r, s in zip(reads, reads[1:]):
        assert s.start - r.stop > gap
    for r in reads:
        inside = sorted((a, b) for a, b in inputs if r.start <= a and b <= r.stop)
        assert inside[0][0] == r.start and max(b for _, b in inside) == r.stop
        reach = inside[0][1]
        for a, b in inside[1:]:  # holes a read spans are at most ``gap`` long
            assert a - reach <= gap
            reach = max(reach, b)


def test_coalesce_examples():
    spans = [(10, 20), (0, 5), (5, 8), (22, 30), (50, 50)]
    assert coalesce(spans, 1) == [ReadRange(0, 8), ReadRange(10, 20), ReadRange(22, 30)]
    assert coalesce([(10, 20), (0, 5), (5, 8), (22, 30)], 2) == [ReadRange(0, 30)]
    assert coalesce([(10, 20), (0, 5)], 5) == [ReadRange(0, 20)]
    assert coalesce([], 0) == []
    with pytest.raises(ValueError, match="gap"):
        coalesce([(0, 1)], -1)


@st.composite
def chunk_intervals(draw):
    n = draw(st.integers(1, 1000))
    block = draw(st.integers(1, 128))
    start = draw(st.integers(0, n - 1))
    return n, block, (start, draw(st.integers(start + 1, n)))


@settings(max_examples=300, deadline=None)
@given(chunk_intervals())
def test_align_to_blocks_is_the_smallest_verifiable_cover(case):
    n, block, (start, stop) = case
    read = align_to_blocks((start, stop), block, n)
    assert read.start % block == 0 and read.first_block == read.start // block
    assert read.stop % block == 0 or read.stop == n
    assert read.start <= start < read.start + block
    assert stop <= read.stop <= n and read.stop < stop + block


def test_align_to_blocks_examples():
    assert align_to_blocks((5, 9), 4, 100) == AlignedRead(4, 12, 1)
    assert align_to_blocks(ReadRange(96, 99), 8, 99) == AlignedRead(96, 99, 12)
    assert align_to_blocks((8, 8), 4, 100) == AlignedRead(8, 8, 2)
    with pytest.raises(ValueError, match="not inside"):
        align_to_blocks((90, 101), 4, 100)
    with pytest.raises(ValueError, match="block_bytes"):
        align_to_blocks((0, 1), 0, 100)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_block_aligned_reads_verify_and_cover_the_runs(data):
    """From places to verified reads: every src byte a run needs is read, in checksummed blocks."""
    shape, itemsize = data.draw(shapes), data.draw(itemsizes)
    src, dst = data.draw(places_in(shape)), data.draw(places_in(shape))
    runs = byte_runs(shape, itemsize, src, dst)
    n = src.numel * itemsize
    block, gap = data.draw(st.integers(1, 64)), data.draw(st.integers(0, 64))
    if n == 0:
        assert block_aligned_reads(runs, block, n, gap) == []
        return
    chunk = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    digests = block_digests(memoryview(chunk), block)
    reads = block_aligned_reads(runs, block, n, gap)
    for r, s in zip(reads, reads[1:]):
        assert r.stop + gap < s.start
    for read in reads:
        assert read.start % block == 0 and (read.stop % block == 0 or read.stop == n) and read.stop <= n
        assert read.first_block == read.start // block
        assert first_bad_block(memoryview(chunk[read.start : read.stop]), block, digests, read.first_block) is None
    for run in runs:
        assert any(r.start <= run.src_offset and run.src_stop <= r.stop for r in reads)


def test_dataclasses_print_their_fields():
    assert repr(ByteRun(0, 8, 16)) == "ByteRun(src_offset=0, dst_offset=8, length=16)"
    assert repr(ReadRange(0, 8)) == "ReadRange(start=0, stop=8)"
    assert repr(AlignedRead(0, 8, 0)) == "AlignedRead(start=0, stop=8, first_block=0)"
