"""The collective sequence that makes a checkpoint appear: stage, write, commit, or abort.

A save and a tier copy both end the same way. Rank 0 opens the destination's staging and every
rank gets a copy of it; every rank writes its share of the data files; once every rank's files
are durable, rank 0 writes the manifest last, which commits. If anything fails on any rank, rank 0
aborts the staging, nothing is committed, and every rank raises the same error
(:meth:`resurgo.dist.comm.Comm.agree`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from resurgo.dist.comm import Comm
from resurgo.storage.base import Staging

Written = TypeVar("Written")


def open_staging(comm: Comm, open_it: Callable[[], Staging]) -> Staging:
    """``open_it()`` on rank 0; every rank gets that staging (it pickles), or the same error."""
    opened = comm.agree(lambda: open_it() if comm.is_coordinator else None)
    shared = comm.broadcast(opened)
    assert shared is not None
    return shared


def write_then_commit(comm: Comm, staging: Staging, write: Callable[[], Written],
                      manifest: Callable[[list[Written]], bytes]) -> tuple[Written, int, float]:
    """Every rank runs ``write()`` (its share, made durable); then rank 0 commits the bytes
    ``manifest(every rank's written)``. Returns this rank's written, the manifest's size and the
    commit's seconds (0 on the other ranks). On any failure rank 0 aborts and every rank raises."""
    everyone: list[Written] | None = None

    def commit() -> tuple[int, float]:
        if not comm.is_coordinator:
            return 0, 0.0
        assert everyone is not None
        raw = manifest(everyone)
        t0 = time.perf_counter()
        staging.commit(raw)
        return len(raw), time.perf_counter() - t0

    try:
        written = comm.agree(write)
        everyone = comm.gather(written)
        manifest_bytes, seconds = comm.agree(commit)
    except BaseException:
        if comm.is_coordinator:
            staging.abort()
        raise
    return written, manifest_bytes, seconds
