"""``resurgo diff``: what differs between two checkpoints, as plain data.

Both manifests are read and checked against their own checksums, and every data file of both is
checked to exist with the size its manifest says (one listing or stat per file, no data read).
Tensors compare by their block checksums when both checkpoints store them in the same chunks with
the same block sizes, which is the case for two saves of one job: no data is read, and equal
xxh3-128 digests mean equal bytes as far as the data matches its checksums, which ``verify=True``
checks first by reading every byte of both. Otherwise, and for the statistics of a tensor that
differs (``stats=True``), both are read a window of their flattened elements at a time within a
memory budget, every block read verified, and compared bit for bit: ``-0.0`` and ``0.0`` differ, a
NaN equals the same NaN. Damage found by any of these checks raises CorruptCheckpointError naming
the checkpoint and the file; data that is not read is not checked (``verify=True`` reads it all).

What describes the state is compared: step, world size, user metadata, tensors, non-tensor values
(by their manifest nodes, which keep exact types and float bits). What describes the save
(creation time, library versions, ``save_info``) is compared only with ``include_save_info=True``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from resurgo.api import DEFAULT_IO_THREADS
from resurgo.errors import CorruptCheckpointError
from resurgo.format import dtypes, values
from resurgo.format.manifest import Manifest, TensorEntry
from resurgo.format.tree import iter_values
from resurgo.layout.box import FlatRange, place_order
from resurgo.layout.shards import LocalPiece
from resurgo.pipeline import data_files
from resurgo.pipeline.buffers import typed_view
from resurgo.pipeline.manifest_read import read_manifest_of
from resurgo.pipeline.reader import read_destinations
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.renamed import renamed_keywords
from resurgo.state.unflatten import Destination
from resurgo.storage.base import Checkpoint
from resurgo.storage.open import open_checkpoint

DEFAULT_DIFF_BUDGET = 256 << 20  # bytes of both windows together


@dataclass
class TensorDiff:
    """One tensor that is not the same in both checkpoints."""

    key: str
    change: str  # only_a | only_b | kind | dtype | shape | data
    a: str = ""  # "float32 [2, 3]"; empty when the tensor is absent
    b: str = ""
    compared_by: str = ""  # checksums | data (for change == "data")
    blocks_differing: int | None = None  # of blocks_total, when compared by checksums
    blocks_total: int | None = None
    elements_differing: int | None = None  # when the data was read
    max_abs_diff: float | None = None  # numeric dtypes, when the data was read


@dataclass
class ValueDiff:
    """One non-tensor value that differs; ``a``/``b`` are the manifest nodes (None: absent)."""

    key: str
    a: dict | None
    b: dict | None


@dataclass
class CheckpointDiff:
    a: str
    b: str
    # step, world, metadata.*; with include_save_info also created_at, library.*, save_info.*
    fields: list[tuple[str, Any, Any]] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[ValueDiff] = field(default_factory=list)
    tensors_compared: int = 0
    equal_by_checksums: int = 0
    equal_by_data: int = 0
    bytes_read: int = 0  # data read to compare tensors (checksum blocks at window edges included)
    verified: bool = False  # every byte of both was read and matched its checksum first
    bytes_verified: int = 0

    @property
    def identical(self) -> bool:
        return not (self.fields or self.tensors or self.values)


@renamed_keywords("resurgo.diff_checkpoints", memory_budget="buffer_bytes")
def diff_checkpoints(a: str | os.PathLike, b: str | os.PathLike, *, stats: bool = False, only: str | None = None,
                     buffer_bytes: int = DEFAULT_DIFF_BUDGET, storage_options: dict | None = None,
                     io_threads: int = DEFAULT_IO_THREADS, verify: bool = False,
                     include_save_info: bool = False) -> CheckpointDiff:
    """Compare the checkpoints ``a`` and ``b`` (paths or URLs); ``only`` keeps keys with that prefix.

    Raises CorruptCheckpointError, naming the checkpoint and the file, when a manifest fails its
    checksum, a data file is missing or of another size, or data read fails its checksum;
    ``verify=True`` first reads and verifies every byte of both. ``include_save_info=True``
    compares what describes the save too (creation time, library versions, ``save_info``).
    ``buffer_bytes`` (old name ``memory_budget``, deprecated): the most bytes held at once, both
    checkpoints' windows together; each tensor is read and compared a window at a time (default 256 MiB).
    """
    ca, cb = open_checkpoint(a, storage_options), open_checkpoint(b, storage_options)
    ma, mb = read_manifest_of(ca), read_manifest_of(cb)
    for ckpt, m in ((ca, ma), (cb, mb)):  # a missing or cut file costs a stat to catch, not a read
        data_files.check_sizes(ckpt, m)
    out = CheckpointDiff(str(a), str(b))
    if verify:
        out.bytes_verified = sum(_verify_all(path, storage_options) for path in (a, b))
        out.verified = True
    if only is None:
        out.fields = _field_changes(ma, mb, include_save_info)
    keep = (lambda k: k.startswith(only)) if only else (lambda k: True)
    reader = _PairReader(ca, ma, cb, mb, buffer_bytes, io_threads)
    for key in sorted(k for k in ma.tensors.keys() | mb.tensors.keys() if keep(k)):
        found, by_data = _tensor_change(key, ma.tensors.get(key), mb.tensors.get(key), reader, stats)
        if found is not None:
            out.tensors.append(found)
        elif by_data:
            out.equal_by_data += 1
        else:
            out.equal_by_checksums += 1
        if found is None or found.change == "data":
            out.tensors_compared += 1
    va, vb = ({leaf.key: leaf.node for leaf in iter_values(m.tree)} for m in (ma, mb))
    for key in sorted(k for k in va.keys() | vb.keys() if keep(k)):
        if _canonical(va.get(key)) != _canonical(vb.get(key)):
            out.values.append(ValueDiff(key, va.get(key), vb.get(key)))
    out.bytes_read = reader.bytes_read
    return out


def _verify_all(path: str | os.PathLike, storage_options: dict | None) -> int:
    """Bytes checked: every data file's header and every checksum block of ``path``."""
    report = verify_checkpoint(path, storage_options=storage_options)
    if report.problems:
        more = f"; and {len(report.problems) - 1} more (run `resurgo verify {path}`)" if len(report.problems) > 1 else ""
        raise CorruptCheckpointError(f"{path}: does not verify: {report.problems[0]}{more}")
    return report.bytes_checked


