"""Sending data files between ranks over torch.distributed, verified before they are written.

A memory tier keeps each rank's data files in its node's memory and sends a replica of them to
ranks on other nodes (:mod:`resurgo.plan.memory_plan` decides who sends what to whom); a restore
sends the files a node lost from a node that holds them. Here is the transfer itself: every rank
takes the same list of :class:`~resurgo.plan.memory_plan.Transfer`, posts a non-blocking send of
each file it is the source of and a non-blocking receive of each it is the destination of (point
to point on the ``comm``'s gloo group, each transfer tagged by its place in the list), so all
transfers run at once, in both directions, and none waits on another. A received file is checked
against the manifest (size, header, every block checksum) before it is written.

A failure (a file that cannot be read, a replica that does not verify) is remembered and raised
once every transfer is done, so no rank is left waiting on a peer that stopped half-way; the caller
agrees on it (:meth:`resurgo.dist.comm.Comm.agree`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from resurgo.dist.comm import Comm
from resurgo.errors import CorruptCheckpointError
from resurgo.format.manifest import Manifest
from resurgo.pipeline.verify import verify_file_bytes
from resurgo.plan.memory_plan import Transfer
from resurgo.storage.base import ReadHandle

# Fault injection for tests: called with each transfer this rank received and wrote.
after_receive: Callable[[Transfer], None] | None = None


def read_all(handle: ReadHandle) -> np.ndarray:
    """The whole file behind ``handle`` (closed afterwards)."""
    try:
        buf = np.empty(handle.size, dtype=np.uint8)
        handle.read_into(0, buf.data)
        return buf
    finally:
        handle.close()


def exchange(comm: Comm, transfers: Sequence[Transfer], manifest: Manifest, where: str,
             read: Callable[[str], np.ndarray], write: Callable[[str, np.ndarray], None]) -> int:
    """As a source, send ``read(name)``; as a destination, receive the bytes, verify them against
    ``manifest`` and ``write(name, bytes)``. Returns the bytes this rank received. Collective over
    the ranks named in ``transfers``; ``where`` names the destination in messages. Holds every
    file this rank sends or receives in memory at once."""
    import torch
    import torch.distributed as dist

    errors: list[Exception] = []
    received = 0
    sends: list[tuple[Any, Any]] = []  # (the tensor, kept alive until sent; its request)
    receives: list[tuple[Transfer, Any, Any]] = []
    for tag, t in enumerate(transfers):
        if comm.rank == t.src:
            try:
                data = read(t.name)
                if data.nbytes != t.nbytes:
                    raise CorruptCheckpointError(f"{t.name}: {data.nbytes} bytes to send, the manifest says {t.nbytes}")
            except Exception as e:  # noqa: BLE001 - raised at the end: the peer must not wait forever
                errors.append(e)
                data = np.zeros(t.nbytes, dtype=np.uint8)  # the peer still waits for these bytes; it will not verify them
            out = torch.from_numpy(data)
            sends.append((out, dist.isend(out, dst=_global(comm, t.dst), group=comm.group, tag=tag)))
        elif comm.rank == t.dst:
            buf = torch.empty(t.nbytes, dtype=torch.uint8)
            receives.append((t, buf, dist.irecv(buf, src=_global(comm, t.src), group=comm.group, tag=tag)))
    for t, buf, request in receives:
        request.wait()
        data = buf.numpy()
        problems = verify_file_bytes(manifest, t.name, data, f"{where} (from rank {t.src})")
        if problems:
            errors.append(CorruptCheckpointError(
                f"{where}: the copy of {t.name} received from rank {t.src} does not verify ({problems[0]}); "
                "it was not written"))
            continue
        try:
            write(t.name, data)
        except Exception as e:  # noqa: BLE001 - raised at the end
            errors.append(e)
            continue
        received += t.nbytes
        if after_receive is not None:
            after_receive(t)
    for _, request in sends:
        request.wait()
    if errors:
        raise errors[0]
    return received


def _global(comm: Comm, rank: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(comm.group, rank) if comm.group is not None else rank
