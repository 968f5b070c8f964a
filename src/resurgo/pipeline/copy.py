"""Copying a committed checkpoint to another location (another tier), byte for byte.

The source's manifest is read and checked first (:mod:`resurgo.pipeline.manifest_read`). The
data files are streamed in pieces from the source's read handles into a save at the destination,
several files at once, and committed there with the source's manifest bytes, unchanged, by the
same collective sequence as a save (:mod:`resurgo.pipeline.collective`). A checkpoint that
references another's data files is copied self-contained: the referenced files become its own
(:func:`self_contained`), and the manifest is rewritten to say so: the destination's commit
protocol applies (temporary directory and rename on a filesystem; data objects, then the manifest,
on an object store), so a copy cut short is never a checkpoint. A checkpoint imported in place (its chunks in foreign
files) is copied self-contained too: each foreign file's chunks become a data file of the copy
(:func:`without_foreign_files`), so the copy loads where the foreign files are not.

In a distributed job every rank copies its share of the files (:func:`resurgo.plan.copy_plan.assign_files`)
and rank 0 commits once all are done, so a large checkpoint is not funnelled through one node.
On an object store, data objects other ranks already wrote when one failed stay until the prefix
is cleaned up as incomplete (the manager does so before its next copy there).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from resurgo import faults
from resurgo.dist import liveness
from resurgo.dist.comm import Comm
from resurgo.format import checksum
from resurgo.format.manifest import FORMAT_VERSION, Manifest, is_external
from resurgo.format.safetensors_file import HeaderEntry, build_header
from resurgo.layout.box import ChunkBox
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


@dataclass(frozen=True)
class MadeFile:
    """A data file of a copy that is not a file of the source: ``header`` (a safetensors header),
    then the bytes ``[start, stop)`` of each source file in ``pieces``, in order."""

    header: bytes
    pieces: tuple[tuple[str, int, int], ...]


def without_foreign_files(manifest: Manifest) -> tuple[Manifest, dict[str, MadeFile]]:
    """``manifest`` with every chunk in a foreign file (an import in place, version 5) moved into
    a data file of its own (one per foreign file, each chunk a tensor of its safetensors header,
    its block checksums unchanged: the same bytes), and what each such file is made of. A copy
    then holds every byte it needs, as a copy of a checkpoint with references does."""
    ext = manifest.external
    if ext is None:
        return manifest, {}
    chunks_in: dict[str, list[tuple[str, int]]] = {}  # foreign file -> (key, chunk index) of its chunks
    for key, t in manifest.tensors.items():
        for ci, c in enumerate(t.chunks):
            if c.file is not None and is_external(c.file):
                chunks_in.setdefault(c.file, []).append((key, ci))
    tensors = {key: t.model_dump(exclude_none=True) for key, t in manifest.tensors.items()}
    files = {name: e.model_dump() for name, e in manifest.files.items()}
    made: dict[str, MadeFile] = {}
    n = 0
    for foreign in sorted(chunks_in):
        while (name := f"data/rank{100000 + n}-000.safetensors") in files:  # a name resurgo writes (see above)
            n += 1
        n += 1
        entries, pieces = [], []
        for key, ci in chunks_in[foreign]:
            t, c = manifest.tensors[key], manifest.tensors[key].chunks[ci]
            place = c.place
            shape = tuple(place.shape) if isinstance(place, ChunkBox) else (place.numel,)
            entries.append(HeaderEntry(f"{key}#{ci}", t.dtype, shape, c.nbytes))
            assert c.byte_range is not None  # version 5 chunks in foreign files have one span (format.md 12)
            pieces.append((foreign, c.byte_range[0], c.byte_range[1]))
        header, ranges = build_header(entries)
        for (key, ci), (start, stop) in zip(chunks_in[foreign], ranges):
            tensors[key]["chunks"][ci].update(file=name, name=f"{key}#{ci}", byte_range=[start, stop])
        files[name] = {"bytes": ranges[-1][1], "header_bytes": len(header), "header_checksum": checksum.digest(header)}
        made[name] = MadeFile(header, tuple(pieces))
    doc = manifest.model_dump(exclude_none=True)
    doc.pop("external")
    doc.update(version=FORMAT_VERSION, tensors=tensors, files=files)
    return Manifest.model_validate(doc), made


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
    manifest, made = without_foreign_files(manifest)
    if manifest is not original:
        raw = manifest.to_json_bytes()
    files = data_files(manifest)
    sizes = dict(files)
    mine = (share or share_of)(files, group)
    staging = open_staging(group, lambda: open_checkpoint(dst, dst_options).stage(overwrite, declared_files))

    def copy_file(name: str) -> None:
        recipe = made.get(name) or MadeFile(b"", ((sources[name], 0, sizes[name]),))
        buf = bytearray(min(PIECE_BYTES, max((b - a for _, a, b in recipe.pieces), default=0)))
        writer = staging.create(name)
        try:
            if recipe.header:
                writer.write(memoryview(recipe.header))
            for file, start, stop in recipe.pieces:
                reader = open_data_file(source, original, file)
                try:
                    check_size(source.path, file, reader.size, original.file_entry(file).bytes)
                    for off in range(start, stop, PIECE_BYTES):
                        view = memoryview(buf)[: min(PIECE_BYTES, stop - off)]
                        reader.read_into(off, view)
                        writer.write(view)
                        liveness.progress()  # a slow copy is not a stalled rank
                finally:
                    reader.close()
            writer.fsync()
        finally:
            writer.close()

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
