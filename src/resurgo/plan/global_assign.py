"""Who writes what in the global save plan: each tensor's distinct chunks and their holders
(:class:`Chunks`, from the array fast path :func:`regular_chunks` or the general
:func:`listed_chunks`), and their assignment, largest first, to the least loaded holder.

The result is a :class:`~resurgo.plan.global_types.GlobalPlan` whose writes are a
:class:`~resurgo.plan.global_types.PlanWrites`: arrays of the chunks, built into writes per rank
only when a rank reads its own.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import numpy as np

from resurgo.errors import ShardingError
from resurgo.format import dtypes
from resurgo.format.tree import per_rank_key
from resurgo.layout.box import ChunkBox, FlatRange, Place, place_order
from resurgo.layout.grid import grid_cells
from resurgo.plan.global_checks import agreed_meta, check_tiling
from resurgo.plan.global_types import GlobalPlan, PlanWrites, RankDecl, RankWrite, TensorDecl, TensorMeta
from resurgo.plan.save_plan import WriteItem


# The fewest ranks for which the arrays pay: below, their fixed cost per tensor exceeds the general
# path's cost per rank.
REGULAR_FROM = 16


def plan_tensors(decls: list[RankDecl], block_bytes_for: Callable[[int, int], int], tree: dict,
                 per_rank: set[str], regular_from: int = REGULAR_FROM, own: Collection[str] = frozenset()) -> GlobalPlan:
    """The plan of ``tree``'s tensors: each per-rank tensor (``per_rank``; ``own``, those under a
    PerRank, whose holders may differ in dtype and shape) written whole by its rank, every other
    tensor's chunks validated and assigned (see :func:`plan_global`)."""
    regular = len(decls) >= regular_from
    tensors: dict[str, TensorMeta] = {}
    writes: list[list[RankWrite]] = [[] for _ in decls]
    to_assign = _Assignment()
    keys = _same_keys(decls)
    table = _Table.of(decls, keys) if regular and keys is not None else None
    for i, (key, ranks, held) in enumerate(_by_key(decls, keys)):
        if key in per_rank:  # saved once per rank; under a PerRank, each of its own dtype and shape
            if key not in own:
                agreed_meta(key, ranks, held)
            for r, t in zip(ranks, held):
                if t.sharded:
                    raise ShardingError(f"tensor {key!r}: sharded, but it sits in a part of the state that differs "
                                        f"between ranks (saved per rank); only plain tensors can be saved per rank")
                k = per_rank_key(key, r)
                meta = tensors[k] = TensorMeta(t.kind, t.dtype, t.shape)
                itemsize = dtypes.itemsize(meta.dtype)
                block = block_bytes_for(math.prod(meta.shape) * itemsize, math.prod(meta.shape[1:]) * itemsize)
                whole = ChunkBox.whole(meta.shape)
                writes[r].append(RankWrite(WriteItem(k, k, meta.dtype, whole, whole.numel * itemsize, block), key, whole))
            continue
        meta = table.metas[i] if table is not None else agreed_meta(key, ranks, held)
        itemsize = dtypes.itemsize(meta.dtype)
        row_bytes = math.prod(meta.shape[1:]) * itemsize  # one index of the first dimension
        block = block_bytes_for(math.prod(meta.shape) * itemsize, row_bytes)
        tensors[key] = meta
        if table is not None:
            chunks = table.chunks(i)
        else:
            chunks = regular_chunks(meta.shape, ranks, held) if regular else None
        to_assign.add(key, meta.dtype, block, itemsize,
                      chunks if chunks is not None else listed_chunks(key, meta.shape, ranks, held))
    return GlobalPlan(tree, tensors, to_assign.assign(tuple(tuple(w) for w in writes)))


def _same_keys(decls: list[RankDecl]) -> tuple[str, ...] | None:
    """The tensor keys when every rank declares the same ones, once each, in the same order (the
    usual job); else None."""
    keys = tuple(map(_KEY, decls[0].tensors)) if decls else ()
    if len(set(keys)) == len(keys) and all(tuple(map(_KEY, d.tensors)) == keys for d in decls[1:]):
        return keys
    return None


