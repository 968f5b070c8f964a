"""Import in place: chunks that point into the foreign files instead of copies of their bytes.

For ``import_checkpoint(..., in_place=True)`` the spec executor asks :func:`choose` which tensors
can be referenced where they lie: every piece contiguous and row-major in its source file (or in
a stored zip member of it), taken as it is (replicas asserted equal are compared and the piece
referenced; averaged replicas need a new value). Those tensors' chunks name the foreign files
(format version 5, ``external``) at their byte offsets; the others are copied into the
checkpoint's data files as a plain import copies them, each named with the reason
(:attr:`Placed.copied`). :func:`checksum_pieces` computes the block checksums of every referenced
byte in one sequential read per file, files in parallel; :func:`amend` puts the chunks and the
source root (with this user's tag, :mod:`resurgo.storage.external`) into the manifest before the
commit.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from resurgo.errors import CorruptCheckpointError
from resurgo.format import checksum, dtypes
from resurgo.format.manifest import (
    EXTERNAL_VERSION,
    BoxPlace,
    ChunkEntry,
    External,
    ExternalFile,
    FlatPlace,
    Manifest,
    external_name,
    validate_manifest,
)
from resurgo.interop.spec import ImportSpec, TensorSpec, row_major_strides
from resurgo.layout.box import ChunkBox
from resurgo.storage import external

if TYPE_CHECKING:
    from resurgo.interop.execute import _Sources

READ_BYTES = 16 << 20  # one read of the foreign bytes, hashed as it arrives


@dataclass(frozen=True)
class _Ref:
    """A piece referenced in place: its place in the tensor, the real path of its file, and the
    absolute byte range of its elements there."""

    key: str
    index: int  # the piece's number in its tensor
    box: BoxPlace | None
    flat: FlatPlace | None
    path: str
    start: int
    stop: int
    block_bytes: int


@dataclass
class Placed:
    """What an import in place references (by tensor key, its pieces) and what it copies (by key, why)."""

    refs: dict[str, list[_Ref]] = field(default_factory=dict)
    copied: dict[str, str] = field(default_factory=dict)
    checksums: dict[tuple[str, int], list[str]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(r.stop - r.start for rs in self.refs.values() for r in rs)


def _why_copied(t: TensorSpec) -> str | None:
    """Why tensor ``t`` cannot be referenced in place (None: it can)."""
    for p in t.pieces:
        if p.combine == "mean":
            return "its replicas are averaged (combine 'mean'): the mean is a new value"
        if p.strides is not None and p.numel > 1 and tuple(p.strides) != row_major_strides(p.shape):
            return f"a piece is strided in its source (strides {p.strides}), not contiguous"
    return None


def choose(spec: ImportSpec, sources: "_Sources") -> Placed:
    """Which tensors of ``spec`` are referenced in place, piece by piece, and which are copied."""
    placed = Placed()
    for t in spec.tensors:
        if math.prod(t.shape) == 0:
            continue  # no bytes to place
        why = _why_copied(t)
        if why is not None:
            placed.copied[t.key] = why
            continue
        nbytes = math.prod(t.shape) * dtypes.itemsize(t.dtype)
        row = nbytes // t.shape[0] if t.shape and t.shape[0] else nbytes
        block = checksum.block_bytes_for(nbytes, row)
        refs = []
        for i, p in enumerate(t.pieces):
            if p.numel == 0:
                continue
            region = sources.region(p.file, p.member)
            start = region.start + p.offset
            place = p.place
            box = BoxPlace(offsets=list(place.offsets), shape=list(place.shape)) if isinstance(place, ChunkBox) else None
            flat = None if box is not None else FlatPlace(start=place.start, stop=place.stop)  # type: ignore[union-attr]
            refs.append(_Ref(t.key, i, box, flat, str(region.path), start,
                             start + p.numel * dtypes.itemsize(t.dtype), block))
        placed.refs[t.key] = refs
    return placed


def _hash_file(path: str, refs: list[_Ref]) -> dict[tuple[str, int], list[str]]:
    """The block checksums of ``refs`` (all in ``path``), in one pass over the file in offset order."""
    out: dict[tuple[str, int], list[str]] = {}
    buf = np.empty(READ_BYTES, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for r in sorted(refs, key=lambda r: r.start):
            piece = max(r.block_bytes, READ_BYTES // r.block_bytes * r.block_bytes)
            if piece > len(buf):
                buf = np.empty(piece, dtype=np.uint8)
            digests: list[str] = []
            for at in range(r.start, r.stop, piece):
                n = min(piece, r.stop - at)
                view = buf.data[:n]
                got = os.preadv(fd, [view], at)
                while got < n:
                    more = os.preadv(fd, [view[got:]], at + got)
                    if more == 0:
                        raise CorruptCheckpointError(f"{path}: ends at byte {at + got}, before the bytes of tensor "
                                                     f"{r.key!r} piece {r.index} [{r.start}, {r.stop})")
                    got += more
                digests.extend(checksum.block_digests(view, r.block_bytes))
            out[(r.key, r.index)] = digests
    finally:
        os.close(fd)
    return out


def checksum_pieces(placed: Placed, threads: int) -> None:
    """Fill ``placed.checksums``: each referenced piece's block digests, one read per file."""
    by_file: dict[str, list[_Ref]] = {}
    for refs in placed.refs.values():
        for r in refs:
            by_file.setdefault(r.path, []).append(r)
    with ThreadPoolExecutor(max(1, min(threads, len(by_file)))) as pool:
        for digests in pool.map(lambda item: _hash_file(*item), sorted(by_file.items())):
            placed.checksums.update(digests)


def external_root(root: Path, placed: Placed) -> str:
    """The directory the foreign files are recorded under: the source directory, or the folder
    holding it and every file's real location (a Hugging Face snapshot's files lie in its blobs)."""
    paths = [str(root)] + [r.path for refs in placed.refs.values() for r in refs]
    return os.path.commonpath(paths)


def amend(manifest: Manifest, placed: Placed, root: str) -> Manifest:
    """``manifest`` with the referenced tensors' chunks in the foreign files under ``root``, the
    files' sizes and this user's tag recorded; version 5 when anything is referenced."""
    if not placed.refs:
        return manifest
    files: dict[str, ExternalFile] = {}
    tensors = dict(manifest.tensors)
    for key, refs in placed.refs.items():
        chunks = []
        for r in refs:
            rel = os.path.relpath(r.path, root)
            if rel not in files:
                files[rel] = ExternalFile(bytes=os.stat(r.path).st_size)
            chunks.append(ChunkEntry(box=r.box, flat=r.flat, file=external_name(rel), byte_range=[r.start, r.stop],
                                     block_bytes=r.block_bytes, checksums=placed.checksums[(key, r.index)]))
        tensors[key] = tensors[key].with_chunks(chunks)
    ext = External(root=root, files=dict(sorted(files.items())))
    ext = ext.model_copy(update={"tag": external.make_tag(ext.tagged_body())})
    amended = manifest.model_copy(update={"version": EXTERNAL_VERSION, "tensors": tensors, "external": ext})
    validate_manifest(amended, str(root))
    return amended