def _field_changes(ma: Manifest, mb: Manifest, include_save_info: bool) -> list[tuple[str, Any, Any]]:
    changes: list[tuple[str, Any, Any]] = []
    if ma.step != mb.step:
        changes.append(("step", ma.step, mb.step))
    if ma.world != mb.world:
        changes.append(("world", dict(ma.world), dict(mb.world)))
    changes += _member_changes("metadata", ma.metadata, mb.metadata)
    if include_save_info:
        if ma.created_at != mb.created_at:
            changes.append(("created_at", ma.created_at, mb.created_at))
        changes += _member_changes("library", ma.library, mb.library)
        changes += _member_changes("save_info", ma.save_info, mb.save_info)
    return changes


def _member_changes(name: str, a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """``(name.key, a's, b's)`` for each key whose JSON value differs (None: absent)."""
    return [(f"{name}.{k}", a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if _canonical(a.get(k, _MISSING)) != _canonical(b.get(k, _MISSING))]


_MISSING = {"<missing>": True}


def _canonical(node: Any) -> str:
    return json.dumps(node, sort_keys=True, separators=(",", ":"))


def _describe(t: TensorEntry) -> str:
    return f"{t.dtype} {list(t.shape)}" + (" (numpy)" if t.kind == "numpy" else "")


def _tensor_change(key: str, ta: TensorEntry | None, tb: TensorEntry | None, reader: _PairReader,
                   stats: bool) -> tuple[TensorDiff | None, bool]:
    """The tensor's difference (None: equal), and whether its data was read to tell."""
    if ta is None or tb is None:
        return TensorDiff(key, "only_b" if ta is None else "only_a", _describe(ta) if ta else "",
                          _describe(tb) if tb else ""), False
    for what in ("kind", "dtype", "shape"):
        if getattr(ta, what) != getattr(tb, what):
            return TensorDiff(key, what, _describe(ta), _describe(tb)), False
    blocks = _block_comparison(ta, tb)
    if blocks is not None and blocks[0] == 0:
        return None, False
    if blocks is not None and not stats:
        return TensorDiff(key, "data", _describe(ta), _describe(tb), "checksums", blocks[0], blocks[1]), False
    differing, max_abs = reader.compare(key)
    if differing == 0:
        return None, True
    found = TensorDiff(key, "data", _describe(ta), _describe(tb), "data", elements_differing=differing,
                       max_abs_diff=max_abs)
    if blocks is not None:
        found.blocks_differing, found.blocks_total = blocks
    return found, True


def _block_comparison(ta: TensorEntry, tb: TensorEntry) -> tuple[int, int] | None:
    """(differing, total) checksum blocks when both tensors have the same chunks and block sizes, else None."""
    ca, cb = (sorted(t.chunks, key=lambda c: place_order(c.place)) for t in (ta, tb))
    if len(ca) != len(cb) or any(x.place != y.place or x.block_bytes != y.block_bytes for x, y in zip(ca, cb)):
        return None
    pairs = [(x, y) for c, d in zip(ca, cb) for x, y in zip(c.checksums, d.checksums)]
    return sum(x != y for x, y in pairs), len(pairs)


class _PairReader:
    """Reads one tensor from both checkpoints in the same windows and compares them bitwise."""

    def __init__(self, ca: Checkpoint, ma: Manifest, cb: Checkpoint, mb: Manifest, budget: int, threads: int):
        self.sides = ((ca, ma), (cb, mb))
        self.budget = budget
        self.threads = threads
        self.bytes_read = 0

    def compare(self, key: str) -> tuple[int, float | None]:
        entry = self.sides[0][1].tensors[key]
        itemsize = dtypes.itemsize(entry.dtype)
        numel = math.prod(entry.shape)
        # Each side's window, and the reader's scratch for chunks that do not land in one run.
        window = max(1, self.budget // 4 // itemsize)
        differing, max_abs = 0, None
        for start in range(0, numel, window):
            stop = min(numel, start + window)
            a, b = (self._window(ckpt, m, key, start, stop) for ckpt, m in self.sides)
            rows_a, rows_b = a.reshape(-1, itemsize), b.reshape(-1, itemsize)
            unequal = (rows_a != rows_b).any(axis=1)
            n = int(unequal.sum())
            if n:
                differing += n
                gap = _max_abs_diff(a, b, entry.dtype, unequal)
                if gap is not None:
                    max_abs = gap if max_abs is None or gap > max_abs or math.isnan(gap) else max_abs
        return differing, max_abs

    def _window(self, ckpt: Checkpoint, manifest: Manifest, key: str, start: int, stop: int) -> np.ndarray:
        entry = manifest.tensors[key]
        flat = np.empty((stop - start) * dtypes.itemsize(entry.dtype), dtype=np.uint8)
        view = typed_view(flat, dtypes.TORCH_DTYPES[entry.dtype], (stop - start,))
        piece = (LocalPiece(FlatRange(start, stop), view),)
        result = read_destinations(ckpt, manifest, [Destination(key, entry, view, piece)], verify=True,
                                   threads=self.threads, atomic=False)  # a fresh window, dropped on failure
        self.bytes_read += result.bytes_read
        return flat


def _max_abs_diff(a: np.ndarray, b: np.ndarray, dtype: str, unequal: np.ndarray) -> float | None:
    """The largest |a - b| over the ``unequal`` elements (NaN if a NaN meets a number), for numeric
    dtypes; elements with equal bits (the same NaN) do not count."""
    torch_dtype = dtypes.TORCH_DTYPES[dtype]
    if torch_dtype == torch.bool or dtypes.itemsize(dtype) == 1 and torch_dtype not in (torch.uint8, torch.int8):
        return None  # bool, and float8 types whose arithmetic torch does not offer everywhere
    mask = torch.from_numpy(unequal)
    ta, tb = typed_view(a, torch_dtype, (-1,))[mask], typed_view(b, torch_dtype, (-1,))[mask]
    wide = torch.complex128 if torch_dtype.is_complex else torch.float64
    try:
        gap = (ta.to(wide) - tb.to(wide)).abs()
    except (RuntimeError, TypeError):  # a dtype torch cannot convert on this build
        return None
    return float(gap.max()) if gap.numel() else None