def _by_key(decls: list[RankDecl], keys: tuple[str, ...] | None) -> Iterator[tuple[str, list[int], list[TensorDecl]]]:
    """Each tensor key in the order first declared, with the ranks holding it and their declarations
    (by columns when every rank declares the same ``keys``)."""
    if keys is not None:
        ranks = list(range(len(decls)))
        for key, held in zip(keys, zip(*(d.tensors for d in decls))):
            yield key, ranks, list(held)
        return
    by_key: dict[str, tuple[list[int], list[TensorDecl]]] = {}
    for r, d in enumerate(decls):
        for t in d.tensors:
            ranks_of, held_of = by_key.setdefault(t.key, ([], []))
            ranks_of.append(r)
            held_of.append(t)
    for key, (ranks_of, held_of) in by_key.items():
        yield key, ranks_of, held_of


_KEY = operator.attrgetter("key")
_META = operator.attrgetter("kind", "dtype", "shape")


@dataclass(frozen=True)
class Chunks:
    """A tensor's distinct places in place order, what each holds and who holds it: the input of
    the assignment. Plain data, from either :func:`regular_chunks` or :func:`listed_chunks`."""

    places: tuple[Place, ...]
    numels: tuple[int, ...]
    holders: tuple[tuple[int, ...], ...]  # ascending, without repeats
    # the fast path's boxes as arrays (offsets, sizes: places x dimensions), for the grid description
    boxes: tuple[np.ndarray, np.ndarray] | None = field(default=None, compare=False, repr=False)


def listed_chunks(key: str, shape: tuple[int, ...], ranks: list[int], held: list[TensorDecl]) -> Chunks:
    """The general path: every declared place, any number of holders each, the tiling checked
    place by place (the error names the tensor, the ranks and what is wrong)."""
    owners: dict[Place, list[int]] = {}
    for r, t in zip(ranks, held):
        for p in t.places:
            owners.setdefault(p, []).append(r)
    check_tiling(key, shape, owners)
    ordered = sorted(owners, key=place_order)
    return Chunks(tuple(ordered), tuple(p.numel for p in ordered), tuple(tuple(sorted(set(owners[p]))) for p in ordered))


def regular_chunks(shape: tuple[int, ...], ranks: list[int], held: list[TensorDecl]) -> Chunks | None:
    """The fast path, :func:`listed_chunks` with array operations: when the non-empty places are
    the cells of a grid (:func:`resurgo.layout.grid.grid_cells`), each held by one rank, and the
    empty ones lie inside the tensor. None otherwise (overlaps, replicas, holes, mixed kinds, a
    0-d tensor): the general path decides, and words the error."""
    declared = list(map(_PLACES, held))
    if not shape or set(map(len, declared)) != {1}:
        return None
    places = list(map(_FIRST, declared))
    kinds = set(map(type, places))
    if kinds == {ChunkBox}:
        offsets, sizes = _int_rows(map(_OFFSETS, places), len(places), len(shape)), \
            _int_rows(map(_SHAPE, places), len(places), len(shape))
        extent: tuple[int, ...] = shape
    elif kinds == {FlatRange}:  # a flat range is a 1-d box of the flattened tensor
        offsets, stops = _int_rows(map(_low, places), len(places), 1), _int_rows(map(_high, places), len(places), 1)
        sizes = None if offsets is None or stops is None else stops - offsets
        extent = (math.prod(shape),)
    else:
        return None
    if offsets is None or sizes is None:
        return None
    found = _regular(extent, offsets, sizes, np.asarray(ranks, dtype=np.int64))
    if found is None:
        return None
    at = found[0]
    return Chunks(tuple([places[i] for i in at]), *found[1:], boxes=(offsets[at], sizes[at]) if kinds == {ChunkBox} else None)


def _regular(extent: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, holder: np.ndarray
             ) -> tuple[list[int], tuple[int, ...], tuple[tuple[int, ...], ...]] | None:
    """:func:`regular_chunks` on arrays (one row per declared place, ``holder`` its rank): a row
    declaring each distinct place, in place order, the places' element counts and holders."""
    full = (sizes > 0).all(axis=1)
    empty = ~full
    if (sizes < 0).any() or (offsets[empty] < 0).any() or (offsets[empty] + sizes[empty] > np.array(extent)).any():
        return None
    if full.any() and grid_cells(extent, offsets[full], sizes[full]) is None:
        return None
    if not full.any() and 0 not in extent:  # elements, and no place holding any
        return None
    full_at = np.flatnonzero(full)
    rows = np.concatenate([offsets, sizes], axis=1)
    empty_rows, first, inverse = np.unique(rows[empty], axis=0, return_index=True, return_inverse=True)
    empty_at = np.flatnonzero(empty)
    distinct = np.concatenate([rows[full_at], empty_rows])  # the full places, then one of each empty place
    order = np.lexsort(distinct.T[::-1]) if len(distinct) > 1 else np.zeros(1, dtype=np.int64)
    numel = np.prod(sizes, axis=1)
    at = np.concatenate([full_at, empty_at[first]])[order]  # a declaration of each place, in place order
    groups = [tuple(sorted(set(g))) for g in _split_by(holder[empty_at], inverse.reshape(-1), len(empty_rows))]
    holders_of = [(h,) for h in holder[full_at].tolist()] + groups
    return at.tolist(), tuple(numel[at].tolist()), tuple([holders_of[i] for i in order.tolist()])


