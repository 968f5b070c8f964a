"""Format version 4: a core manifest in O(tensors), and one index per rank with its chunks.

A distributed save describes a regularly laid out tensor once in ``manifest.json`` (its grid:
:mod:`resurgo.layout.grid`), and an irregular one by its pieces and the rank that wrote each; the
byte ranges and checksums of the chunks, and the data files that hold them, are in the writing
rank's *index*, ``data/<tag>rank<R>-index.safetensors``. The core records each index's size and
xxh3-128, so an index is as trusted as the core, and a reader reads the indexes of the ranks that
wrote what it needs, not the whole job's metadata.

An index is a valid safetensors file holding one tensor of bytes, ``resurgo.index``: the compact
JSON of a :class:`RankIndex`. This module encodes and checks indexes, says which ranks' indexes a
read needs (:func:`ranks_needed`) and builds the manifest a reader uses from the core and those
indexes (:func:`resolve`): the same :class:`~resurgo.format.manifest.Manifest` as version 2's,
holding the chunks asked for. Pure: bytes in, objects out.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Final, Literal, Optional

from pydantic import ValidationError

from resurgo.errors import CorruptCheckpointError, ManifestError
from resurgo.format import checksum, strict_json
from resurgo.format.manifest import (
    INDEXED_VERSION,
    ChunkEntry,
    FileEntry,
    Manifest,
    TensorEntry,
    _check_file_entry,
    _Strict,
    check_chunk,
)
from resurgo.format.safetensors_file import HeaderEntry, build_header, read_header
from resurgo.gcpause import collector_paused
from resurgo.layout.box import ChunkBox, FlatRange, Place, place_order

INDEX_FORMAT: Final = "resurgo.index"
INDEX_TENSOR = "resurgo.index"  # the one tensor of an index file: the index's JSON, as bytes


def data_file_name(rank: int, index: int, tag: str = "") -> str:
    """The ``index``-th data file of ``rank``. ``tag`` makes the names unique per save where saves
    share a directory (object stores). Version 4 readers rely on this rule."""
    return f"data/{tag}rank{rank:05d}-{index:03d}.safetensors"


def index_file_name(rank: int, tag: str = "") -> str:
    return f"data/{tag}rank{rank:05d}-index.safetensors"


class RankIndex(_Strict):
    """What one rank of a version 4 save wrote: its data files and, by tensor key, its chunks."""

    format: Literal["resurgo.index"]
    version: int
    rank: int
    files: dict[str, FileEntry]
    chunks: dict[str, list[ChunkEntry]]
    # Of the index file itself, set when it is read (never written): its header's size and checksum.
    header_bytes: Optional[int] = None
    header_checksum: Optional[str] = None

    def encode(self) -> bytes:
        """The index file: a safetensors header declaring one tensor of bytes, then the JSON."""
        body = json.dumps(self.model_dump(exclude_none=True, exclude={"header_bytes", "header_checksum"}),
                          separators=(",", ":"), allow_nan=False).encode()
        header, _ = build_header([HeaderEntry(INDEX_TENSOR, "uint8", (len(body),), len(body))], {"resurgo": "index"})
        return header + body


_NAME_RE = re.compile(r"rank(\d{5,})-(?:(\d{3,})|index)\.safetensors")


class DeclaredNames(Collection[str]):
    """Every file a version 4 save wrote, by the naming rule: each rank's data files and index.
    Membership is answered by reading the name, and iteration yields the names one by one: never
    one list of them all (a core of a few KB may declare 4,000 ranks x 1,000 files)."""

    def __init__(self, core: Manifest):
        assert core.ranks is not None and core.file_tag is not None
        self._tag, self._files = core.file_tag, core.ranks.files
        self._prefix = f"data/{self._tag}"

    def __len__(self) -> int:
        return sum(self._files) + len(self._files)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or not name.startswith(self._prefix):
            return False
        m = _NAME_RE.fullmatch(name, len(self._prefix))
        if m is None or int(m.group(1)) >= len(self._files):
            return False
        rank = int(m.group(1))
        if m.group(2) is None:
            return name == index_file_name(rank, self._tag)
        i = int(m.group(2))
        return i < self._files[rank] and name == data_file_name(rank, i, self._tag)  # one spelling of each number

    def __iter__(self) -> Iterator[str]:
        for r, n in enumerate(self._files):
            for i in range(n):
                yield data_file_name(r, i, self._tag)
            yield index_file_name(r, self._tag)


def declared_names(core: Manifest) -> DeclaredNames:
    """Every file a version 4 save wrote, by the naming rule, as a :class:`DeclaredNames`."""
    return DeclaredNames(core)


def parse_index(raw: bytes, core: Manifest, rank: int, source: str) -> RankIndex:
    """Check the bytes of rank ``rank``'s index against the core (size and xxh3-128: else
    CorruptCheckpointError) and validate it completely (else ManifestError)."""
    ranks = core.ranks
    assert ranks is not None and core.file_tag is not None
    if len(raw) != ranks.index_bytes[rank] or checksum.digest(raw) != ranks.index_checksums[rank]:
        raise CorruptCheckpointError(
            f"{source}: rank {rank}'s index is {len(raw)} bytes with xxh3-128 {checksum.digest(raw)}, the manifest "
            f"recorded {ranks.index_bytes[rank]} bytes and {ranks.index_checksums[rank]}: it was damaged or replaced")

    def fail(msg: str) -> None:
        raise ManifestError(f"{source}: {msg}")

    try:
        header = read_header(raw[:8], lambda n: raw[8:8 + n])
        start, stop = header.entries[INDEX_TENSOR]
        with collector_paused():
            doc = strict_json.loads(raw[header.data_start + start:header.data_start + stop])
            marker = doc.get("format") if isinstance(doc, dict) else None
            if marker != INDEX_FORMAT:
                raise CorruptCheckpointError(f"{source}: is not a resurgo index: its 'format' is "
                                             f"{str(marker)[:60]!r}, an index's is {INDEX_FORMAT!r}")
            index = RankIndex.model_validate(doc)
    except (ValueError, KeyError, RecursionError, ValidationError) as e:
        raise ManifestError(f"{source}: not a valid index ({type(e).__name__}: {str(e)[:400]})") from None
    if index.header_bytes is not None or index.header_checksum is not None:
        fail("'header_bytes' and 'header_checksum' are not fields of an index")
    if index.version != INDEXED_VERSION or index.rank != rank:
        fail(f"is the index of rank {index.rank}, version {index.version}; expected rank {rank}, version {INDEXED_VERSION}")
    expected = {data_file_name(rank, i, core.file_tag) for i in range(ranks.files[rank])}
    if set(index.files) != expected:
        fail(f"lists data files {sorted(index.files)[:4]}, the manifest says rank {rank} wrote {sorted(expected)[:4]}")
    for path, entry in index.files.items():
        _check_file_entry(path, entry, fail)
    for key, chunks in index.chunks.items():
        t = core.tensors.get(key)
        if t is None:
            fail(f"holds chunks of {key!r}, which the manifest does not list")
            return index
        writers = ChunkWriters(t)
        for i, c in enumerate(chunks):
            check_chunk(key, t, i, c, index.files, {}, INDEXED_VERSION, fail)
            if writers.of(c.place) != rank:
                fail(f"holds a chunk of {key!r} at {c.place}, which the manifest does not place on rank {rank}")
    return index.model_copy(update={"header_bytes": header.data_start,
                                    "header_checksum": checksum.digest(raw[:header.data_start])})


class ChunkWriters:
    """Which rank's index holds the chunk of one tensor at a place: the grid's rule, or the listed
    pieces as a dict place -> rank (built once, so checking an index costs one lookup a chunk)."""

    def __init__(self, t: TensorEntry):
        self._shape = tuple(t.shape)
        self._grid = t.grid.grid if t.grid is not None else None
        # Reversed: where pieces share a place (empty ones), the first listed is the one named.
        self._pieces = {p.place: p.rank for p in reversed(t.pieces or ())}

    def of(self, place: Place) -> int | None:
        """The writer of the chunk at ``place``; None when no chunk is there."""
        grid = self._grid
        if grid is None:
            return self._pieces.get(place)
        if not isinstance(place, ChunkBox) or len(place.offsets) != len(self._shape):
            return None
        cell = []
        for n, p, o in zip(self._shape, grid.parts, place.offsets):
            step = -(-n // p) if n else 0
            if step == 0:
                return None
            cell.append(o // step)
        if any(c >= p for c, p in zip(cell, grid.parts)) or grid.box(self._shape, cell) != place or place.numel == 0:
            return None
        return grid.writer(cell)


def _hull(place: Place, shape: tuple[int, ...]) -> ChunkBox:
    """A box holding every element of ``place``: the box itself, or the rows a flat range crosses."""
    if isinstance(place, ChunkBox):
        return place
    if not shape:
        return ChunkBox((), ())
    row = math.prod(shape[1:])
    first, last = (place.start // row, -(-place.stop // row)) if row else (0, 0)
    return ChunkBox((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:])


class TooManyCells(Exception):
    """A grid places more chunks where a read needs them than the indexes read hold (``count``: at
    least that many; enumeration stopped there)."""

    def __init__(self, count: int):
        super().__init__(count)
        self.count = count


def _grid_ranges(t: TensorEntry, places: Iterable[Place] | None) -> list[list[range]]:
    """Per place needed (one entry for the whole tensor when None), the grid's cell ranges."""
    assert t.grid is not None
    grid, shape = t.grid.grid, tuple(t.shape)
    if places is None:
        return [grid.cell_ranges(shape)]
    return [grid.cell_ranges(shape, _hull(place, shape)) for place in places]


