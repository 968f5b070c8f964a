"""Shared reads: bytes that several ranks need are read from storage by one of them and sent.

:class:`SharedLoad` takes one rank's load plan (its read ops) and, with the other ranks:

1. agrees on a :class:`~resurgo.plan.share_plan.SharePlan` (:func:`agree_plan`). One small
   all-gather carries each rank's checkpoint (path and manifest digest), host, whether it reads
   an object store, and a fingerprint of its needs; ranks with identical needs form a group that
   needs no further exchange, and only when there are several groups does the lowest rank of
   each send its group's need list. It also decides whether to share at all: ``share_reads=None``
   shares when the page cache cannot make repeated reads free (an object store, or ranks on
   several hosts); every rank must load the same version of the same checkpoint.
2. transfers (:meth:`SharedLoad.transfer`): every rank posts the receives of the messages it
   gets, then reads, verifies and sends its own messages one after the other (the next read
   overlaps the previous sends, which gloo runs in the background), then reads the bytes only it
   needs. Failures are kept until every transfer is done, so no peer waits forever, then raised;
   the caller agrees on them (:meth:`resurgo.dist.comm.Comm.agree`), so a corrupt chunk makes
   every rank raise the same error.
3. fills the targets (:meth:`SharedLoad.finish`), only once every rank succeeded: the shared
   bytes are scattered from memory into the destinations by the ordinary read ops.
"""

from __future__ import annotations

import bisect
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from resurgo.dist.comm import Comm, sent_bytes
from resurgo.errors import CorruptCheckpointError
from resurgo.format.manifest import Manifest, TensorEntry
from resurgo.pipeline.reader import ReadResult, copy_back, place_destinations, read_ops
from resurgo.plan.load_plan import MAX_PIECE_BYTES, ReadOp, ReadPart, plan_reads
from resurgo.plan.share_plan import (MESSAGE_BYTES, ChunkId, SharePlan, fingerprint, groups_of,
                                     plan_shares)
from resurgo.state.unflatten import Destination
from resurgo.storage.base import Checkpoint


