"""Asynchronous save: the call takes a snapshot; writing, hashing, fsync and commit run behind.

``async_save`` flattens the state (plain values are encoded at once), copies every tensor into
reusable staging buffers (see :mod:`resurgo.pipeline.staging`) and returns an
:class:`AsyncSaveHandle`; a background thread writes the data files from those buffers and
commits. The checkpoint holds the values of the moment of the call, whatever training does after.

With ``guard=optimizer`` the parameters and optimizer state are not copied during the call: a
background thread copies them (hashing each block as it lands) while the next forward and
backward run, which do not modify them, and a pre-hook on ``optimizer.step()`` takes over
whatever is not copied yet (:mod:`resurgo.pipeline.host_copy`). Everything else (buffers that
forward mutates, such as BatchNorm statistics) is copied during the call.

Background writing uses threads: ``os.write``, ``fsync``, tensor copies and large xxhash calls all
release the GIL, and a thread shares the staging buffers with no copy or serialization, which a
helper process would need (docs/async.md gives the measured difference).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from resurgo import faults
from resurgo.dist import comm as dist_comm
from resurgo.dist import liveness
from resurgo.errors import MemoryBudgetError
from resurgo.pipeline import inflight
from resurgo.pipeline.host_copy import CopyBatch
from resurgo.pipeline.collective import NodeLocal
from resurgo.pipeline.save import LazySources, PreparedSave, prepare_save, write_and_commit
from resurgo.pipeline.staging import DeviceOrder, StagingPool, staging_bytes
from resurgo.pipeline.writer import chunk_file_offsets
from resurgo.reports import SaveReport

_pool = StagingPool()  # one per process: at most one async save is in flight, so reuse is safe


class AsyncSaveHandle:
    """A save in progress. ``wait()`` returns its SaveReport or raises its error; ``done()``,
    ``staged()`` and ``wait_staged()`` follow it; ``path`` and ``stall_seconds`` describe it. Only
    the save it belongs to changes its state."""

    def __init__(self, path: str):
        self.path = path
        self.stall_seconds = 0.0  # how long the async_save call blocked the caller
        self._staged = threading.Event()
        self._done = threading.Event()
        self._report: SaveReport | None = None
        self._error: BaseException | None = None
        self._error_seen = False
        self._thread: threading.Thread | None = None

    def staged(self) -> bool:
        """True once every tensor is copied out: training may then change anything. Device copies
        may still be in flight then, but the caller's CUDA stream (current at the call, or at
        ``guard.step()``) waits for them; work on other streams must wait for that one."""
        return self._staged.is_set()

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveReport:
        """Block until the checkpoint is committed; return its report or raise its error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"asynchronous save to {self.path} still running after {timeout} s")
        if self._thread is not None:
            self._thread.join()  # it has only its clean-up left; the next save then starts at once
        if self._error is not None:
            self._error_seen = True
            raise self._error
        assert self._report is not None
        return self._report

    def wait_staged(self) -> None:
        """Block until :meth:`staged` is true."""
        self._staged.wait()

    # -- transitions, made only by the save this handle belongs to --------------------------------
    def _mark_staged(self) -> None:
        """Every tensor is copied out, or the copy gave up: nothing may wait for the snapshot anymore."""
        self._staged.set()

    def _run_in(self, thread: threading.Thread) -> None:
        """The background thread that writes this save; ``wait()`` joins it."""
        self._thread = thread

    def _mark_committed(self, report: SaveReport) -> None:
        self._report = report
        self._staged.set()
        self._done.set()

    def _mark_failed(self, error: BaseException, *, raised_to_caller: bool = False) -> None:
        """The save failed; ``wait()`` raises ``error`` (and the next save or exit does, unless the
        caller already got it)."""
        self._error = error
        self._error_seen = raised_to_caller
        self._staged.set()
        self._done.set()

    def _settle(self) -> None:
        self._done.wait()
        if self._thread is not None:
            self._thread.join()  # fully ended: nothing of it may still run at interpreter exit
        if self._error is not None and not self._error_seen:
            self._error_seen = True
            raise self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else "committed" if self.done() else "staged" if self.staged() else "staging"
        return f"AsyncSaveHandle({self.path!r}, {state})"


