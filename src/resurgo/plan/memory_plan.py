"""Memory-tier plan: which node each rank is on, where its replicas go, which step memory can
rebuild, who sends which file to whom, and the bytes a node holds. Pure data, no I/O.

Nodes are numbered in the order of their lowest rank; a node's *leader* is its lowest rank (it
opens and commits the node's directory). Placement of replicas is fixed: rank ``r``, the ``j``-th
rank of node ``k``, sends its data files to the ``j``-th rank (modulo that node's size) of nodes
``k+1, ..., k+replicas`` (modulo the number of nodes).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from resurgo.errors import UnsupportedValueError


@dataclass(frozen=True)
class Nodes:
    """The ranks of a job grouped by node: ``index[r]`` is rank r's node (0, 1, ...),
    ``members[k]`` the ranks of node k, in order."""

    index: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, node_ids: Sequence[Hashable]) -> "Nodes":
        """From each rank's node identity (any hashable: an int, a hostname)."""
        order: dict[Hashable, int] = {}
        index = tuple(order.setdefault(n, len(order)) for n in node_ids)
        members = tuple(tuple(r for r, k in enumerate(index) if k == node) for node in range(len(order)))
        return cls(index, members)

    @property
    def count(self) -> int:
        return len(self.members)

    def leader(self, rank: int) -> int:
        return self.members[self.index[rank]][0]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(m[0] for m in self.members)


@dataclass(frozen=True, order=True)
class Transfer:
    """One data file sent from rank ``src`` to rank ``dst`` (``nbytes`` long)."""

    src: int
    name: str
    dst: int
    nbytes: int


def replica_targets(nodes: Nodes, replicas: int) -> tuple[tuple[int, ...], ...]:
    """For each rank, the ranks that hold its replicas: one on each of the next ``replicas`` nodes.
    UnsupportedValueError when there are not that many other nodes."""
    if replicas < 0:
        raise UnsupportedValueError(f"MemoryTier: replicas must be >= 0, not {replicas}")
    if replicas and replicas >= nodes.count:
        raise UnsupportedValueError(
            f"MemoryTier(replicas={replicas}): the job has {nodes.count} node(s), so at most {nodes.count - 1} "
            f"replica(s) can live on other nodes; lower replicas, or check node= (each node needs its own "
            f"identity: GROUP_RANK, LOCAL_WORLD_SIZE or the hostname)")
    out = []
    for rank, k in enumerate(nodes.index):
        j = nodes.members[k].index(rank)
        targets = []
        for step in range(1, replicas + 1):
            other = nodes.members[(k + step) % nodes.count]
            targets.append(other[j % len(other)])
        out.append(tuple(targets))
    return tuple(out)


def replication(files: Sequence[Sequence[tuple[str, int]]], targets: Sequence[Sequence[int]]) -> list[Transfer]:
    """Every transfer of a save's replication, in the one order every rank walks: ``files[r]``
    are the ``(name, size)`` data files rank r wrote."""
    return sorted(Transfer(src, name, dst, size) for src, own in enumerate(files) for name, size in own
                  for dst in targets[src])


def node_bytes(rank_bytes: Sequence[int], nodes: Nodes, targets: Sequence[Sequence[int]]) -> list[int]:
    """The data bytes each node holds of one save: its ranks' own, plus the replicas it receives."""
    out = [0] * nodes.count
    for rank, n in enumerate(rank_bytes):
        out[nodes.index[rank]] += n
        for dst in targets[rank]:
            out[nodes.index[dst]] += n
    return out


@dataclass(frozen=True)
class Holding:
    """What one node's memory root holds of one committed step: its manifest's digest, the data
    files that manifest lists (name -> size), and those present with that size."""

    digest: str
    declared: Mapping[str, int]
    held: frozenset[str]


@dataclass(frozen=True)
class Rebuild:
    """The step memory can rebuild, its manifest's digest, the node (leader rank) to take the
    manifest from, and the transfers that give every node every file."""

    step: int
    digest: str
    source: int
    transfers: tuple[Transfer, ...]

    def receivers(self) -> frozenset[int]:
        return frozenset(t.dst for t in self.transfers)


def choose_rebuild(holdings: Mapping[int, Mapping[int, Holding]], only: int | None = None) -> Rebuild | None:
    """The newest step (``only``: that one) whose files the nodes' memory holds among them, all
    nodes that have it agreeing on its manifest; None when there is none. ``holdings`` maps each
    node's leader rank to its steps. Every file a node lacks (all of them, for a node that lost the
    step) comes from the lowest leader that holds it: every node then holds the whole step."""
    steps = sorted({s for per_node in holdings.values() for s in per_node}, reverse=True)
    for step in steps if only is None else [s for s in steps if s == only]:
        have = {leader: per_node[step] for leader, per_node in holdings.items() if step in per_node}
        by_digest: dict[str, list[int]] = {}
        for leader, h in sorted(have.items()):
            by_digest.setdefault(h.digest, []).append(leader)
        # The manifest most nodes hold (ties: the lowest leader's); others are replaced.
        digest = max(by_digest, key=lambda d: (len(by_digest[d]), -by_digest[d][0]))
        holders = by_digest[digest]
        declared = have[holders[0]].declared
        if set().union(*(have[h].held for h in holders)) != set(declared):
            continue
        transfers = []
        for leader in sorted(holdings):
            mine = have[leader].held if leader in holders else frozenset()
            for name in sorted(set(declared) - mine):
                src = next(h for h in holders if name in have[h].held)
                transfers.append(Transfer(src, name, leader, declared[name]))
        return Rebuild(step, digest, holders[0], tuple(sorted(transfers)))
    return None


def spread(transfers: Sequence[Transfer], nodes: Nodes) -> list[Transfer]:
    """``transfers`` between node leaders spread over the ranks of both nodes (any rank of a node
    reads and writes its node's root): the ``i``-th file between two nodes goes from member
    ``i mod n`` of the sending node to member ``i mod m`` of the receiving one, so that a whole
    node's worth of files does not pass through one pair of ranks."""
    count: dict[tuple[int, int], int] = {}
    out = []
    for t in transfers:
        src, dst = nodes.members[nodes.index[t.src]], nodes.members[nodes.index[t.dst]]
        i = count.get((t.src, t.dst), 0)
        count[(t.src, t.dst)] = i + 1
        out.append(Transfer(src[i % len(src)], t.name, dst[i % len(dst)], t.nbytes))
    return sorted(out)


def assign_held(files: Sequence[tuple[str, int]], held: Sequence[frozenset[str]]) -> list[list[str]]:
    """Each rank's share of ``(name, size)`` files to copy, taken only from files ``held[r]`` (what
    rank r's node holds): each file to the holder with the fewest bytes so far (ties: the lowest
    rank), largest files first. Every rank computes the same shares. ValueError for a file no rank holds."""
    loads = [0] * len(held)
    shares: list[list[str]] = [[] for _ in held]
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        candidates = [r for r, h in enumerate(held) if name in h]
        if not candidates:
            raise ValueError(f"{name}: no rank holds it")
        r = min(candidates, key=lambda c: (loads[c], c))
        shares[r].append(name)
        loads[r] += size
    return [sorted(s) for s in shares]
