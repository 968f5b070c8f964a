"""The coordinator's save plan for a distributed job: one tree, every tensor covered exactly once,
each replicated chunk written by one rank, bytes balanced across ranks.

Pure data in, pure data out: every rank sends a :class:`RankDecl` (its tree and, per tensor, the
places it holds; metadata only, never tensor data), :func:`plan_global` validates and decides,
and every rank gets the same :class:`GlobalPlan` back. Values that differ between ranks become
``per_rank`` nodes of the tree (their tensors saved once per rank, under ``key@rankN``) instead of
collapsing into one copy.

Repeated saves of one layout send less: every rank keeps the last plan it received
(:meth:`PlanCache.hold`) and sends a :class:`RankSummary` (fixed-size fingerprints plus its values
at the tree's per-rank places, at most :data:`SMALL_VALUES_BYTES`); the coordinator reuses the last
plan from the summaries alone (:meth:`PlanCache.reuse`) or asks every rank for its full
:class:`RankDecl`.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import xxhash

from resurgo.errors import ShardingError, UnsupportedValueError
from resurgo.format import dtypes
from resurgo.format.tree import TENSORS, per_rank_key
from resurgo.gcpause import collector_paused
from resurgo.layout.box import ChunkBox, FlatRange, Place, covers_exactly_once, place_order
from resurgo.layout.grid import grid_cells
from resurgo.plan.save_plan import WriteItem
from resurgo.wording import on_ranks


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


def _digest(value: Any) -> str:
    """xxh3-128 of a canonical JSON encoding: equal on every process for equal values."""
    return xxhash.xxh3_128_hexdigest(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def layout_fingerprint(tensors: tuple[TensorDecl, ...]) -> str:
    """A digest of what a plan depends on in these declarations: keys (in order), kinds, dtypes,
    shapes, places, whether a tensor is sharded and whether it is compared across ranks; not the
    compared digests themselves (values, not layout)."""
    return _digest([[t.key, t.kind, t.dtype, list(t.shape), [_place_code(p) for p in t.places], t.sharded,
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


def _place_text(place: Place) -> str:
    if isinstance(place, ChunkBox):
        return f"box offsets {list(place.offsets)} shape {list(place.shape)}"
    return f"flat range [{place.start}, {place.stop})"


# -- trees ---------------------------------------------------------------------------------------
def _must_split(node: Any, keys: set[str]) -> bool:
    """True when ``node`` holds a per_rank node or a tensor whose replicas differ."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("type") == "per_rank" or n.get("type") in TENSORS and n.get("key") in keys:
                return True
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return False


def merge_trees(trees: list[dict], differing: set[str], own: set[str] | None = None) -> tuple[dict, set[str]]:
    """One tree for all ranks: equal parts kept once, parts that differ (or mention a tensor in
    ``differing``, or sit under a PerRank) as ``per_rank`` nodes. Returns the tree and the keys of
    the tensors saved per rank; ``own`` gets those of them under a PerRank (each rank's own
    tensor, of its own dtype and shape). Where the trees differ in shape, not only in values,
    every rank must hold the same tensors there, else UnsupportedValueError."""
    per_rank: set[str] = set()
    owned = own if own is not None else set()

    def rename(node: Any, rank: int) -> Any:
        if isinstance(node, dict):
            if node.get("type") in TENSORS and isinstance(node.get("key"), str):
                per_rank.add(node["key"])
                return {**node, "key": per_rank_key(node["key"], rank)}
            return {k: rename(v, rank) for k, v in node.items()}
        if isinstance(node, list):
            return [rename(v, rank) for v in node]
        return node

    def split(nodes: list[dict]) -> dict:
        items = [rename(n["items"][0] if n.get("type") == "per_rank" else n, r) for r, n in enumerate(nodes)]
        return {"type": "per_rank", "items": items}

    def split_own(nodes: list[dict]) -> dict:
        before = set(per_rank)
        merged = split(nodes)
        owned.update(per_rank - before)
        return merged

    def merge(nodes: list[dict]) -> dict:
        first = nodes[0]
        t = first.get("type")
        if any(n.get("type") == "per_rank" for n in nodes):  # a PerRank: the ranks' own, whatever they hold
            return split_own(nodes)
        if all(n == first for n in nodes[1:]) and not _must_split(first, differing):
            return first
        if all(n.get("type") == t for n in nodes):
            if t in ("dict", "ordered_dict"):
                keys = [p[0] for p in first["items"]]
                if all([p[0] for p in n["items"]] == keys for n in nodes[1:]):
                    return {"type": t, "items": [[k, merge([n["items"][i][1] for n in nodes])] for i, k in enumerate(keys)]}
            elif t in ("list", "tuple"):
                if all(len(n["items"]) == len(first["items"]) for n in nodes[1:]):
                    return {"type": t, "items": [merge([n["items"][i] for n in nodes]) for i in range(len(first["items"]))]}
            elif t == "stateful" and all(n["class"] == first["class"] for n in nodes[1:]):
                return {"type": t, "class": first["class"], "state": merge([n["state"] for n in nodes])}
        _check_same_tensors(nodes)
        return split(nodes)

    return merge(trees), per_rank


