"""Sending data files between ranks over torch.distributed, verified before they are kept.

A memory tier keeps each rank's data files in its node's memory and sends a replica of them to
ranks on other nodes (:mod:`resurgo.plan.memory_plan` decides who sends what to whom); a restore
sends the files a node lost from a node that holds them. Here is the transfer itself: every rank
takes the same list of :class:`~resurgo.plan.memory_plan.Transfer` and the same :class:`Piece`
list of each file, posts a non-blocking send of each piece of each file it is the source of and a
non-blocking receive of each piece it is the destination of (point to point on the ``comm``'s
gloo group, each piece tagged by its place in the list), so all transfers run at once, in both
directions, and none waits on another.

A save starts its exchange before it writes its own files (:func:`start`): a file is sent from
the bytes it is written from (:class:`StagedFile`: its header and its chunks' staged sources,
so the sends run beside the local write), and a receiving thread maps each replica's new file
and receives into it, hashing each piece's checksum blocks as it lands (while it is in cache).
Once the manifest is known, :meth:`Exchange.finish` checks every replica against it (size,
header, every block checksum: those hashed on arrival are compared, not hashed again) before it
is made durable; one that does not verify is never committed. No copy of a file is held beside
its mapping or its sources: gloo reads and writes those bytes in place.

A failure (a file that cannot be read, a replica that does not verify) is remembered and raised
once every transfer is done, so no rank is left waiting on a peer that stopped half-way; the caller
agrees on it (:meth:`resurgo.dist.comm.Comm.agree`). :meth:`Exchange.drain` ends an exchange the
save gave up on: what was not sent yet is sent as zeros (never verified), everything is waited for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from resurgo import faults
from resurgo.dist import liveness
from resurgo.dist.comm import Comm
from resurgo.errors import CorruptCheckpointError
from resurgo.format import checksum
from resurgo.format.manifest import Manifest, parse_manifest
from resurgo.format.safetensors_file import build_header
from resurgo.pipeline.verify import verify_file_bytes
from resurgo.plan.memory_plan import Transfer
from resurgo.plan.save_plan import FilePlan

PIECE_BYTES = 16 << 20  # sent, received and hashed as one: the receiver hashes it while it is in cache

# Fault injection for tests: called with each transfer this rank received and wrote; and with each
# piece received (the transfer, the piece, its bytes in the new file) before it is hashed.
after_receive: Callable[[Transfer], None] | None = None
on_piece: Callable[[Transfer, "Piece", memoryview], None] | None = None


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of a data file, sent as one message; ``block_bytes``: the checksum
    blocks it holds, from its start (0: none, e.g. the header: verified once the file is whole)."""

    start: int
    stop: int
    block_bytes: int = 0


def whole(nbytes: int) -> tuple[Piece, ...]:
    """A file sent in pieces of at most :data:`PIECE_BYTES`, none hashed on arrival."""
    return tuple(Piece(a, min(a + PIECE_BYTES, nbytes)) for a in range(0, nbytes, PIECE_BYTES)) or (Piece(0, 0),)


class Outgoing(Protocol):
    """The bytes of a file to send, by piece."""

    def view(self, piece: Piece) -> memoryview: ...

    def close(self) -> None: ...


class Mapped(Protocol):
    """A file's bytes in memory (:class:`resurgo.storage.local_files.MappedFile`): sent from, or
    received into, in place."""

    view: memoryview

    def fsync(self) -> None: ...

    def close(self) -> None: ...


class MappedOutgoing:
    """A mapped file sent piece by piece (its mapping is closed once sent)."""

    def __init__(self, mapped: Mapped, nbytes: int, name: str):
        if len(mapped.view) != nbytes:
            mapped.close()
            raise CorruptCheckpointError(f"{name}: {len(mapped.view)} bytes to send, the manifest says {nbytes}")
        self._mapped = mapped

    def view(self, piece: Piece) -> memoryview:
        return self._mapped.view[piece.start:piece.stop]

    def close(self) -> None:
        self._mapped.close()


