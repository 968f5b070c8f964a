"""Shared reads: bytes that several ranks need are read from storage by one of them and sent.

:class:`SharedLoad` takes one rank's load plan (its read ops) and, with the other ranks:

1. agrees on a :class:`~resurgo.plan.share_plan.SharePlan` (:func:`agree_plan`) in no collective
   of its own: each rank's checkpoint (path and manifest digest), host, whether it reads an
   object store, and a fingerprint of its needs (:func:`share_note`) travel with the outcome of
   its load plan (:meth:`resurgo.dist.comm.Comm.agree_noting`). Ranks with identical needs form a
   group that needs no further exchange; only when there are several groups does the lowest rank
   of each send its group's need list. It also decides whether to share at all:
   ``share_reads=None`` shares when the page cache cannot make repeated reads free (an object
   store, or ranks on several hosts); every rank must load the same version of the same checkpoint,
   and pass the same ``share_reads`` (each rank's travels in the same note: see
   :func:`mixed_share_reads`).
2. transfers (:meth:`SharedLoad.transfer`): every rank posts the receives of the messages it
   gets; it reads and verifies its own messages in parallel, each sent as soon as it is verified
   (gloo sends in the background while the next ones are read), then reads the bytes only it
   needs. Bytes are verified once, by the rank that read them from storage; the receivers get
   them over the process group's reliable transport. Messages land in memory: a receiver cannot
   know before they land whether the reader's bytes verified, and a target changes only with
   verified bytes (without ``verify``, a piece that lands as one contiguous run of a target goes
   straight into it). A tensor that gets any bytes from messages has its bytes from storage held
   in memory too; the others are read into place as a plain load does, a tensor filled once all
   its bytes verified. Failures are kept until every transfer is done, so no peer waits forever,
   then raised; the caller agrees on them (:meth:`resurgo.dist.comm.Comm.agree`), so a corrupt
   chunk makes every rank raise the same error, with every tensor it needed from memory untouched.
3. fills the rest of the targets (:meth:`SharedLoad.finish`) once every rank succeeded: bytes
   held in memory are scattered into place by the ordinary read ops. Holding them costs memory
   of the size of the bytes received (and of the held reads): what keeping unverified bytes
   out of the targets takes when any rank may be the one whose read fails.
"""

from __future__ import annotations

