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

import json
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from resurgo.errors import ShardingError
from resurgo.format import dtypes
from resurgo.format.tree import TENSORS, per_rank_key
from resurgo.gcpause import collector_paused
from resurgo.layout.box import ChunkBox, FlatRange, Place, covers_exactly_once, place_order
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


@dataclass(frozen=True)
class RankWrite:
    """A chunk a rank writes: the item, and which of its local tensors (key, place) holds the bytes."""

    item: WriteItem
    local_key: str
    local_place: Place


@dataclass(frozen=True)
class GlobalPlan:
    tree: dict
    tensors: dict[str, TensorMeta]  # manifest keys (per-rank tensors as key@rankN)
    writes: tuple[tuple[RankWrite, ...], ...]  # per rank

    def bytes_per_rank(self) -> list[int]:
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


def merge_trees(trees: list[dict], differing: set[str]) -> tuple[dict, set[str]]:
    """One tree for all ranks: equal parts kept once, parts that differ (or mention a tensor in
    ``differing``, or sit under a PerRank) as ``per_rank`` nodes. Returns the tree and the keys of
    the tensors saved per rank."""
    per_rank: set[str] = set()

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

    def merge(nodes: list[dict]) -> dict:
        first = nodes[0]
        t = first.get("type")
        if any(n.get("type") == "per_rank" for n in nodes):
            return split(nodes)
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
        return split(nodes)

    return merge(trees), per_rank


# -- tensors -------------------------------------------------------------------------------------
def _differing_replicas(decls: list[RankDecl]) -> set[str]:
    seen: dict[str, str] = {}
    out = set()
    for d in decls:
        for t in d.tensors:
            if t.digest is None:
                continue
            if seen.setdefault(t.key, t.digest) != t.digest:
                out.add(t.key)
    return out


def _check_consistent(key: str, holders: list[tuple[int, TensorDecl]]) -> TensorMeta:
    r0, t0 = holders[0]
    for r, t in holders[1:]:
        if (t.kind, t.dtype) != (t0.kind, t0.dtype):
            raise ShardingError(f"tensor {key!r}: rank {r0} holds {t0.kind} {t0.dtype}, rank {r} holds {t.kind} {t.dtype}")
        if t.shape != t0.shape:
            raise ShardingError(f"tensor {key!r}: rank {r0} declares global shape {list(t0.shape)}, rank {r} {list(t.shape)}")
    return TensorMeta(t0.kind, t0.dtype, t0.shape)


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


def plan_global(decls: list[RankDecl], block_bytes_for: Callable[[int, int], int]) -> GlobalPlan:
    """Validate every rank's declarations and decide who writes what (see the module docstring).

    ``block_bytes_for(global_nbytes, row_bytes)`` gives the checksum block size of a tensor's chunks
    (``row_bytes``: the bytes of one index of its first dimension).
    Raises ShardingError naming the tensor and the ranks when the shards do not fit together.
    """
    with collector_paused():  # an object per chunk, all kept: see resurgo.gcpause
        return _plan_global(decls, block_bytes_for)


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
            tree, per_rank = merge_trees([d.tree for d in decls], _differing_replicas(decls))
            key = (tuple(d.layout for d in decls), frozenset(per_rank), block_rule)
            if key == self._key and self._plan is not None:
                self.hits += 1
                return GlobalPlan(tree, self._plan.tensors, self._plan.writes)
            self._key, self._plan = None, None  # a failed plan leaves nothing to reuse
            plan = _plan_tensors(decls, block_bytes_for, tree, per_rank)
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


def _plan_global(decls: list[RankDecl], block_bytes_for: Callable[[int, int], int]) -> GlobalPlan:
    tree, per_rank = merge_trees([d.tree for d in decls], _differing_replicas(decls))
    return _plan_tensors(decls, block_bytes_for, tree, per_rank)


def _plan_tensors(decls: list[RankDecl], block_bytes_for: Callable[[int, int], int], tree: dict,
                  per_rank: set[str]) -> GlobalPlan:
    by_key: dict[str, list[tuple[int, TensorDecl]]] = {}
    for r, d in enumerate(decls):
        for t in d.tensors:
            by_key.setdefault(t.key, []).append((r, t))
    tensors: dict[str, TensorMeta] = {}
    writes: list[list[RankWrite]] = [[] for _ in decls]
    load = [0] * len(decls)
    # (nbytes, key, place, holders) of every chunk to assign, replicated ones deduplicated
    to_assign: list[tuple[int, str, str, Place, list[int], int]] = []
    for key, holders in by_key.items():
        meta = _check_consistent(key, holders)
        itemsize = dtypes.itemsize(meta.dtype)
        row_bytes = math.prod(meta.shape[1:]) * itemsize  # one index of the first dimension
        block = block_bytes_for(math.prod(meta.shape) * itemsize, row_bytes)
        if key in per_rank:
            for r, t in holders:
                if t.sharded:
                    raise ShardingError(f"tensor {key!r}: sharded, but it sits in a part of the state that differs "
                                        f"between ranks (saved per rank); only plain tensors can be saved per rank")
                k = per_rank_key(key, r)
                tensors[k] = meta
                whole = ChunkBox.whole(meta.shape)
                item = WriteItem(k, k, meta.dtype, whole, whole.numel * itemsize, block)
                writes[r].append(RankWrite(item, key, whole))
                load[r] += item.nbytes
            continue
        tensors[key] = meta
        owners: dict[Place, list[int]] = {}
        for r, t in holders:
            for p in t.places:
                owners.setdefault(p, []).append(r)
        _check_tiling(key, meta.shape, owners)
        ordered = sorted(owners, key=place_order)
        for i, p in enumerate(ordered):
            name = key if len(ordered) == 1 else f"{key}#{i}"
            to_assign.append((p.numel * itemsize, key, name, p, owners[p], block))
    # Largest first, each to its least loaded holder (LPT): balances bytes written per rank.
    for nbytes, key, name, place, holders_of, block in sorted(to_assign, key=lambda a: (-a[0], a[1], a[2])):
        r = min(holders_of, key=lambda h: (load[h], h))
        load[r] += nbytes
        writes[r].append(RankWrite(WriteItem(key, name, tensors[key].dtype, place, nbytes, block), key, place))
    return GlobalPlan(tree, tensors, tuple(tuple(w) for w in writes))
