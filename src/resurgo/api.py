"""The public entry points: ``save``, ``load`` and ``load_dict``.

Each is the pipeline end to end: flatten the state, plan, write or read in parallel, commit or
fill the target. The pieces live in their own modules; this file only wires them together.
"""

from __future__ import annotations

import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from resurgo.errors import KeyMismatchError, PickleNotAllowedError, UnsupportedValueError
from resurgo.format import checksum
from resurgo.format.manifest import (
    MANIFEST_NAME,
    MAX_METADATA_DEPTH,
    BoxPlace,
    ChunkEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    json_depth_exceeds,
    parse_manifest,
)
from resurgo.layout.box import ChunkBox
from resurgo.pipeline.buffers import source_bytes
from resurgo.pipeline.reader import read_destinations
from resurgo.pipeline.writer import WrittenFile, write_data_file
from resurgo.plan.save_plan import WriteItem, plan_files
from resurgo.reports import LoadReport, SaveReport
from resurgo.state.flatten import flatten_state
from resurgo.state.unflatten import Restorer
from resurgo.storage.local import CheckpointDir

DEFAULT_IO_THREADS = 4
__version__ = "0.1.0"


def _library_versions() -> dict[str, str]:
    return {"resurgo": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def save(state: Any, path: str | os.PathLike, *, overwrite: bool = False, allow_pickle: bool = False,
         step: int | None = None, metadata: dict | None = None, io_threads: int = DEFAULT_IO_THREADS,
         block_bytes: int | None = None) -> SaveReport:
    """Save ``state`` as a checkpoint directory at ``path``; returns a :class:`SaveReport`.

    The checkpoint exists only once every byte is durable (see docs/format.md, "Commit"). Saving
    onto an existing checkpoint raises CheckpointExistsError unless ``overwrite=True``; even then
    the old checkpoint is replaced atomically, never modified in place. Values that are not plain
    data raise UnsupportedValueError unless ``allow_pickle=True``. ``block_bytes`` fixes the
    checksum block size (default: per chunk, see :func:`resurgo.format.checksum.block_bytes_for`).
    """
    t_start = time.perf_counter()
    _check_metadata(metadata, step)
    tree, leaves, pickled = flatten_state(state, allow_pickle=allow_pickle)
    ckpt = CheckpointDir(path)
    staging = ckpt.stage(overwrite)
    try:
        t0 = time.perf_counter()
        sources = {key: source_bytes(leaf.value) for key, leaf in leaves.items()}
        t_stage = time.perf_counter() - t0
        items = [WriteItem(key, key, leaf.dtype, ChunkBox.whole(leaf.shape), leaf.nbytes,
                           block_bytes or checksum.block_bytes_for(leaf.nbytes))
                 for key, leaf in leaves.items()]
        plan = plan_files(items, rank=0, max_files=max(1, io_threads))
        if len(plan.files) == 1:
            written = [write_data_file(staging, plan.files[0], sources)]
        else:
            with ThreadPoolExecutor(len(plan.files), thread_name_prefix="resurgo-write") as pool:
                written = list(pool.map(lambda f: write_data_file(staging, f, sources), plan.files))
        manifest = _build_manifest(tree, leaves, written, pickled, step, metadata)
        raw = manifest.to_json_bytes()
        t0 = time.perf_counter()
        staging.commit(raw)
        t_commit = time.perf_counter() - t0
    except BaseException:
        staging.abort()
        raise
    seconds = {"stage": t_stage, "commit": t_commit}
    for phase in ("write", "checksum", "fsync"):
        seconds[phase] = sum(w.seconds[phase] for w in written)
    seconds["total"] = time.perf_counter() - t_start
    return SaveReport(
        path=str(path),
        bytes_written=sum(w.nbytes for w in written) + len(raw),
        tensor_bytes=sum(leaf.nbytes for leaf in leaves.values()),
        files=[w.path for w in written] + [MANIFEST_NAME],
        num_tensors=len(leaves),
        seconds=seconds,
    )


def _check_metadata(metadata: dict | None, step: int | None) -> None:
    if step is not None and type(step) is not int:
        raise UnsupportedValueError(f"step must be an int or None, not {type(step).__name__}")
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise UnsupportedValueError("metadata must be a dict with str keys")
    if json_depth_exceeds(metadata, MAX_METADATA_DEPTH):  # readers refuse it: keep the manifest readable
        raise UnsupportedValueError(f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedValueError(f"metadata must be plain JSON (str, int, float, bool, None, list, dict): {e}") from None


def _build_manifest(tree: dict, leaves: dict, written: list[WrittenFile], pickled: bool,
                    step: int | None, metadata: dict | None) -> Manifest:
    chunks: dict[str, list[ChunkEntry]] = {key: [] for key in leaves}
    for w in written:
        for c in w.chunks:
            place = c.item.place
            assert isinstance(place, ChunkBox)
            chunks[c.item.key].append(ChunkEntry(
                box=BoxPlace(offsets=list(place.offsets), shape=list(place.shape)),
                file=c.file, name=None if c.item.name == c.item.key else c.item.name, byte_range=list(c.byte_range),
                block_bytes=c.block_bytes, checksums=c.checksums,
            ))
    tensors = {key: TensorEntry(kind=leaf.kind, dtype=leaf.dtype, shape=list(leaf.shape), chunks=chunks[key])
               for key, leaf in leaves.items()}
    return Manifest(
        format="resurgo.checkpoint", version=1,
        created_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        step=step, metadata=dict(metadata or {}), library=_library_versions(),
        world={"size": 1, "rank": 0}, checksum_algorithm="xxh3-128", pickled=pickled,
        files={w.path: FileEntry(bytes=w.nbytes, header_bytes=w.header_bytes, header_checksum=w.header_checksum)
               for w in written},
        tensors=tensors, tree=tree,
    )


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The validated manifest of the checkpoint at ``path``."""
    ckpt = CheckpointDir(path)
    return parse_manifest(ckpt.read_manifest_bytes(), str(ckpt.path / MANIFEST_NAME))


def _restore(target: Any, path: str | os.PathLike, *, strict: bool, verify: bool, allow_pickle: bool,
             io_threads: int) -> tuple[Any, LoadReport]:
    t_start = time.perf_counter()
    ckpt = CheckpointDir(path)
    manifest = parse_manifest(ckpt.read_manifest_bytes(), str(ckpt.path / MANIFEST_NAME))
    if manifest.pickled and not allow_pickle:
        raise PickleNotAllowedError(
            f"{ckpt.path}: holds pickled values; loading them could run code from the file. "
            "Pass allow_pickle=True only if you trust this checkpoint."
        )
    ckpt.check_sizes({name: f.bytes for name, f in manifest.files.items()})  # before any allocation
    restorer = Restorer(manifest, allow_pickle=allow_pickle, strict=strict)
    result = restorer.restore(target)
    if strict and (restorer.missing or restorer.unexpected):
        raise KeyMismatchError(_key_mismatch_message(ckpt, restorer.missing, restorer.unexpected),
                               restorer.missing, restorer.unexpected)
    t_plan = time.perf_counter() - t_start
    read = read_destinations(ckpt, manifest, restorer.destinations, verify=verify, threads=io_threads)
    restorer.run_actions()
    seconds = dict(read.seconds)
    seconds["plan"] = t_plan + seconds.get("plan", 0.0)
    seconds["total"] = time.perf_counter() - t_start
    return result, LoadReport(
        path=str(path), bytes_read=read.bytes_read, files=read.files, num_tensors=len(restorer.destinations),
        seconds=seconds, missing_keys=restorer.missing, unexpected_keys=restorer.unexpected,
        mismatched_keys=restorer.mismatched, step=manifest.step,
    )


def _key_mismatch_message(ckpt: CheckpointDir, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"{ckpt.path}: keys differ between the target state and the checkpoint (strict=True)."]
    if missing:
        parts.append(f"Missing from the checkpoint ({len(missing)}): {', '.join(map(repr, missing))}.")
    if unexpected:
        parts.append(f"In the checkpoint but not in the target ({len(unexpected)}): {', '.join(map(repr, unexpected))}.")
    parts.append("Pass strict=False to load the keys that match.")
    return " ".join(parts)


def load(state: Any, path: str | os.PathLike, *, strict: bool = True, verify: bool = True,
         allow_pickle: bool = False, io_threads: int = DEFAULT_IO_THREADS) -> LoadReport:
    """Load the checkpoint at ``path`` into ``state`` in place; returns a :class:`LoadReport`.

    Tensors are filled in place (dtype and shape must match: resurgo never casts), plain values
    and containers are replaced, Statefuls get ``load_state_dict``. With ``strict=True`` any key
    present on one side only raises KeyMismatchError listing all of them. Checksums are verified
    unless ``verify=False``.
    """
    _, report = _restore(state, path, strict=strict, verify=verify, allow_pickle=allow_pickle, io_threads=io_threads)
    return report


def load_dict(path: str | os.PathLike, *, verify: bool = True, allow_pickle: bool = False,
              io_threads: int = DEFAULT_IO_THREADS) -> Any:
    """The whole checkpoint as new values: nested containers of full tensors and plain values."""
    result, _ = _restore(None, path, strict=True, verify=verify, allow_pickle=allow_pickle, io_threads=io_threads)
    return result
