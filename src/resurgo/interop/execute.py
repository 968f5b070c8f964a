"""The one spec executor: a validated :class:`ImportSpec` becomes an ordinary resurgo checkpoint.

It is not a second pipeline. Each piece is a view of the source file where its bytes lie (a
copy-on-write memory map, never written), declared to the save machinery as a
:class:`~resurgo.layout.shards.Pieces` leaf; ``prepare_save`` plans the files and
``write_and_commit`` streams them, checksums them and commits atomically. The writers get each
contiguous piece as a :class:`_FileStream`: read with large ``preadv`` calls into the writer's
slice buffer (the GIL released), the next slice's read announced to the kernel meanwhile, so reads
overlap hashing and writing and the memory held is the writers' slice buffers, within
``buffer_bytes``, whatever the source's size (pages of a memory map would all stay resident).
A strided piece is copied a slice at a time from the map. Before anything is written every
source file is checked to exist and be long enough, and replicas are compared bit for bit, or,
for a piece whose ``combine`` is ``"mean"``, averaged into memory (within the budget). The
spec's pickled ``objects`` are unpickled, and saved as pickled values, only with ``allow_pickle``.
"""

from __future__ import annotations

import copy
import io
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ExpansionError,
    ImportSpecError,
    MemoryBudgetError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from resurgo.conversion import check_free_space
from resurgo.format import dtypes
from resurgo.format.expansion import MAX_EXPANSION
from resurgo.format.manifest import Manifest
from resurgo.interop import inplace
from resurgo.interop.source_files import open_file_inside, open_inside, resolve_inside
from resurgo.interop.spec import ImportSpec, Piece, Source, TensorSpec, row_major_strides, span_elements
from resurgo.interop.torch_file import stored_member
from resurgo.layout.shards import LocalPiece, Pieces
from resurgo.pipeline.buffers import TensorStream, as_copyable, copy_flat_range
from resurgo.pipeline.save import DEFAULT_IO_THREADS, LazySources, prepare_save, write_and_commit
from resurgo.pipeline.writer import SLICE_BYTES
from resurgo.plan.save_plan import FilePlan, SavePlan
from resurgo.reports import ImportReport
from resurgo.state.flatten import TensorLeaf
from resurgo.storage.direct_io import BOUNCE_BYTES
from resurgo.storage.open import is_url, local_path

DEFAULT_MEMORY_BUDGET = 1 << 30
WRITER_BYTES = SLICE_BYTES + BOUNCE_BYTES  # what one writer thread holds: its slice and its aligned write buffer


@dataclass(frozen=True)
class _Region:
    """The bytes of a file or of one stored zip member: where they start in the file, how many."""

    path: Path
    start: int
    size: int
    name: str  # for messages: "file" or "file:member"


