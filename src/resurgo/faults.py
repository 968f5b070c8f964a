"""Named fault-injection points: a test hook, not public API.

The pipeline calls :func:`point` at each named phase of a save, load, tier copy, replication or
shared read: "save.write", "save.commit", "async.stage", "async.copy", "load.read", "load.share"
(a shared read's reader), "manager.restore" (choosing the step), "tier.copy", "replicate.send",
"restore.peer" (a peer restore's sender), and "collective.entered" (inside any
collective, once every rank arrived, before gloo's exchange). Unarmed, a point costs one set lookup.
Armed, through the environment variable ``RESURGO_FAULT`` or :func:`arm`, with a comma-separated
list of ``<rank>:<point>:<action>`` (``*`` for every rank), the process of that rank acts when it
reaches that point, the first time only (so that a test can check that a following save
succeeds):

- ``kill``: SIGKILL itself (a rank that dies);
- ``stop``: SIGSTOP itself (a rank alive but silent, until someone sends SIGCONT);
- ``raise``: raise :class:`InjectedFault` (a bug or a refused check on one rank);
- ``enospc`` / ``eio`` / ``eacces``: raise the OSError of that errno (a full, failing or
  read-only disk on this rank only);
- ``slow=<seconds>``: sleep that long (a slow but live rank), every time the point is reached.

The rank is the ``RANK`` environment variable that launchers set (0 when unset).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from dataclasses import dataclass

ENV = "RESURGO_FAULT"


class InjectedFault(RuntimeError):
    """Raised by an armed ``raise`` fault: not a ResurgoError, as a user's bug would not be."""


@dataclass(frozen=True)
class Fault:
    rank: str  # a rank number, or "*"
    point: str
    action: str


_lock = threading.Lock()
_armed: dict[str, list[Fault]] = {}
_fired: set[Fault] = set()
_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO, "eacces": errno.EACCES}


def parse(spec: str) -> list[Fault]:
    """The faults of a ``RESURGO_FAULT`` value; ValueError for a malformed one."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        if len(fields) != 3 or not all(fields):
            raise ValueError(f"{ENV}: {part!r} is not <rank>:<point>:<action>")
        rank, name, action = fields
        if action not in ("kill", "stop", "raise", *_ERRNO) and not action.startswith("slow="):
            raise ValueError(f"{ENV}: unknown action {action!r} in {part!r}")
        faults.append(Fault(rank, name, action))
    return faults


def arm(spec: str) -> None:
    """Arm the faults of ``spec`` in this process (replacing any armed before); "" disarms."""
    table: dict[str, list[Fault]] = {}
    for fault in parse(spec):
        table.setdefault(fault.point, []).append(fault)
    with _lock:
        _armed.clear()
        _armed.update(table)
        _fired.clear()


def point(name: str) -> None:
    """The named phase ``name`` is reached: act if a fault is armed there for this rank."""
    if not _armed or name not in _armed:
        return
    rank = os.environ.get("RANK", "0")
    for fault in _armed.get(name, []):
        if fault.rank not in ("*", rank):
            continue
        if fault.action.startswith("slow="):
            time.sleep(float(fault.action.split("=", 1)[1]))
            continue
        with _lock:
            if fault in _fired:
                continue
            _fired.add(fault)
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "raise":
            raise InjectedFault(f"fault injected at {name} on rank {rank}")
        else:
            code = _ERRNO[fault.action]
            raise OSError(code, f"{os.strerror(code)} (fault injected at {name} on rank {rank})")


arm(os.environ.get(ENV, ""))
