"""CheckpointManager: the orchestration of when to save, what to keep, what to restore, and what
to do on preemption.

The manager owns one root directory of checkpoints named by step (see
:mod:`resurgo.manager.catalog`), or one per tier. It holds the order of events and the state
between calls; each concern is a module of this package:

- :mod:`~resurgo.manager.config`: the keyword arguments composed into tiers and policies;
- :mod:`~resurgo.manager.saving`: one save (making way for it, the save paths);
- :mod:`~resurgo.manager.chain`: the incremental chain (the base of the next save);
- :mod:`~resurgo.manager.restore`: which checkpoint to restore, loaded on every rank;
- :mod:`~resurgo.manager.prune`: retention applied to a root;
- :mod:`~resurgo.manager.tier_copy`: copies to the durable tiers;
- :mod:`~resurgo.manager.janitor`: the background thread, leftovers and deletion errors;
- :mod:`~resurgo.manager.preemption`: the signal handlers.

Deletions and copies run in the janitor thread and are crash-safe
(:meth:`resurgo.storage.base.Root.remove`); in a multi-rank job the ranks agree on every decision
(:mod:`resurgo.manager.agreement`), and a background failure is raised on every rank by the next
call. One job per root: the manager removes temporary directories it finds there when it starts.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from resurgo.api import DEFAULT_IO_THREADS, AsyncSaveHandle, read_manifest
from resurgo.dist import comm as dist_comm
from resurgo.dist import liveness
from resurgo.manager import agreement
from resurgo.manager.call_forms import state_first
from resurgo.manager.catalog import COMMITTED, checkpoint_name, scan
from resurgo.manager.chain import IncrementalChain, full_save_policy
from resurgo.manager.config import MTBF_ENV, compose_policy, compose_retention, compose_tiers, describe_retention
from resurgo.manager.daly import daly_interval
from resurgo.manager.full_policy import FullSavePolicy
from resurgo.manager.janitor import DeletionErrors, Janitor
from resurgo.manager.memory import MemoryNodes, MemoryTier
from resurgo.manager.policies import SaveContext, SavePolicy
from resurgo.manager.preemption import Preemption
from resurgo.manager.prune import prune
from resurgo.manager.restore import Restorer
from resurgo.manager.retention import RetentionPolicy
from resurgo.manager.saving import SaveSettings, json_metrics, make_way, start_save
from resurgo.manager.tier_copy import TierCopies
from resurgo.manager.tiers import Tier
from resurgo.storage.base import Root
from resurgo.storage.open import open_root

__all__ = ["CheckpointManager", "MTBF_ENV"]

log = logging.getLogger("resurgo.manager")

COST_SMOOTHING = 0.3  # weight of the newest measurement in the running estimate of δ


class CheckpointManager:
    """Saves by policy into ``root/step_NNNNNNNNN``, keeps what retention says, restores the
    newest checkpoint that verifies, and saves-then-stops on preemption.

    Keyword shortcuts build the policy objects: ``every_steps=n``, ``every_seconds=t``,
    ``at_steps=[...]``, ``interval="auto"`` with ``mtbf=`` seconds (or the
    ``RESURGO_MTBF_SECONDS`` environment variable) for Daly's optimal interval build the save
    policy, or pass ``policy=``; ``keep_last=k``, ``keep_every=n``, ``keep_best=(metric,
    "min"|"max"[, k])`` build the retention, or pass ``retention=``. Giving a shortcut and the
    object of the same rule raises UnsupportedValueError naming both. Without any retention every
    checkpoint is kept. ``signals`` are the preemption signals (handlers are
    installed only when created on the main thread). ``guard`` and ``io_threads`` are passed to
    the saves.

    ``root`` is a directory or a URL (``s3://bucket/run``; ``storage_options`` go to fsspec). With
    ``tiers=[Tier(fast), Tier(durable, copy_every_steps=..., keep_last=...), ...]`` instead of a root,
    every save goes to the first tier and the checkpoints each later tier selects are copied there
    in the background and verified; ``restore`` takes the newest that verifies in any tier.

    ``on_commit(step, path)`` is called once per save of this manager, on every rank, as soon as
    that save is committed, in the thread that committed it: the background writer thread of an
    asynchronous save, the caller's thread of a synchronous one. It should return quickly (the
    next save waits for it); an exception it raises is warned (RuntimeWarning), never lost, and
    does not fail the save. :attr:`latest_committed_step` reads the same event without blocking.

    ``incremental=True`` saves each checkpoint with the previous one as its base: bytes that did
    not change are referenced in the earlier checkpoints' files instead of written again, and a
    full save comes every 10 saves (:class:`~resurgo.manager.full_policy.FullEvery`; pass a
    policy object instead of True to choose). Retention and ``resurgo gc`` keep every checkpoint
    a kept one references. Copies to later tiers are self-contained.

    A :class:`~resurgo.manager.memory.MemoryTier` as the first tier keeps checkpoints in each
    node's memory with replicas on other nodes (:mod:`resurgo.manager.memory`); ``restore`` then
    takes the newest step the nodes' memory can rebuild, else the newest that verifies in a
    durable tier.

    ``collective_timeout``: in a job of several ranks, the seconds a collective waits for a rank
    that neither arrives nor makes progress before every other rank raises RankFailedError naming
    it (:mod:`resurgo.dist.liveness`); it applies to every resurgo collective of this process.
    Default: ``RESURGO_COLLECTIVE_TIMEOUT``, else 120.
    """

    def __init__(self, root: str | os.PathLike | None = None, *, every_steps: int | None = None,
                 every_seconds: float | None = None, at_steps: Iterable[int] | None = None,
                 interval: str | None = None, mtbf: float | None = None, keep_last: int | None = None,
                 keep_every: int | None = None, keep_best: tuple | None = None, async_save: bool = True,
                 policy: SavePolicy | None = None, retention: RetentionPolicy | None = None,
                 signals: Iterable[int] = (signal.SIGTERM,), guard: Any = None,
                 io_threads: int = DEFAULT_IO_THREADS, storage_options: dict | None = None,
                 tiers: Iterable[Tier] | None = None,
                 on_commit: Callable[[int, Path | str], None] | None = None,
                 incremental: bool | FullSavePolicy = False, collective_timeout: float | None = None) -> None:
        if collective_timeout is not None:  # before the first collective: the groups take it too
            liveness.set_collective_timeout(collective_timeout)
        self.tiers: list[Any] = compose_tiers(root, storage_options, tiers)
        # The rules first: an argument error leaves nothing made (no memory nodes, no open roots).
        self.save_policy, self._daly = compose_policy(policy, every_steps, every_seconds, at_steps, interval, mtbf)
        self.retention = compose_retention(retention, keep_last, keep_every, keep_best, self.tiers[0])
        # Made collectively over the control channel, in the same order on every rank.
        self._memory = MemoryNodes(self.tiers[0], dist_comm.current("control")) if isinstance(
            self.tiers[0], MemoryTier) else None
        self._roots: list[Root] = [self._memory.open_root() if i == 0 and self._memory is not None
                                   else open_root(t.root, t.storage_options) for i, t in enumerate(self.tiers)]
        self._store: Root = self._roots[0]
        self.root: Path | str = self._store.path
        self._retention_record = describe_retention(self.retention, self.tiers, self._roots)
        self._chain = IncrementalChain(full_save_policy(incremental, self._memory is not None))
        self.async_save = bool(async_save)
        self._guard = guard
        self._io_threads = io_threads
        self._rank, self._world_size = agreement.world()
        self._restorer = Restorer(self._roots, self._memory, self._rank)
        self._janitor = Janitor()
        self._copies = TierCopies(self.tiers, self._roots, self._janitor, self._memory)
        self._pending: AsyncSaveHandle | None = None
        self._pending_step: int | None = None
        self._on_commit = on_commit
        self._latest_committed: int | None = None  # written by the committing thread: one int, atomic
        self._last_save_step: int | None = None
        self._last_save_time = time.monotonic()
        self._save_cost: float | None = None
        self._should_stop = False
        self._unreadable_steps: set[int] = set()  # found corrupt by restore: never counted by retention
        self._deletions = DeletionErrors(self._janitor, self.root, self._world_size)
        self._closed = False
        self._preemption = Preemption(tuple(signals))
        for tier, store in enumerate(self._roots):
            if self._cleans(tier):
                self._janitor.clear_leftovers(store)

    def _cleans(self, tier: int) -> bool:
        """Whether this rank removes leftovers and applies retention in ``tier``: rank 0, or in a
        memory tier each node's lowest rank (each node has its own root)."""
        if tier == 0 and self._memory is not None:
            return self._memory.is_leader
        return self._rank == 0

    # -- public state -----------------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True once a preemption was handled (its checkpoint is committed), or once background
        work failed (an asynchronous save's write or commit, a tier copy: raised on every rank by
        the next call): end the loop."""
        return self._should_stop

    @property
    def full_policy(self) -> FullSavePolicy | None:
        """When an incremental save is made in full instead (None: every save is full)."""
        return self._chain.full_policy

    @property
    def save_cost_seconds(self) -> float | None:
        """The running estimate of one checkpoint's cost δ (None before any save was measured)."""
        return self._save_cost

    @property
    def interval_seconds(self) -> float | None:
        """With ``interval="auto"``: the current optimal interval, once δ is known."""
        if self._daly is None or self._save_cost is None:
            return None
        return daly_interval(self._save_cost, self._daly.mtbf_seconds)

    @property
    def latest_committed_step(self) -> int | None:
        """The step of the newest save of this manager that is committed (None before the first).
        Never blocks: an asynchronous save counts from the moment its commit is done, before
        ``wait()`` or the next ``maybe_save`` learns of it."""
        return self._latest_committed

    def path_for(self, step: int, tier: int = 0) -> Path | str:
        return self._roots[tier].location(checkpoint_name(step))

    def steps(self, tier: int = 0) -> list[int]:
        """Steps of the committed checkpoints in the root (or that tier), oldest first (reads
        manifests, no data)."""
        return [e.step for e in scan(self._roots[tier]) if e.status == COMMITTED and e.step is not None]

    def notify_preemption(self) -> None:
        """Ask for a save-and-stop at the next ``maybe_save``, as a preemption signal does."""
        self._preemption.request()

    # -- restore ----------------------------------------------------------------------------------
    def restore(self, state: Any, step: int | None = None, *, strict: bool = True) -> int | None:
        """Load the newest committed checkpoint that verifies into ``state``; return its step, or
        None when the root holds no committed checkpoint (a fresh start).

        Incomplete and corrupt checkpoints are skipped with a warning saying why, never loaded and
        never deleted. ``step=`` loads that step or raises. Every rank restores the same step:
        rank 0 chooses, and a checkpoint that fails on any rank is skipped on all. A rank that
        fails meanwhile is named on every other by RankFailedError (operation "restore").
        """
        self._check_open()
        with liveness.operation("restore", self.root):  # what the others name if this rank falls silent
            return self._restorer.restore(state, step, strict, self._unreadable_steps, self._restored)

    def _restored(self, path: Path | str, step: int, tier: int) -> None:
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        manifest = read_manifest(path, storage_options=self._roots[tier].storage_options)
        if tier == 0:  # the base of the next incremental save
            self._chain.restored(step, manifest.save_info)
        cost = manifest.save_info.get("save_cost_seconds", manifest.metadata.get("save_cost_seconds"))
        if isinstance(cost, (int, float)) and not isinstance(cost, bool) and math.isfinite(cost) and cost >= 0:
            self._save_cost = float(cost)  # the interval survives restarts without a measuring save
        log.info("restored step %d from %s", step, path)

    # -- saving -----------------------------------------------------------------------------------
    def maybe_save(self, state: Any, step: int, metrics: Mapping[str, Any] | None = None) -> bool:
        """Save if the policy says so, or a preemption is pending (then also wait for the commit
        and set ``should_stop``). True when a save was started. Every rank calls it."""
        state, step = state_first("maybe_save", state, step)
        self._check_open()
        self._deletions.reap()
        ctx = SaveContext(step=step, now=time.monotonic(), last_save_step=self._last_save_step,
                          last_save_time=self._last_save_time, preempted=self._preemption.requested,
                          save_cost=self._save_cost)
        wanted = self.save_policy.should_save(ctx) if self.save_policy is not None else False
        preempted, wanted = self._agree_on_background([ctx.preempted, wanted])
        fresh = step != self._last_save_step  # never the same step twice (e.g. right after a restore)
        if preempted:
            self._preemption.clear()
            if fresh:
                self._save(step, state, metrics)
            self._wait_commit()
            self._should_stop = True
            log.info("preempted: step %d is committed; should_stop is set", self._last_save_step)
            return fresh
        if wanted and fresh:
            self._save(step, state, metrics)
            return True
        return False

    def save(self, state: Any, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Save now, whatever the policy (asynchronously unless ``async_save=False``)."""
        state, step = state_first("save", state, step)
        self._check_open()
        self._deletions.reap()
        self._agree_on_background([])
        self._save(step, state, metrics)

    def _save(self, step: int, state: Any, metrics: Mapping[str, Any] | None) -> None:
        t_start = time.monotonic()
        path = self.path_for(step)
        metadata = {"metrics": json_metrics(metrics)}  # the state's; the save's own figures go apart
        save_info = {"save_cost_seconds": self._save_cost, **self._retention_record}
        self._wait_commit()  # the previous save: its error is raised here, its retention starts
        overwrite = make_way(self._store, path, step, self._rank, self._janitor)
        base = self._chain.choose_base(step, self.path_for, self._store.storage_options, self._unreadable_steps)
        chain = self._chain.begin(base)
        if chain is not None:
            save_info["incremental"] = chain
        log.info("saving step %d to %s%s", step, path, f" (base {base})" if base is not None else "")
        handle = start_save(state, path, step, SaveSettings(self.async_save, self._guard, self._io_threads,
                                                            self._store.storage_options, self._memory),
                            metadata=metadata, save_info=save_info, overwrite=overwrite, base=base,
                            as_base=self._chain.incremental, on_commit=lambda: self._announce_commit(step, path))
        if handle is not None:
            self._pending, self._pending_step = handle, step
        else:
            self._announce_commit(step, path)
            self._committed(step)
        cost = time.monotonic() - t_start  # the stall of an async save, the whole of a sync one
        self._save_cost = cost if self._save_cost is None else (
            COST_SMOOTHING * cost + (1 - COST_SMOOTHING) * self._save_cost)
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        self._unreadable_steps.discard(step)

    def _announce_commit(self, step: int, path: Path | str) -> None:
        """In the thread that committed ``step``: publish it, then call ``on_commit`` (warned if it raises)."""
        self._latest_committed = step
        if self._on_commit is None:
            return
        try:
            self._on_commit(step, path)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed whatever the callback does
            warnings.warn(f"resurgo: on_commit({step}, {str(path)!r}) raised {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)

    def _background_failure(self) -> BaseException | None:
        """This rank's background failure known now: a finished asynchronous save's error, or a
        tier copy's. Each is already agreed by the ranks of its own collectives, but each rank
        learns of it at its own moment."""
        if self._pending is not None and self._pending.done():
            try:
                self._wait_commit()
            except BaseException as e:  # noqa: BLE001 - agreed with the other ranks, then raised
                return e
        return self._copies.take_error()

    def _agree_on_background(self, flags: list[bool]) -> list[bool]:
        """``flags`` OR-ed over the ranks, in the same collective that agrees on background
        failures: if one rank's save, commit or tier copy failed, every rank raises that error
        (naming the rank) and ``should_stop`` turns true."""
        def check() -> tuple[None, list[bool]]:
            failure = self._background_failure()
            if failure is not None:
                raise failure
            return None, [bool(f) for f in flags]

        # A deletion's error (rank-local) travels with this agreement, even from a failing rank.
        try:
            _, notes = dist_comm.current("control").agree_noting(
                check, self._deletions.take(), lambda everyone: self._deletions.warn(everyone, stacklevel=6))
        except BaseException:
            self._should_stop = True
            self._forget_background()
            raise
        return [any(column) for column in zip(*notes)] if flags else []

    def _forget_background(self) -> None:
        """After an agreed background failure: this rank's own share of it (its save still
        failing, its copy's error) ends here and is not raised again."""
        handle, self._pending, self._pending_step = self._pending, None, None
        if handle is not None:
            try:
                handle.wait()
            except BaseException:  # noqa: BLE001 - the same failure, raised already
                pass
        self._janitor.join()
        self._copies.take_errors()

    def _wait_commit(self) -> None:
        handle, step = self._pending, self._pending_step
        if handle is None or step is None:
            return
        self._pending, self._pending_step = None, None
        try:
            handle.wait()  # raises the save's error, once (every rank's save fails alike)
        except BaseException:
            self._should_stop = True
            raise
        self._committed(step)

    def _committed(self, step: int) -> None:
        log.info("committed step %d", step)
        self._chain.committed(step)
        self._copies.queue(step)  # before retention, which may then delete the source
        if not self._cleans(0):
            return
        if self.retention is not None:
            unreadable = frozenset(self._unreadable_steps)
            self._janitor.submit(lambda: self._retain(step, unreadable))

    # -- retention (janitor thread) ---------------------------------------------------------------
    def _retain(self, just_committed: int, unreadable: frozenset[int]) -> None:
        """The first tier's retention, named "retention" to the other ranks should this one fall
        silent in it (a deletion stuck on storage)."""
        with liveness.operation("retention", self.root):
            prune(self._store, self.retention, just_committed, unreadable=unreadable,
                  held=self._memory.committed_steps if self._memory is not None else None,
                  in_use=self._in_use, keep_damaged=True)

    def _in_use(self) -> tuple[int, ...]:
        """Steps the first tier's retention keeps whatever it says: those a queued copy still
        reads, and the base of the save that may be running now."""
        base = self._chain.base_step
        return self._copies.pending() + ((base,) if base is not None else ())

    # -- lifecycle --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager({str(self.root)!r}) is closed")

    def wait(self) -> None:
        """Block until the save in flight is committed (raising its error), deletions are done,
        and a restore's re-replication to nodes that came back empty is done."""
        self._restorer.wait_refill()
        try:
            self._wait_commit()
            self._janitor.join()
        except BaseException:
            self._should_stop = True
            raise
        self._deletions.reap()
        # Every rank's copies ended (each failed on every rank, agreed): raised here without a collective.
        failures = self._copies.take_errors()
        failure = failures[0] if failures else None
        if failure is not None:
            self._should_stop = True
            raise failure

    def close(self) -> None:
        """Wait for everything in flight, then restore the previous signal handlers."""
        if self._closed:
            return
        waited = False
        try:
            self.wait()
            waited = True
        finally:
            self._janitor.join()
            if waited:
                self._agree_last_deletions()
            else:  # wait's failure was agreed: every rank is here, but no later collective is due
                self._deletions.reap(now=True)
            self._preemption.uninstall()
            self._closed = True

    def _agree_last_deletions(self) -> None:
        """The last deletions' errors, warned alike on every rank: one more agreement, as close
        is called on every rank like each call of the manager."""
        self._deletions.reap()
        dist_comm.current("control").agree_noting(
            lambda: (None, None), self._deletions.take(), lambda everyone: self._deletions.warn(everyone, stacklevel=6))

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the exception already propagating is the one to see; a save error is not lost either
            self.close()
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"resurgo: closing the manager while handling {exc_type.__name__} failed: {e}",
                          stacklevel=2)

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.root)!r}, policy={self.save_policy!r}, retention={self.retention!r})"