# The most tensor keys a message lists for one group of ranks.
KEYS_SHOWN = 4


def _tensor_keys(node: Any) -> list[str]:
    """The keys of the tensors in ``node`` outside any PerRank (their ranks' own), in tree order."""
    keys: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if n.get("type") == "per_rank":
                continue
            if n.get("type") in TENSORS and isinstance(n.get("key"), str):
                keys.append(n["key"])
                continue
            stack.extend(reversed(list(n.values())))
        elif isinstance(n, list):
            stack.extend(reversed(n))
    return keys


def _check_same_tensors(nodes: list[Any]) -> None:
    """Where the ranks' trees differ in shape (not only in values), every rank must hold the same
    tensors there: a tensor that only some ranks hold would be saved once per rank, each rank's
    copy under its own key, and no other layout could load it. Raises UnsupportedValueError
    naming, for each group of ranks, the tensors that not every rank holds (a few of them)."""
    held = [_tensor_keys(n) for n in nodes]
    sets = [frozenset(h) for h in held]
    if all(k == sets[0] for k in sets[1:]):
        return
    common = frozenset.intersection(*sets)

    def describe(keys: list[str]) -> str:
        extra = [k for k in keys if k not in common]
        if not extra:
            return "no other tensor"
        shown = ", ".join(map(repr, extra[:KEYS_SHOWN]))
        return shown + (f" and {len(extra) - KEYS_SHOWN} more" if len(extra) > KEYS_SHOWN else "")

    raise UnsupportedValueError(
        f"the ranks' states hold different tensors ({on_ranks([describe(h) for h in held])}); every rank "
        f"must hold the same tensors (each sharded one as a Shard, FlatShard or DTensor, even if empty on some "
        f"ranks), or wrap what is its own in resurgo.PerRank")


# -- tensors -------------------------------------------------------------------------------------
def _differing_replicas(decls: list[RankDecl]) -> set[str]:
    seen: dict[str, str | None] = {}
    out = set()
    for d in decls:  # most tensors carry no digest: those are skipped in C
        for t in itertools.compress(d.tensors, map(operator.is_not, map(_DIGEST, d.tensors), itertools.repeat(None))):
            if seen.setdefault(t.key, t.digest) != t.digest:
                out.add(t.key)
    return out


