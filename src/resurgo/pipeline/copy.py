"""Copying a committed checkpoint to another location (another tier), byte for byte.

The source's manifest is read and checked first (:mod:`resurgo.pipeline.manifest_read`). The
data files are streamed in pieces from the source's read handles into a save at the destination,
several files at once, and committed there with the source's manifest bytes, unchanged, by the
same collective sequence as a save (:mod:`resurgo.pipeline.collective`). A checkpoint that
references another's data files is copied self-contained: the referenced files become its own
(:func:`self_contained`), and the manifest is rewritten to say so: the destination's commit
protocol applies (temporary directory and rename on a filesystem; data objects, then the manifest,
on an object store), so a copy cut short is never a checkpoint.

In a distributed job every rank copies its share of the files (:func:`resurgo.plan.copy_plan.assign_files`)
and rank 0 commits once all are done, so a large checkpoint is not funnelled through one node.
On an object store, data objects other ranks already wrote when one failed stay until the prefix
is cleaned up as incomplete (the manager does so before its next copy there).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from resurgo import faults
from resurgo.dist import liveness
from resurgo.dist.comm import Comm
from resurgo.format.manifest import Manifest
from resurgo.pipeline.collective import open_staging, write_then_commit
from resurgo.pipeline.data_files import open_data_file
from resurgo.pipeline.manifest_read import read_manifest_and_bytes
from resurgo.plan.copy_plan import assign_files
from resurgo.storage.base import check_size
from resurgo.storage.open import open_checkpoint
from resurgo.storage.ownership import DeclaredFiles

PIECE_BYTES = 16 << 20


def self_contained(manifest: Manifest) -> tuple[Manifest, dict[str, str]]:
    """``manifest`` with every referenced data file taken in as one of its own, and the source of
    each of its data files (own name -> name in ``manifest``). A copy holds all its bytes: it may
    live where the checkpoints it references do not."""
    sources = {name: name for name in manifest.files}
    if not manifest.references:
        return manifest, sources
    renamed: dict[str, str] = {}
    n = 0
    for ref in sorted(manifest.references):
        # A name of the form resurgo writes (rank<R>-<I>): a copy cut short is then recognized as
        # resurgo's and cleaned up; no rank of a real job is that high.
        while (name := f"data/rank{100000 + n}-000.safetensors") in manifest.files:
            n += 1
        renamed[ref], sources[name] = name, ref
        n += 1
    doc = manifest.model_dump(exclude_none=True)
    doc["files"] |= {renamed[r]: e for r, e in doc.pop("references").items()}
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            for e in c.get("extents", ()):
                e["file"] = renamed.get(e["file"], e["file"])
    return Manifest.model_validate(doc), sources


def data_files(manifest: Manifest) -> list[tuple[str, int]]:
    """``(name, size)`` of every data file the manifest lists, by name."""
    return sorted((name, entry.bytes) for name, entry in manifest.files.items())


def share_of(files: list[tuple[str, int]], comm: Comm) -> list[str]:
    """The data files of ``files`` (:func:`data_files`) that this rank copies and verifies."""
    return assign_files(files, comm.size)[comm.rank]


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, src_options: dict | None = None,
                    dst_options: dict | None = None, overwrite: bool = False, threads: int = 4,
                    comm: Comm | None = None, declared_files: DeclaredFiles | None = None,
                    share: Callable[[list[tuple[str, int]], Comm], list[str]] | None = None) -> int:
    """Copy the checkpoint ``src`` to ``dst``; returns the bytes of the checkpoint (data files and
    manifest). Up to ``threads`` data files are copied at once, each through its own buffer.

    ``comm`` (resurgo.dist.comm): with more than one rank, collective; every rank copies its share
    of the files and rank 0 commits. Something already at ``dst`` is replaced (``overwrite``) only
    when resurgo can prove it wrote it, ``declared_files`` reading the data files its manifest
    lists (:mod:`resurgo.storage.ownership`). ``share(files, comm)``: the files this rank copies,
    when not :func:`share_of` (a memory tier: each rank copies files its own node holds, ``src``
    being its node's directory)."""
    group = comm or Comm(0, 1)  # alone, agree() and broadcast() are local
    source = open_checkpoint(src, src_options)
    original, raw = read_manifest_and_bytes(source)
    manifest, sources = self_contained(original)
    if manifest is not original:
        raw = manifest.to_json_bytes()
    files = data_files(manifest)
    sizes = dict(files)
    mine = (share or share_of)(files, group)
    staging = open_staging(group, lambda: open_checkpoint(dst, dst_options).stage(overwrite, declared_files))

    def copy_file(name: str) -> None:
        total = sizes[name]
        buf = bytearray(min(PIECE_BYTES, total))
        reader = open_data_file(source, original, sources[name])
        try:
            check_size(source.path, sources[name], reader.size, total)
            writer = staging.create(name)
            try:
                for off in range(0, total, PIECE_BYTES):
                    view = memoryview(buf)[: min(PIECE_BYTES, total - off)]
                    reader.read_into(off, view)
                    writer.write(view)
                    liveness.progress()  # a slow copy is not a stalled rank
                writer.fsync()
            finally:
                writer.close()
        finally:
            reader.close()

    def copy_mine() -> None:
        faults.point("tier.copy")
        workers = max(1, min(threads, len(mine)))
        if workers == 1:
            for name in mine:
                copy_file(name)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="resurgo-copy-file") as pool:
                list(pool.map(copy_file, mine))

    write_then_commit(group, staging, copy_mine, lambda _: raw)
    return sum(sizes.values()) + len(raw)
