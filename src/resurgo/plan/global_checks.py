"""Validation of the ranks' declarations for the global save plan, and the merge of their trees.

:func:`merge_trees` makes one tree of every rank's (parts that differ become ``per_rank`` nodes);
the checks refuse, with the tensor and the ranks named, what no plan can save: tensors held by
only some ranks, replicas of one tensor that disagree on dtype or shape, and shards that do not
tile their tensor exactly once.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

from resurgo.errors import ShardingError, UnsupportedValueError
from resurgo.format.tree import TENSORS, per_rank_key
from resurgo.layout.box import ChunkBox, FlatRange, Place, covers_exactly_once
from resurgo.plan.global_types import RankDecl, TensorDecl, TensorMeta
from resurgo.wording import on_ranks


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
def merge_declared(decls: list[RankDecl]) -> tuple[dict, set[str], set[str]]:
    """:func:`merge_trees` over the ranks' declarations, a tensor whose compared replicas differ
    kept per rank: the tree, the keys of the tensors saved per rank, and those of them under a
    PerRank (each rank's own)."""
    own: set[str] = set()
    tree, per_rank = merge_trees([d.tree for d in decls], _differing_replicas(decls), own)
    return tree, per_rank, own


def _differing_replicas(decls: list[RankDecl]) -> set[str]:
    """The keys of the tensors whose replicas' digests (small plain tensors) differ between ranks."""
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


def check_tiling(key: str, shape: tuple[int, ...], owners: dict[Place, list[int]]) -> None:
    """Raise ShardingError unless the declared places (``owners``: each place's ranks) cover the
    tensor exactly once, naming what is wrong: a place outside the shape, block and flat shards
    mixed, an overlap, or a hole."""
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


_DIGEST = operator.attrgetter("digest")


def agreed_meta(key: str, ranks: list[int], held: list[TensorDecl]) -> TensorMeta:
    """The meta every holder of ``key`` declares (see :func:`_check_consistent` for the errors)."""
    first = held[0]
    if all(_all_equal(list(map(operator.attrgetter(a), held))) for a in ("kind", "dtype", "shape")):
        return TensorMeta(first.kind, first.dtype, first.shape)
    return _check_consistent(key, list(zip(ranks, held)))


def _all_equal(values: list) -> bool:
    return values.count(values[0]) == len(values)  # compared in C: one pass over the ranks
