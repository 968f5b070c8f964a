"""The core of a version 4 manifest: each tensor's layout as a grid when it is regular, else its
pieces and their writers, from a save plan. Pure data.

Described once per plan: a repeated save of one layout reuses the plan's writes, and with them
this description (:func:`layouts_of` keeps the last one).
"""

from __future__ import annotations

from resurgo.format.manifest import BoxPlace, FlatPlace, GridEntry, PieceEntry
from resurgo.layout.box import ChunkBox, Place, place_order
from resurgo.layout.grid import describe
from resurgo.plan.global_plan import GlobalPlan

Layout = GridEntry | list[PieceEntry]


def piece(place: Place, rank: int) -> PieceEntry:
    if isinstance(place, ChunkBox):
        return PieceEntry(box=BoxPlace(offsets=list(place.offsets), shape=list(place.shape)), rank=rank)
    return PieceEntry(flat=FlatPlace(start=place.start, stop=place.stop), rank=rank)


def describe_layouts(plan: GlobalPlan) -> dict[str, Layout]:
    """Each tensor's grid (:func:`resurgo.layout.grid.describe`) or, when it has none, its
    non-empty pieces in place order with the ranks that write them."""
    placed: dict[str, list[tuple[Place, int]]] = {key: [] for key in plan.tensors}
    for rank, writes in enumerate(plan.writes):
        for w in writes:
            if w.item.place.numel:  # an empty chunk holds nothing and is listed nowhere
                placed[w.item.key].append((w.item.place, rank))
    return {key: layout_of(plan.tensors[key].shape, chunks) for key, chunks in placed.items()}


def layout_of(shape: tuple[int, ...], chunks: list[tuple[Place, int]]) -> Layout:
    """One tensor's grid, or its pieces: ``chunks`` are its non-empty places and their writers."""
    grid = describe(shape, [(p, r) for p, r in chunks if isinstance(p, ChunkBox)]) \
        if all(isinstance(p, ChunkBox) for p, _ in chunks) else None
    if grid is not None:
        return GridEntry(parts=list(grid.parts), offset=grid.offset, strides=list(grid.strides))
    return [piece(p, r) for p, r in sorted(chunks, key=lambda c: place_order(c[0]))]


_last: tuple[object, dict[str, Layout]] | None = None


def layouts_of(plan: GlobalPlan) -> dict[str, Layout]:
    """:func:`describe_layouts`, computed once for the writes of the last plan."""
    global _last
    if _last is None or _last[0] is not plan.writes:
        _last = (plan.writes, describe_layouts(plan))
    return _last[1]
