"""Share plan: which rank reads each chunk that several ranks need, and whom it sends it to.

Pure data. A *need* is what one rank's load plan touches: piece ids (a block-aligned piece of
a saved chunk, named by the chunk's key, where the chunk's bytes start and where the piece starts
in it: the same on every rank) with their sizes; "chunk" below means such a piece. Ranks whose needs are
identical (data-parallel replicas) form a group; a group is described once, so the messages that
build the plan do not grow with world x chunks when most ranks need the same things
(:func:`fingerprint` is what each rank sends to find its group).

For every chunk that two ranks or more need, one of them reads it from storage (the one with the
fewest bytes to read so far, largest chunks first: within a group, reads differ by at most one
chunk) and the others receive it. Chunks only one rank needs are not in the plan: that rank
reads them as usual. The shared chunks travel in messages, one send per receiver each: a chunk of
:data:`ALONE_BYTES` or more alone (the receivers take it straight into their tensors), smaller
ones with the same reader and receivers packed together up to :data:`MESSAGE_BYTES`, so a state
of many small tensors does not cost one send per tensor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from resurgo.plan.load_plan import MAX_PIECE_BYTES

ChunkId = tuple[str, str, int, int]  # (key, data file of the chunk's first byte, its offset there, piece start in the chunk)
# The unit shared: the load plan's read pieces (a direct read part is then one piece, all of it
# received or all of it read), small enough that sends start while the reader reads the rest.
PIECE_BYTES = MAX_PIECE_BYTES
MESSAGE_BYTES = 16 << 20  # small pieces packed up to this
ALONE_BYTES = 1 << 20  # a piece this large is sent alone: one copy less beats one message less


def fingerprint(needs: Mapping[ChunkId, int]) -> str:
    """A digest of a need (the same needs give the same digest on every rank)."""
    h = hashlib.blake2b(digest_size=16)
    for cid in sorted(needs):
        h.update(repr((cid, needs[cid])).encode())
    return h.hexdigest()


def groups_of(fingerprints: Sequence[str]) -> list[tuple[int, ...]]:
    """Ranks with the same fingerprint, each group in rank order, groups by their lowest rank."""
    by_print: dict[str, list[int]] = {}
    for rank, fp in enumerate(fingerprints):
        by_print.setdefault(fp, []).append(rank)
    return sorted((tuple(ranks) for ranks in by_print.values()), key=lambda g: g[0])


@dataclass(frozen=True)
class SharedChunk:
    chunk: ChunkId
    nbytes: int
    reader: int
    receivers: tuple[int, ...]  # every other rank that needs it, in rank order


@dataclass(frozen=True)
class Message:
    """Chunks read by ``reader`` and sent, back to back in this order, to each of ``receivers``."""

    reader: int
    receivers: tuple[int, ...]
    chunks: tuple[SharedChunk, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def offsets(self) -> list[int]:
        """Where each chunk starts in the message."""
        out, at = [], 0
        for c in self.chunks:
            out.append(at)
            at += c.nbytes
        return out


@dataclass(frozen=True)
class SharePlan:
    messages: tuple[Message, ...]  # in one order on every rank: a message's index is its tag

    @property
    def chunks(self) -> list[SharedChunk]:
        return [c for m in self.messages for c in m.chunks]

    def shared_ids(self) -> set[ChunkId]:
        return {c.chunk for c in self.chunks}

    def read_bytes(self, rank: int) -> int:
        return sum(m.nbytes for m in self.messages if m.reader == rank)

    def received_bytes(self, rank: int) -> int:
        return sum(m.nbytes for m in self.messages if rank in m.receivers)


def plan_shares(groups: Sequence[tuple[Sequence[int], Mapping[ChunkId, int]]],
                message_bytes: int = MESSAGE_BYTES, alone_bytes: int = ALONE_BYTES) -> SharePlan:
    """The plan for ``groups``: (ranks, their common need) pairs, each rank in one group."""
    needers: dict[ChunkId, list[int]] = {}
    sizes: dict[ChunkId, int] = {}
    load: dict[int, int] = {}
    for ranks, need in groups:
        for rank in ranks:
            load[rank] = 0
        for cid, nbytes in need.items():
            needers.setdefault(cid, []).extend(ranks)
            sizes[cid] = nbytes
    shared: list[SharedChunk] = []
    for cid in sorted((c for c, r in needers.items() if len(r) > 1), key=lambda c: (-sizes[c], c)):
        ranks = sorted(needers[cid])
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += sizes[cid]
        shared.append(SharedChunk(cid, sizes[cid], reader, tuple(r for r in ranks if r != reader)))
    shared.sort(key=lambda c: (c.reader, c.receivers, c.chunk))
    messages: list[Message] = []
    batch: list[SharedChunk] = []
    batch_bytes = 0
    for c in shared:
        if c.nbytes >= alone_bytes:
            messages.append(Message(c.reader, c.receivers, (c,)))
            continue
        if batch and ((batch[0].reader, batch[0].receivers) != (c.reader, c.receivers)
                      or batch_bytes + c.nbytes > message_bytes):
            messages.append(Message(batch[0].reader, batch[0].receivers, tuple(batch)))
            batch, batch_bytes = [], 0
        batch.append(c)
        batch_bytes += c.nbytes
    if batch:
        messages.append(Message(batch[0].reader, batch[0].receivers, tuple(batch)))
    return SharePlan(tuple(messages))
