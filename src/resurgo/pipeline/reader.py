"""Reading a load plan: parallel positional reads into destination memory, verified as they land.

Each read op fills a slice of either the destination's own bytes (one whole chunk) or a chunk
buffer (several chunks, assembled afterwards). Verification hashes the blocks of each slice right
after it is read, in the same thread, so the data is checked while still in cache.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from resurgo.errors import CorruptCheckpointError
from resurgo.format import checksum, dtypes
from resurgo.format.manifest import Manifest
from resurgo.layout.box import ChunkBox
from resurgo.pipeline.buffers import as_copyable, typed_view, writable_bytes
from resurgo.plan.load_plan import ReadOp, plan_reads, reads_whole_into_dest
from resurgo.state.unflatten import Destination
from resurgo.storage.local import CheckpointDir, ReadHandle


@dataclass
class ReadResult:
    bytes_read: int
    files: list[str]
    seconds: dict[str, float]


def _torch_dtype(entry_dtype: str) -> torch.dtype:
    return dtypes.TORCH_DTYPES[entry_dtype]


def read_destinations(ckpt: CheckpointDir, manifest: Manifest, destinations: list[Destination],
                      verify: bool = True, threads: int = 4) -> ReadResult:
    t_start = time.perf_counter()
    by_key = {d.key: d for d in destinations}
    ops = plan_reads({d.key: d.entry for d in destinations})
    # Where each destination's bytes land: its own memory, or a staging array copied in afterwards.
    flat: dict[str, np.ndarray] = {}
    staged: list[Destination] = []
    chunk_bufs: dict[tuple[str, int], np.ndarray] = {}
    for d in destinations:
        mem = writable_bytes(d.tensor)
        if mem is None:
            nbytes = sum(c.nbytes for c in d.entry.chunks)
            mem = np.empty(nbytes, dtype=np.uint8)
            staged.append(d)
        flat[d.key] = mem
        if not reads_whole_into_dest(d.entry):
            for ci, c in enumerate(d.entry.chunks):
                chunk_bufs[(d.key, ci)] = np.empty(c.nbytes, dtype=np.uint8)
    handles = _open_files(ckpt, manifest, {op.file for op in ops}, verify)
    seconds = {"plan": time.perf_counter() - t_start, "read": 0.0, "checksum": 0.0}

    def run(op: ReadOp) -> tuple[float, float]:
        views = []
        for part in op.parts:
            buf = flat[part.key] if part.into == "dest" else chunk_bufs[(part.key, part.chunk)]
            views.append(buf.data[part.buffer_offset : part.buffer_offset + part.length])
        t0 = time.perf_counter()
        handles[op.file].read_into_many(op.file_offset, views)
        t1 = time.perf_counter()
        if verify:
            for part, view in zip(op.parts, views):
                chunk = by_key[part.key].entry.chunks[part.chunk]
                bad = checksum.first_bad_block(view, chunk.block_bytes, chunk.checksums, part.first_block)
                if bad is not None:
                    start = chunk.byte_range[0] + bad * chunk.block_bytes
                    raise CorruptCheckpointError(
                        f"{ckpt.path}: tensor {part.key!r} is corrupt in {op.file}: block {bad} "
                        f"(file bytes {start}..{min(start + chunk.block_bytes, chunk.byte_range[1])}) "
                        f"does not match its xxh3-128 checksum"
                    )
        return t1 - t0, time.perf_counter() - t1

    try:
        if threads <= 1 or len(ops) <= 1:
            results = [run(op) for op in ops]
        else:
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="resurgo-read") as pool:
                results = list(pool.map(run, ops))
    finally:
        for h in handles.values():
            h.close()
    seconds["read"] = sum(r[0] for r in results)
    seconds["checksum"] = sum(r[1] for r in results)
    t0 = time.perf_counter()
    _assemble(destinations, flat, chunk_bufs)
    for d in staged:
        _copy_back(d, flat[d.key])
    seconds["assemble"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start
    return ReadResult(sum(op.length for op in ops), sorted(handles), seconds)


def _open_files(ckpt: CheckpointDir, manifest: Manifest, names: set[str], verify: bool) -> dict[str, ReadHandle]:
    handles: dict[str, ReadHandle] = {}
    try:
        for name in sorted(names):
            h = ckpt.open_read(name)
            handles[name] = h
            expected = manifest.files[name].bytes
            if h.size != expected:
                raise CorruptCheckpointError(
                    f"{ckpt.path}: data file {name} has {h.size} bytes, the manifest says {expected} (truncated or altered)"
                )
            if verify:
                check_header(ckpt, manifest, name, h)
    except BaseException:
        for h in handles.values():
            h.close()
        raise
    return handles


def check_header(ckpt: CheckpointDir, manifest: Manifest, name: str, handle: ReadHandle) -> None:
    """The safetensors header is covered by its own checksum, so every byte of a file is verified."""
    entry = manifest.files[name]
    if checksum.digest(handle.read_at(0, entry.header_bytes)) != entry.header_checksum:
        raise CorruptCheckpointError(
            f"{ckpt.path}: the safetensors header of {name} (bytes 0..{entry.header_bytes}) does not match its checksum"
        )


def _assemble(destinations: list[Destination], flat: dict[str, np.ndarray],
              chunk_bufs: dict[tuple[str, int], np.ndarray]) -> None:
    for d in destinations:
        if reads_whole_into_dest(d.entry):
            continue
        dt = _torch_dtype(d.entry.dtype)
        whole = typed_view(flat[d.key], dt, tuple(d.entry.shape))
        for ci, c in enumerate(d.entry.chunks):
            place = c.place
            part = as_copyable(typed_view(chunk_bufs[(d.key, ci)], dt, tuple(place.shape) if isinstance(place, ChunkBox) else (place.numel,)))
            if isinstance(place, ChunkBox):
                as_copyable(whole)[place.slices()] = part
            else:
                as_copyable(whole).view(-1)[place.start : place.stop] = part


def _copy_back(d: Destination, mem: np.ndarray) -> None:
    if isinstance(d.tensor, np.ndarray):
        np.copyto(d.tensor, mem.view(d.tensor.dtype).reshape(d.tensor.shape))
        return
    with torch.no_grad():
        as_copyable(d.tensor).copy_(as_copyable(typed_view(mem, d.tensor.dtype, tuple(d.tensor.shape))))
