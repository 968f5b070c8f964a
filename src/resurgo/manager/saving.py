"""One save of the manager into its first tier: its metrics as JSON numbers, making way for it where
its step is already saved (replacing what resurgo wrote, refusing what later checkpoints
reference), and the save itself, synchronous or not, into a root or the nodes' memory.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resurgo.api import AsyncSaveHandle, async_save, save
from resurgo.dist import comm as dist_comm
from resurgo.errors import CheckpointExistsError, ForeignFilesError, UnsupportedValueError
from resurgo.manager.catalog import COMMITTED, INCOMPLETE, classify, remove, scan
from resurgo.manager.janitor import Janitor
from resurgo.manager.memory import MemoryNodes
from resurgo.pipeline import inflight
from resurgo.pipeline.async_save import start_async_save
from resurgo.pipeline.collective import NodeLocal
from resurgo.pipeline.save import LazySources, prepare_save, write_and_commit
from resurgo.storage.base import Root

log = logging.getLogger("resurgo.manager")


def json_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Metrics as JSON numbers (0-d tensors and numpy scalars too); NaN and inf become None."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics must be a mapping of names to numbers, not {type(metrics).__name__}")
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise UnsupportedValueError(f"metrics: names must be str, not {name!r}")
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            raise UnsupportedValueError(f"metrics[{name!r}]: expected a number, got {type(value).__name__}") from None
        out[name] = number if math.isfinite(number) else None
    return out


def make_way(store: Root, path: Path | str, step: int, rank: int, janitor: Janitor) -> bool:
    """Whether the save of ``step`` must replace something already at ``path`` (it warns what). Something
    resurgo cannot prove it wrote is not warned about: the save's staging refuses it, on every
    rank (ForeignFilesError), before anything is written."""
    if classify(store, step) is None:
        return False
    janitor.join()  # no deletion of this very path may still be running
    entry = classify(store, step)
    if entry is None:
        return False
    users = [e.location for e in scan(store) if e.status == COMMITTED and entry.name in e.referenced]
    if users:
        raise CheckpointExistsError(
            f"{path}: step {step} is already saved, and {users[0]}" + (f" (and {len(users) - 1} more)" if len(users) > 1 else "")
            + " references its data files: replacing it would break them. Delete the later checkpoints "
            "(resurgo gc --keep-last, or by hand) or save to another root")
    try:
        remove(store, entry.name, dry_run=True)
    except ForeignFilesError:
        return True
    if entry.status == INCOMPLETE and store.saves_in_place:
        if rank == 0:  # who stages the save; a save of ours that died: its token would refuse it
            remove(store, entry.name)
        return False
    detail = f": {entry.detail}" if entry.detail else ""
    warnings.warn(f"resurgo: replacing {path} ({entry.status}{detail}) with a new save of step {step}; "
                  "the replacement is atomic", stacklevel=4)
    return True


@dataclass(frozen=True)
class SaveSettings:
    """How a manager saves: asynchronously or not, with which guard and I/O threads, into a root
    with these storage options, or into the nodes' ``memory``."""

    asynchronous: bool
    guard: Any
    io_threads: int
    storage_options: dict | None
    memory: MemoryNodes | None


def start_save(state: Any, path: Path | str, step: int, settings: SaveSettings, *, metadata: dict,
               save_info: dict, overwrite: bool, base: Path | str | None, as_base: bool,
               on_commit: Callable[[], None]) -> AsyncSaveHandle | None:
    """Save ``state`` as ``step`` at ``path``: the handle of an asynchronous save (``on_commit``
    is called in the thread that commits it), or None once a synchronous one is committed."""
    if settings.memory is not None:
        return _save_to_memory(state, path, step, settings, settings.memory, metadata, save_info, overwrite,
                               on_commit)
    if settings.asynchronous:
        handle = async_save(state, path, step=step, metadata=metadata, save_info=save_info, overwrite=overwrite,
                            guard=settings.guard, io_threads=settings.io_threads,
                            storage_options=settings.storage_options,
                            on_commit=lambda _report: on_commit(), base=base, as_base=as_base)
        log.info("staged step %d; writing in the background", step)
        return handle
    save(state, path, step=step, metadata=metadata, save_info=save_info, overwrite=overwrite,
         io_threads=settings.io_threads, storage_options=settings.storage_options, base=base,
         as_base=as_base)
    return None


def _save_to_memory(state: Any, path: Path | str, step: int, settings: SaveSettings, memory: MemoryNodes,
                    metadata: dict, save_info: dict, overwrite: bool,
                    on_commit: Callable[[], None]) -> AsyncSaveHandle | None:
    """Save into this node's memory root; the save replicates to other nodes before each node
    commits (:mod:`resurgo.manager.memory`)."""
    node: NodeLocal = memory.node_local(step, dist_comm.current)
    if settings.asynchronous:
        handle = start_async_save(
            state, path, overwrite=overwrite, allow_pickle=False, step=step, metadata=metadata,
            io_threads=settings.io_threads, block_bytes=None, storage_options=None, save_info=save_info,
            guard=settings.guard, if_busy="wait", staging_limit=None, fallback="raise",
            on_commit=lambda _report: on_commit(), node_local=node)
        log.info("staged step %d; writing and replicating in the background", step)
        return handle
    inflight.settle(if_busy="wait")
    prep = prepare_save(state, path, overwrite=overwrite, allow_pickle=False, step=step, metadata=metadata,
                        io_threads=settings.io_threads, block_bytes=None, save_info=save_info, node_local=node)
    write_and_commit(prep, LazySources(prep.leaves))
    return None
