"""Reuse of the last global save plan while the job's layout stays the same (:class:`PlanCache`).

Repeated saves of one layout send less: every rank keeps the last plan it received
(:meth:`PlanCache.hold`) and sends a :class:`RankSummary` (fixed-size fingerprints plus its values
at the tree's per-rank places, at most :data:`SMALL_VALUES_BYTES`); the coordinator reuses the last
plan from the summaries alone (:meth:`PlanCache.reuse`) or asks every rank for its full
:class:`~resurgo.plan.global_types.RankDecl`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from resurgo.gcpause import collector_paused
from resurgo.plan.global_assign import plan_tensors
from resurgo.plan.global_checks import merge_declared, merge_trees
from resurgo.plan.global_types import GlobalPlan, RankDecl, canonical_digest


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
            tree, per_rank, own = merge_declared(decls)
            key = (tuple(d.layout for d in decls), frozenset(per_rank), block_rule)
            if key == self._key and self._plan is not None:
                self.hits += 1
                return GlobalPlan(tree, self._plan.tensors, self._plan.writes)
            self._key, self._plan = None, None  # a failed plan leaves nothing to reuse
            plan = plan_tensors(decls, block_bytes_for, tree, per_rank, own=own)
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
        self._held = _Held(plan_id, canonical_digest([plan_id, [list(p) for p in places]]), places, per_rank, plan)

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
        shared = canonical_digest([_replace_at(decl.tree, held.places, [None] * len(held.places)), others])
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
    return canonical_digest([list(layouts), sorted(per_rank), repr(block_rule)])


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
