"""The core of a version 4 manifest: each tensor's layout as a grid when it is regular, else its
pieces and their writers, from a save plan. Pure data.

Described once per plan: a repeated save of one layout reuses the plan's writes, and with them
this description (:func:`layouts_of` keeps the last one).
"""

from __future__ import annotations

import numpy as np

from resurgo.format.manifest import BoxPlace, FlatPlace, GridEntry, PieceEntry
from resurgo.layout.box import ChunkBox, Place, place_order
from resurgo.layout.grid import describe, describe_arrays
from resurgo.plan.global_plan import GlobalPlan, PlanWrites

Layout = GridEntry | list[PieceEntry]


def piece(place: Place, rank: int) -> PieceEntry:
    if isinstance(place, ChunkBox):
        return PieceEntry(box=BoxPlace(offsets=list(place.offsets), shape=list(place.shape)), rank=rank)
    return PieceEntry(flat=FlatPlace(start=place.start, stop=place.stop), rank=rank)


def describe_layouts(plan: GlobalPlan) -> dict[str, Layout]:
    """Each tensor's grid (:func:`resurgo.layout.grid.describe`) or, when it has none, its
    non-empty pieces in place order with the ranks that write them. From the planner's arrays
    when the plan keeps them (:class:`PlanWrites`): no write is built."""
    writes = plan.writes
    assigned = writes.placed() if isinstance(writes, PlanWrites) else {}
    placed: dict[str, list[tuple[Place, int]]] = {key: [] for key in plan.tensors if key not in assigned}
    for rank, ws in enumerate(writes.fixed if isinstance(writes, PlanWrites) else writes):
        for w in ws:
            if w.item.place.numel:  # an empty chunk holds nothing and is listed nowhere
                placed[w.item.key].append((w.item.place, rank))
    out: dict[str, Layout] = {}
    for key, meta in plan.tensors.items():
        if key in assigned:
            out[key] = _layout_of_chunks(meta.shape, *assigned[key])
        else:
            out[key] = layout_of(meta.shape, placed[key])
    return out


def _layout_of_chunks(shape: tuple[int, ...], places: tuple[Place, ...], boxes: tuple[np.ndarray, np.ndarray] | None,
                      ranks: np.ndarray) -> Layout:
    """:func:`layout_of` of a tensor's planned places, on the fast path's arrays when it has them."""
    if boxes is not None:
        grid = grid_of_arrays(shape, *boxes, ranks)
        if grid is not None:
            return grid
    return layout_of(shape, [(p, r) for p, r in zip(places, ranks.tolist()) if p.numel])


def grid_of_arrays(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, ranks: np.ndarray) -> GridEntry | None:
    """The grid of a tensor's boxes given as arrays (one row per box: offsets, sizes, writer rank;
    empty boxes are ignored), or None when its non-empty boxes form none."""
    if not shape or 0 in shape:
        return None
    full = (sizes > 0).all(axis=1)
    if not full.any():
        return None
    grid = describe_arrays(shape, offsets[full], sizes[full], ranks[full])
    return None if grid is None else GridEntry(parts=list(grid.parts), offset=grid.offset, strides=list(grid.strides))


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
