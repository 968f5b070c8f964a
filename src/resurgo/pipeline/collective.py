"""The collective sequence that makes a checkpoint appear: stage, write, commit, or abort.

A save and a tier copy both end the same way. Rank 0 opens the destination's staging and every
rank gets a copy of it; every rank writes its share of the data files; once every rank's files
are durable, rank 0 writes the manifest last, which commits. If anything fails on any rank, rank 0
aborts the staging, nothing is committed, and every rank raises the same error
(:meth:`resurgo.dist.comm.Comm.agree`).

Node-local saves (a memory tier, :class:`NodeLocal`) have one directory per node instead of one
shared by all: each node's lowest rank opens its node's staging, every rank writes into its own
node's, a hook runs on every rank with the coordinator's manifest bytes once every rank's files
are written (the end of the replication to other nodes, started before the writes), and only once
that succeeded everywhere does each node's lowest rank commit its directory with those same
manifest bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from resurgo import faults
from resurgo.dist import liveness
from resurgo.dist.comm import Comm
from resurgo.storage.base import Staging

Written = TypeVar("Written")


def open_staging(comm: Comm, open_it: Callable[[], Staging]) -> Staging:
    """``open_it()`` on rank 0; every rank gets that staging (it pickles), or the same error."""
    opened = comm.agree(lambda: open_it() if comm.is_coordinator else None)
    shared = comm.broadcast(opened)
    assert shared is not None
    return shared


@dataclass(frozen=True)
class NodeLocal:
    """A save into one directory per node (the same path name, each node's own storage).

    ``leader``: the rank that opens and commits this rank's node directory (its node's lowest).
    ``before_stage(plan)``: run by each leader once the plan is known, before anything is written
    (a memory budget check). ``replicate(staging, this rank's file plans, their sources)``: run by
    every rank before it writes (collective), it starts the replication and returns it; its
    ``finish(manifest bytes)`` runs on every rank once every rank's files are written, before any
    commit; its ``drain()`` always runs last (it ends what a failed save left in flight)."""

    leader: int
    before_stage: Callable[[Any], None]
    replicate: Callable[[Staging, Any, Any], "Replication"]


class Replication(Protocol):
    """A node-local save's replication in flight (:class:`NodeLocal`)."""

    def finish(self, manifest: bytes) -> Any: ...

    def drain(self) -> None: ...


def open_node_staging(comm: Comm, leader: int, open_it: Callable[[], Staging]) -> Staging:
    """``open_it()`` on each node's leader; every rank gets its leader's staging, or every rank
    the same error (then every staging that was opened is aborted)."""
    opened: Staging | None = None

    def run() -> None:
        nonlocal opened
        if comm.rank == leader:
            opened = open_it()

    try:
        comm.agree(run)
    except BaseException:
        if opened is not None:
            opened.abort()
        raise
    shared = comm.all_gather(opened)[leader]
    assert shared is not None
    return shared


def write_then_commit(comm: Comm, staging: Staging, write: Callable[[], Written],
                      manifest: Callable[[list[Written]], bytes],
                      node_local: tuple[int, Callable[[bytes, Written], None]] | None = None
                      ) -> tuple[Written, int, float]:
    """Every rank runs ``write()`` (its share, made durable); then rank 0 commits the bytes
    ``manifest(every rank's written)``. Returns this rank's written, the manifest's size and the
    commit's seconds (0 on the other ranks). On any failure rank 0 aborts and every rank raises.

    ``node_local=(leader, before_commit)``: every rank's ``staging`` is its node's; every rank runs
    ``before_commit(manifest bytes, its written)``, then each leader commits its node's staging
    (and aborts it on any failure)."""
    everyone: list[Written] | None = None
    commits = comm.is_coordinator if node_local is None else comm.rank == node_local[0]

    def build() -> bytes:
        assert everyone is not None
        return manifest(everyone)

    def commit(raw: bytes | None) -> tuple[int, float]:
        if not commits:
            return 0, 0.0
        raw = build() if raw is None else raw
        faults.point("save.commit")
        t0 = time.perf_counter()
        staging.commit(raw)
        return len(raw), time.perf_counter() - t0

    try:
        liveness.phase("write")
        written = comm.agree(write)
        liveness.phase("commit")
        everyone = comm.gather(written)
        if node_local is None:
            manifest_bytes, seconds = comm.agree(lambda: commit(None))
        else:
            raw = comm.broadcast(comm.agree(lambda: build() if comm.is_coordinator else b""))
            comm.agree(lambda: node_local[1](raw, written))
            manifest_bytes, seconds = comm.agree(lambda: commit(raw))
    except BaseException:
        if commits:
            staging.abort()
        raise
    return written, manifest_bytes, seconds
