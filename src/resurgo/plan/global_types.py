"""The global save plan's data: what each rank declares (:class:`RankDecl`, :class:`TensorDecl`,
fingerprinted by :func:`layout_fingerprint`) and what every rank gets back (:class:`GlobalPlan`,
its writes as :class:`RankWrite` tuples or the assignment's compact :class:`PlanWrites`).

Plain data only: no planning decision is made here (see :mod:`resurgo.plan.global_plan`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import xxhash

from resurgo.layout.box import ChunkBox, Place
from resurgo.plan.save_plan import WriteItem


@dataclass(frozen=True)
class TensorDecl:
    """What one rank holds of one tensor."""

    key: str
    kind: Literal["torch", "numpy"]
    dtype: str
    shape: tuple[int, ...]  # global
    places: tuple[Place, ...]
    sharded: bool  # DTensor / Shard / FlatShard (a plain tensor is the whole of itself)
    digest: str | None = None  # of a small plain tensor's bytes: replicas that differ are kept per rank


@dataclass(frozen=True)
class RankDecl:
    tree: dict
    tensors: tuple[TensorDecl, ...]
    layout: str = ""  # fingerprint of the tensors' layout (not of their values); computed when empty

    def __post_init__(self) -> None:
        if not self.layout:  # computed by the rank that declares, so the coordinator only compares
            object.__setattr__(self, "layout", layout_fingerprint(self.tensors))


def _place_code(place: Place) -> list:
    if isinstance(place, ChunkBox):
        return ["box", list(place.offsets), list(place.shape)]
    return ["flat", place.start, place.stop]


def canonical_digest(value: Any) -> str:
    """xxh3-128 of a canonical JSON encoding: equal on every process for equal values."""
    return xxhash.xxh3_128_hexdigest(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def layout_fingerprint(tensors: tuple[TensorDecl, ...]) -> str:
    """A digest of what a plan depends on in these declarations: keys (in order), kinds, dtypes,
    shapes, places, whether a tensor is sharded and whether it is compared across ranks; not the
    compared digests themselves (values, not layout)."""
    return canonical_digest([[t.key, t.kind, t.dtype, list(t.shape), [_place_code(p) for p in t.places], t.sharded,
                             t.digest is not None] for t in tensors])


@dataclass(frozen=True)
class TensorMeta:
    kind: Literal["torch", "numpy"]
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)  # one per chunk, as WriteItem
class RankWrite:
    """A chunk a rank writes: the item, and which of its local tensors (key, place) holds the bytes."""

    item: WriteItem
    local_key: str
    local_place: Place


@dataclass(frozen=True)
class GlobalPlan:
    tree: dict
    tensors: dict[str, TensorMeta]  # manifest keys (per-rank tensors as key@rankN)
    writes: Sequence[tuple[RankWrite, ...]]  # per rank: a tuple, or the planner's PlanWrites

    def bytes_per_rank(self) -> list[int]:
        if isinstance(self.writes, PlanWrites):
            return self.writes.bytes_per_rank()
        return [sum(w.item.nbytes for w in ws) for ws in self.writes]


# An assigned tensor as the plan keeps it: key, dtype, block bytes, places in place order, boxes as arrays
_Assigned = tuple[str, str, int, tuple[Place, ...], "tuple[np.ndarray, np.ndarray] | None"]


class PlanWrites(Sequence[tuple[RankWrite, ...]]):
    """Every rank's writes (``writes[rank]``: a tuple of :class:`RankWrite`), kept as arrays of
    the chunks and built for a rank only when read: a job's plan holds a chunk per rank per
    tensor, and each rank reads only its own. Plain data: equal to, and printed as, the tuple of
    every rank's writes."""

    def __init__(self, fixed: tuple[tuple[RankWrite, ...], ...], tensors: list[_Assigned],
                 tensor: np.ndarray, index: np.ndarray, nbytes: np.ndarray, by_rank: np.ndarray,
                 bounds: np.ndarray) -> None:
        self._fixed = fixed  # per rank: the writes decided before the assignment, first in its list
        self._tensors = tensors
        self._tensor, self._index, self._nbytes = tensor, index, nbytes  # per chunk: its tensor, place, bytes
        self._by_rank = by_rank  # the chunks grouped by the rank writing them, each group in LPT order
        self._bounds = bounds  # rank r writes by_rank[bounds[r]:bounds[r + 1]]

    def __len__(self) -> int:
        return len(self._fixed)

    def __getstate__(self) -> dict:
        # the boxes serve the coordinator's layout description, which it makes from its own plan:
        # the ranks receiving the plan get the places alone
        return {**self.__dict__, "_tensors": [(key, dtype, block, places, None)
                                              for key, dtype, block, places, _ in self._tensors]}

    def __getitem__(self, rank):  # type: ignore[no-untyped-def, override]
        if isinstance(rank, slice):
            return tuple(self[r] for r in range(len(self))[rank])
        rank = range(len(self))[rank]  # IndexError past the world, as a tuple's
        chunks = self._by_rank[self._bounds[rank]:self._bounds[rank + 1]]
        built = []
        for t, i, nb in zip(self._tensor[chunks].tolist(), self._index[chunks].tolist(), self._nbytes[chunks].tolist()):
            key, dtype, block, places, _ = self._tensors[t]
            place = places[i]
            built.append(RankWrite(WriteItem(key, f"{key}#{i}" if len(places) > 1 else key, dtype, place, nb, block),
                                   key, place))
        return self._fixed[rank] + tuple(built)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PlanWrites({tuple(self)!r})"

    def bytes_per_rank(self) -> list[int]:
        """The bytes each rank writes, from the arrays."""
        fixed = [sum(w.item.nbytes for w in ws) for ws in self._fixed]
        assigned = np.zeros(len(self), dtype=np.int64)
        np.add.at(assigned, np.repeat(np.arange(len(self)), np.diff(self._bounds)), self._nbytes[self._by_rank])
        return [a + b for a, b in zip(fixed, assigned.tolist())]

    @property
    def fixed(self) -> tuple[tuple[RankWrite, ...], ...]:
        """Each rank's writes of its per-rank tensors (the first of its writes)."""
        return self._fixed

    def placed(self) -> dict[str, tuple[tuple[Place, ...], tuple[np.ndarray, np.ndarray] | None, np.ndarray]]:
        """Each assigned tensor's places (in place order), their boxes as arrays (as
        :attr:`Chunks.boxes`) and the rank writing each place."""
        rank = np.empty(len(self._tensor), dtype=np.int64)
        rank[self._by_rank] = np.repeat(np.arange(len(self)), np.diff(self._bounds))
        starts = np.cumsum([0] + [len(t[3]) for t in self._tensors]).tolist()
        return {key: (places, boxes, rank[a:b])
                for (key, _, _, places, boxes), a, b in zip(self._tensors, starts, starts[1:])}