class _Sources:
    """Source files and members, resolved and memory-mapped once each."""

    def __init__(self, root: Path):
        self.root = root
        self.root_real = Path(os.path.realpath(root))
        self._regions: dict[tuple[str, str | None], _Region] = {}
        self._maps: dict[Path, np.memmap] = {}
        self._fds: dict[Path, int] = {}
        # by id() of the view given to the pipeline; the view is kept alive so that its id stays its own
        self._streams: dict[int, tuple[torch.Tensor, _FileStream]] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def stream(self, view: "torch.Tensor | np.ndarray") -> "_FileStream | None":
        """The stream of a contiguous piece's view (None for anything else)."""
        found = self._streams.get(id(view))
        return found[1] if found is not None and found[0] is view else None

    def file_bytes(self) -> int:
        """The sizes of the distinct files resolved so far, summed."""
        return sum(os.stat(path).st_size for path in {r.path for r in self._regions.values()})

    def read_seconds(self) -> float:
        """Seconds the streams spent reading, summed over the writer threads."""
        return sum(stream.seconds for _, stream in self._streams.values())

    def region(self, file: str, member: str | None) -> _Region:
        key = (file, member)
        if key not in self._regions:
            self._regions[key] = self._resolve(file, member)
        return self._regions[key]

    def _resolve(self, file: str, member: str | None) -> _Region:
        shown = self.root / file
        try:
            path = resolve_inside(self.root, file, "a source file named by the spec")
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"{shown}: source file not found (named by the spec, relative "
                                          f"to {self.root})") from None
        size = path.stat().st_size
        if member is None:
            return _Region(path, 0, size, str(shown))
        try:
            with open_file_inside(path) as f:
                start, member_size = stored_member(f, member, str(shown))
        except KeyError:
            raise ImportSpecError(f"{shown}: archive has no member {member!r}") from None
        available = max(0, min(member_size, size - start))
        return _Region(path, start, available, f"{shown}:{member}")

    def tensor(self, src: Source | Piece, shape: list[int], dtype: str) -> torch.Tensor:
        """A view of the source's elements (nothing is read until the bytes are used)."""
        tdtype = dtypes.TORCH_DTYPES[dtype]
        size = tdtype.itemsize
        span = span_elements(shape, src.strides)
        if span == 0:
            return dtypes.uninitialized(shape, tdtype)
        region = self.region(src.file, src.member)
        start = region.start + src.offset
        if region.path not in self._maps:
            with open_file_inside(region.path) as f:  # the mapping outlives the descriptor
                self._maps[region.path] = np.memmap(f, dtype=np.uint8, mode="c")
        flat = torch.from_numpy(self._maps[region.path][start: start + span * size]).view(tdtype)
        strides = tuple(src.strides) if src.strides is not None else row_major_strides(shape)
        view = flat.as_strided(tuple(shape), strides)
        if view.is_contiguous():
            if region.path not in self._fds:
                self._fds[region.path] = open_inside(region.path)
                os.posix_fadvise(self._fds[region.path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._streams[id(view)] = (view, _FileStream(view, self._fds[region.path], start, region.name))
        return view

    def check_length(self, src: Source | Piece, shape: list[int], dtype: str, what: str) -> int:
        """The bytes the source's elements span; CorruptCheckpointError if the file is too short."""
        span = span_elements(shape, src.strides) * dtypes.itemsize(dtype)
        if span == 0:
            return 0
        region = self.region(src.file, src.member)
        need = src.offset + span
        if need > region.size:
            raise CorruptCheckpointError(
                f"{region.name}: {what} needs bytes [{src.offset}, {need}) but it holds {region.size} bytes "
                f"(expected at least {need}); the source file is truncated or the spec is wrong")
        return math.prod(shape) * dtypes.itemsize(dtype)


class _FileStream(TensorStream):
    """A contiguous piece's bytes read from its file with ``preadv`` into the writer's buffer."""

    def __init__(self, view: torch.Tensor, fd: int, start: int, name: str):
        super().__init__(view)
        self._fd, self._start, self._name = fd, start, name
        self.seconds = 0.0  # spent reading (one writer thread reads a stream)

    def read_into(self, offset: int, out: np.ndarray) -> memoryview:
        t0 = time.perf_counter()
        pos, want = self._start + offset, len(out)
        done = 0
        while done < want:  # preadv may return less than asked; 0 is the file's end
            got = os.preadv(self._fd, [out[done:].data], pos + done)
            if got == 0:
                raise CorruptCheckpointError(
                    f"{self._name}: ended at byte {pos + done - self._start} of a piece that needs "
                    f"{self.nbytes} bytes (from byte {self._start}); the file was truncated during the import")
            done += got
        rest = self.nbytes - offset - want
        if rest > 0:  # the kernel reads the next slice while this one is hashed and written
            os.posix_fadvise(self._fd, pos + want, min(rest, want), os.POSIX_FADV_WILLNEED)
        self.seconds += time.perf_counter() - t0
        return out.data.cast("B")


class _StreamedSources(Mapping):
    """What the writers read, by chunk name: a contiguous piece as its :class:`_FileStream`, any
    other leaf as the save pipeline gives it (:class:`LazySources`)."""

    def __init__(self, leaves: dict[str, TensorLeaf], sources: _Sources):
        self._leaves, self._sources, self._lazy = leaves, sources, LazySources(leaves)

    def __getitem__(self, key: str) -> "np.ndarray | TensorStream":
        stream = self._sources.stream(self._leaves[key].value)
        return stream if stream is not None else self._lazy[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)


def _equal_bits(a: torch.Tensor, b: torch.Tensor, slice_elements: int) -> bool:
    """Whether two tensors of one shape hold the same bits, compared a slice at a time."""
    a, b = as_copyable(a), as_copyable(b)
    n = a.numel()
    step = max(1, slice_elements)
    buf_a, buf_b = dtypes.uninitialized((min(n, step),), a.dtype), dtypes.uninitialized((min(n, step),), b.dtype)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        copy_flat_range(a, lo, hi, buf_a[: hi - lo])
        copy_flat_range(b, lo, hi, buf_b[: hi - lo])
        if not torch.equal(buf_a[: hi - lo], buf_b[: hi - lo]):
            return False
    return True


def _mean(sources: _Sources, p: Piece, dtype: str, slice_elements: int) -> torch.Tensor:
    """The piece and its replicas averaged as docs/import.md specifies: each element converted
    exactly to float64, summed in listing order starting from the piece's (so -0.0 stays -0.0),
    divided by the number of copies, converted back by torch (to float32 first: round to nearest even)."""
    tdtype = dtypes.TORCH_DTYPES[dtype]
    copies = [sources.tensor(p, p.shape, dtype)] + [sources.tensor(r, p.shape, dtype) for r in p.replicas]
    out = dtypes.uninitialized(p.shape, tdtype)
    n, step = out.numel(), max(1, slice_elements)
    flat_out, buf = out.view(-1), dtypes.uninitialized((min(n, step),), tdtype)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        copy_flat_range(copies[0], lo, hi, buf[: hi - lo])
        acc = buf[: hi - lo].to(torch.float64, copy=True)  # a float64 buf would otherwise be acc itself
        for c in copies[1:]:
            copy_flat_range(c, lo, hi, buf[: hi - lo])
            acc += buf[: hi - lo].to(torch.float64)
        flat_out[lo:hi] = (acc / len(copies)).to(tdtype)
    return out


def _load_objects(spec: ImportSpec, sources: _Sources, allow_pickle: bool) -> dict[str, Any]:
    """The spec's pickled objects, fully unpickled: only with ``allow_pickle``."""
    objects: dict[str, Any] = {}
    for key, obj in spec.objects.items():
        region = sources.region(obj.file, None)
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{region.name}: {key!r} is a pickled Python object (bytes [{obj.offset}, {obj.offset + obj.length})) "
                "that only full unpickling can build, which may run code of the file's choosing; pass "
                "allow_pickle=True (--allow-pickle) only if you trust this checkpoint")
        if obj.offset + obj.length > region.size:
            raise CorruptCheckpointError(
                f"{region.name}: object {key!r} needs bytes [{obj.offset}, {obj.offset + obj.length}) but it holds "
                f"{region.size} bytes; the source file is truncated or the spec is wrong")
        with open_file_inside(region.path) as f:
            f.seek(obj.offset)
            data = f.read(obj.length)
        try:
            objects[key] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any failure of a foreign pickle is a damaged source
            raise CorruptCheckpointError(f"{region.name}: object {key!r} could not be unpickled "
                                         f"({type(e).__name__}: {e})") from None
    return objects


def _tensor_bytes(t: TensorSpec) -> int:
    return math.prod(t.shape) * dtypes.itemsize(t.dtype)


def _check_expansion(spec: ImportSpec, sources: _Sources, root: str | os.PathLike) -> None:
    """ExpansionError when the tensors would take more than :data:`MAX_EXPANSION` times the bytes
    of the source files they are read from (pieces with stride 0, or many pieces on the same
    bytes), naming the tensors that expand most and by how much."""
    written = sum(_tensor_bytes(t) for t in spec.tensors)
    source = sources.file_bytes()
    if written <= MAX_EXPANSION * source:
        return

    def spanned(t: TensorSpec) -> int:  # the source bytes its pieces reach (replicas excluded)
        return sum(span_elements(p.shape, p.strides) for p in t.pieces) * dtypes.itemsize(t.dtype)

    worst = sorted(spec.tensors, key=lambda t: _tensor_bytes(t) / max(1, spanned(t)), reverse=True)[:3]
    named = "; ".join(f"tensor {t.key!r:.100} ({t.dtype} {t.shape}) is {_tensor_bytes(t)} bytes read from "
                      f"{spanned(t)} bytes of its source"
                      f"{' (strides ' + str(t.pieces[0].strides) + ')' if t.pieces and t.pieces[0].strides else ''}"
                      for t in worst)
    raise ExpansionError(
        f"{root}: the import would write {written} bytes of tensors from {source} bytes of source files, "
        f"{written / max(1, source):.1f} times as many (more than {MAX_EXPANSION} times is refused): {named}; "
        "pass allow_expansion=True (--allow-expansion) if the source is trusted and the size intended")


def _check_free_space(spec: ImportSpec, dst: str | os.PathLike) -> None:
    """StorageError when the filesystem of a local ``dst`` has less free space than the tensors need."""
    if not is_url(dst):
        check_free_space(local_path(dst), sum(_tensor_bytes(t) for t in spec.tensors), "the import")


def _nested(spec: ImportSpec, state: dict[str, Any]) -> dict[Any, Any]:
    """``state`` with each tensor that has a ``path`` moved there, making the dicts on the way (the
    spec's values are copied first: they stay as they are)."""
    out: dict[Any, Any] = {k: copy.deepcopy(v) if k in spec.values else v for k, v in state.items()}
    for t in spec.tensors:
        if t.path is None:
            continue
        leaf, node = out.pop(t.key), out
        for name in t.path[:-1]:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ImportSpecError(f"tensor {t.key!r}: its path {t.path} passes through value {name!r}, "
                                      "which is not a dict")
        if t.path[-1] in node:
            raise ImportSpecError(f"tensor {t.key!r}: its path {t.path} is taken by another tensor or value")
        node[t.path[-1]] = leaf
    return out


def execute(spec: ImportSpec, root: str | os.PathLike, dst: str | os.PathLike, *, source: str = "spec",
            buffer_bytes: int | None = None, storage_options: dict | None = None,
            metadata: dict | None = None, allow_pickle: bool = False, allow_expansion: bool = False,
            in_place: bool = False) -> ImportReport:
    """Write the checkpoint ``dst`` from the sources under ``root`` as ``spec`` (validated) says.
    ``in_place``: tensors whose bytes lie contiguous in the sources are not copied; their chunks
    point into the source files (:mod:`resurgo.interop.inplace`), the others are copied.
    The spec's ``objects`` are unpickled only with ``allow_pickle`` (PickleNotAllowedError otherwise).
    Tensors of more than :data:`MAX_EXPANSION` times the source files' bytes are written only with
    ``allow_expansion`` (ExpansionError otherwise); a local ``dst`` whose filesystem has too little
    free space for them raises StorageError first."""
    t_start = time.perf_counter()
    budget = DEFAULT_MEMORY_BUDGET if buffer_bytes is None else buffer_bytes
    if in_place and is_url(dst):
        raise UnsupportedValueError(f"{dst}: an import in place references the source files by their local path; "
                                    "its checkpoint goes on the local filesystem (import to a URL copies)")
    if budget < WRITER_BYTES:
        raise MemoryBudgetError(f"buffer_bytes={budget} is below what one writer holds ({WRITER_BYTES} bytes: an "
                                f"{SLICE_BYTES >> 20} MiB slice and a {BOUNCE_BYTES >> 20} MiB aligned write buffer); raise it")
    sources = _Sources(Path(root))
    try:
        return _execute(spec, root, dst, sources, source=source, budget=budget, storage_options=storage_options,
                        metadata=metadata, allow_pickle=allow_pickle, allow_expansion=allow_expansion,
                        in_place=in_place, t_start=t_start)
    finally:
        sources.close()


def _execute(spec: ImportSpec, root: str | os.PathLike, dst: str | os.PathLike, sources: _Sources, *, source: str,
             budget: int, storage_options: dict | None, metadata: dict | None, allow_pickle: bool,
             allow_expansion: bool, in_place: bool, t_start: float) -> ImportReport:
    objects = _load_objects(spec, sources, allow_pickle)
    bytes_read = 0
    for t in spec.tensors:  # every length first: nothing is written from a truncated source
        for i, p in enumerate(t.pieces):
            bytes_read += sources.check_length(p, p.shape, t.dtype, f"tensor {t.key!r} piece {i}")
            for j, r in enumerate(p.replicas):
                bytes_read += sources.check_length(r, p.shape, t.dtype, f"tensor {t.key!r} piece {i} replica {j}")
    if not allow_expansion:
        _check_expansion(spec, sources, root)
    placed = inplace.choose(spec, sources) if in_place else inplace.Placed()
    _check_free_space(spec.model_copy(update={"tensors": [t for t in spec.tensors if t.key not in placed.refs]}), dst)
    compare_elements = budget // 4
    averaged = sum(p.numel * dtypes.itemsize(t.dtype) for t in spec.tensors for p in t.pieces if p.combine == "mean")
    if averaged + WRITER_BYTES > budget:  # the means are held until written, beside at least one writer
        raise MemoryBudgetError(f"{root}: the averaged pieces (combine 'mean') hold {averaged} bytes in memory until "
                                f"written; with one writer's {WRITER_BYTES} bytes that is more than "
                                f"buffer_bytes={budget}; raise buffer_bytes")
    for t in spec.tensors:
        for i, p in enumerate(t.pieces):
            for j, r in enumerate(p.replicas if p.combine == "equal" else ()):
                first = sources.tensor(p, p.shape, t.dtype)
                if not _equal_bits(first, sources.tensor(r, p.shape, t.dtype), compare_elements // first.element_size()):
                    raise CorruptCheckpointError(
                        f"{sources.region(r.file, r.member).name}: tensor {t.key!r} piece {i} replica {j} differs from "
                        f"the piece at {sources.region(p.file, p.member).name} offset {p.offset}: replicas must be equal")
    t_checked = time.perf_counter()
    state: dict[str, Any] = {}
    for t in spec.tensors:
        if math.prod(t.shape) == 0:  # nothing to read: an empty tensor of its shape
            state[t.key] = dtypes.uninitialized(t.shape, dtypes.TORCH_DTYPES[t.dtype])
            continue
        pieces = tuple(LocalPiece(p.place, _mean(sources, p, t.dtype, SLICE_BYTES // 8) if p.combine == "mean"
                                  else sources.tensor(p, p.shape, t.dtype)) for p in t.pieces if p.numel > 0)
        state[t.key] = Pieces(tuple(t.shape), pieces, pieces[0].tensor)
    state.update(spec.values)
    state.update(objects)
    if any(t.path is not None for t in spec.tensors):
        state = _nested(spec, state)
    # The means are held until written: the writers share what they leave of the budget.
    threads = max(1, min(DEFAULT_IO_THREADS, (budget - averaged) // WRITER_BYTES))
    t_hashed = time.perf_counter()
    if placed.refs:
        inplace.checksum_pieces(placed, DEFAULT_IO_THREADS)  # before the staging exists: a failure leaves nothing
    t_hashed = time.perf_counter() - t_hashed
    prep = prepare_save(state, dst, overwrite=False, allow_pickle=allow_pickle, step=None, metadata=metadata,
                        io_threads=threads, block_bytes=None, storage_options=storage_options)
    amend = None
    if placed.refs:  # their chunks are not written: the manifest points into the sources
        prep.plan = SavePlan(tuple(FilePlan(f.path, tuple(i for i in f.items if i.key not in placed.refs))
                                   for f in prep.plan.files))
        kept = {i.name for f in prep.plan.files for i in f.items}  # by chunk name: a sharded tensor has several
        prep.leaves = {name: leaf for name, leaf in prep.leaves.items() if name in kept}
        ext_root = inplace.external_root(sources.root_real, placed)

        def amend(m: Manifest) -> Manifest:
            return inplace.amend(m, placed, ext_root)
    t_prepared = time.perf_counter()
    saved = write_and_commit(prep, _StreamedSources(prep.leaves, sources), amend=amend)
    seconds = {"check": t_checked - t_start, "prepare": t_prepared - t_checked,
               "write_and_commit": saved.seconds["write_and_commit"], "read": sources.read_seconds(),
               **({"in_place_checksum": t_hashed} if in_place else {}),
               **{k: saved.seconds[k] for k in ("checksum", "write", "fsync", "commit")},
               "total": time.perf_counter() - t_start}
    return ImportReport(src=str(root), dst=str(dst), source=source, num_tensors=len(spec.tensors),
                        num_values=len(spec.values) + len(objects), tensor_bytes=prep.tensor_bytes, bytes_read=bytes_read,
                        bytes_written=saved.bytes_written, seconds=seconds, in_place=in_place,
                        in_place_bytes=placed.nbytes, copied=dict(placed.copied))
