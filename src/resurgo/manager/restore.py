"""Restore: which checkpoint a manager loads (the newest that verifies, in any tier, or the newest
step the nodes' memory can rebuild) and loading it on every rank, the ranks agreeing on each
outcome. A checkpoint that cannot be read is skipped (an older one is tried); an error the caller
must fix is raised at once.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resurgo import faults
from resurgo.api import DEFAULT_IO_THREADS, load
from resurgo.dist import comm as dist_comm
from resurgo.dist.call import call_note, check_same
from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ManifestError,
    NotACheckpointError,
    ResurgoError,
    StorageError,
)
from resurgo.manager import agreement
from resurgo.manager.catalog import COMMITTED, CORRUPT, INCOMPLETE, checkpoint_name, classify, scan
from resurgo.manager.memory import MemoryNodes, Refill
from resurgo.pipeline import inflight
from resurgo.pipeline.load import load_into
from resurgo.pipeline.peer_read import PeerFiles
from resurgo.storage.base import Root

log = logging.getLogger("resurgo.manager")

# A checkpoint that cannot be read: restore tries an older one. Any other error (the caller's
# state has other keys, dtypes or shapes) is the caller's to fix and is raised at once.
UNREADABLE = (NotACheckpointError, ManifestError, CorruptCheckpointError, CheckpointNotFoundError, StorageError)
OK, UNREADABLE_HERE, FATAL = 0, 1, 2


def try_load(state: Any, path: Path | str, step: int, strict: bool, storage_options: dict | None,
             peers: PeerFiles | None = None) -> tuple[int, ResurgoError | None]:
    try:
        if peers is None:
            report = load(state, path, strict=strict, verify=True, storage_options=storage_options)
        else:  # the files this rank's node lacks are read from peers' memory
            _, report = load_into(state, path, strict=strict, verify=True, allow_pickle=False,
                                     io_threads=DEFAULT_IO_THREADS, peers=peers)
    except UNREADABLE as e:
        return UNREADABLE_HERE, e
    except ResurgoError as e:
        return FATAL, e
    if report.step != step:
        return UNREADABLE_HERE, CorruptCheckpointError(
            f"{path}: its manifest says step {report.step}, its name says step {step}")
    return OK, None


def load_agreed(state: Any, path: Path | str, step: int, strict: bool, storage_options: dict | None,
                peers: PeerFiles | None = None) -> tuple[int, ResurgoError | None]:
    """:func:`try_load` on every rank, the worst outcome agreed: the outcome and, unless OK, the
    error to raise or warn (this rank's, else one naming another rank)."""
    outcome, error = try_load(state, path, step, strict, storage_options, peers)
    (outcome,) = agreement.max_over_ranks([outcome])
    if outcome != OK and error is None:  # it loaded here, not on another rank
        error = CorruptCheckpointError(f"{path}: could not be restored on another rank (see its error)")
    return outcome, error


class Restorer:
    """The restores of one manager from its tiers (``roots``; the first held in the nodes' memory
    when ``memory`` is given). Rank 0 chooses the candidates; every rank loads each in turn."""

    def __init__(self, roots: list[Root], memory: MemoryNodes | None, rank: int) -> None:
        self._roots, self._memory, self._rank = roots, memory, rank
        self._root = roots[0].path
        self._refill: Refill | None = None  # a restore's re-replication to nodes that lacked files

    def wait_refill(self) -> None:
        """Block until the last restore's re-replication to nodes that came back empty is done."""
        if self._refill is not None:
            self._refill.wait()
            self._refill = None

    def _location(self, step: int, tier: int) -> Path | str:
        return self._roots[tier].location(checkpoint_name(step))

    def restore(self, state: Any, step: int | None, strict: bool, unreadable: set[int],
                on_restored: Callable[[Path | str, int, int], None]) -> int | None:
        """Load the newest committed checkpoint that verifies (or ``step``) into ``state``, on
        every rank; call ``on_restored(path, step, tier)`` once it is loaded and return its step (None
        when there is none). Steps of the first tier found unreadable are added to ``unreadable``."""
        if self._memory is not None:
            restored = self._from_memory(state, step, strict, unreadable, on_restored)
            if restored is not None:
                return restored

        def choose() -> tuple[None, list[tuple[int, int]] | None]:
            """Rank 0's candidates (its refusal of ``step``, raised on every rank, unless the ranks'
            arguments differ: that is raised first)."""
            mine = None
            faults.point("manager.restore")
            if self._rank == 0:
                mine = self._explicit_candidates(step) if step is not None else self._candidates(unreadable)
            return None, mine

        names, call = call_note(step=step, strict=strict)
        _, notes = dist_comm.current("control").agree_noting(
            choose, call, lambda calls: check_same("restore", str(self._root), names, calls))
        candidates = notes[0]
        assert candidates is not None
        failures = []
        for s, tier in candidates:
            path = self._location(s, tier)
            outcome, error = load_agreed(state, path, s, strict, self._roots[tier].storage_options)
            if outcome == OK:
                on_restored(path, s, tier)
                return s
            assert error is not None
            if outcome == FATAL or (step is not None and (s, tier) == candidates[-1]):
                raise error
            warnings.warn(f"resurgo: not restoring {path}: {error}; trying an older checkpoint, this one is left "
                          f"in place", stacklevel=3)
            if tier == 0:
                unreadable.add(s)
            failures.append(s)
        if not candidates:
            return None
        raise CorruptCheckpointError(
            f"{self._root}: none of the committed checkpoints could be restored (steps {failures}; the warnings say "
            "why). Repair or remove them (`resurgo verify`, `resurgo gc`), or start without restore.")

    def _from_memory(self, state: Any, step: int | None, strict: bool, unreadable: set[int],
                     on_restored: Callable[[Path | str, int, int], None]) -> int | None:
        """Restore the newest step (or ``step``) the nodes' memory can rebuild: each node first
        receives the files it lacks from a peer, then every rank loads from its own node's root.
        None when memory holds no such step, or it cannot be loaded (warned): the durable tiers
        are tried next."""
        assert self._memory is not None
        comm = dist_comm.current("control")
        inflight.settle("wait")  # an earlier restore's re-replication writes the same directories
        try:
            rebuild = self._memory.rebuild(comm, step)
            if rebuild is None:
                log.info("no step%s complete in the nodes' memory: trying the durable tiers",
                         "" if step is None else f" {step}")
                return None
            peers = self._memory.open_for_load(comm, rebuild)
        except UNREADABLE as e:
            warnings.warn(f"resurgo: not restoring from memory ({self._memory.root}): {e}; trying the durable "
                          "tiers", stacklevel=4)
            return None
        s, path = rebuild.step, self._location(rebuild.step, 0)
        outcome, error = load_agreed(state, path, s, strict, None, peers)
        if outcome == OK:
            on_restored(path, s, 0)
            # The nodes that lacked files get them after the restore returns, before the next save.
            self._refill = self._memory.refill(dist_comm.current(), rebuild)
            if self._refill is not None:
                inflight.register(self._refill)
            return s
        assert error is not None
        if outcome == FATAL:
            raise error
        warnings.warn(f"resurgo: not restoring {path} from memory: {error}; trying the durable tiers", stacklevel=4)
        unreadable.add(s)
        return None

    def _durable(self, tier: int) -> bool:
        """Whether restore looks in ``tier`` by listing it (a memory tier is asked collectively)."""
        return not (tier == 0 and self._memory is not None)

    def _explicit_candidates(self, step: int) -> list[tuple[int, int]]:
        """``step`` in each tier that holds it committed, the fast tier first (else the fast tier's
        path, whose load then names what is wrong)."""
        found = [(step, i) for i, store in enumerate(self._roots)
                 if self._durable(i) and (e := classify(store, step)) is not None and e.status == COMMITTED]
        return found or [(step, 0 if self._durable(0) else len(self._roots) - 1)]

    def _candidates(self, unreadable: set[int]) -> list[tuple[int, int]]:
        """Committed (step, tier) pairs, newest step first and, for one step, the fast tier first;
        warns about each incomplete or corrupt checkpoint."""
        candidates = []
        for tier, store in enumerate(self._roots):
            if not self._durable(tier):
                continue
            for entry in scan(store):
                assert entry.step is not None
                if entry.status == COMMITTED:
                    candidates.append((entry.step, tier))
                elif entry.status in (INCOMPLETE, CORRUPT):
                    if entry.status == CORRUPT and tier == 0:
                        unreadable.add(entry.step)
                    warnings.warn(f"resurgo: not restoring {entry.location}: {entry.status}: {entry.detail}; left "
                                  "in place (see `resurgo ls`, remove with `resurgo gc`)", stacklevel=3)
        return sorted(candidates, key=lambda c: (-c[0], c[1]))