def needed_chunks(t: TensorEntry, places: Iterable[Place] | None, limit: int | None = None) -> list[tuple[Place, int]]:
    """The chunks of ``t`` (place, writer) holding an element of ``places`` (None: every chunk).
    ``limit``: TooManyCells as soon as a grid would give more (a grid's cells are counted before
    they are built: a few bytes of manifest may declare 2**40)."""
    shape = tuple(t.shape)
    if t.grid is not None:
        grid = t.grid.grid
        cells: dict[tuple[int, ...], None] = {}
        for ranges in _grid_ranges(t, places):
            n = math.prod(len(r) for r in ranges)
            if limit is not None and n > limit:
                raise TooManyCells(n)
            for cell in itertools.product(*ranges):
                cells[cell] = None
            if limit is not None and len(cells) > limit:
                raise TooManyCells(len(cells))
        return [(grid.box(shape, c), grid.writer(c)) for c in cells]
    pieces = t.pieces or []
    if places is None:
        return [(p.place, p.rank) for p in pieces]
    wanted = list(places)
    return [(p.place, p.rank) for p in pieces
            if any(type(w) is not type(p.place) or w.intersect(p.place) is not None for w in wanted)]  # type: ignore[arg-type]


def ranks_needed(core: Manifest, wanted: Mapping[str, Iterable[Place] | None] | None) -> list[int]:
    """The ranks whose indexes hold the chunks ``wanted`` (key -> the places needed, None: all of
    the tensor; ``wanted`` None: every tensor). A grid's writers are computed, its cells never built."""
    keys = core.tensors if wanted is None else wanted
    out: set[int] = set()
    for key in keys:
        t = core.tensors[key]
        places = None if wanted is None else wanted[key]
        if t.grid is not None:
            for ranges in _grid_ranges(t, places):
                out.update(t.grid.grid.writers(ranges))
        else:
            out.update(rank for _, rank in needed_chunks(t, places))
    return sorted(out)


