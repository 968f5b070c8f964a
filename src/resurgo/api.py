"""The public entry points: ``save``, ``async_save``, ``load``, ``load_dict`` and ``read_manifest``.

Each is a thin wrapper over the pipeline (:mod:`resurgo.pipeline.save`,
:mod:`resurgo.pipeline.async_save`, :mod:`resurgo.pipeline.load`): the public signatures, their
defaults and their documentation live here; the work lives there.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from collections.abc import Callable, Iterator

from resurgo.dist import liveness
from resurgo.dist.comm import alone
from resurgo.format.manifest import Manifest
from resurgo.pipeline import inflight
from resurgo.pipeline.async_save import AsyncSaveHandle, start_async_save
from resurgo.pipeline.load import load_into
from resurgo.pipeline.manifest_read import read_manifest_of
from resurgo.pipeline.save import DEFAULT_IO_THREADS, LazySources, prepare_save, write_and_commit
from resurgo.renamed import renamed_keywords
from resurgo.reports import LoadReport, SaveReport
from resurgo.storage.open import open_checkpoint
from resurgo.version import __version__

__all__ = ["save", "async_save", "AsyncSaveHandle", "load", "load_dict", "read_manifest", "DEFAULT_IO_THREADS",
           "__version__"]


@renamed_keywords("resurgo.save", incremental="as_base")
def save(state: Any, path: str | os.PathLike, *, overwrite: bool = False, allow_pickle: bool = False,
         step: int | None = None, metadata: dict | None = None, io_threads: int = DEFAULT_IO_THREADS,
         block_bytes: int | None = None, storage_options: dict | None = None,
         save_info: dict | None = None, base: str | os.PathLike | None = None,
         as_base: bool = False, collective: bool = True) -> SaveReport:
    """Save ``state`` as a checkpoint directory at ``path``; returns a :class:`SaveReport`.

    ``path`` is a local path or an fsspec URL (``s3://bucket/run/step_100``, ``memory://...``);
    ``storage_options`` go to fsspec for URLs (credentials, ``endpoint_url``, ...).

    The checkpoint exists only once every byte is durable (see docs/format.md, "Commit"). Saving
    onto an existing checkpoint raises CheckpointExistsError unless ``overwrite=True``; even then
    the old checkpoint is replaced atomically, never modified in place. Values that are not plain
    data raise UnsupportedValueError unless ``allow_pickle=True``. ``block_bytes`` fixes the
    checksum block size (default: from each tensor's size, see :func:`resurgo.format.checksum.block_bytes_for`).
    ``step`` is recorded in the manifest (``inspect``, the manager); when it is not given, the int
    saved under the key ``"step"`` at the top of the state is used (``TrainState(..., step=n)``,
    ``{"model": ..., "step": n}``), else none is recorded.
    ``metadata`` describes the state (it is compared by ``resurgo diff``); ``save_info`` describes
    this save (timings, host, policies: JSON, shown by ``inspect``, left out of ``diff`` by default).
    An asynchronous save still in flight is waited for first (its error, if any, is raised here).
    ``base``: an earlier checkpoint in the same directory (or under the same URL prefix); bytes
    whose checksums equal the base's are not written again, the new checkpoint references them
    (docs/format.md, section 3.5). ``as_base=True`` (implied by ``base``) picks checksum blocks
    small enough to be the unit of reuse, so that later saves can take this checkpoint as their
    base: pass it to the first save of such a series (``incremental=``, its old name, still works
    for one release, with a DeprecationWarning).
    ``collective``: in a distributed job (torch.distributed initialized) every rank calls ``save``
    and each writes its share; ``collective=False`` saves as a job of one process, the others not
    calling (``if rank == 0: resurgo.save(state, path, collective=False)``, the torch.save habit):
    the checkpoint holds this process's state, and a sharded value (DTensor, Shard) raises, since
    this process holds only its own part of it. Every rank must pass the same ``path``, ``step``,
    ``overwrite``, ``allow_pickle``, ``base`` and ``as_base``: ranks that differ all raise
    UnsupportedValueError naming each rank's value, before anything is written. A check that
    fails on one rank only (its disk full, its state's ``state_dict()`` raising) makes every rank
    raise the same error, naming that rank.
    """
    t_start = time.perf_counter()
    with _scope("save", path, collective):
        inflight.settle(if_busy="wait")
        prep = prepare_save(state, path, overwrite=overwrite, allow_pickle=allow_pickle, step=step,
                            metadata=metadata, io_threads=io_threads, block_bytes=block_bytes,
                            storage_options=storage_options, save_info=save_info, base=base,
                            as_base=as_base)
        report = write_and_commit(prep, LazySources(prep.leaves))
    report.seconds["stage"] = 0.0  # tensors are written from their own memory, copied only when they must be
    report.seconds["total"] = time.perf_counter() - t_start
    return report


@contextlib.contextmanager
def _scope(name: str, path: object, collective: bool) -> Iterator[None]:
    """Where a call runs: this thread does ``name`` of ``path`` (:func:`resurgo.dist.liveness.operation`);
    ``collective=False``, as a job of one (:func:`resurgo.dist.comm.alone`), told to the other ranks
    of a job so that those waiting for it in a collective of the same call name the mismatch."""
    with contextlib.ExitStack() as stack:
        if not collective:
            stack.enter_context(alone())
        stack.enter_context(liveness.operation(name, path, collective=collective))
        yield


@renamed_keywords("resurgo.async_save", incremental="as_base", memory_budget="staging_bytes")
def async_save(state: Any, path: str | os.PathLike, *, overwrite: bool = False, allow_pickle: bool = False,
               step: int | None = None, metadata: dict | None = None, io_threads: int = DEFAULT_IO_THREADS,
               block_bytes: int | None = None, storage_options: dict | None = None,
               save_info: dict | None = None, guard: Any = None, if_busy: str = "wait",
               staging_bytes: int | None = None, fallback: str = "raise",
               on_commit: Callable[[SaveReport], None] | None = None,
               base: str | os.PathLike | None = None, as_base: bool = False,
               collective: bool = True) -> AsyncSaveHandle:
    """Snapshot ``state`` and save it in the background; returns an :class:`AsyncSaveHandle`
    once every tensor is copied out (``handle.wait()`` -> SaveReport, or the save's error).

    The arguments of :func:`save` (``base``, ``as_base`` and ``collective`` included), and: ``guard``, an optimizer whose parameters and state may be
    copied after the call returns (the next ``guard.step()`` waits for the copy); ``if_busy``,
    "wait" (default) for a save still in flight or "raise" SaveInFlightError (in a job of several
    ranks, on every rank as soon as one of them is still saving, so that all skip this save);
    ``staging_bytes`` (old name ``memory_budget``, deprecated), the most bytes of staging memory this rank may
    take (a larger snapshot raises MemoryBudgetError, or with ``fallback="sync"`` is saved
    synchronously before the call returns); ``on_commit(report)``,
    called once the checkpoint is committed, in the thread that committed it (the background
    writer; the caller's thread for a synchronous fallback), before ``done()`` turns true; an
    exception it raises is warned (RuntimeWarning), never lost, and never fails the save.
    """
    # The background commit keeps the world it was started in.
    with _scope("async save", path, collective):
        return start_async_save(state, path, overwrite=overwrite, allow_pickle=allow_pickle, step=step,
                                metadata=metadata, io_threads=io_threads, block_bytes=block_bytes,
                                storage_options=storage_options, save_info=save_info, guard=guard,
                                if_busy=if_busy, staging_limit=staging_bytes, fallback=fallback,
                                on_commit=on_commit, base=base, as_base=as_base)


def read_manifest(path: str | os.PathLike, *, storage_options: dict | None = None) -> Manifest:
    """The validated manifest of the checkpoint at ``path`` (a local path or a URL)."""
    return read_manifest_of(open_checkpoint(path, storage_options))


def load(state: Any, path: str | os.PathLike, *, strict: bool = True, verify: bool = True,
         allow_pickle: bool = False, io_threads: int = DEFAULT_IO_THREADS,
         storage_options: dict | None = None, ignore_mismatched: bool = False,
         collective: bool = True, share_reads: bool | None = None, allow_expansion: bool = False) -> LoadReport:
    """Load the checkpoint at ``path`` into ``state`` in place; returns a :class:`LoadReport`.

    Tensors are filled in place (dtype and shape must match: resurgo never casts), plain values
    and containers are replaced, Statefuls get ``load_state_dict``. With ``strict=True`` any key
    present on one side only raises KeyMismatchError listing all of them; ``strict=False`` loads
    the keys both have. A tensor whose dtype or shape differs raises DTypeMismatchError or
    ShapeMismatchError whatever ``strict`` says, unless ``ignore_mismatched=True``: then it is left
    as it is and its key listed in ``LoadReport.mismatched_keys``. Every error names the
    checkpoint and the key. Checksums are verified unless ``verify=False``; no byte that fails
    one reaches ``state``: a tensor is filled only once all of its bytes verified, so the
    CorruptCheckpointError leaves each tensor loaded or exactly as it was, and lists which (its
    ``loaded`` and ``untouched`` keys, for this rank), with no value or ``load_state_dict`` of
    ``state`` applied. A save that replaces
    the checkpoint during the load is not an error: the load reads one complete version, the old
    or the new (:mod:`resurgo.pipeline.consistent`). In a distributed job every rank calls ``load``;
    ``collective=False`` loads as a job of one process, the others not calling (plain tensors only).
    ``share_reads``: in a distributed job, bytes that several ranks need (replicas) are read from
    storage by one of them, verified there and sent to the others over the job's process group
    (``LoadReport.bytes_received``); every rank must load the same checkpoint. None (default)
    shares when it saves storage traffic the page cache cannot: a URL (``s3://...``) or ranks on
    several hosts; local files on one host are read by each rank. True always, False never.
    Tensors ``state`` does not hold (a fresh optimizer's empty state) are allocated; if those new
    tensors would take more than 4 times the distinct bytes the checkpoint's chunks read (a
    manifest placing many tensors on the same bytes), ExpansionError before any is allocated,
    unless ``allow_expansion=True``. Every rank must pass the same ``strict``, ``allow_pickle``,
    ``ignore_mismatched``, ``share_reads`` and ``allow_expansion``, and load a checkpoint of the
    same name (each rank may read its own copy): ranks that differ all raise UnsupportedValueError
    naming each rank's value.
    """
    with _scope("load", path, collective):
        _, report = load_into(state, path, strict=strict, verify=verify, allow_pickle=allow_pickle,
                            io_threads=io_threads, storage_options=storage_options,
                            ignore_mismatched=ignore_mismatched, share_reads=share_reads,
                            allow_expansion=allow_expansion)
    return report


def load_dict(path: str | os.PathLike, *, verify: bool = True, allow_pickle: bool = False,
              io_threads: int = DEFAULT_IO_THREADS, storage_options: dict | None = None,
              collective: bool = True, allow_expansion: bool = False) -> Any:
    """The whole checkpoint as new values: nested containers of full tensors and plain values.
    ``collective=False``: read by this process alone while the other ranks do not call.
    Tensors taking more than 4 times the distinct bytes the checkpoint's chunks read (a manifest
    placing many tensors on the same bytes; tied weights take 2 times) raise ExpansionError
    before any is allocated, unless ``allow_expansion=True``."""
    with _scope("load_dict", path, collective):
        result, _ = load_into(None, path, strict=True, verify=verify, allow_pickle=allow_pickle, io_threads=io_threads,
                            storage_options=storage_options, allow_expansion=allow_expansion)
    return result