class StagedFile:
    """A data file of a save as the bytes it is written from (:func:`resurgo.pipeline.writer.write_data_file`
    writes the same: its header, then each chunk's source), before or while it is written: its
    size and its pieces (each chunk cut into pieces of whole checksum blocks, hashed on arrival).
    ``sendable``: every chunk's source is bytes in host memory (else, a device tensor streamed
    slice by slice, the file is sent from what was written, once it is)."""

    def __init__(self, plan: FilePlan, sources: Mapping[str, Any]):
        header, ranges = build_header(plan.header_entries)
        self.path = plan.path
        self.nbytes = ranges[-1][1] if ranges else len(header)
        self._parts: list[tuple[int, memoryview]] = [(0, memoryview(bytearray(header)))]  # writable: gloo takes a tensor
        pieces = [Piece(0, len(header))]
        for item, (a, b) in zip(plan.items, ranges):
            if item.partial:
                raise AssertionError(f"{plan.path}: chunk {item.name} is not written whole from its source")
            step = max(item.block_bytes, PIECE_BYTES // item.block_bytes * item.block_bytes)
            pieces += [Piece(s, min(s + step, b), item.block_bytes) for s in range(a, b, step)]
            source = sources[item.name]
            if isinstance(source, np.ndarray) and source.nbytes == b - a:
                self._parts.append((a, source.data.cast("B")))
        self.pieces = tuple(pieces)
        self.sendable = len(self._parts) == len(plan.items) + 1

    def view(self, piece: Piece) -> memoryview:
        at, data = next((a, d) for a, d in reversed(self._parts) if a <= piece.start)
        return data[piece.start - at:piece.stop - at]

    def close(self) -> None:
        pass


class SaveExchange:
    """A save's replication: started before the save writes its own files (each sendable file's
    sends posted at once, every receive posted by the receiving thread), finished once the save's
    manifest is known (:meth:`finish`: the other files sent from what was written, every replica
    verified), or drained when the save gave up (:meth:`drain`)."""

    def __init__(self, comm: Comm, transfers: Sequence[Transfer], pieces: Mapping[tuple[int, str], Sequence[Piece]],
                 where: str, staged: Sequence[StagedFile], sink: Callable[[str, int], Mapped],
                 written: Callable[[str], Mapped]):
        self._exchange = Exchange(comm, transfers, pieces, where, sink)
        self._written = written
        self._sizes = {f.path: f.nbytes for f in staged}
        for f in staged:
            if f.sendable:
                self._exchange.send(f.path, lambda f=f: f)  # type: ignore[misc]

    def finish(self, raw: bytes) -> int:
        """Send what was not sent yet from the files written; verify every replica received
        against the save's manifest (its bytes: ``raw``) and keep it (:meth:`Exchange.finish`)."""
        manifest = parse_manifest(raw, "the manifest being saved")
        for name in self._exchange.unsent():
            self._exchange.send(name, lambda: MappedOutgoing(self._written(name), self._sizes[name], name))
        return self._exchange.finish(manifest)

    def drain(self) -> None:
        self._exchange.drain()


@dataclass
class _Incoming:
    transfer: Transfer
    into: Mapped | None
    requests: list[Any]
    hashed: dict[tuple[int, int], str]  # (start, stop) of a block in the file -> its digest


class Exchange:
    """The transfers of one exchange, in flight (see the module docstring). Made on every rank
    named in ``transfers``; :meth:`finish` (or :meth:`drain`) must then run on each."""

    def __init__(self, comm: Comm, transfers: Sequence[Transfer], pieces: Mapping[tuple[int, str], Sequence[Piece]],
                 where: str, sink: Callable[[str, int], Mapped]):
        self.comm, self.where, self._pieces = comm, where, pieces
        self._errors: list[Exception] = []
        self._receive_errors: list[Exception] = []
        self._first_tag: dict[Transfer, int] = {}
        tag = 0
        for t in transfers:
            self._first_tag[t] = tag
            tag += len(pieces[(t.src, t.name)])
        self._outgoing = {t.name: [u for u in transfers if u.src == t.src and u.name == t.name]
                          for t in transfers if t.src == comm.rank}
        self._sends: list[list[Any]] = []  # [the tensor, kept alive until sent; its request; its peer]
        self._opened: list[Outgoing] = []
        self._incoming: list[_Incoming] = []
        self._received = 0
        self._done = False
        mine = [t for t in transfers if t.dst == comm.rank]
        self._thread = threading.Thread(target=self._receive, args=(mine, sink), name="resurgo-replicate", daemon=True)
        self._thread.start()

    # -- sending ----------------------------------------------------------------------------------
    def send(self, name: str, source: Callable[[], Outgoing] | None) -> None:
        """Post the sends of this rank's file ``name`` to every destination, from ``source()``
        (None, or a failure: zeros, which the destination will not verify)."""
        transfers = self._outgoing.pop(name, [])
        if not transfers:
            return
        out: Outgoing | None = None
        if source is not None:
            try:
                faults.point("replicate.send")
                out = source()
                self._opened.append(out)
            except Exception as e:  # noqa: BLE001 - raised at the end: the peers must not wait forever
                self._errors.append(e)
        pieces = self._pieces[(transfers[0].src, name)]
        tensors = None
        if out is not None:
            try:
                tensors = [_tensor(out.view(piece)) for piece in pieces]
            except Exception as e:  # noqa: BLE001 - raised at the end, as above
                self._errors.append(e)
        if tensors is None:  # the peers still wait for these bytes; they will not verify them
            zeros = _zeros(max(p.stop - p.start for p in pieces))
            tensors = [zeros[: p.stop - p.start] for p in pieces]
        for t in transfers:
            for i, tensor in enumerate(tensors):
                self._post(tensor, t, i, send=True)

    def unsent(self) -> list[str]:
        """The files of this rank not sent yet."""
        return sorted(self._outgoing)

    def _post(self, tensor: Any, t: Transfer, i: int, send: bool) -> Any:
        import torch.distributed as dist

        tag = self._first_tag[t] + i
        if send:
            dst = self.comm.global_rank(t.dst)
            self._sends.append([tensor, dist.isend(tensor, dst=dst, group=self.comm.group, tag=tag), dst])
            return None
        return dist.irecv(tensor, src=self.comm.global_rank(t.src), group=self.comm.group, tag=tag)

    # -- receiving (its own thread) -------------------------------------------------------------
    def _receive(self, mine: list[Transfer], sink: Callable[[str, int], Mapped]) -> None:
        try:
            self._receive_all(mine, sink)
        except BaseException as e:  # noqa: BLE001 - a receive that did not end: finish raises, nothing is kept
            self._receive_errors.append(CorruptCheckpointError(f"{self.where}: receiving the replicas failed: {e!r}"))

    def _receive_all(self, mine: list[Transfer], sink: Callable[[str, int], Mapped]) -> None:
        import torch

        for t in mine:  # every receive posted first: the next file's mapping is made while this one arrives
            pieces = self._pieces[(t.src, t.name)]
            into: Mapped | None = None
            try:
                into = sink(t.name, t.nbytes)
                if len(into.view) != t.nbytes or (pieces and pieces[-1].stop != t.nbytes):
                    raise CorruptCheckpointError(f"{self.where}: {t.name} from rank {t.src} is sent as other bytes "
                                                 f"than its {t.nbytes}")
                bufs = [_tensor(into.view[p.start:p.stop]) for p in pieces]
            except Exception as e:  # noqa: BLE001 - raised at the end; the bytes are still received
                self._receive_errors.append(e)
                scratch = torch.empty(max((p.stop for p in pieces), default=0), dtype=torch.uint8)
                bufs = [scratch[p.start:p.stop] for p in pieces]
                if into is not None:
                    into.close()
                into = None
            requests = [self._post(buf, t, i, send=False) for i, buf in enumerate(bufs)]
            self._incoming.append(_Incoming(t, into, requests, {}))
        for entry in self._incoming:
            pieces = self._pieces[(entry.transfer.src, entry.transfer.name)]
            for i, request in enumerate(entry.requests):  # every one waited for: none may land in a closed file
                try:
                    liveness.wait_requests([request], [self.comm.global_rank(entry.transfer.src)])
                    piece = pieces[i]
                    if entry.into is None or not piece.block_bytes:
                        continue
                    view = entry.into.view[piece.start:piece.stop]
                    if on_piece is not None:
                        on_piece(entry.transfer, piece, view)
                    entry.hashed.update(_hash_blocks(view, piece))
                    del view
                except Exception as e:  # noqa: BLE001 - raised at the end (a block not hashed here is hashed then)
                    self._receive_errors.append(e)
            entry.requests = []

    # -- ending -----------------------------------------------------------------------------------
    def finish(self, manifest: Manifest) -> int:
        """Wait for every transfer; check every received file against ``manifest`` and make it
        durable. Returns the bytes this rank received; raises the first failure (once all is done)."""
        for name in self.unsent():
            self.send(name, None)
        self._thread.join()
        self._errors += self._receive_errors
        for entry in self._incoming:
            t, into = entry.transfer, entry.into
            if into is None:
                continue
            try:
                problems = verify_file_bytes(manifest, t.name, np.frombuffer(into.view, dtype=np.uint8),
                                             f"{self.where} (from rank {t.src})", entry.hashed)
                if problems:
                    error = CorruptCheckpointError(
                        f"{self.where}: the copy of {t.name} received from rank {t.src} does not verify "
                        f"({problems[0]}); it is not kept")
                    error.secondary = True  # type: ignore[attr-defined]  # the sender's own failure, if any, is the cause
                    raise error
                into.fsync()
            except Exception as e:  # noqa: BLE001 - raised at the end
                self._errors.append(e)
                continue
            finally:
                into.close()
                entry.into = None
            self._received += t.nbytes
            if after_receive is not None:
                after_receive(t)
        self._end()
        if self._errors:
            raise self._errors[0]
        return self._received

    def drain(self) -> None:
        """End the exchange without keeping anything: send zeros for what was not sent, wait for
        every transfer, close every file. Safe after :meth:`finish` (it then does nothing)."""
        if self._done:
            return
        for name in self.unsent():
            self.send(name, None)
        self._thread.join()
        for entry in self._incoming:
            if entry.into is not None:
                entry.into.close()
                entry.into = None
        self._end()

    def _end(self) -> None:
        try:
            liveness.wait_requests([entry[1] for entry in self._sends], [entry[2] for entry in self._sends])
        except Exception as e:  # noqa: BLE001 - raised by finish
            self._errors.append(e)
        self._sends.clear()
        for out in self._opened:
            out.close()
        self._opened.clear()
        self._done = True


def exchange(comm: Comm, transfers: Sequence[Transfer], manifest: Manifest, where: str,
             source: Callable[[str], Mapped], sink: Callable[[str, int], Mapped]) -> int:
    """Send the files this rank is the source of from their mappings ``source(name)``; receive
    each file this rank is the destination of into ``sink(name, nbytes)`` (the new file, mapped),
    verify it against ``manifest`` and make it durable. Returns the bytes this rank received.
    Collective over the ranks named in ``transfers``; ``where`` names the destination in
    messages. A file that does not verify stays in the staging, which the caller aborts on the
    error raised."""
    pieces = {(t.src, t.name): whole(t.nbytes) for t in transfers}
    ex = Exchange(comm, transfers, pieces, where, sink)
    sizes = {t.name: t.nbytes for t in transfers if t.src == comm.rank}
    try:
        for name in ex.unsent():
            ex.send(name, lambda: MappedOutgoing(source(name), sizes[name], name))
        return ex.finish(manifest)
    finally:
        ex.drain()


def _hash_blocks(view: memoryview, piece: Piece) -> dict[tuple[int, int], str]:
    """The digest of each checksum block of a received piece, by its byte range in the file."""
    bb, at = piece.block_bytes, piece.start
    return {(at + a, at + min(a + bb, len(view))): checksum.digest(view[a:a + bb]) for a in range(0, len(view), bb)}


def _zeros(n: int) -> Any:
    import torch

    return torch.zeros(n, dtype=torch.uint8)


def _tensor(view: memoryview) -> Any:
    """A uint8 tensor over ``view``'s memory (gloo sends from it, or receives into it, in place)."""
    import torch

    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)