class _Table:
    """Every rank's declarations as arrays, read rank by rank (each rank's objects lie together in
    memory; reading them tensor by tensor, across ranks, costs a cache miss per value): built when
    every rank declares the same keys, kinds, dtypes and shapes, one place per tensor, of the
    same kind on every rank, as Python ints."""

    def __init__(self, metas: list[TensorMeta], places: list[list[Place]], columns: list[tuple[int, int]],
                 extents: list[tuple[int, ...]], offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.metas = metas
        self._places = list(zip(*places))  # per tensor, per rank
        self._columns = columns  # per tensor: its first column in the arrays, and how many
        self._extents = extents
        self._offsets = offsets  # ranks x columns: each place's offsets (a flat range's start)
        self._sizes = sizes  # its shape (a flat range's length)

    @staticmethod
    def of(decls: list[RankDecl], keys: tuple[str, ...]) -> _Table | None:
        if not decls or not keys:
            return None
        first = list(map(_META, decls[0].tensors))
        places = []
        lows: list[int] = []
        highs: list[int] = []
        kinds: list[type] = []
        widths: list[int] = []
        for d in decls:
            if list(map(_META, d.tensors)) != first:
                return None
            declared = list(map(_PLACES, d.tensors))
            if set(map(len, declared)) != {1}:
                return None
            mine = list(map(_FIRST, declared))
            if not kinds:
                kinds = list(map(type, mine))
                if not {ChunkBox, FlatRange} >= set(kinds):
                    return None
                boxes = kinds.count(ChunkBox) == len(kinds)
                widths = [len(m[2]) if k is ChunkBox else 1 for m, k in zip(first, kinds)]
            elif list(map(type, mine)) != kinds:
                return None
            places.append(mine)
            lo, hi = list(map(_OFFSETS if boxes else _low, mine)), list(map(_SHAPE if boxes else _high, mine))
            if list(map(len, lo)) != widths or list(map(len, hi)) != widths:
                return None
            lows.extend(itertools.chain.from_iterable(lo))
            highs.extend(itertools.chain.from_iterable(hi))
        width = sum(widths)
        if not {int} >= set(map(type, lows)) or not {int} >= set(map(type, highs)):
            return None
        try:
            offsets = np.fromiter(lows, dtype=np.int64, count=len(lows)).reshape(len(decls), width)
            sizes = np.fromiter(highs, dtype=np.int64, count=len(highs)).reshape(len(decls), width)
        except OverflowError:  # past int64
            return None
        if not boxes:
            flat = np.repeat(np.array([k is FlatRange for k in kinds]), widths)
            sizes[:, flat] -= offsets[:, flat]  # stop - start
        starts = np.cumsum([0] + widths).tolist()
        # the extents of the tensors whose places are boxes of their rank (0-d tensors go the general way)
        extents = [m[2] if k is ChunkBox else (math.prod(m[2]),) for m, k in zip(first, kinds)]
        return _Table([TensorMeta(*m) for m in first], places, list(zip(starts, widths)), extents, offsets, sizes)

    def chunks(self, i: int) -> Chunks | None:
        """:func:`regular_chunks` of tensor ``i``."""
        start, width = self._columns[i]
        if not self.metas[i].shape:
            return None
        lo, size = self._offsets[:, start:start + width], self._sizes[:, start:start + width]
        held = self._places[i]
        found = _regular(self._extents[i], lo, size, np.arange(len(held), dtype=np.int64))
        if found is None:
            return None
        at = found[0]
        return Chunks(tuple(map(held.__getitem__, at)), *found[1:],
                      boxes=(lo[at], size[at]) if isinstance(held[0], ChunkBox) else None)


def _low(p: Place) -> tuple[int, ...]:
    """A box's offsets, a flat range's start."""
    return p.offsets if isinstance(p, ChunkBox) else (p.start,)


def _high(p: Place) -> tuple[int, ...]:
    """A box's shape, a flat range's stop."""
    return p.shape if isinstance(p, ChunkBox) else (p.stop,)


_PLACES, _FIRST = operator.attrgetter("places"), operator.itemgetter(0)
_OFFSETS, _SHAPE = operator.attrgetter("offsets"), operator.attrgetter("shape")


def _int_rows(rows: Iterator[tuple[int, ...]], n: int, width: int) -> np.ndarray | None:
    """``n`` tuples of ``width`` Python ints as an int64 array (n x width); None when one is of
    another length or holds something else."""
    listed = list(rows)
    if set(map(len, listed)) != {width} or not {int} >= set(map(type, itertools.chain.from_iterable(listed))):
        return None
    try:
        return np.fromiter(itertools.chain.from_iterable(listed), dtype=np.int64, count=n * width).reshape(n, width)
    except OverflowError:  # past int64
        return None


def _split_by(values: np.ndarray, group: np.ndarray, groups: int) -> list[list[int]]:
    """``values`` split by their group number (0 to ``groups - 1``), each group in its order."""
    order = np.argsort(group, kind="stable")
    bounds = np.searchsorted(group[order], np.arange(groups + 1))
    ordered = values[order].tolist()
    return [ordered[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


class _Assignment:
    """Every tensor's chunks, assigned largest first (then by key, then by name), each to its least
    loaded holder (LPT): balances the bytes each rank writes. The order is found with arrays; a
    chunk with one holder goes to it, so only replicated chunks compare loads, and no write is
    built: the result is a :class:`PlanWrites`."""

    def __init__(self) -> None:
        self._tensors: list[tuple[str, str, int, Chunks]] = []  # key, dtype, block bytes, chunks
        self._nbytes: list[np.ndarray] = []

    def add(self, key: str, dtype: str, block: int, itemsize: int, chunks: Chunks) -> None:
        self._tensors.append((key, dtype, block, chunks))
        self._nbytes.append(np.asarray(chunks.numels, dtype=np.int64) * itemsize)

    def assign(self, fixed: tuple[tuple[RankWrite, ...], ...]) -> PlanWrites:
        """``fixed``: each rank's writes decided already (its per-rank tensors), first in its list."""
        world = len(fixed)
        counts = [len(c.places) for _, _, _, c in self._tensors]
        empty = np.zeros(0, dtype=np.int64)
        if not counts:
            return PlanWrites(fixed, [], empty, empty, empty, empty, np.zeros(world + 1, dtype=np.int64))
        key_order = np.empty(len(counts), dtype=np.int64)
        key_order[sorted(range(len(counts)), key=lambda i: self._tensors[i][0])] = np.arange(len(counts))
        tensor = np.repeat(np.arange(len(counts)), counts)
        index = np.concatenate([np.arange(n) for n in counts])  # each chunk's place in its tensor
        name_order = np.concatenate([_name_order(n) for n in counts])
        nbytes = np.concatenate(self._nbytes)
        order = np.lexsort((name_order, key_order[tensor], -nbytes))
        holders = list(itertools.chain.from_iterable(c.holders for _, _, _, c in self._tensors))
        single = np.fromiter(map(len, holders), dtype=np.int64, count=len(holders)) == 1
        rank = np.full(len(holders), -1, dtype=np.int64)
        rank[single] = [h[0] for h, one in zip(holders, single.tolist()) if one]
        load = np.array([sum(w.item.nbytes for w in ws) for ws in fixed], dtype=np.int64)
        done = 0  # the chunks before order[done] are counted in load
        for at in np.flatnonzero(~single[order]).tolist():  # replicated chunks, in LPT order
            before = order[done:at]  # each with one holder
            np.add.at(load, rank[before], nbytes[before])
            j = int(order[at])
            hs = holders[j]
            r = hs[int(np.argmin(load[list(hs)]))]  # the least loaded, the lowest rank among equals
            rank[j] = r
            load[r] += nbytes[j]
            done = at + 1
        by_rank = order[np.argsort(rank[order], kind="stable")]  # each rank's chunks, in LPT order
        bounds = np.searchsorted(rank[by_rank], np.arange(world + 1))
        kept = [(key, dtype, block, c.places, c.boxes) for key, dtype, block, c in self._tensors]  # not the holders
        return PlanWrites(fixed, kept, tensor, index, nbytes, by_rank, bounds)


@functools.lru_cache(maxsize=64)
def _name_order(n: int) -> np.ndarray:
    """Where each of the names ``key#0`` to ``key#{n-1}`` (or ``key`` alone) sorts among them, as strings."""
    out = np.empty(n, dtype=np.int64)
    out[sorted(range(n), key=str)] = np.arange(n)
    out.flags.writeable = False
    return out