def _step(block: int, most: int) -> int:
    return max(block, most // block * block)


@dataclass(frozen=True)
class _Piece:
    key: str
    chunk: int  # index in this rank's manifest entry
    start: int  # bytes of the chunk
    stop: int


class _MemoryFile:
    """Bytes of one data file held in memory, in segments (file offset -> array): read like a
    :class:`~resurgo.storage.base.ReadHandle` by the ordinary read ops."""

    def __init__(self, rel: str):
        self.rel = rel
        self.size = 0
        self._starts: list[int] = []
        self._segments: list[tuple[int, np.ndarray]] = []

    def add(self, offset: int, data: np.ndarray) -> None:
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._segments.insert(i, (offset, data))

    def holds(self, offset: int, length: int) -> bool:
        end = offset + length
        while offset < end:
            i = bisect.bisect_right(self._starts, offset) - 1
            if i < 0:
                return False
            start, data = self._segments[i]
            if offset >= start + len(data):
                return False
            offset = start + len(data)
        return True

    def read_into_many(self, offset: int, bufs: list[memoryview]) -> None:
        for buf in bufs:
            out = np.frombuffer(buf, dtype=np.uint8)
            at = 0
            while at < len(out):
                i = bisect.bisect_right(self._starts, offset) - 1
                start, data = self._segments[i]
                n = min(len(out) - at, start + len(data) - offset)
                out[at:at + n] = data[offset - start:offset - start + n]
                at, offset = at + n, offset + n

    def close(self) -> None:
        pass


def agree_plan(comm: Comm, checkpoint: tuple[str, str], needs: dict[ChunkId, int], share_reads: bool | None,
               object_store: bool) -> tuple[SharePlan | None, int]:
    """The share plan every rank agrees on, or None when the ranks do not share; and the bytes this
    rank sent to build it. Collective."""
    before = sum(sent_bytes().values())
    mine = fingerprint(needs)
    every = comm.all_gather((checkpoint, socket.gethostname(), object_store, mine))
    one_checkpoint = len({c for c, _, _, _ in every}) == 1
    helps = any(o for _, _, o, _ in every) or len({h for _, h, _, _ in every}) > 1
    plan = None
    if one_checkpoint and (share_reads or (share_reads is None and helps)):
        groups = groups_of([fp for _, _, _, fp in every])
        if len(groups) == 1:
            plan = plan_shares([(groups[0], needs)])
        else:
            leads = {g[0] for g in groups}
            lists = comm.all_gather(sorted(needs.items()) if comm.rank in leads else None)
            plan = plan_shares([(g, dict(lists[g[0]] or ())) for g in groups])
    return plan, sum(sent_bytes().values()) - before


class SharedLoad:
    """One rank's part of a load whose shared bytes are read once per job (see the module)."""

    def __init__(self, ckpt: Checkpoint, manifest: Manifest, destinations: list[Destination], verify: bool,
                 threads: int):
        self.ckpt, self.manifest, self.verify, self.threads = ckpt, manifest, verify, threads
        self.targets, self.bufs, self.staged = place_destinations(destinations)
        self.entries: dict[str, TensorEntry] = {d.key: d.entry for d in destinations}
        self.ops = plan_reads(self.targets, self.entries)
        self.pieces: dict[ChunkId, _Piece] = {}
        self.needs: dict[ChunkId, int] = {}
        for op in self.ops:
            for part in op.parts:
                for cid, piece in self._pieces_of(part):
                    self.pieces[cid] = piece
                    self.needs[cid] = piece.stop - piece.start
        self.memory: dict[str, _MemoryFile] = {}
        self.from_memory: list[ReadOp] = []
        self.bytes_received = 0

    def _pieces_of(self, part: ReadPart) -> list[tuple[ChunkId, _Piece]]:
        """The share pieces a read part touches (one block more at its end: a part that starts
        inside a block, at an extent boundary, ends up to one block past ``first_block``'s span)."""
        c = self.entries[part.key].chunks[part.chunk]
        step = _step(c.block_bytes, MESSAGE_BYTES)
        lo = part.first_block * c.block_bytes
        hi = min(c.nbytes, lo + part.length + c.block_bytes)
        file, offset, _ = c.spans[0]
        out = []
        for start in range(lo // step * step, hi, step):
            out.append(((part.key, file, offset, start), _Piece(part.key, part.chunk, start, min(start + step, c.nbytes))))
        return out

    def read_alone(self) -> ReadResult:
        """Every op from storage (the ranks do not share)."""
        result = read_ops(self.ckpt, self.manifest, self.entries, self.bufs, self.ops, self.verify, self.threads)
        self.from_memory = []
        return result

    def transfer(self, comm: Comm, plan: SharePlan) -> ReadResult:
        """Receive, read and send the shared messages, and read what only this rank needs; raise
        the first failure once every transfer is done. Targets are not touched (see :meth:`finish`)."""
        import torch
        import torch.distributed as dist

        t_start = time.perf_counter()
        group_rank = dist.get_global_rank if comm.group is not None else None

        def peer(rank: int) -> int:
            return group_rank(comm.group, rank) if group_rank is not None else rank

        errors: list[BaseException] = []
        pending: list[Any] = []  # (request, arena): arenas kept alive until their transfer is done
        arenas: dict[int, np.ndarray] = {}
        for tag, m in enumerate(plan.messages):
            if comm.rank in m.receivers:
                arena = np.empty(m.nbytes, dtype=np.uint8)
                arenas[tag] = arena
                pending.append((dist.irecv(torch.from_numpy(arena), src=peer(m.reader), group=comm.group, tag=tag), arena))
        totals = {"bytes": 0}
        seconds = {"read": 0.0, "checksum": 0.0, "assemble": 0.0}
        files: set[str] = set()

        def read(bufs: list[np.ndarray], ops: list[ReadOp]) -> None:
            """Read ``ops`` from storage into ``bufs``, counting; a failure is kept for the end."""
            if errors:  # after a failure the peers still get (unverified) bytes, then everyone raises
                return
            try:
                got = read_ops(self.ckpt, self.manifest, self.entries, bufs, ops, self.verify, self.threads)
            except BaseException as e:  # noqa: BLE001 - raised once every transfer is done
                errors.append(e)
                return
            totals["bytes"] += got.bytes_read
            files.update(got.files)
            for k in seconds:
                seconds[k] += got.seconds[k]

        for tag, m in enumerate(plan.messages):
            if m.reader != comm.rank:
                continue
            arena = np.empty(m.nbytes, dtype=np.uint8)
            arenas[tag] = arena
            try:
                ops = self._message_ops(m.chunks, m.offsets())
            except BaseException as e:  # noqa: BLE001 - raised once every transfer is done
                errors.append(e)
                ops = []
            read([arena], ops)
            tensor = torch.from_numpy(arena)
            for r in m.receivers:
                pending.append((dist.isend(tensor, dst=peer(r), group=comm.group, tag=tag), arena))
        for tag, arena in arenas.items():
            m = plan.messages[tag]
            for c, at in zip(m.chunks, m.offsets()):
                piece = self.pieces.get(c.chunk)
                if piece is not None:
                    self._hold(piece, arena[at:at + c.nbytes])
        self.from_memory = []
        from_storage: list[ReadOp] = []
        for op in self.ops:  # an op is split where its parts switch between memory and storage
            at = op.file_offset
            for part in op.parts:
                held = op.file in self.memory and self.memory[op.file].holds(at, part.length)
                (self.from_memory if held else from_storage).append(ReadOp(op.file, at, part.length, (part,)))
                at += part.length
        read(self.bufs, from_storage)
        t_wait = time.perf_counter()
        for request, _ in pending:
            try:
                request.wait()
            except BaseException as e:  # noqa: BLE001 - a peer that failed mid-transfer
                errors.append(CorruptCheckpointError(f"{self.ckpt.path}: a shared read from another rank failed: {e}"))
        seconds["transfer_wait"] = time.perf_counter() - t_wait
        self.bytes_received = plan.received_bytes(comm.rank)
        if errors:
            raise errors[0]
        seconds["total"] = time.perf_counter() - t_start
        return ReadResult(totals["bytes"], sorted(files), seconds, bytes_received=self.bytes_received)

    def _message_ops(self, chunks: Any, offsets: list[int]) -> list[ReadOp]:
        """Read ops that fill a message's arena (its one target) with its pieces, verified."""
        ops = []
        for c, at in zip(chunks, offsets):
            key, _, _, start = c.chunk
            ci = self._piece(c.chunk).chunk
            chunk = self.entries[key].chunks[ci]
            step = _step(chunk.block_bytes, MAX_PIECE_BYTES)
            for a in range(start, start + c.nbytes, step):
                for file, offset, lo, hi in chunk.locate(a, min(a + step, start + c.nbytes)):
                    ops.append(ReadOp(file, offset, hi - lo, (ReadPart(key, ci, hi - lo, lo // chunk.block_bytes, 0,
                                                                       at + lo - start),)))
        return ops

    def _piece(self, cid: ChunkId) -> _Piece:
        """This rank's piece ``cid`` (a reader reads only pieces it needs itself)."""
        piece = self.pieces.get(cid)
        if piece is None:
            key, file, offset, _ = cid
            raise CorruptCheckpointError(f"{self.ckpt.path}: tensor {key!r} has no chunk at byte {offset} of {file}")
        return piece

    def _hold(self, piece: _Piece, data: np.ndarray) -> None:
        chunk = self.entries[piece.key].chunks[piece.chunk]
        for file, offset, lo, hi in chunk.locate(piece.start, piece.stop):
            self.memory.setdefault(file, _MemoryFile(file)).add(offset, data[lo - piece.start:hi - piece.start])

    def finish(self) -> float:
        """Fill the targets from the shared bytes in memory (every rank read and verified its
        share); seconds it took."""
        t0 = time.perf_counter()
        if self.from_memory:
            read_ops(self.ckpt, self.manifest, self.entries, self.bufs, self.from_memory, verify=False,
                     threads=self.threads, handles=self.memory)  # type: ignore[arg-type]
        copy_back(self.staged)
        self.memory.clear()
        return time.perf_counter() - t0
