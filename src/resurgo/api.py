"""The public entry points: ``save``, ``load`` and ``load_dict``.

Each is the pipeline end to end: flatten the state, plan, write or read in parallel, commit or
fill the target. The pieces live in their own modules; this file only wires them together.
"""

from __future__ import annotations

import os
import time
from typing import Any

from resurgo.dist import comm as dist_comm
from resurgo.errors import CheckpointReplacedError, KeyMismatchError, PickleNotAllowedError, ResurgoError
from resurgo.format import checksum
from resurgo.format.manifest import Manifest
from resurgo.pipeline import consistent, inflight
from resurgo.pipeline.manifest_read import read_manifest_and_bytes, read_manifest_of
from resurgo.pipeline.reader import ReadResult, read_destinations
from resurgo.pipeline.save import LazySources, prepare_save, write_and_commit
from resurgo.reports import LoadReport, SaveReport
from resurgo.state.unflatten import Restorer
from resurgo.storage.base import Checkpoint
from resurgo.storage.open import open_checkpoint

from resurgo.version import __version__

DEFAULT_IO_THREADS = 4


def save(state: Any, path: str | os.PathLike, *, overwrite: bool = False, allow_pickle: bool = False,
         step: int | None = None, metadata: dict | None = None, io_threads: int = DEFAULT_IO_THREADS,
         block_bytes: int | None = None, storage_options: dict | None = None,
         save_info: dict | None = None) -> SaveReport:
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
    """
    t_start = time.perf_counter()
    inflight.settle(if_busy="wait")
    prep = prepare_save(state, path, overwrite=overwrite, allow_pickle=allow_pickle, step=step,
                        metadata=metadata, io_threads=io_threads, block_bytes=block_bytes,
                        storage_options=storage_options, save_info=save_info)
    report = write_and_commit(prep, LazySources(prep.leaves))
    report.seconds["stage"] = 0.0  # tensors are written from their own memory, copied only when they must be
    report.seconds["total"] = time.perf_counter() - t_start
    return report


def read_manifest(path: str | os.PathLike, *, storage_options: dict | None = None) -> Manifest:
    """The validated manifest of the checkpoint at ``path`` (a local path or a URL)."""
    return read_manifest_of(open_checkpoint(path, storage_options))


def _restore(target: Any, path: str | os.PathLike, *, strict: bool, verify: bool, allow_pickle: bool,
             io_threads: int, storage_options: dict | None = None,
             ignore_mismatched: bool = False) -> tuple[Any, LoadReport]:
    """Plan, check and read everything, then fill the target. In a distributed job every rank reads
    only what its own layout needs; if any rank fails before the target is touched, all raise."""
    t_start = time.perf_counter()
    comm = dist_comm.current()
    if comm.size > 1:  # an in-flight save commits with collectives on the same group: let it finish
        inflight.settle(if_busy="wait")

    seen: list[bytes] = []  # the manifest this attempt read

    def plan_and_read() -> tuple[Restorer, Any, ReadResult, Manifest, float]:
        ckpt = open_checkpoint(path, storage_options).pinned()  # one version, where the backend can
        try:
            manifest, raw = read_manifest_and_bytes(ckpt)
            seen.append(raw)
            if manifest.pickled and not allow_pickle:
                raise PickleNotAllowedError(
                    f"{ckpt.path}: holds pickled values; loading them could run code from the file. "
                    "Pass allow_pickle=True only if you trust this checkpoint."
                )
            ckpt.check_sizes({name: f.bytes for name, f in manifest.files.items()})  # before any allocation
            restorer = Restorer(manifest, allow_pickle=allow_pickle, strict=strict, rank=comm.rank, world=comm.size,
                                source=str(ckpt.path), ignore_mismatched=ignore_mismatched)
            result = restorer.restore(target)
            if strict and (restorer.missing or restorer.unexpected):
                raise KeyMismatchError(_key_mismatch_message(ckpt, restorer.missing, restorer.unexpected),
                                       restorer.missing, restorer.unexpected)
            t_plan = time.perf_counter() - t_start
            return restorer, result, read_destinations(ckpt, manifest, restorer.destinations, verify=verify,
                                                       threads=io_threads), manifest, t_plan
        finally:
            ckpt.close()

    # A save replacing the checkpoint meanwhile is not corruption: read the new version instead. Every
    # decision is collective, so all ranks retry together and end on the same version.
    for _ in range(consistent.ATTEMPTS):
        seen.clear()
        try:
            restorer, result, read, manifest, t_plan = comm.agree(plan_and_read)
        except CheckpointReplacedError:
            continue  # raised on every rank by agree()
        except ResurgoError:
            changed = consistent.manifest_changed(path, storage_options, seen[0] if seen else None)
            if any(comm.all_gather(changed)):
                continue
            raise
        if comm.size == 1 or len(set(comm.all_gather(checksum.digest(seen[0])))) == 1:
            break
    else:
        raise consistent.replaced_too_often(path)
    restorer.run_actions()
    seconds = dict(read.seconds)
    seconds["plan"] = t_plan + seconds.get("plan", 0.0)
    seconds["total"] = time.perf_counter() - t_start
    return result, LoadReport(
        path=str(path), bytes_read=read.bytes_read, files=read.files, num_tensors=len(restorer.destinations),
        seconds=seconds, missing_keys=restorer.missing, unexpected_keys=restorer.unexpected,
        mismatched_keys=restorer.mismatched, step=manifest.step,
    )


def _key_mismatch_message(ckpt: Checkpoint, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"{ckpt.path}: keys differ between the target state and the checkpoint (strict=True)."]
    if missing:
        parts.append(f"Missing from the checkpoint ({len(missing)}): {', '.join(map(repr, missing))}.")
    if unexpected:
        parts.append(f"In the checkpoint but not in the target ({len(unexpected)}): {', '.join(map(repr, unexpected))}.")
    parts.append("Pass strict=False to load the keys that match.")
    return " ".join(parts)


def load(state: Any, path: str | os.PathLike, *, strict: bool = True, verify: bool = True,
         allow_pickle: bool = False, io_threads: int = DEFAULT_IO_THREADS,
         storage_options: dict | None = None, ignore_mismatched: bool = False) -> LoadReport:
    """Load the checkpoint at ``path`` into ``state`` in place; returns a :class:`LoadReport`.

    Tensors are filled in place (dtype and shape must match: resurgo never casts), plain values
    and containers are replaced, Statefuls get ``load_state_dict``. With ``strict=True`` any key
    present on one side only raises KeyMismatchError listing all of them; ``strict=False`` loads
    the keys both have. A tensor whose dtype or shape differs raises DTypeMismatchError or
    ShapeMismatchError whatever ``strict`` says, unless ``ignore_mismatched=True``: then it is left
    as it is and its key listed in ``LoadReport.mismatched_keys``. Every error names the
    checkpoint and the key. Checksums are verified unless ``verify=False``. A save that replaces
    the checkpoint during the load is not an error: the load reads one complete version, the old
    or the new (:mod:`resurgo.pipeline.consistent`).
    """
    _, report = _restore(state, path, strict=strict, verify=verify, allow_pickle=allow_pickle, io_threads=io_threads,
                         storage_options=storage_options, ignore_mismatched=ignore_mismatched)
    return report


def load_dict(path: str | os.PathLike, *, verify: bool = True, allow_pickle: bool = False,
              io_threads: int = DEFAULT_IO_THREADS, storage_options: dict | None = None) -> Any:
    """The whole checkpoint as new values: nested containers of full tensors and plain values."""
    result, _ = _restore(None, path, strict=True, verify=verify, allow_pickle=allow_pickle, io_threads=io_threads,
                         storage_options=storage_options)
    return result