def _lower_priority() -> None:
    """Let training threads win the CPU: the writer thread's hashing and copying yield to them.

    Linux gives each thread its own nice value; elsewhere this does nothing.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class _GuardHook:
    """The one step pre-hook resurgo registers on an optimizer, shared by all its guarded saves.

    It is never removed: ``wait()`` may run in any thread, and a hook removed while ``step()``
    iterates over the hooks raises "OrderedDict mutated during iteration" there (a benchmark's
    waiter thread hit it on a GPU, where saves commit within a few steps). Between saves it
    calls nothing.
    """

    def __init__(self) -> None:
        self.pending: Any = None  # the current guarded save's take-over, or None

    def __call__(self, *_: Any) -> None:
        take_over = self.pending
        if take_over is not None:
            take_over()


_guard_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _guard_hook(optimizer: Any) -> _GuardHook:
    hook = _guard_hooks.get(optimizer)
    if hook is None:
        hook = _guard_hooks[optimizer] = _GuardHook()
        optimizer.register_step_pre_hook(hook)
    return hook


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), tuple(t.shape), t.dtype)


def _guarded_storages(guard: Any) -> set[tuple]:
    """Where the tensors only ``guard.step()`` modifies live: parameters and optimizer state.

    Matched by storage, not identity: ``state_dict()`` returns detached aliases of parameters.
    """
    tensors = [p for group in guard.param_groups for p in group["params"]]
    tensors += [v for per_param in guard.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {_storage_key(t) for t in tensors}


def start_async_save(state: Any, path: str | os.PathLike, *, overwrite: bool, allow_pickle: bool,
                     step: int | None, metadata: dict | None, io_threads: int, block_bytes: int | None,
                     storage_options: dict | None, save_info: dict | None, guard: Any, if_busy: str,
                     staging_limit: int | None, fallback: str,
                     on_commit: Callable[[SaveReport], None] | None,
                     base: str | os.PathLike | None = None, as_base: bool = False,
                     node_local: NodeLocal | None = None) -> AsyncSaveHandle:
    """The work of :func:`resurgo.async_save` (its arguments are documented there): snapshot the
    state into staging buffers (the guard's share beside training), then write and commit in a
    background thread. A snapshot over ``staging_limit`` bytes (``staging_bytes`` of :func:`resurgo.async_save`) with ``fallback="sync"`` streams from the
    tensors instead, before returning."""
    t_start = time.perf_counter()
    if fallback not in ("raise", "sync"):
        raise ValueError(f"fallback must be 'raise' or 'sync', not {fallback!r}")
    inflight.settle(if_busy, dist_comm.current("control"), str(path))
    prep = prepare_save(state, path, overwrite=overwrite, allow_pickle=allow_pickle, step=step,
                        metadata=metadata, io_threads=io_threads, block_bytes=block_bytes,
                        storage_options=storage_options, save_info=save_info, base=base, as_base=as_base,
                        node_local=node_local, call=(("call", "async_save"), ("fallback", fallback)))
    handle = AsyncSaveHandle(str(path))
    sources: dict[str, np.ndarray] = {}
    digests: dict[str, list[str]] = {}
    # Every rank's budget check and snapshot are agreed: one rank over its budget, or failing to
    # stage, makes every rank raise its error (or, over a budget with fallback="sync", every rank
    # save synchronously); only the staging's owner removes it.
    try:
        (_, deferred, background, order), over = prep.comm.agree_noting(
            lambda: _snapshot(prep, path, guard, staging_limit, fallback, sources, digests))
    except BaseException:
        if prep.owns_staging:
            prep.staging.abort()
        raise
    if any(over):
        return _finish_synchronously(handle, prep, t_start, on_commit)
    assert background is not None and order is not None
    if deferred:
        _arm_step_hook(guard, handle, background, order)
    else:
        handle._mark_staged()
    behind = background if deferred else None
    _start_background(handle, path, t_start,
                      lambda: _commit_in_background(prep, handle, behind, sources, digests, t_start, on_commit))
    return handle


def _snapshot(prep: PreparedSave, path: str | os.PathLike, guard: Any, staging_limit: int | None, fallback: str,
              sources: dict[str, np.ndarray], digests: dict[str, list[str]]
              ) -> tuple[tuple[list[str], list[str], CopyBatch | None, DeviceOrder | None], bool]:
    """This rank's budget check and snapshot; its note: whether it is over its budget. Fills
    ``sources`` (each key's staged bytes) and ``digests`` (the block hashes the copy made)."""
    needed = sum(staging_bytes(leaf.nbytes) for leaf in prep.leaves.values())
    if staging_limit is not None and needed > staging_limit:
        if fallback == "raise":
            raise MemoryBudgetError(
                f"{path}: the snapshot needs {needed} bytes of staging memory on rank {prep.comm.rank}, the budget "
                f"is {staging_limit} (staging_bytes); raise staging_bytes, or pass fallback='sync' to save synchronously")
        return ([], [], None, None), True
    faults.point("async.stage")
    eager, deferred = _split(prep, guard)
    t0 = time.perf_counter()
    _pool.retain_only(prep.leaves)
    layout = chunk_file_offsets(prep.plan)
    order = DeviceOrder(_pool)

    def batch(keys: list[str], hashed: bool) -> CopyBatch:
        tasks = []
        for key in keys:
            offset, chunk_block = layout[key]
            staged = _pool.stage(prep.leaves[key], order, offset, chunk_block if hashed else 0)
            sources[key] = staged.flat
            tasks += staged.tasks
            if staged.digests is not None:
                digests[key] = staged.digests
        return CopyBatch(tasks)

    # The guard's copy runs beside training, so it also hashes each block while in cache; the
    # call's copy stays a bare memmove, the shortest stall (hashing there made it 1.18-1.25x a copy).
    background = batch(deferred, hashed=True)
    batch(eager, hashed=False).finish()
    order.training_waits()  # kernels queued after the call wait for its device copies
    prep.seconds["stage"] = time.perf_counter() - t0
    return (eager, deferred, background, order), False


def _arm_step_hook(guard: Any, handle: AsyncSaveHandle, background: CopyBatch, order: DeviceOrder) -> None:
    """Arm ``guard.step()``'s pre-hook for this save: it finishes the guard's copy before the step."""
    hook = _guard_hook(guard)

    def before_step() -> None:
        # Take over what the background has not copied yet, at full speed, rather than wait.
        if hook.pending is before_step:
            hook.pending = None  # in the training thread: the next save may re-arm it
        if handle.staged():
            return
        try:
            background.finish()
        except BaseException:
            pass  # the save has failed; the background thread reports it, training goes on
        order.training_waits()  # step()'s kernels wait for the device copies, not forward's
        handle._mark_staged()
    hook.pending = before_step


def _commit_in_background(prep: PreparedSave, handle: AsyncSaveHandle, behind: CopyBatch | None,
                          sources: dict[str, np.ndarray], digests: dict[str, list[str]], t_start: float,
                          on_commit: Callable[[SaveReport], None] | None) -> None:
    """The background thread's work: the guard's copy (``behind``, when it has one), then the
    write and commit; the outcome goes to ``handle``."""
    staging_failed: BaseException | None = None  # given to every rank by the write's agreement
    try:
        if behind is not None:
            # At the caller's priority: step() needs this copy soon, and at a lower one it
            # ran only once step() took it over (on a CPU-bound 2-core loop, measured).
            t1 = time.perf_counter()
            try:
                faults.point("async.copy")  # the guard's copy, beside training
                behind.run()
                behind.wait()
                _pool.synchronize()  # staged() means landed: step() then waits for nothing
            finally:
                prep.seconds["stage_background"] = time.perf_counter() - t1
                handle._mark_staged()  # even on failure: never leave the optimizer waiting
        _lower_priority()  # writing and hashing yield to training
        _pool.synchronize()
    except BaseException as e:  # noqa: BLE001 - raised in the write phase, agreed by every rank
        staging_failed = e
    try:
        report = write_and_commit(prep, sources, digests, failed_before=staging_failed)
        report.seconds["stall"] = handle.stall_seconds
        report.seconds["total"] = time.perf_counter() - t_start
    except BaseException as e:  # reported by wait(), the next save, or at exit
        try:
            if prep.owns_staging:
                prep.staging.abort()
        finally:
            handle._mark_failed(e)
    else:
        _notify(on_commit, report)
        handle._mark_committed(report)


def _start_background(handle: AsyncSaveHandle, path: str | os.PathLike, t_start: float, work: Callable[[], None]) -> None:
    """Run ``work`` in the save's thread, registered as the save in flight; the stall ends here."""

    def run() -> None:
        with liveness.operation("async save", path):
            work()

    # Not a daemon: the interpreter joins it before exiting, so an in-flight save always commits.
    thread = threading.Thread(target=run, name="resurgo-async-save", daemon=False)
    handle._run_in(thread)
    inflight.register(handle)
    handle.stall_seconds = time.perf_counter() - t_start  # before start(): the report reads it
    thread.start()

def _split(prep: PreparedSave, guard: Any) -> tuple[list[str], list[str]]:
    """(keys copied during the call, keys the background copies before ``guard.step()``)."""
    if guard is None:
        return list(prep.leaves), []
    if not callable(getattr(guard, "register_step_pre_hook", None)):
        raise TypeError("guard must be a torch.optim.Optimizer (it needs register_step_pre_hook)")
    guarded = _guarded_storages(guard)
    eager, deferred = [], []
    for key, leaf in prep.leaves.items():
        v = leaf.value
        if isinstance(v, torch.Tensor) and _storage_key(v) in guarded:
            deferred.append(key)
        else:
            eager.append(key)
    return eager, deferred


def _notify(on_commit: Callable[[SaveReport], None] | None, report: SaveReport) -> None:
    """Tell ``on_commit`` about a committed save; what it raises is warned, the save stands."""
    if on_commit is None:
        return
    try:
        on_commit(report)
    except Exception as e:  # noqa: BLE001 - the checkpoint is committed whatever the callback does
        warnings.warn(f"resurgo: the on_commit callback for {report.path} raised {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=2)


def _finish_synchronously(handle: AsyncSaveHandle, prep: PreparedSave, t_start: float,
                          on_commit: Callable[[SaveReport], None] | None) -> AsyncSaveHandle:
    try:
        report = write_and_commit(prep, LazySources(prep.leaves))
    except BaseException as e:
        handle.stall_seconds = time.perf_counter() - t_start
        handle._mark_failed(e, raised_to_caller=True)
        raise
    report.seconds["stall"] = report.seconds["total"] = time.perf_counter() - t_start
    _notify(on_commit, report)
    handle.stall_seconds = time.perf_counter() - t_start
    handle._mark_committed(report)
    return handle