def _check_consistent(key: str, holders: list[tuple[int, TensorDecl]]) -> TensorMeta:
    """The one meta the ``holders`` of ``key`` agree on, else an error naming theirs: a tensor
    that is not sharded on every rank is the same whole tensor on each, so a difference is the
    ranks' disagreement (UnsupportedValueError, each rank's value); shards that disagree on the
    tensor they cut are a ShardingError."""
    if not all(t.sharded for _, t in holders):
        texts = {r: f"{t.kind} {t.dtype} {list(t.shape)}" for r, t in holders}
        if len(set(texts.values())) > 1:
            shown = "; ".join(f"{text} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                              for text, rs in _group(texts).items())
            raise UnsupportedValueError(
                f"tensor {key!r}: the ranks hold it differently ({shown}); a tensor that is not sharded must have "
                f"the same dtype and shape on every rank (declare its shards as a Shard, FlatShard or DTensor, "
                f"or wrap a rank's own in resurgo.PerRank)")
    r0, t0 = holders[0]
    for r, t in holders[1:]:
        if (t.kind, t.dtype) != (t0.kind, t0.dtype):
            raise ShardingError(f"tensor {key!r}: rank {r0} holds {t0.kind} {t0.dtype}, rank {r} holds {t.kind} {t.dtype}")
        if t.shape != t0.shape:
            raise ShardingError(f"tensor {key!r}: rank {r0} declares global shape {list(t0.shape)}, rank {r} {list(t.shape)}")
    return TensorMeta(t0.kind, t0.dtype, t0.shape)


def _group(texts: dict[int, str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, text in texts.items():
        groups.setdefault(text, []).append(rank)
    return groups


def _check_tiling(key: str, shape: tuple[int, ...], owners: dict[Place, list[int]]) -> None:
    places = list(owners)
    if covers_exactly_once(places, shape):
        return
    for p in places:
        if not p.fits_in(shape):
            raise ShardingError(f"tensor {key!r}: rank {owners[p][0]} holds {_place_text(p)}, outside the shape {list(shape)}")
    if len({type(p) for p in places if p.numel}) > 1:
        raise ShardingError(f"tensor {key!r}: ranks mix block shards and flat shards "
                            f"(block: ranks {sorted({r for p in places if isinstance(p, ChunkBox) for r in owners[p]})}, "
                            f"flat: ranks {sorted({r for p in places if isinstance(p, FlatRange) for r in owners[p]})})")
    total = sum(p.numel for p in places)
    need = math.prod(shape)
    overlap = _find_overlap(places)
    if overlap is not None:
        a, b = overlap
        raise ShardingError(f"tensor {key!r}: the shards of ranks {owners[a]} ({_place_text(a)}) and ranks "
                            f"{owners[b]} ({_place_text(b)}) overlap but are not the same shard")
    raise ShardingError(f"tensor {key!r}: the ranks' shards hold {total} of its {need} elements "
                        f"(global shape {list(shape)}): some part is held by no rank")


def _find_overlap(places: list[Place]) -> tuple[Place, Place] | None:
    ne = [p for p in places if p.numel]
    for i, a in enumerate(ne):  # only on the error path
        for b in ne[i + 1:]:
            if type(a) is type(b) and a.intersect(b) is not None:  # type: ignore[arg-type]
                return a, b
    return None


# The fewest ranks for which the arrays pay: below, their fixed cost per tensor exceeds the general
# path's cost per rank.
REGULAR_FROM = 16


def plan_global(decls: list[RankDecl], block_bytes_for: Callable[[int, int], int],
                regular_from: int = REGULAR_FROM) -> GlobalPlan:
    """Validate every rank's declarations and decide who writes what (see the module docstring).

    ``block_bytes_for(global_nbytes, row_bytes)`` gives the checksum block size of a tensor's chunks
    (``row_bytes``: the bytes of one index of its first dimension).
    Raises ShardingError naming the tensor and the ranks when the shards do not fit together.

    From ``regular_from`` ranks on, each tensor's chunks are first looked for as a grid with one
    holder per chunk, with arrays (:func:`regular_chunks`); the tensors that are not, and smaller
    jobs, take the general path (:func:`listed_chunks`). Both give the same plan.
    """
    with collector_paused():  # an object per chunk, all kept: see resurgo.gcpause
        own: set[str] = set()
        tree, per_rank = merge_trees([d.tree for d in decls], _differing_replicas(decls), own)
        return _plan_tensors(decls, block_bytes_for, tree, per_rank, regular_from, own)


class PlanCache:
    """The last plan's tensor part, reused while nothing it depends on changed.

    Saves of one job every N steps declare the same layout each time; only the values in the tree
    change. Planning is most of the coordinator's work (2.2 s of 2.4 s for 256 ranks of 1,000
    tensors; the tree merge is the rest), so when every rank's layout fingerprint, the tensors
    kept per rank and the block-size rule are those of the last plan, the coordinator merges the
    new trees and takes the tensors and writes from the last plan. One entry: a job alternating
    between two states replans each time.

    Every rank also holds the last plan it received (:meth:`hold`), to send a
    :class:`RankSummary` instead of its declarations (:meth:`summarize`) and to take its writes
    from that plan when the coordinator reuses it (:meth:`reused`).
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._plan: GlobalPlan | None = None
        self._held: _Held | None = None
        self.hits = 0

    def plan(self, decls: list[RankDecl], block_bytes_for: Callable[[int, int], int], block_rule: Hashable) -> GlobalPlan:
        """:func:`plan_global`, or its reuse. ``block_rule`` identifies ``block_bytes_for`` (e.g. the
        fixed block size asked for, or None for the default rule)."""
        with collector_paused():
            own: set[str] = set()
            tree, per_rank = merge_trees([d.tree for d in decls], _differing_replicas(decls), own)
            key = (tuple(d.layout for d in decls), frozenset(per_rank), block_rule)
            if key == self._key and self._plan is not None:
                self.hits += 1
                return GlobalPlan(tree, self._plan.tensors, self._plan.writes)
            self._key, self._plan = None, None  # a failed plan leaves nothing to reuse
            plan = _plan_tensors(decls, block_bytes_for, tree, per_rank, own=own)
            self._key, self._plan = key, plan
            return plan

    def ticket(self) -> tuple[str, frozenset[str]]:
        """The id of the last plan made (equal on every process for equal inputs) and the keys of
        the tensors it saves per rank: what every rank passes to :meth:`hold`."""
        assert self._key is not None
        return _key_id(self._key), self._key[1]

    def hold(self, plan_id: str, plan: GlobalPlan, per_rank: frozenset[str]) -> None:
        """Every rank, with each plan it receives: the basis of its next :meth:`summarize`."""
        places = per_rank_places(plan.tree)
        self._held = _Held(plan_id, _digest([plan_id, [list(p) for p in places]]), places, per_rank, plan)

    def summarize(self, decl: RankDecl) -> RankSummary:
        """This rank's summary against the plan it holds (an empty ``basis`` when it holds none,
        its tree lacks a per-rank place, or its values there exceed :data:`SMALL_VALUES_BYTES`)."""
        held = self._held
        unusable = RankSummary("", decl.layout, "", (), ())
        if held is None:
            return unusable
        try:
            values = tuple(_at(decl.tree, p) for p in held.places)
        except (KeyError, IndexError, TypeError):
            return unusable
        digests = tuple((t.key, t.digest) for t in decl.tensors if t.digest is not None and t.key in held.per_rank)
        if len(json.dumps([values, digests], separators=(",", ":"))) > SMALL_VALUES_BYTES:
            return unusable
        others = [[t.key, t.digest] for t in decl.tensors if t.digest is not None and t.key not in held.per_rank]
        shared = _digest([_replace_at(decl.tree, held.places, [None] * len(held.places)), others])
        return RankSummary(held.basis, decl.layout, shared, values, digests)

    def reuse(self, tree: dict, summaries: list[RankSummary], block_rule: Hashable) -> dict | None:
        """The coordinator (``tree``: its own): the merged tree of this save when the last plan
        holds for every rank's summary, else None (then every rank sends its declarations). The
        merge is :func:`merge_trees` over each rank's tree, rebuilt from the coordinator's tree and
        that rank's values at the per-rank places: equal summaries mean equal trees elsewhere."""
        held, key = self._held, self._key
        if (held is None or key is None or self._plan is None or held.plan_id != _key_id(key)
                or key[2] != block_rule or tuple(s.layout for s in summaries) != key[0]
                or any(s.basis != held.basis or s.shared != summaries[0].shared for s in summaries)):
            return None
        with collector_paused():
            seen: dict[str, str] = {}
            differing = {k for s in summaries for k, d in s.digests if seen.setdefault(k, d) != d}
            rebuild = _replacer(held.places)
            merged, per_rank = merge_trees([rebuild(tree, s.values) for s in summaries], differing)
        if frozenset(per_rank) != key[1]:
            return None
        self.hits += 1
        return merged

    def reused(self, tree: dict) -> GlobalPlan:
        """Every rank, when the coordinator reused the plan: the held plan with this save's tree."""
        held = self._held
        assert held is not None
        plan = GlobalPlan(tree, held.plan.tensors, held.plan.writes)
        self.hold(held.plan_id, plan, held.per_rank)
        return plan


# -- fingerprint-only gathers --------------------------------------------------------------------
# The most a rank's values at the per-rank places of the tree (RNG states, PerRank leaves) and the
# digests of its per-rank tensors may weigh, JSON-encoded, in a summary; more, and it sends its
# declarations. A summary is this plus three 32-character digests.
SMALL_VALUES_BYTES = 16 << 10


@dataclass(frozen=True)
class RankSummary:
    """What a rank sends when the last plan may hold: fingerprints of a fixed size and its values."""

    basis: str  # the plan and per-rank places it was cut against; "" when it cannot be used
    layout: str  # layout_fingerprint of its tensors
    shared: str  # its tree off the per-rank places, and the compared digests of its other tensors
    values: tuple  # its subtrees at the per-rank places
    digests: tuple[tuple[str, str], ...]  # (key, digest) of its compared tensors the plan saves per rank


@dataclass(frozen=True)
class _Held:
    plan_id: str
    basis: str
    places: tuple[tuple, ...]
    per_rank: frozenset[str]
    plan: GlobalPlan


def _key_id(key: tuple) -> str:
    layouts, per_rank, block_rule = key
    return _digest([list(layouts), sorted(per_rank), repr(block_rule)])


def per_rank_places(tree: dict) -> tuple[tuple, ...]:
    """The JSON paths (object keys, list indexes) of the outermost ``per_rank`` nodes of a tree."""
    out = []
    stack: list[tuple[Any, tuple]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "per_rank":
                out.append(path)
            else:
                stack.extend((v, path + (k,)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, path + (i,)) for i, v in enumerate(node))
    return tuple(sorted(out, key=lambda p: [(isinstance(s, str), s) for s in p]))


def _at(tree: Any, path: tuple) -> Any:
    """The node at ``path``; KeyError, IndexError or TypeError when the tree has none there."""
    for step in path:
        if not isinstance(tree, (dict, list)):  # a str or number indexes too, but holds no node
            raise TypeError(f"no container at {path}")
        tree = tree[step]
    return tree


def _replace_at(tree: Any, paths: tuple[tuple, ...], values: Any) -> Any:
    """``tree`` with the node at each path replaced by the matching value; the nodes on no path are
    shared, not copied (so comparing two such trees costs only their paths)."""
    return _replacer(paths)(tree, values)


def _replacer(paths: tuple[tuple, ...]) -> Callable[[Any, Any], Any]:
    """:func:`_replace_at` for these paths, walked once: the coordinator applies it to each rank."""
    if paths == ((),):
        return lambda tree, values: values[0]
    trie: dict = {}
    for i, path in enumerate(paths):
        node = trie
        for step in path[:-1]:
            node = node.setdefault(step, {})
        node[path[-1]] = i

    def rebuild(tree: Any, node: dict, values: Any) -> Any:
        out = dict(tree) if isinstance(tree, dict) else list(tree)
        for step, sub in node.items():
            out[step] = values[sub] if isinstance(sub, int) else rebuild(tree[step], sub, values)
        return out

    return lambda tree, values: rebuild(tree, trie, values) if paths else tree


def _plan_tensors(decls: list[RankDecl], block_bytes_for: Callable[[int, int], int], tree: dict,
                  per_rank: set[str], regular_from: int = REGULAR_FROM, own: Collection[str] = frozenset()) -> GlobalPlan:
    regular = len(decls) >= regular_from
    tensors: dict[str, TensorMeta] = {}
    writes: list[list[RankWrite]] = [[] for _ in decls]
    to_assign = _Assignment()
    keys = _same_keys(decls)
    table = _Table.of(decls, keys) if regular and keys is not None else None
    for i, (key, ranks, held) in enumerate(_by_key(decls, keys)):
        if key in per_rank:  # saved once per rank; under a PerRank, each of its own dtype and shape
            if key not in own:
                _meta(key, ranks, held)
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
        meta = table.metas[i] if table is not None else _meta(key, ranks, held)
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


_KEY, _DIGEST = operator.attrgetter("key"), operator.attrgetter("digest")
_META = operator.attrgetter("kind", "dtype", "shape")


def _meta(key: str, ranks: list[int], held: list[TensorDecl]) -> TensorMeta:
    first = held[0]
    if all(_all_equal(list(map(operator.attrgetter(a), held))) for a in ("kind", "dtype", "shape")):
        return TensorMeta(first.kind, first.dtype, first.shape)
    return _check_consistent(key, list(zip(ranks, held)))


def _all_equal(values: list) -> bool:
    return values.count(values[0]) == len(values)  # compared in C: one pass over the ranks


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
    _check_tiling(key, shape, owners)
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


@functools.lru_cache(maxsize=64)
def _name_order(n: int) -> np.ndarray:
    """Where each of the names ``key#0`` to ``key#{n-1}`` (or ``key`` alone) sorts among them, as strings."""
    out = np.empty(n, dtype=np.int64)
    out[sorted(range(n), key=str)] = np.arange(n)
    out.flags.writeable = False
    return out