def resolve(core: Manifest, indexes: Mapping[int, RankIndex], wanted: Mapping[str, Iterable[Place] | None] | None,
            describe: Callable[[int], str]) -> Manifest:
    """The manifest of a version 4 checkpoint holding the chunks ``wanted`` (as in
    :func:`ranks_needed`; None: all, then every index's chunks must be the ones the core places),
    their data files and the indexes read (each as a data file, for tools that copy or check
    files). ``indexes``: at least the ranks :func:`ranks_needed` names, parsed by :func:`parse_index`.
    A chunk the core places on a rank and its index lacks is CorruptCheckpointError."""
    assert core.file_tag is not None
    found: dict[int, dict[tuple[str, tuple], ChunkEntry]] = {
        r: {(key, place_order(c.place)): c for key, cs in ix.chunks.items() for c in cs} for r, ix in indexes.items()}
    tensors: dict[str, TensorEntry] = {}
    used: set[int] = set()
    for key, t in core.tensors.items():
        if wanted is not None and key not in wanted:
            tensors[key] = t
            continue
        places = None if wanted is None else wanted[key]
        held = sum(len(ix.chunks.get(key, ())) for ix in indexes.values())
        try:
            needed = needed_chunks(t, places, limit=held)
        except TooManyCells as e:
            first = min(ranks_needed(core, {key: places}), default=0)
            raise CorruptCheckpointError(
                f"{describe(first)}: the manifest's grid places {e.count if e.count < 1 << 62 else 'more than 2**62'} "
                f"chunks of {key!r} where they are needed, the indexes of the ranks writing them hold {held}: chunks are "
                f"missing (the grid declares more cells than were written)") from None
        chunks = []
        for place, rank in needed:
            chunk = found.get(rank, {}).pop((key, place_order(place)), None)
            if chunk is None:
                raise CorruptCheckpointError(
                    f"{describe(rank)}: rank {rank}'s index has no chunk of {key!r} at {place}, where the manifest "
                    f"places one" + ("" if rank in indexes else " (the index was not read)"))
            chunks.append(chunk)
            used.add(rank)
        tensors[key] = t.with_chunks(sorted(chunks, key=lambda c: place_order(c.place)))
    if wanted is None:
        for rank, rest in found.items():
            if rest:
                key, _ = next(iter(rest))
                raise ManifestError(f"{describe(rank)}: rank {rank}'s index holds {len(rest)} chunk(s) the manifest "
                                    f"does not place on it (first of {key!r})")
    files: dict[str, FileEntry] = {}
    for rank in sorted(used if wanted is not None else indexes):
        ix = indexes[rank]
        files.update(ix.files)
        files[index_file_name(rank, core.file_tag)] = index_entry(core, rank, ix)
    return core.model_copy(update={"tensors": tensors, "files": dict(sorted(files.items()))})


def index_entry(core: Manifest, rank: int, index: RankIndex) -> FileEntry:
    """The index file as a data file: its size, and its header's size and checksum as read."""
    assert core.ranks is not None and index.header_bytes is not None and index.header_checksum is not None
    return FileEntry(bytes=core.ranks.index_bytes[rank], header_bytes=index.header_bytes,
                     header_checksum=index.header_checksum)