import bisect
import pickle
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from resurgo import faults
from resurgo.dist import liveness
from resurgo.dist.comm import Comm, sent_bytes
from resurgo.errors import CorruptCheckpointError, RankFailedError, UnsupportedValueError
from resurgo.format.manifest import Manifest, TensorEntry
from resurgo.pipeline.reader import ReadResult, copy_back, place_destinations, read_ops
from resurgo.plan.load_plan import MAX_PIECE_BYTES, ReadOp, ReadPart, plan_reads
from resurgo.plan.share_plan import (PIECE_BYTES, ChunkId, Message, SharePlan, fingerprint, groups_of,
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


def share_note(needs: dict[ChunkId, int], object_store: bool) -> tuple[str, bool, str]:
    """What this rank tells the others to plan the sharing (gathered with the load plan's outcome,
    in no collective of its own): its host, whether it reads an object store, a fingerprint of
    its needs."""
    return socket.gethostname(), object_store, fingerprint(needs)


def mixed_share_reads(path: str, choices: list[bool | None]) -> UnsupportedValueError:
    """The error every rank raises when the ranks of one load passed different ``share_reads``
    (``choices``, in rank order, gathered with the load plan's outcome): ranks deciding apart
    would pair up mismatched collectives."""
    ranks: dict[bool | None, list[int]] = {}
    for rank, choice in enumerate(choices):
        ranks.setdefault(choice, []).append(rank)
    passed = "; ".join(f"{choice!r} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for choice, rs in ranks.items())
    return UnsupportedValueError(f"{path}: the ranks of one load passed different share_reads ({passed}); "
                                 "pass the same value on every rank")


def agree_plan(comm: Comm, checkpoints: list[tuple[str, str]], notes: list[tuple[str, bool, str]],
               needs: dict[ChunkId, int], share_reads: bool | None) -> tuple[SharePlan | None, int]:
    """The share plan every rank agrees on, from every rank's checkpoint (path, manifest digest)
    and :func:`share_note`, or None when the ranks do not share; and the bytes this rank sent to
    build it. Collective only when the needs differ (each group's lowest rank sends its list)."""
    sent = len(pickle.dumps(notes[comm.rank], protocol=pickle.HIGHEST_PROTOCOL))
    helps = any(o for _, o, _ in notes) or len({h for h, _, _ in notes}) > 1
    if len(set(checkpoints)) > 1 or not (share_reads or (share_reads is None and helps)):
        return None, sent
    groups = groups_of([fp for _, _, fp in notes])
    if len(groups) == 1:
        return plan_shares([(groups[0], needs)]), sent
    before = sum(sent_bytes().values())
    leads = {g[0] for g in groups}
    lists = comm.all_gather(sorted(needs.items()) if comm.rank in leads else None)
    return plan_shares([(g, dict(lists[g[0]] or ())) for g in groups]), sent + sum(sent_bytes().values()) - before


def _whole_chunks(ops: list[ReadOp]) -> dict[tuple[str, int], tuple[int, int]]:
    """Chunks read straight into one target as one contiguous run (its parts all direct, to one
    target): (key, chunk) -> (target, byte of the target where the chunk's first byte lands)."""
    places: dict[tuple[str, int], set[tuple[int, int]]] = {}
    for op in ops:
        for part in op.parts:
            places.setdefault((part.key, part.chunk), set()).add((-1, 0) if part.target is None else (part.target, part.dst_offset))
    out = {}
    for chunk, found in places.items():
        targets = {t for t, _ in found}
        if len(targets) == 1 and -1 not in targets:  # a part lands at base + where it starts in the chunk
            out[chunk] = min(found)
    return out


class SharedLoad:
    """One rank's part of a load whose shared bytes are read once per job (see the module)."""

    def __init__(self, ckpt: Checkpoint, manifest: Manifest, destinations: list[Destination], verify: bool,
                 threads: int, loaded: set[str] | None = None):
        self.ckpt, self.manifest, self.verify, self.threads = ckpt, manifest, verify, threads
        self.loaded = loaded if loaded is not None else set()  # keys filled, every byte verified
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
        self.whole = _whole_chunks(self.ops)
        self.landed: dict[tuple[str, int], set[int]] = {}  # chunk -> starts of its pieces taken into its target
        self.memory: dict[str, _MemoryFile] = {}
        self.from_memory: list[ReadOp] = []
        self.bytes_received = 0

    def _pieces_of(self, part: ReadPart) -> list[tuple[ChunkId, _Piece]]:
        """The share pieces a read part touches (one block more at its end: a part that starts
        inside a block, at an extent boundary, ends up to one block past ``first_block``'s span)."""
        c = self.entries[part.key].chunks[part.chunk]
        step = _step(c.block_bytes, PIECE_BYTES)
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
        the first failure once every transfer is done. A message of one piece that lands as one
        contiguous run of a target is received (or read) straight into it; other messages land
        in memory, scattered into the targets by :meth:`finish`."""
        import torch
        import torch.distributed as dist

        t_start = time.perf_counter()
        peer = comm.global_rank

        errors: list[BaseException] = []
        landing, pending = self._post_receives(comm, plan)
        results: list[ReadResult] = []

        def read(bufs: list[np.ndarray], ops: list[ReadOp], threads: int, targets: bool = False) -> None:
            """Read ``ops`` from storage into ``bufs`` (``targets``: the targets' own bytes); a
            failure is kept for the end."""
            if errors:  # after a failure the peers still get (unverified) bytes, then everyone raises
                return
            try:
                results.append(read_ops(self.ckpt, self.manifest, self.entries, bufs, ops, self.verify, threads,
                                        loaded=self.loaded if targets else None))
            except BaseException as e:  # noqa: BLE001 - raised once every transfer is done
                errors.append(e)

        def read_and_send(tag: int) -> None:
            """Read one of this rank's messages and send it; from a pool thread, so the sends of
            one message start while the others are read, with no hand-off to this thread."""
            m, into = plan.messages[tag], landing[tag]
            try:
                faults.point("load.share")
                read([into], self._message_ops(m.chunks, m.offsets()), 1)
            except BaseException as e:  # noqa: BLE001 - raised once every transfer is done
                errors.append(e)
            tensor = torch.from_numpy(into)
            for r in m.receivers:
                pending.append((dist.isend(tensor, dst=peer(r), group=comm.group, tag=tag), into, peer(r)))

        mine = [tag for tag, m in enumerate(plan.messages) if m.reader == comm.rank]
        if mine:
            with ThreadPoolExecutor(max_workers=max(1, self.threads), thread_name_prefix="resurgo-share") as pool:
                list(pool.map(read_and_send, mine))
        from_storage = self._split_rest()
        # A tensor that gets some bytes from memory is filled by finish(), once every rank verified
        # its part: its bytes from storage are held in memory too, so a failure leaves it untouched.
        mixed = {part.key for op in self.from_memory for part in op.parts}
        to_hold = [op for op in from_storage if op.parts[0].key in mixed]
        if to_hold:
            copies = [np.empty(op.length, dtype=np.uint8) for op in to_hold]
            read(copies, [ReadOp(op.file, op.file_offset, op.length, (replace(op.parts[0], target=i, dst_offset=0, scatters=(),
                                                                            box=None),))
                        for i, op in enumerate(to_hold)], self.threads)
            for op, data in zip(to_hold, copies):
                self.memory.setdefault(op.file, _MemoryFile(op.file)).add(op.file_offset, data)
            self.from_memory += to_hold
        from_storage = [op for op in from_storage if op.parts[0].key not in mixed]
        if from_storage:
            read(self.bufs, from_storage, self.threads, targets=True)
        t_wait = time.perf_counter()
        try:
            liveness.wait_requests([request for request, _, _ in pending], [other for _, _, other in pending])
        except RankFailedError as e:  # a peer died or stalled
            errors.append(e)
        except BaseException as e:  # noqa: BLE001 - a transfer that failed otherwise
            errors.append(CorruptCheckpointError(f"{self.ckpt.path}: a shared read from another rank failed: {e}"))
        seconds = {k: sum(r.seconds[k] for r in results) for k in ("read", "checksum", "assemble")}
        seconds["transfer_wait"] = time.perf_counter() - t_wait
        self.bytes_received = plan.received_bytes(comm.rank)
        if errors:
            raise errors[0]
        seconds["total"] = time.perf_counter() - t_start
        return ReadResult(sum(r.bytes_read for r in results), sorted({f for r in results for f in r.files}), seconds,
                          bytes_received=self.bytes_received)

    def _post_receives(self, comm: Comm, plan: SharePlan) -> tuple[dict[int, np.ndarray], list[Any]]:
        """Where each message this rank reads or receives lands (by its index, its tag), and the
        receives posted: (request, buffer, peer), buffers kept alive until their transfer is done."""
        import torch
        import torch.distributed as dist

        peer = comm.global_rank
        pending: list[Any] = []
        landing: dict[int, np.ndarray] = {}
        for tag, m in enumerate(plan.messages):
            if comm.rank == m.reader or comm.rank in m.receivers:
                landing[tag] = self._landing(m)
        for tag, m in enumerate(plan.messages):
            if comm.rank in m.receivers:
                pending.append((dist.irecv(torch.from_numpy(landing[tag]), src=peer(m.reader), group=comm.group,
                                           tag=tag), landing[tag], peer(m.reader)))
        return landing, pending

    def _split_rest(self) -> list[ReadOp]:
        """The parts of this rank's ops that no message takes straight into a target, as ops: those
        whose bytes are held in memory into :attr:`from_memory`, those to read from storage returned."""
        self.from_memory = []
        from_storage: list[ReadOp] = []
        for op in self.ops:  # an op is split where its parts switch between taken, memory and storage
            at = op.file_offset
            for part in op.parts:
                if not self._taken(part):
                    held = op.file in self.memory and self.memory[op.file].holds(at, part.length)
                    (self.from_memory if held else from_storage).append(ReadOp(op.file, at, part.length, (part,)))
                at += part.length
        return from_storage

    def _landing(self, m: Message) -> np.ndarray:
        """Where message ``m``'s bytes go on this rank: straight into the target when it is one
        piece landing there as one contiguous run and nothing is verified, else a buffer held in
        memory (a receiver cannot know, before its bytes land, whether the reader's verified: a
        target must not change unless they did)."""
        piece = self.pieces.get(m.chunks[0].chunk) if len(m.chunks) == 1 and not self.verify else None
        place = self.whole.get((piece.key, piece.chunk)) if piece is not None else None
        if piece is not None and place is not None and piece.stop - piece.start == m.nbytes:
            target, base = place
            self.landed.setdefault((piece.key, piece.chunk), set()).add(piece.start)
            return self.bufs[target][base + piece.start:base + piece.stop]
        arena = np.empty(m.nbytes, dtype=np.uint8)
        for c, at in zip(m.chunks, m.offsets()):
            held = self.pieces.get(c.chunk)
            if held is not None:
                self._hold(held, arena[at:at + c.nbytes])
        return arena

    def _taken(self, part: ReadPart) -> bool:
        """Whether every byte of ``part`` is taken straight into its target by a message."""
        starts = self.landed.get((part.key, part.chunk))
        if part.target is None or starts is None:
            return False
        c = self.entries[part.key].chunks[part.chunk]
        step = _step(c.block_bytes, PIECE_BYTES)
        lo = part.dst_offset - self.whole[(part.key, part.chunk)][1]
        return all(s in starts for s in range(lo // step * step, lo + part.length, step))

    def _message_ops(self, chunks: Any, offsets: list[int]) -> list[ReadOp]:
        """Read ops that fill a message's landing (their one target) with its pieces, verified."""
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
