"""Loading a checkpoint whose node lacks some data files: those bytes come from peers' memory.

A memory tier restores a node that lost its memory from the other nodes' copies. Rather than
copying whole files into the node first and then loading them, each rank's ordinary load plan
runs as usual, and every read of a file its node does not hold is received from a rank of a node
that holds it, which sends those bytes from its file's mapping. They land in memory held by the
reader and are verified there, every block checksum and every header, exactly like bytes read
from a file, then copied into place once every read of the tensors they belong to verified
(:mod:`resurgo.pipeline.reader`): nothing that was not verified is loaded, a tensor whose bytes
fail is left untouched, no file is written.

:class:`PeerFiles` says which rank sends each file a node lacks; :class:`PeerLoad` is one rank's
load (like :class:`~resurgo.pipeline.shared_read.SharedLoad`): plan on construction, then
:meth:`PeerLoad.transfer` (collective): every rank gathers every rank's requests (file, offset,
buffer lengths of each read), posts the sends it serves, reads its own plan (held files from its
node's directory, missing ones received), then waits for its sends. A failure (a file the sender
cannot map, a range outside it) is kept until every transfer is done, the receiver getting zeros
that will not verify, then raised; the caller agrees on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from resurgo import faults
from resurgo.dist import liveness
from resurgo.dist.comm import Comm
from resurgo.errors import CorruptCheckpointError, RankFailedError
from resurgo.format.manifest import Manifest, TensorEntry
from resurgo.pipeline.data_files import open_data_file
from resurgo.pipeline.reader import ReadResult, copy_back, place_destinations, plan_tasks, read_ops, task_extent
from resurgo.plan.load_plan import plan_reads
from resurgo.state.unflatten import Destination
from resurgo.storage.base import Checkpoint

Request = tuple[str, int, tuple[int, ...]]  # (data file, where the read starts, its buffers' lengths)


@dataclass(frozen=True)
class PeerFiles:
    """For the data files this rank's node lacks, the rank that sends each (``senders``); the
    same on every rank of the node."""

    senders: Mapping[str, int]

    def check_sizes(self, ckpt: Checkpoint, sizes: dict[str, int]) -> None:
        """The files this node holds have their sizes (the senders check the others')."""
        ckpt.check_sizes({name: n for name, n in sizes.items() if name not in self.senders})


class PeerLoad:
    """One rank's part of a load in which some files are received from peers (see the module)."""

    def __init__(self, ckpt: Checkpoint, manifest: Manifest, destinations: list[Destination], verify: bool,
                 threads: int, peers: PeerFiles, map_file: Any, loaded: set[str] | None = None):
        self.ckpt, self.manifest, self.verify, self.threads, self.peers = ckpt, manifest, verify, threads, peers
        self.loaded = loaded if loaded is not None else set()  # keys filled, every byte verified
        self.map_file = map_file  # rel -> a mapping of this node's file (what this rank sends)
        self.targets, self.bufs, self.staged = place_destinations(destinations)
        self.entries: dict[str, TensorEntry] = {d.key: d.entry for d in destinations}
        self.ops = plan_reads(self.targets, self.entries)
        self.tasks = plan_tasks(manifest, self.ops, {op.file for op in self.ops}, verify)
        self.requests: list[Request] = []
        for task in self.tasks:
            if task.file in peers.senders:
                header = manifest.file_entry(task.file).header_bytes if task.header else 0
                self.requests.append((task.file, *task_extent(task, header)))
        self.bytes_received = 0

    def transfer(self, comm: Comm) -> ReadResult:
        """Serve the other ranks' requests and read this rank's plan, receiving what its node
        lacks; raise the first failure once every transfer is done. Collective."""
        t_start = time.perf_counter()
        everyone = comm.all_gather((self.requests, dict(self.peers.senders)))
        tags = _tags([r for r, _ in everyone])
        errors: list[BaseException] = []
        sending = _Sends(comm, self.manifest, self.map_file, errors)
        received: dict[str, _Received] = {}
        try:
            for rank, (requests, senders) in enumerate(everyone):
                for i, (name, start, lengths) in enumerate(requests):
                    if senders.get(name) == comm.rank:
                        sending.send(rank, name, start, lengths, tags[rank][i])
            mine = tags[comm.rank]
            for i, (name, start, lengths) in enumerate(self.requests):
                sender = self.peers.senders[name]
                handle = received.setdefault(name, _Received(name, self.manifest.file_entry(name).bytes, sender, comm))
                handle.expect(start, lengths, mine[i])
            handles: dict[str, Any] = dict(received)
            try:
                for name in sorted({op.file for op in self.ops} - set(received)):
                    handles[name] = open_data_file(self.ckpt, self.manifest, name)
                result = read_ops(self.ckpt, self.manifest, self.entries, self.bufs, self.ops, self.verify,
                                  self.threads, handles=handles, tasks=self.tasks, loaded=self.loaded)
            except BaseException as e:  # noqa: BLE001 - raised once every transfer is done
                errors.append(e)
                result = None
            finally:
                for name, h in handles.items():
                    if name not in received:
                        h.close()
        finally:
            for h in received.values():
                h.drain()  # what a failed read did not take: the sender must not wait forever
            sending.wait()
        if errors:
            raise errors[0]
        assert result is not None
        self.bytes_received = sum(h.nbytes for h in received.values())
        result.seconds["total"] = time.perf_counter() - t_start
        result.bytes_received = self.bytes_received
        result.bytes_read = sum(op.length for op in self.ops if op.file not in received)
        return result

    def finish(self) -> float:
        """Copy the staged bytes into their tensors (every rank succeeded); seconds it took."""
        t0 = time.perf_counter()
        copy_back(self.staged)
        return time.perf_counter() - t0


def _tags(requests: list[list[Request]]) -> list[list[int]]:
    """The first message tag of each request (one tag per buffer), the same on every rank."""
    out, tag = [], 0
    for mine in requests:
        firsts = []
        for _, _, lengths in mine:
            firsts.append(tag)
            tag += len(lengths)
        out.append(firsts)
    return out



class _Sends:
    """The requests this rank serves, sent from its files' mappings (opened once each)."""

    def __init__(self, comm: Comm, manifest: Manifest, map_file: Any, errors: list[BaseException]):
        self.comm, self.manifest, self.map_file, self.errors = comm, manifest, map_file, errors
        self.files: dict[str, Any] = {}
        self.pending: list[Any] = []

    def _view(self, name: str) -> memoryview | None:
        if name not in self.files:
            try:
                faults.point("restore.peer")
                f = self.map_file(name)
                expected = self.manifest.file_entry(name).bytes
                if len(f.view) != expected:
                    f.close()
                    raise CorruptCheckpointError(f"{name}: {len(f.view)} bytes to send, the manifest says {expected}")
                self.files[name] = f
            except Exception as e:  # noqa: BLE001 - raised at the end: the peer must not wait forever
                self.errors.append(e)
                self.files[name] = None
        f = self.files[name]
        return None if f is None else f.view

    def send(self, dst: int, name: str, start: int, lengths: tuple[int, ...], tag: int) -> None:
        import torch
        import torch.distributed as dist

        view = self._view(name)
        if view is not None and start + sum(lengths) > len(view):
            self.errors.append(CorruptCheckpointError(
                f"{name}: rank {dst} asked for bytes {start}..{start + sum(lengths)}, the file has {len(view)}"))
            view = None
        at = start
        for i, n in enumerate(lengths):
            if n:
                out = torch.frombuffer(view[at:at + n], dtype=torch.uint8) if view is not None else torch.zeros(
                    n, dtype=torch.uint8)  # the peer still waits for these bytes; it will not verify them
                self.pending.append((out, dist.isend(out, dst=self.comm.global_rank(dst), group=self.comm.group,
                                                     tag=tag + i), self.comm.global_rank(dst)))
            at += n

    def wait(self) -> None:
        try:
            liveness.wait_requests([request for _, request, _ in self.pending], [other for _, _, other in self.pending])
        except RankFailedError as e:  # a peer died or stalled
            self.errors.append(e)
        except BaseException as e:  # noqa: BLE001 - a transfer that failed otherwise
            self.errors.append(CorruptCheckpointError(f"a send to another rank's load failed: {e}"))
        self.pending.clear()
        for f in self.files.values():
            if f is not None:
                f.close()
        self.files.clear()


class _Received:
    """A data file this node lacks, read from the rank that sends it: each read receives its
    bytes into the reader's buffers (the requests were agreed on beforehand)."""

    def __init__(self, rel: str, size: int, sender: int, comm: Comm):
        self.rel, self.size, self.sender, self.comm = rel, size, sender, comm
        self._expected: dict[tuple[int, tuple[int, ...]], int] = {}  # (start, lengths) -> first tag
        self._done: set[int] = set()
        self._lock = threading.Lock()
        self.nbytes = 0

    def expect(self, start: int, lengths: tuple[int, ...], tag: int) -> None:
        self._expected[(start, lengths)] = tag

    def read_into_many(self, offset: int, bufs: list[memoryview]) -> None:
        import torch

        lengths = tuple(len(b) for b in bufs)
        tag = self._expected.get((offset, lengths))
        if tag is None:
            raise CorruptCheckpointError(f"{self.rel}: a read of bytes {offset}.. that was not asked of rank "
                                         f"{self.sender}")
        with self._lock:
            self._done.add(tag)
        self._receive([torch.frombuffer(b, dtype=torch.uint8) if len(b) else None for b in bufs], tag)
        with self._lock:
            self.nbytes += sum(lengths)

    def _receive(self, tensors: list[Any], tag: int) -> None:
        import torch.distributed as dist

        src = self.comm.global_rank(self.sender)
        requests: list[Any] = [dist.irecv(t, src=src, group=self.comm.group, tag=tag + i)
                               for i, t in enumerate(tensors) if t is not None]
        liveness.wait_requests(requests, [src])

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_into_many(offset, [buf])

    def read_at(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def drain(self) -> None:
        """Receive, and drop, every request no read took (a read that failed before them)."""
        import torch

        for (_, lengths), tag in sorted(self._expected.items(), key=lambda kv: kv[1]):
            with self._lock:
                if tag in self._done:
                    continue
                self._done.add(tag)
            self._receive([torch.empty(n, dtype=torch.uint8) if n else None for n in lengths], tag)

    def close(self) -> None:
        pass
