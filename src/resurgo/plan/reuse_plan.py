"""Reuse plan: which bytes of each chunk an incremental save takes from its base instead of writing.

Pure data. The base checkpoint is indexed by (tensor key, place): a chunk of the new checkpoint
with the same key, place, size and checksum block size as a base chunk is compared with it block
by block, from the digests the save computes anyway. Runs of equal blocks become references to
the file bytes that hold them: the base's own data files, or the files the base itself references,
so a reference always names the file holding the bytes, never another reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from resurgo.format.manifest import FileEntry, Manifest, Span, is_external, locate, split_reference
from resurgo.layout.box import Place


@dataclass(frozen=True)
class BaseChunk:
    """A chunk of the base: its block size and digests, and its bytes as referenced files' spans."""

    nbytes: int
    block_bytes: int
    checksums: tuple[str, ...]
    spans: tuple[Span, ...]  # (reference "<checkpoint>/data/<name>.safetensors", start, stop)

    @cached_property
    def packed(self) -> np.ndarray:
        """The digests as one array of 32-byte strings, compared with a new chunk's in one step."""
        return pack(self.checksums)


@dataclass(frozen=True)
class BaseIndex:
    """The chunks of a base checkpoint, by (key, place), and the data files they are in."""

    name: str  # the base's name in the root
    files: dict[str, FileEntry]  # reference -> its entry, for every file a base chunk uses
    chunks: dict[tuple[str, Place], BaseChunk]

    @classmethod
    def of(cls, name: str, manifest: Manifest) -> "BaseIndex":
        def ref(file: str) -> str:  # the base's own files are named from the root; references stay
            return file if file in manifest.references else f"{name}/{file}"

        files = {ref(f): e for f, e in manifest.files.items()} | dict(manifest.references)
        # A chunk in a foreign file (an import in place) is never a base chunk: a reference stays
        # inside the root, so the new save writes those bytes.
        chunks = {(key, c.place): BaseChunk(c.nbytes, c.block_bytes, tuple(c.checksums),
                                            tuple((ref(f), a, b) for f, a, b in c.spans))
                  for key, t in manifest.tensors.items() for c in t.chunks
                  if not any(is_external(f) for f, _, _ in c.spans)}
        for r in files:
            split_reference(r)  # every name is a well-formed reference (the manifest validated)
        return cls(name, files, chunks)

    def match(self, key: str, place: Place, nbytes: int, block_bytes: int) -> BaseChunk | None:
        """The base chunk whose bytes can stand in for blocks of this one, if any."""
        c = self.chunks.get((key, place))
        return c if c is not None and c.nbytes == nbytes and c.block_bytes == block_bytes else None


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, stop)`` of a chunk: written by this save (``reference`` None), or found at
    file offset ``offset`` of ``reference``."""

    start: int
    stop: int
    reference: str | None = None
    offset: int = 0


def pack(digests: "list[str] | tuple[str, ...]") -> np.ndarray:
    """Hex digests (32 characters each, as the manifest holds them) as an array of 32-byte strings."""
    return np.frombuffer("".join(digests).encode("ascii"), dtype="S32")


def segments(nbytes: int, digests: list[str], base: BaseChunk) -> list[Segment]:
    """The chunk in runs of blocks equal to the base's (referenced) and runs that differ (written).

    The blocks are compared in one vectorised step; Python only walks the runs, so a chunk that
    changed everywhere, or nowhere, costs one comparison, not one per block."""
    if not digests:  # an empty chunk has no blocks
        return []
    block = base.block_bytes
    same = pack(digests) == base.packed
    edges = np.flatnonzero(same[1:] != same[:-1]) + 1  # where a run of equal or differing blocks ends
    starts, stops = [0, *edges.tolist()], [*edges.tolist(), len(digests)]
    out: list[Segment] = []
    for i, j in zip(starts, stops):
        start, stop = i * block, min(j * block, nbytes)
        if same[i]:
            out.extend(Segment(lo, hi, file, offset) for file, offset, lo, hi in locate(base.spans, start, stop))
        else:
            out.append(Segment(start, stop))
    return out


def owned_bytes(segs: list[Segment]) -> int:
    return sum(s.stop - s.start for s in segs if s.reference is None)


SAMPLE_BLOCKS = 16


def sample_blocks(n: int, count: int = SAMPLE_BLOCKS) -> list[int]:
    """The indexes of ``count`` blocks spread evenly over a chunk of ``n`` blocks, first and last
    included (all of them when ``n <= count``)."""
    if n <= count:
        return list(range(n))
    return [i * (n - 1) // (count - 1) for i in range(count)]


def changed_throughout(sampled: list[str], base: BaseChunk, picks: list[int]) -> bool:
    """Every sampled block (digests ``sampled`` of blocks ``picks``) differs from the base's: the
    chunk is written whole without hashing the rest first, so that it is hashed as it is written
    (a chunk that changed everywhere then costs what it costs in a save without a base)."""
    return all(d != base.checksums[i] for d, i in zip(sampled, picks, strict=True))


def mostly_changed(segs: list[Segment], nbytes: int) -> bool:
    """More than half of the chunk's bytes differ from the base's: it is written whole, referencing
    nothing (a few saved bytes are not worth the extents and the older file kept alive)."""
    return 2 * owned_bytes(segs) > nbytes
