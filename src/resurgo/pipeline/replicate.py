"""Sending data files between ranks over torch.distributed, verified before they are written.

A memory tier keeps each rank's data files in its node's memory and sends a replica of them to
ranks on other nodes (:mod:`resurgo.plan.memory_plan` decides who sends what to whom); a restore
sends the files a node lost from a node that holds them. Here is the transfer itself: every rank
takes the same list of :class:`~resurgo.plan.memory_plan.Transfer`, posts a non-blocking send of
each file it is the source of and a non-blocking receive of each it is the destination of (point
to point on the ``comm``'s gloo group, each transfer tagged by its place in the list), so all
transfers run at once, in both directions, and none waits on another. Files are sent from, and
received into, their memory mappings (no copy beside them: gloo reads and writes the files'
pages). A received file is checked against the manifest (size, header, every block checksum)
before it is made durable; one that does not verify is never committed.

A failure (a file that cannot be read, a replica that does not verify) is remembered and raised
once every transfer is done, so no rank is left waiting on a peer that stopped half-way; the caller
agrees on it (:meth:`resurgo.dist.comm.Comm.agree`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from resurgo.dist.comm import Comm
from resurgo.errors import CorruptCheckpointError
from resurgo.format.manifest import Manifest
from resurgo.pipeline.verify import verify_file_bytes
from resurgo.plan.memory_plan import Transfer

# Fault injection for tests: called with each transfer this rank received and wrote.
after_receive: Callable[[Transfer], None] | None = None


class Mapped(Protocol):
    """A file's bytes in memory (:class:`resurgo.storage.local.MappedFile`): sent from, or
    received into, in place."""

    view: memoryview

    def fsync(self) -> None: ...

    def close(self) -> None: ...


def exchange(comm: Comm, transfers: Sequence[Transfer], manifest: Manifest, where: str,
             source: Callable[[str], Mapped], sink: Callable[[str, int], Mapped]) -> int:
    """As a source, send the bytes of ``source(name)``; as a destination, receive them straight
    into ``sink(name, nbytes)`` (the new file, mapped), verify them there against ``manifest``
    and make the file durable. Returns the bytes this rank received. Collective over the ranks
    named in ``transfers``; ``where`` names the destination in messages. No copy of a file is
    held beside its mapping; a file that does not verify stays in the staging, which the caller
    aborts on the error raised."""
    import torch
    import torch.distributed as dist

    errors: list[Exception] = []
    received = 0
    sends: list[list[Any]] = []  # [the tensor, kept alive until sent; its request; its file]
    receives: list[list[Any]] = []  # [transfer, tensor, request, file]
    for tag, t in enumerate(transfers):
        if comm.rank == t.src:
            f: Mapped | None = None
            try:
                f = source(t.name)
                if len(f.view) != t.nbytes:
                    raise CorruptCheckpointError(f"{t.name}: {len(f.view)} bytes to send, the manifest says {t.nbytes}")
                out = _tensor(f.view)
            except Exception as e:  # noqa: BLE001 - raised at the end: the peer must not wait forever
                errors.append(e)
                out = torch.zeros(t.nbytes, dtype=torch.uint8)  # the peer still waits for these bytes; it will not verify them
            sends.append([out, dist.isend(out, dst=_global(comm, t.dst), group=comm.group, tag=tag), f])
        elif comm.rank == t.dst:
            into: Mapped | None = None
            try:
                into = sink(t.name, t.nbytes)
                buf = _tensor(into.view)
            except Exception as e:  # noqa: BLE001 - raised at the end; the bytes are still received
                errors.append(e)
                buf = torch.empty(t.nbytes, dtype=torch.uint8)
            receives.append([t, buf, dist.irecv(buf, src=_global(comm, t.src), group=comm.group, tag=tag), into])
    for entry in receives:
        t, _, request, into = entry
        request.wait()
        entry[1] = entry[2] = None  # the tensor over the file's mapping: gone before it is closed
        if into is None:
            continue
        try:
            problems = verify_file_bytes(manifest, t.name, np.frombuffer(into.view, dtype=np.uint8),
                                         f"{where} (from rank {t.src})")
            if problems:
                raise CorruptCheckpointError(
                    f"{where}: the copy of {t.name} received from rank {t.src} does not verify ({problems[0]}); "
                    "it is not kept")
            into.fsync()
        except Exception as e:  # noqa: BLE001 - raised at the end
            errors.append(e)
            continue
        finally:
            into.close()
        received += t.nbytes
        if after_receive is not None:
            after_receive(t)
    for entry in sends:
        entry[1].wait()
        f = entry[2]
        entry[0] = entry[1] = None
        if f is not None:
            f.close()
    if errors:
        raise errors[0]
    return received


def _tensor(view: memoryview) -> Any:
    """A uint8 tensor over ``view``'s memory (gloo sends from it, or receives into it, in place)."""
    import torch

    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


def _global(comm: Comm, rank: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(comm.group, rank) if comm.group is not None else rank
