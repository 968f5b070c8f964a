"""Verifying a whole checkpoint without loading it: sizes, safetensors headers, every checksum."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from resurgo.errors import CheckpointReplacedError, CorruptCheckpointError, ResurgoError
from resurgo.format import checksum, dtypes
from resurgo.format.expansion import MAX_EXPANSION, distinct_bytes, span_bytes
from resurgo.format.manifest import ChunkEntry, Manifest, TensorEntry, is_external
from resurgo.format.safetensors_file import read_header
from resurgo.layout.box import ChunkBox
from resurgo.pipeline import consistent
from resurgo.pipeline.data_files import open_data_file
from resurgo.pipeline.manifest_read import read_manifest_and_bytes
from resurgo.pipeline.reader import check_header
from resurgo.storage.base import Checkpoint
from resurgo.storage.open import open_checkpoint

PIECE_BYTES = 16 << 20
# Hashing beyond MAX_EXPANSION times the stored bytes is refused only past this much more, so that
# small checkpoints with a few tied scalars never trip it.
EXPANSION_SLACK = 64 << 20


@dataclass
class VerifyReport:
    path: str
    bytes_checked: int = 0
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)
    bytes_read: int = 0  # of the bytes checked, those read and hashed: a span several chunks share is read once

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | os.PathLike, progress: Callable[[int], None] | None = None, *,
                      storage_options: dict | None = None, files: Collection[str] | None = None) -> VerifyReport:
    """Check every data file's size and header and every block checksum; collect all problems.

    Raises only when the checkpoint cannot be read at all (missing, no manifest, invalid manifest).
    ``progress`` is called with the number of bytes just checked. ``files``: check only these data
    files (the ranks of a job sharing the work), else all. A save that replaces the checkpoint
    meanwhile is not a problem: one complete version is checked (:mod:`resurgo.pipeline.consistent`).
    """
    for _ in range(consistent.ATTEMPTS):
        seen: list[bytes] = []
        ckpt = open_checkpoint(path, storage_options).pinned()
        try:
            report = _verify_once(ckpt, str(path), progress, files, seen)
        except CheckpointReplacedError:
            continue
        except ResurgoError:
            if consistent.manifest_changed(path, storage_options, seen[0] if seen else None):
                continue
            raise
        finally:
            ckpt.close()
        if report.ok or not consistent.manifest_changed(path, storage_options, seen[0]):
            return report
    raise consistent.replaced_too_often(path)


def _verify_once(ckpt: Checkpoint, path: str, progress: Callable[[int], None] | None,
                 files: Collection[str] | None, seen: list[bytes]) -> VerifyReport:
    manifest, raw = read_manifest_and_bytes(ckpt)
    seen.append(raw)
    report = VerifyReport(path)
    hashed, stored = span_bytes(manifest), distinct_bytes(manifest)
    if hashed > MAX_EXPANSION * stored + EXPANSION_SLACK:
        # Spans of several chunks overlapping at shifted offsets: checking each would read the same
        # stored bytes over and over, a cost beyond the checkpoint's size (resurgo never writes them).
        report.problems.append(
            f"{path}: its chunks span {hashed} bytes, {hashed / max(1, stored):.1f} times the {stored} distinct "
            f"bytes of its data files (chunks overlapping at shifted offsets); not checked further")
        return report
    by_file = _spans_by_file(manifest)
    buf = np.empty(PIECE_BYTES, dtype=np.uint8)
    every = {**manifest.files, **manifest.references, **manifest.external_files}
    for name in sorted(every if files is None else set(files) & every.keys()):
        try:
            handle = open_data_file(ckpt, manifest, name)
        except CheckpointReplacedError:
            raise
        except ResurgoError as e:
            report.problems.append(str(e))
            continue
        try:
            _check_file(ckpt, manifest, name, handle, by_file, buf, report, progress)
        finally:
            handle.close()
    return report


Spans = dict[str, list[tuple[str, int, int, int, int]]]  # file -> (key, chunk, chunk offset, start, stop)


def _spans_by_file(manifest: Manifest) -> Spans:
    by_file: Spans = {}
    for key, t in manifest.tensors.items():
        for ci, c in enumerate(t.chunks):
            for file, start, lo, hi in c.locate(0, c.nbytes):
                by_file.setdefault(file, []).append((key, ci, lo, start, start + hi - lo))
    return by_file


def _check_file(ckpt: Checkpoint, manifest: Manifest, name: str, handle, by_file: Spans, buf: np.ndarray,
                report: VerifyReport, progress: Callable[[int], None] | None) -> None:
    """Size, safetensors header and every checksum of the data file ``name`` opened as ``handle``."""
    expected = manifest.file_entry(name).bytes
    if handle.size != expected:
        report.problems.append(f"{manifest.describe_file(name)}: {handle.size} bytes, the manifest says {expected}")
        return
    if not is_external(name):  # a foreign file has no header of ours: its chunks' checksums cover what is used
        try:
            check_header(ckpt, manifest, name, handle)
        except CorruptCheckpointError as e:
            report.problems.append(str(e))
    if name in manifest.files:  # a referenced file names its chunks as its own checkpoint does
        report.problems.extend(_check_header(handle, name, manifest, by_file.get(name, [])))
    # Several tensors may be placed on the same bytes (a crafted manifest: thousands on one range);
    # bytes that verified against the same checksums are not read again for each of them.
    verified: set[tuple] = set()
    for key, ci, offset, start, stop in by_file.get(name, []):
        c = manifest.tensors[key].chunks[ci]
        first, last = offset // c.block_bytes, (offset + stop - start - 1) // c.block_bytes
        same = (start, stop, offset % c.block_bytes, c.block_bytes, tuple(c.checksums[first:last + 1]))
        if same in verified:
            report.chunks_checked += offset == 0
            report.bytes_checked += stop - start
            if progress:
                progress(stop - start)
            continue
        problem = _check_span(handle, manifest, key, ci, offset, start, stop, buf, report, progress)
        if problem:
            report.problems.append(problem)
        else:
            verified.add(same)


class _BytesHandle:
    """A data file held in memory, read like an open file (:class:`resurgo.storage.base.ReadHandle`)."""

    def __init__(self, rel: str, data: np.ndarray, hashed: Mapping[tuple[int, int], str] | None = None):
        self.rel, self._data, self.size = rel, data.reshape(-1).view(np.uint8), data.nbytes
        self.hashed = hashed or {}  # digests of its blocks already computed, by (start, stop) in the file

    def read_into(self, offset: int, buf: memoryview) -> None:
        n = len(memoryview(buf).cast("B"))
        if offset + n > self.size:
            raise CorruptCheckpointError(f"data file {self.rel!r}: ends at byte {self.size}, before the data the manifest lists")
        np.frombuffer(buf, dtype=np.uint8)[:] = self._data[offset:offset + n]

    def read_at(self, offset: int, n: int) -> bytes:
        return self._data[offset:offset + n].tobytes()

    def view(self, offset: int, n: int) -> memoryview:
        """The bytes themselves (checked where they are, no copy)."""
        if offset + n > self.size:
            raise CorruptCheckpointError(f"data file {self.rel!r}: ends at byte {self.size}, before the data the manifest lists")
        return self._data[offset:offset + n].data


class _Named:
    """Where messages say the bytes came from (``check_header`` names a checkpoint's path)."""

    def __init__(self, path: str):
        self.path = path


def verify_file_bytes(manifest: Manifest, name: str, data: np.ndarray, where: str,
                      hashed: Mapping[tuple[int, int], str] | None = None) -> list[str]:
    """The problems of the data file ``name`` of ``manifest`` received as ``data`` (bytes in
    memory, e.g. a replica sent by another rank): size, header and every block checksum, before it
    is written anywhere. ``where`` names its origin in the messages. ``hashed``: the digests of
    some of its bytes, computed from ``data`` as they arrived (by ``(start, stop)`` in the file):
    a checksum block of exactly such bytes is compared with that digest, not hashed again."""
    if name not in manifest.files:
        return [f"{where}: {name} is not a data file of the manifest"]
    report = VerifyReport(where)
    by_file = {name: _spans_by_file(manifest).get(name, [])}
    _check_file(_Named(where), manifest, name, _BytesHandle(name, data, hashed), by_file,  # type: ignore[arg-type]
                np.empty(0, dtype=np.uint8), report, None)
    return report.problems


def _check_span(handle, manifest: Manifest, key: str, ci: int, offset: int, start: int, stop: int,
                buf: np.ndarray, report: VerifyReport, progress: Callable[[int], None] | None) -> str | None:
    """Check file bytes ``[start, stop)``, bytes from ``offset`` on of chunk ``ci`` of ``key``."""
    c = manifest.tensors[key].chunks[ci]
    piece = max(c.block_bytes, PIECE_BYTES // c.block_bytes * c.block_bytes)
    in_memory = getattr(handle, "view", None)  # bytes already in memory are checked in place
    if piece > len(buf) and in_memory is None:
        buf = np.empty(piece, dtype=np.uint8)
    if offset == 0:
        report.chunks_checked += 1
    for off in range(0, stop - start, piece):
        n = min(piece, stop - start - off)
        view = buf.data[:n]
        try:
            if in_memory is not None:
                view = in_memory(start + off, n)
            else:
                handle.read_into(start + off, view)
        except CorruptCheckpointError as e:
            return f"tensor {key!r}: {e}"
        hashed = getattr(handle, "hashed", None)
        first = (offset + off) // c.block_bytes
        if hashed:
            bad = _first_bad_hashed(view, start + off, c.block_bytes, c.checksums, first, hashed)
        else:
            bad = checksum.first_bad_block(view, c.block_bytes, c.checksums, first)
        report.bytes_checked += n
        report.bytes_read += n
        if progress:
            progress(n)
        if bad is not None:
            return f"tensor {key!r} chunk {ci} in {handle.rel}: block {bad} does not match its checksum"
    return None


def _first_bad_hashed(view: memoryview, at: int, block_bytes: int, expected: list[str], first_block: int,
                      hashed: Mapping[tuple[int, int], str]) -> int | None:
    """:func:`resurgo.format.checksum.first_bad_block` of ``view`` (file bytes from ``at``), taking
    the digest of each block from ``hashed`` where it holds that block's bytes."""
    for j, a in enumerate(range(0, len(view), block_bytes)):
        b = min(a + block_bytes, len(view))
        known = hashed.get((at + a, at + b))
        if (known if known is not None else checksum.digest(view[a:b])) != expected[first_block + j]:
            return first_block + j
    return None


def _check_header(handle, name: str, manifest: Manifest, chunks: list[tuple[str, int, int, int, int]]) -> list[str]:
    try:
        header = read_header(handle.read_at(0, 8), lambda n: handle.read_at(8, n))
    except ValueError as e:
        return [f"{name}: not a valid safetensors file: {e}"]
    problems = []
    spans: dict[tuple[str, int], list[int]] = {}  # a chunk's own bytes: one tensor of the file, in its extents
    for key, ci, _, start, stop in chunks:
        spans.setdefault((key, ci), []).extend((start, stop))
    for (key, ci), offsets in spans.items():
        c = manifest.tensors[key].chunks[ci]
        entry = header.entries.get(c.name_in_file(key))
        if entry is None:
            problems.append(f"{name}: safetensors header lacks tensor {c.name_in_file(key)!r} (key {key!r})")
        elif (header.data_start + entry[0], header.data_start + entry[1]) != (offsets[0], offsets[-1]):
            problems.append(f"{name}: safetensors header places {c.name_in_file(key)!r} at other bytes than the manifest")
        else:
            problem = _declaration_problem(name, key, manifest.tensors[key], c, offsets, header.raw[c.name_in_file(key)])
            if problem:
                problems.append(problem)
    return problems


def _declaration_problem(name: str, key: str, t: TensorEntry, c: ChunkEntry, offsets: list[int],
                         declared: object) -> str | None:
    """Whether the safetensors header of ``name`` declares the chunk ``c`` of tensor ``key`` as
    the manifest does (format.md 4.2): its dtype's code and its place's shape, raw bytes (``U8``,
    ``[nbytes]``) for a dtype safetensors lacks and for the bytes of a chunk that also reuses another
    checkpoint's (fewer than the chunk's: a copy made self-contained holds all of them, declared as
    the tensor). Otherwise a reader of the file without resurgo would see another tensor."""
    own = offsets[-1] - offsets[0]  # the bytes the header's entry spans
    if own != c.nbytes or t.dtype not in dtypes.SAFETENSORS_CODES:
        expected: dict[str, object] = {"dtype": "U8", "shape": [own]}
    else:
        place = c.place
        expected = {"dtype": dtypes.SAFETENSORS_CODES[t.dtype],
                    "shape": list(place.shape) if isinstance(place, ChunkBox) else [place.numel]}
    got = {f: declared.get(f) for f in expected} if isinstance(declared, dict) else {"dtype": None, "shape": None}
    if got == expected and all(type(d) is int for d in got["shape"]):  # type: ignore[union-attr]
        return None
    what = "raw bytes of " if expected["dtype"] == "U8" and t.dtype != "uint8" else ""
    return (f"{name}: safetensors header declares tensor {c.name_in_file(key)!r} (key {key!r}) as dtype "
            f"{str(got['dtype'])[:40]} shape {str(got['shape'])[:200]}, the manifest as {what}{t.dtype} "
            f"({expected['dtype']}) shape {expected['shape']}: a reader of the file would see another tensor")
