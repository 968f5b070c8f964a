"""Where a chunk sits in its global tensor.

A :class:`ChunkBox` is an axis-aligned block (offsets + shape); a :class:`FlatRange` is a
contiguous range ``[start, stop)`` of the row-major flattened tensor (ZeRO-style partitions).
Both are plain immutable data; everything here is pure and has no I/O.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class ChunkBox:
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def whole(shape: tuple[int, ...]) -> "ChunkBox":
        return ChunkBox(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_whole(self, global_shape: tuple[int, ...]) -> bool:
        return all(o == 0 for o in self.offsets) and tuple(self.shape) == tuple(global_shape)

    def fits_in(self, global_shape: tuple[int, ...]) -> bool:
        return len(self.offsets) == len(self.shape) == len(global_shape) and all(
            o >= 0 and s >= 0 and o + s <= g for o, s, g in zip(self.offsets, self.shape, global_shape)
        )

    def intersect(self, other: "ChunkBox") -> "ChunkBox | None":
        """The common box, or None when they share no element (empty boxes share nothing)."""
        if len(self.offsets) != len(other.offsets):
            raise ValueError(f"boxes of rank {len(self.offsets)} and {len(other.offsets)} cannot intersect")
        offsets, shape = [], []
        for a_o, a_s, b_o, b_s in zip(self.offsets, self.shape, other.offsets, other.shape):
            lo, hi = max(a_o, b_o), min(a_o + a_s, b_o + b_s)
            if hi <= lo:
                return None
            offsets.append(lo)
            shape.append(hi - lo)
        return ChunkBox(tuple(offsets), tuple(shape))

    def relative_to(self, outer: "ChunkBox") -> "ChunkBox":
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return ChunkBox(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))


@dataclass(frozen=True)
class FlatRange:
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def fits_in(self, global_shape: tuple[int, ...]) -> bool:
        return 0 <= self.start <= self.stop <= math.prod(global_shape)

    def intersect(self, other: "FlatRange") -> "FlatRange | None":
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return FlatRange(lo, hi) if hi > lo else None


Place = Union[ChunkBox, FlatRange]


def place_order(p: Place) -> tuple:
    """A sort key for places of one tensor: boxes by offsets then shape, flat ranges by start then stop."""
    return (p.offsets, p.shape) if isinstance(p, ChunkBox) else ((p.start,), (p.stop,))


def covers_exactly_once(places: list[Place], global_shape: tuple[int, ...]) -> bool:
    """True when the places tile the global tensor: inside it, disjoint, and summing to its size.

    All places must be of one kind (all boxes or all flat ranges). The cost is O(n log n) for n
    flat ranges and O(n * ndim) for n boxes (an untrusted manifest may hold many chunks).
    """
    if not all(p.fits_in(global_shape) for p in places):
        return False
    if sum(p.numel for p in places) != math.prod(global_shape):
        return False
    nonempty = [p for p in places if p.numel > 0]
    if len(nonempty) <= 1:  # inside the tensor and as many elements as it has: the whole of it
        return True
    flats = [p for p in nonempty if isinstance(p, FlatRange)]
    boxes = [p for p in nonempty if isinstance(p, ChunkBox)]
    if len(flats) == len(nonempty):
        ranges = sorted(flats, key=lambda r: r.start)
        return all(a.stop <= b.start for a, b in zip(ranges, ranges[1:]))
    if len(boxes) == len(nonempty):
        return _boxes_tile(boxes, tuple(global_shape))
    return False


_PRIME = (1 << 61) - 1


def _boxes_tile(boxes: list[ChunkBox], shape: tuple[int, ...]) -> bool:
    """Whether boxes inside ``shape`` cover each of its elements exactly once, in O(boxes x ndim).

    Along dimension ``d`` write ``u_d(c)`` for the indicator of ``x_d >= c``; a box is the product
    over its dimensions of ``u_d(offset) - u_d(offset + size)``. Products of such indicators at
    distinct corners are linearly independent functions, so the boxes tile the tensor exactly
    when the polynomial ``sum over boxes - the whole tensor's box`` in the variables ``u_d(c)`` is
    zero. That is tested by evaluating it at random points modulo a 61-bit prime (Schwartz-Zippel):
    a polynomial of degree ``ndim`` that is not zero vanishes there with probability at most
    ``ndim / 2**61``, and the points are drawn afresh for every call, so no input can aim at them.
    A sweep over the boxes compares each with the others its extent reaches: quadratic for n tall
    columns beside n wide rows.
    """
    rng = random.Random(random.SystemRandom().getrandbits(128))
    values: list[dict[int, int]] = [{} for _ in shape]

    def u(d: int, c: int) -> int:
        v = values[d].get(c)
        if v is None:
            v = values[d][c] = rng.randrange(1, _PRIME)
        return v

    total = 0
    for b in boxes:
        term = 1
        for d, (o, n) in enumerate(zip(b.offsets, b.shape)):
            term = term * (u(d, o) - u(d, o + n)) % _PRIME
        total += term
    whole = 1
    for d, n in enumerate(shape):
        whole = whole * (u(d, 0) - u(d, n)) % _PRIME
    return (total - whole) % _PRIME == 0
