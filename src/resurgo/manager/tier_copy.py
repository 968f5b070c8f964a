"""Tier copies: each committed checkpoint a durable tier selects is copied there in the janitor
thread, verified there (every checksum, read back from that tier), then that tier's ``keep_last``
is applied. A copy's error is kept for the manager's next call, which raises it on every rank.

The copies are collectives of their own "copy" channel: every rank copies and verifies its share
of the files, in commit order.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from resurgo.dist import comm as dist_comm
from resurgo.dist import liveness
from resurgo.errors import CorruptCheckpointError
from resurgo.format.manifest import declared_files
from resurgo.manager.catalog import COMMITTED, checkpoint_name, classify, remove
from resurgo.manager.janitor import Janitor
from resurgo.manager.memory import MemoryNodes
from resurgo.manager.prune import prune
from resurgo.manager.retention import KeepLast
from resurgo.pipeline.copy import copy_checkpoint, data_files, share_of
from resurgo.pipeline.manifest_read import read_manifest_of
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.storage.base import Root
from resurgo.storage.open import open_checkpoint

log = logging.getLogger("resurgo.manager")


class TierCopies:
    """The copies from the first tier (``roots[0]``) to the later ones, queued in ``janitor``."""

    def __init__(self, tiers: list[Any], roots: list[Root], janitor: Janitor, memory: MemoryNodes | None) -> None:
        self._tiers, self._roots, self._janitor, self._memory = tiers, roots, janitor, memory
        # The copies' collectives run in the janitor thread, on a gloo group of their own, made
        # here, on the training thread, where every rank builds its manager in the same order.
        self._comm = dist_comm.current("copy") if len(tiers) > 1 else dist_comm.Comm(0, 1)
        # Steps whose copy is queued: the fast tier's retention must keep them until the copy has
        # read them (a later step's retention may run before the copy does).
        self._pending: dict[int, int] = {}
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []  # raised by the manager's next call, agreed

    def queue(self, step: int) -> None:
        """Queue the copies of ``step`` to every tier that selects it. Every rank queues them, in
        commit order, since each copies its share."""
        for tier in range(1, len(self._tiers)):
            if self._tiers[tier].selects(step):
                with self._lock:
                    self._pending[step] = self._pending.get(step, 0) + 1
                self._janitor.submit(functools.partial(self._copy, step, tier))

    def pending(self) -> tuple[int, ...]:
        """The steps whose copy is queued or running."""
        with self._lock:
            return tuple(self._pending)

    def take_error(self) -> BaseException | None:
        """The oldest copy error not yet taken."""
        with self._lock:
            return self._errors.pop(0) if self._errors else None

    def take_errors(self) -> list[BaseException]:
        """Every copy error not yet taken, oldest first."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def _location(self, step: int, tier: int) -> Any:
        return self._roots[tier].location(checkpoint_name(step))

    def _copy(self, step: int, tier: int) -> None:
        """Copy the fast tier's checkpoint of ``step`` to ``tier``, verify the copy there (every
        checksum, read back from that tier), then apply that tier's retention."""
        try:
            self._copy_now(step, tier)
        except Exception as e:  # noqa: BLE001 - raised by the next call, on every rank
            with self._lock:
                self._errors.append(e)
        finally:
            with self._lock:
                left = self._pending.get(step, 1) - 1
                if left > 0:
                    self._pending[step] = left
                else:
                    self._pending.pop(step, None)

    def _copy_now(self, step: int, tier: int) -> None:
        """Collective over the "copy" channel: every rank copies and verifies its share of the files."""
        comm = self._comm
        store, source = self._roots[tier], self._location(step, 0)
        dest = self._location(step, tier)

        def make_way() -> bool:  # rank 0 decides; the other ranks follow
            if comm.rank != 0:
                return False
            existing = classify(store, step)
            if existing is not None and existing.status == COMMITTED:
                return True
            if existing is not None:
                remove(store, existing.name)  # an interrupted copy
            return False

        if comm.broadcast(comm.agree(make_way)):
            return
        log.info("copying step %d to %s", step, dest)
        with liveness.operation("tier copy", dest):
            copy_checkpoint(source, dest, src_options=self._roots[0].storage_options, dst_options=store.storage_options,
                            comm=comm, declared_files=declared_files,
                            share=self._memory.copy_share(step) if self._memory is not None else None)

        def verify_mine() -> list[str]:
            manifest = read_manifest_of(open_checkpoint(dest, store.storage_options))
            return verify_checkpoint(dest, storage_options=store.storage_options,
                                     files=share_of(data_files(manifest), comm)).problems

        problems = [p for ps in comm.all_gather(comm.agree(verify_mine)) for p in ps]
        if problems:
            if comm.rank == 0:
                remove(store, checkpoint_name(step))
            raise CorruptCheckpointError(f"{dest}: the copy of step {step} does not verify ({problems[0]}); "
                                         "it was removed")
        log.info("copied and verified step %d in %s", step, dest)
        keep = self._tiers[tier].keep_last
        if keep is not None and comm.rank == 0:
            prune(store, KeepLast(keep), step)
