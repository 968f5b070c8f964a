"""The save pipeline in two halves: prepare (flatten, check, plan, open the staging directory) and
write-and-commit (write data files in parallel, build the manifest, commit atomically).

``resurgo.save`` runs both in the caller's thread; ``resurgo.async_save`` runs the first in the
caller's thread and the second in the background, from a snapshot of the tensors.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from resurgo.errors import UnsupportedValueError
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
)
from resurgo.layout.box import ChunkBox
from resurgo.pipeline.buffers import TensorStream, source_for_write
from resurgo.pipeline.writer import WrittenFile, write_data_file
from resurgo.plan.save_plan import SavePlan, WriteItem, plan_files
from resurgo.reports import SaveReport
from resurgo.state.flatten import TensorLeaf, flatten_state
from resurgo.storage.local import CheckpointDir, LocalStaging
from resurgo.version import __version__


@dataclass
class PreparedSave:
    """Everything decided before any tensor byte is written."""

    path: str
    tree: dict
    leaves: dict[str, TensorLeaf]
    pickled: bool
    step: int | None
    metadata: dict | None
    plan: SavePlan
    staging: LocalStaging
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def library_versions() -> dict[str, str]:
    return {"resurgo": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def check_metadata(metadata: dict | None, step: int | None) -> None:
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


def prepare_save(state: Any, path: str | os.PathLike, *, overwrite: bool, allow_pickle: bool,
                 step: int | None, metadata: dict | None, io_threads: int, block_bytes: int | None) -> PreparedSave:
    """Flatten and check the state (plain values are encoded now: a snapshot), plan the files and
    open the staging directory. Raises before anything is written when the state or path is bad."""
    t0 = time.perf_counter()
    check_metadata(metadata, step)
    tree, leaves, pickled = flatten_state(state, allow_pickle=allow_pickle)
    items = [WriteItem(key, key, leaf.dtype, ChunkBox.whole(leaf.shape), leaf.nbytes,
                       block_bytes or checksum.block_bytes_for(leaf.nbytes))
             for key, leaf in leaves.items()]
    plan = plan_files(items, rank=0, max_files=max(1, io_threads))
    staging = CheckpointDir(path).stage(overwrite)
    return PreparedSave(str(path), tree, leaves, pickled, step, dict(metadata) if metadata else None,
                        plan, staging, {"flatten": time.perf_counter() - t0})


class LazySources(Mapping):
    """Each tensor's bytes as its writer asks for them: a host tensor's own memory, or a
    :class:`TensorStream` copied slice by slice (device, strided), so a synchronous save holds no
    copy of the state beyond one slice buffer per writer thread."""

    def __init__(self, leaves: dict[str, TensorLeaf]):
        self._leaves = leaves

    def __getitem__(self, key: str) -> "np.ndarray | TensorStream":
        return source_for_write(self._leaves[key].value)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)


def write_and_commit(prep: PreparedSave, sources: Mapping[str, np.ndarray]) -> SaveReport:
    """Write every data file (one thread per file), then the manifest, then commit. On any failure
    the staging directory is removed and nothing is committed."""
    t_start = time.perf_counter()
    try:
        files = prep.plan.files
        if len(files) == 1:
            written = [write_data_file(prep.staging, files[0], sources)]
        else:
            with ThreadPoolExecutor(len(files), thread_name_prefix="resurgo-write") as pool:
                written = list(pool.map(lambda f: write_data_file(prep.staging, f, sources), files))
        raw = build_manifest(prep, written).to_json_bytes()
        t0 = time.perf_counter()
        prep.staging.commit(raw)
        t_commit = time.perf_counter() - t0
    except BaseException:
        prep.staging.abort()
        raise
    seconds = dict(prep.seconds)
    seconds["commit"] = t_commit
    for phase in ("write", "checksum", "fsync"):
        seconds[phase] = sum(w.seconds[phase] for w in written)
    seconds["write_and_commit"] = time.perf_counter() - t_start
    return SaveReport(
        path=prep.path,
        bytes_written=sum(w.nbytes for w in written) + len(raw),
        tensor_bytes=prep.tensor_bytes,
        files=[w.path for w in written] + [MANIFEST_NAME],
        num_tensors=len(prep.leaves),
        seconds=seconds,
    )


def build_manifest(prep: PreparedSave, written: list[WrittenFile]) -> Manifest:
    chunks: dict[str, list[ChunkEntry]] = {key: [] for key in prep.leaves}
    for w in written:
        for c in w.chunks:
            place = c.item.place
            assert isinstance(place, ChunkBox)
            chunks[c.item.key].append(ChunkEntry(
                box=BoxPlace(offsets=list(place.offsets), shape=list(place.shape)),
                file=c.file, name=None if c.item.name == c.item.key else c.item.name,
                byte_range=list(c.byte_range), block_bytes=c.block_bytes, checksums=c.checksums,
            ))
    tensors = {key: TensorEntry(kind=leaf.kind, dtype=leaf.dtype, shape=list(leaf.shape), chunks=chunks[key])
               for key, leaf in prep.leaves.items()}
    return Manifest(
        format="resurgo.checkpoint", version=1,
        created_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        step=prep.step, metadata=dict(prep.metadata or {}), library=library_versions(),
        world={"size": 1, "rank": 0}, checksum_algorithm="xxh3-128", pickled=prep.pickled,
        files={w.path: FileEntry(bytes=w.nbytes, header_bytes=w.header_bytes, header_checksum=w.header_checksum)
               for w in written},
        tensors=tensors, tree=prep.tree,
    )
