"""Copying a committed checkpoint to another location (another tier), byte for byte.

The data files are streamed in pieces from the source's read handles into a save at the
destination, several files at once, and committed there with the source's manifest, unchanged:
the destination's commit protocol applies (temporary directory and rename on a filesystem; data
objects, then the manifest, on an object store), so a copy cut short is never a checkpoint.

In a distributed job the copy is collective: the files are shared out among the ranks by size
(:func:`assign_files`), every rank copies its share, and rank 0 commits once all are done, so a
large checkpoint is not funnelled through one node. If any rank fails, rank 0 aborts the staging
and every rank raises the same error; on an object store, data objects other ranks already wrote
stay until the prefix is cleaned up as incomplete (the manager does so before its next copy there).
"""

from __future__ import annotations

import heapq
import json
import os
from concurrent.futures import ThreadPoolExecutor

from resurgo.dist.comm import Comm
from resurgo.storage.base import Staging, check_size
from resurgo.storage.open import open_checkpoint
from resurgo.storage.ownership import DeclaredFiles

PIECE_BYTES = 16 << 20


def assign_files(files: list[tuple[str, int]], ranks: int) -> list[list[str]]:
    """Each rank's share of ``(name, size)`` files: largest first, to the rank with the fewest bytes
    so far (ties to the lowest rank), so no rank gets more than the average plus one file. Each
    share is sorted by name. Pure and deterministic: every rank computes the same shares."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, not {ranks}")
    loads = [(0, r) for r in range(ranks)]
    shares: list[list[str]] = [[] for _ in range(ranks)]
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        load, r = heapq.heappop(loads)
        shares[r].append(name)
        heapq.heappush(loads, (load + size, r))
    return [sorted(share) for share in shares]


def manifest_files(manifest: bytes) -> list[tuple[str, int]]:
    """``(name, size)`` of every data file a (committed, hence validated) manifest lists."""
    return sorted((name, int(entry["bytes"])) for name, entry in json.loads(manifest)["files"].items())


def share_of(files: list[tuple[str, int]], comm: Comm) -> list[str]:
    """The data files of ``files`` (:func:`manifest_files`) that this rank copies and verifies."""
    return assign_files(files, comm.size)[comm.rank]


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, src_options: dict | None = None,
                    dst_options: dict | None = None, overwrite: bool = False, threads: int = 4,
                    comm: Comm | None = None, declared_files: DeclaredFiles | None = None) -> int:
    """Copy the checkpoint ``src`` to ``dst``; returns the bytes of the checkpoint (data files and
    manifest). Up to ``threads`` data files are copied at once, each through its own buffer.

    ``comm`` (resurgo.dist.comm): with more than one rank, collective; every rank copies its share
    of the files (:func:`assign_files`) and rank 0 commits. Something already at ``dst`` is replaced
    (``overwrite``) only when resurgo can prove it wrote it, ``declared_files`` reading the data
    files its manifest lists (:mod:`resurgo.storage.ownership`)."""
    group = comm or Comm(0, 1)  # alone, agree() and broadcast() are local
    source = open_checkpoint(src, src_options)
    manifest = source.read_manifest_bytes()
    files = manifest_files(manifest)
    sizes = dict(files)
    mine = share_of(files, group)

    def copy_file(name: str) -> None:
        total = sizes[name]
        buf = bytearray(min(PIECE_BYTES, total))
        reader = source.open_read(name)
        try:
            check_size(source.path, name, reader.size, total)
            writer = staging.create(name)
            try:
                for off in range(0, total, PIECE_BYTES):
                    view = memoryview(buf)[: min(PIECE_BYTES, total - off)]
                    reader.read_into(off, view)
                    writer.write(view)
                writer.fsync()
            finally:
                writer.close()
        finally:
            reader.close()

    def copy_mine() -> None:
        workers = max(1, min(threads, len(mine)))
        if workers == 1:
            for name in mine:
                copy_file(name)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="resurgo-copy-file") as pool:
                list(pool.map(copy_file, mine))

    def commit() -> None:
        if group.is_coordinator:
            staging.commit(manifest)

    opened = group.agree(lambda: open_checkpoint(dst, dst_options).stage(overwrite, declared_files) if group.is_coordinator else None)
    shared = group.broadcast(opened)  # the other ranks get a copy of rank 0's staging (it pickles)
    assert shared is not None
    staging: Staging = shared
    try:
        group.agree(copy_mine)
        group.agree(commit)
    except BaseException:
        if group.is_coordinator:
            staging.abort()
        raise
    return sum(sizes.values()) + len(manifest)
