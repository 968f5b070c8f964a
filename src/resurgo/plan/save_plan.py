"""Save plan: which data file each chunk goes into, under which name, at which byte range.

Pure data. A rank spreads its chunks over a few files (largest first, to the least loaded file)
so that several threads can write and fsync in parallel; small states stay in one file.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from resurgo.format.index import data_file_name
from resurgo.format.safetensors_file import HeaderEntry
from resurgo.layout.box import ChunkBox, Place

MIN_FILE_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)  # a job's plan holds one per chunk: slots make them small and quick to build
class WriteItem:
    """One chunk to write: its tensor key, its place, and how the data file declares it."""

    key: str
    name: str
    dtype: str
    place: Place
    nbytes: int  # the bytes this data file holds of the chunk: all of them, unless ``partial``
    block_bytes: int  # checksum block size of this chunk
    partial: bool = False  # only the blocks that changed since the base: stored as raw bytes

    @property
    def header_entry(self) -> HeaderEntry:
        """How the data file's header declares this chunk: a box with its shape, a flat range as
        one dimension, the changed blocks of a partial chunk as bytes."""
        if self.partial:
            return HeaderEntry(self.name, "uint8", (self.nbytes,), self.nbytes)
        shape = self.place.shape if isinstance(self.place, ChunkBox) else (self.place.numel,)
        return HeaderEntry(self.name, self.dtype, tuple(shape), self.nbytes)


@dataclass(frozen=True)
class FilePlan:
    path: str
    items: tuple[WriteItem, ...]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def header_entries(self) -> list[HeaderEntry]:
        return [i.header_entry for i in self.items]


@dataclass(frozen=True)
class SavePlan:
    files: tuple[FilePlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


def plan_files(items: list[WriteItem], rank: int = 0, max_files: int = 4,
               min_file_bytes: int = MIN_FILE_BYTES, tag: str = "") -> SavePlan:
    """Spread ``items`` over at most ``max_files`` files, balancing bytes (LPT scheduling)."""
    total = sum(i.nbytes for i in items)
    nfiles = max(1, min(max_files, total // max(1, min_file_bytes)))
    heap = [(0, f) for f in range(nfiles)]
    buckets: list[list[WriteItem]] = [[] for _ in range(nfiles)]
    for item in sorted(items, key=lambda i: (-i.nbytes, i.key)):
        load, f = heapq.heappop(heap)
        buckets[f].append(item)
        heapq.heappush(heap, (load + item.nbytes, f))
    return SavePlan(tuple(
        FilePlan(data_file_name(rank, f, tag), tuple(sorted(b, key=lambda i: i.key)))
        for f, b in enumerate(buckets) if b or f == 0
    ))
