"""The import spec, version 1: how a foreign checkpoint's bytes map onto global tensors.

A spec is JSON (docs/import.md specifies it). Per target tensor: its key, dtype, global shape and
pieces; a piece names a source file (relative to the source directory), optionally a member of
a zip archive in it (torch.save files), the byte offset of its first element, its element shape
and element strides, where its elements go in the global tensor (a box or a flat range) and
optionally replicas: other copies of the same elements, combined as the piece's ``combine``
says: asserted equal bit for bit (``"equal"``, the default) or averaged (``"mean"``, floating
dtypes only, with the float64 arithmetic of docs/import.md).
Non-tensor values are plain JSON under ``values``; Python objects that only full unpickling
can build are named under ``objects`` (file and byte range) and imported only when pickling is
allowed.

:func:`validate` checks a spec without reading anything: dtypes known, shapes and strides in
range, safe paths, every destination inside its tensor, and every tensor covered exactly once;
a gap or an overlap is named by its region (:func:`coverage_problem`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from resurgo.errors import CorruptCheckpointError, ImportSpecError, ResurgoError
from resurgo.format import dtypes
from resurgo.format.manifest import BoxPlace as Box
from resurgo.format.manifest import FlatPlace as Flat
from resurgo.format.manifest import place_of
from resurgo.format.tree import path_key
from resurgo.interop.source_files import check_relative
from resurgo.layout.box import ChunkBox, FlatRange, Place, covers_exactly_once

SPEC_FORMAT: Literal["resurgo.import-spec"] = "resurgo.import-spec"
# The dtypes whose replicas may be averaged (combine "mean"): floating point, converted exactly to float64.
MEAN_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
               "float8_e5m2fnuz")
SPEC_VERSION = 1
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 62


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Source(_Strict):
    """Where a run of elements is stored: a file (or a zip member in it), a byte offset, element strides."""

    file: str
    member: Optional[str] = None
    offset: int = 0
    strides: Optional[list[int]] = None  # elements; None: row-major over the piece's shape


class Piece(_Strict):
    """Elements stored at ``source`` with ``shape`` that fill ``box`` or ``flat`` of the tensor,
    in row-major order of ``shape``; ``replicas`` hold copies of the same elements, which
    ``combine`` says how to use: ``"equal"``, compared bit for bit with the piece (the piece is
    written), or ``"mean"``, the piece and its replicas averaged (the mean is written)."""

    file: str
    member: Optional[str] = None
    offset: int = 0
    shape: list[int]
    strides: Optional[list[int]] = None
    box: Optional[Box] = None
    flat: Optional[Flat] = None
    replicas: list[Source] = Field(default_factory=list)
    combine: Literal["equal", "mean"] = "equal"

    @property
    def place(self) -> Place:
        return place_of(self.box, self.flat)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TensorSpec(_Strict):
    key: str
    dtype: str
    shape: list[int]
    pieces: list[Piece]
    # Where it goes in the nested state (dict keys, ints for int keys such as an optimizer's
    # parameter numbers); joined with '.' it is ``key``. None: the top-level entry ``key``.
    path: Optional[list[Union[str, int]]] = None


class PickledObject(_Strict):
    """A Python object torch.save'd at bytes ``[offset, offset + length)`` of ``file``: imported
    only with ``allow_pickle=True``, since loading it may run code of the file's choosing."""

    file: str
    offset: int = 0
    length: int


class ImportSpec(_Strict):
    format: Literal["resurgo.import-spec"] = SPEC_FORMAT
    version: int = SPEC_VERSION
    tensors: list[TensorSpec] = Field(default_factory=list)
    values: dict[str, Any] = Field(default_factory=dict)
    objects: dict[str, PickledObject] = Field(default_factory=dict)


def from_fields(directory: object, framework: str, build: Callable[[], ImportSpec]) -> ImportSpec:
    """``build()``, the spec of a checkpoint written as a framework's pickled dicts. Their fields
    are checked where they are read; what a field of another type can still raise on the way
    (arithmetic or indexing with it: TypeError, KeyError, IndexError, OverflowError; a method it
    lacks: AttributeError; a spec it makes invalid: ValueError) is a checkpoint resurgo cannot read."""
    try:
        return build()
    except ResurgoError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        raise CorruptCheckpointError(f"{directory}: not a {framework} checkpoint of a layout resurgo reads: a field "
                                     f"holds another type than {framework} writes ({type(e).__name__}: {e!s:.300})"
                                     ) from None


def row_major_strides(shape: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def span_elements(shape: list[int], strides: list[int] | None) -> int:
    """Elements from a source's first element to one past its last (0 for an empty piece)."""
    if math.prod(shape) == 0:
        return 0
    st = strides if strides is not None else row_major_strides(shape)
    return 1 + sum((d - 1) * s for d, s in zip(shape, st))


# -- JSON -------------------------------------------------------------------------------------
def loads(text: str | bytes, where: str = "spec") -> ImportSpec:
    """Parse and validate a spec; ImportSpecError naming ``where`` and the problem."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ImportSpecError(f"{where}: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ImportSpecError(f"{where}: a spec is a JSON object, not {type(doc).__name__}")
    if doc.get("format") != SPEC_FORMAT or doc.get("version") != SPEC_VERSION:
        raise ImportSpecError(f"{where}: expected format {SPEC_FORMAT!r} version {SPEC_VERSION}, found format "
                              f"{doc.get('format')!r} version {doc.get('version')!r}")
    try:
        spec = ImportSpec.model_validate(doc)
    except ValidationError as e:
        first = e.errors()[0]
        at = ".".join(str(x) for x in first["loc"])
        raise ImportSpecError(f"{where}: {at}: {first['msg']} ({e.error_count()} error(s))") from None
    validate(spec, where)
    return spec


def dumps(spec: ImportSpec) -> str:
    """The spec as JSON, one tensor per line (fields left at their defaults omitted); loads() reads it back."""
    doc = spec.model_dump(exclude_none=True)
    for t in doc["tensors"]:
        for p in t["pieces"]:
            if not p["replicas"]:
                del p["replicas"]
            if p["combine"] == "equal":
                del p["combine"]
    tensors = ",\n  ".join(json.dumps(t, separators=(",", ":")) for t in doc["tensors"])
    objects = f',\n "objects": {json.dumps(doc["objects"])}' if doc["objects"] else ""
    return (f'{{"format": {json.dumps(doc["format"])}, "version": {doc["version"]},\n "tensors": [\n  {tensors}\n ],\n'
            f' "values": {json.dumps(doc["values"], allow_nan=False)}{objects}}}\n')


# -- validation -------------------------------------------------------------------------------
def _check_path(rel: str, what: str) -> None:
    check_relative(rel, what)


def _check_source(src: Source | Piece, shape: list[int], what: str) -> None:
    _check_path(src.file, f"{what}: file")
    if src.member is not None:
        _check_path(src.member, f"{what}: member")
    if src.offset < 0:
        raise ImportSpecError(f"{what}: offset {src.offset} is negative")
    if src.strides is not None:
        if len(src.strides) != len(shape):
            raise ImportSpecError(f"{what}: {len(src.strides)} strides for a shape of {len(shape)} dimensions {shape}")
        if any(s < 0 for s in src.strides):
            raise ImportSpecError(f"{what}: strides {src.strides} must not be negative")
        if span_elements(shape, src.strides) > MAX_ELEMENTS:
            raise ImportSpecError(f"{what}: strides {src.strides} reach past {MAX_ELEMENTS} elements")


def validate(spec: ImportSpec, where: str = "spec") -> None:
    """Every check that needs no I/O; ImportSpecError naming the tensor and piece otherwise."""
    seen: set[str] = set()
    for t in spec.tensors:
        what = f"{where}: tensor {t.key!r}"
        if not t.key:
            raise ImportSpecError(f"{where}: a tensor has an empty key")
        if t.key in seen or t.key in spec.values:
            raise ImportSpecError(f"{what}: the key appears twice (tensors and values share one namespace)")
        seen.add(t.key)
        if t.path is not None and (not t.path or path_key(tuple(t.path)) != t.key or "" in t.path):
            raise ImportSpecError(f"{what}: path {t.path} must be non-empty names that joined with '.' give the key")
        if not dtypes.is_known(t.dtype) or t.dtype not in dtypes.TORCH_DTYPES:
            raise ImportSpecError(f"{what}: unknown dtype {t.dtype!r} (use a torch dtype name: float32, bfloat16, ...)")
        if len(t.shape) > MAX_NDIM or any(d < 0 for d in t.shape) or math.prod(max(d, 1) for d in t.shape) > MAX_ELEMENTS:
            raise ImportSpecError(f"{what}: shape {t.shape} is not valid (at most {MAX_NDIM} non-negative dimensions)")
        for i, p in enumerate(t.pieces):
            pw = f"{what}: piece {i}"
            if (p.box is None) == (p.flat is None):
                raise ImportSpecError(f"{pw}: give exactly one destination, 'box' or 'flat'")
            if any(d < 0 for d in p.shape) or len(p.shape) > MAX_NDIM:
                raise ImportSpecError(f"{pw}: shape {p.shape} is not valid")
            _check_source(p, p.shape, pw)
            for j, r in enumerate(p.replicas):
                _check_source(r, p.shape, f"{pw}: replica {j}")
            if p.combine == "mean" and t.dtype not in MEAN_DTYPES:
                raise ImportSpecError(f"{pw}: combine 'mean' averages floating-point elements only "
                                      f"({', '.join(MEAN_DTYPES)}), not {t.dtype}; use combine 'equal'")
            place = p.place
            if isinstance(place, ChunkBox) and len(place.offsets) != len(place.shape):
                raise ImportSpecError(f"{pw}: box offsets {list(place.offsets)} and shape {list(place.shape)} differ in length")
            if not place.fits_in(tuple(t.shape)):
                raise ImportSpecError(f"{pw}: destination {describe(place)} lies outside the shape {t.shape}")
            if place.numel != p.numel:
                raise ImportSpecError(f"{pw}: source shape {p.shape} holds {p.numel} elements, its destination "
                                      f"{describe(place)} {place.numel}")
        problem = coverage_problem([p.place for p in t.pieces], tuple(t.shape))
        if problem is not None:
            raise ImportSpecError(f"{what}: {problem}")
    for key, obj in spec.objects.items():
        what = f"{where}: object {key!r}"
        if not key or key in seen or key in spec.values:
            raise ImportSpecError(f"{what}: the key is empty or appears twice (tensors, values and objects share "
                                  "one namespace)")
        _check_path(obj.file, f"{what}: file")
        if obj.offset < 0 or obj.length < 0:
            raise ImportSpecError(f"{what}: offset {obj.offset} and length {obj.length} must not be negative")


def describe(place: Place) -> str:
    if isinstance(place, ChunkBox):
        return f"box offsets {list(place.offsets)} shape {list(place.shape)}"
    return f"flat range [{place.start}, {place.stop})"


def unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The coordinates of the row-major flat ``index`` in ``shape``."""
    out = []
    for d in reversed(shape):
        out.append(index % d)
        index //= d
    return tuple(reversed(out))


def coverage_problem(places: list[Place], shape: tuple[int, ...]) -> str | None:
    """None when ``places`` (inside ``shape``) cover it exactly once; else a sentence naming the
    first doubly covered region, or the first uncovered element and its region."""
    if covers_exactly_once(places, shape):
        return None
    nonempty = [p for p in places if p.numel > 0]
    kinds = {type(p) for p in nonempty}
    if len(kinds) > 1:
        return "pieces mix boxes and flat ranges; use one kind per tensor"
    if not nonempty:
        return _gap_text(0, describe(ChunkBox.whole(shape)), shape)
    if kinds == {FlatRange}:
        return _flat_problem([p for p in nonempty if isinstance(p, FlatRange)], math.prod(shape), shape)
    return _box_problem([p for p in nonempty if isinstance(p, ChunkBox)], shape)


def _flat_problem(ranges: list[FlatRange], total: int, shape: tuple[int, ...]) -> str:
    covered = 0
    for r in sorted(ranges, key=lambda r: (r.start, r.stop)):
        if r.start < covered:
            return f"elements [{r.start}, {min(covered, r.stop)}) are covered twice"
        if r.start > covered:
            return _gap_text(covered, f"flat range [{covered}, {r.start})", shape)
        covered = r.stop
    return _gap_text(covered, f"flat range [{covered}, {total})", shape)


def _gap_text(first: int, region: str, shape: tuple[int, ...]) -> str:
    return f"no piece covers element {first} (coordinates {list(unravel(first, shape))}), uncovered: {region}"


def _box_problem(boxes: list[ChunkBox], shape: tuple[int, ...]) -> str:
    ndim = len(shape)
    if ndim == 0:
        return "a 0-d tensor is covered twice" if len(boxes) > 1 else _gap_text(0, "the whole tensor", shape)
    for i, a in enumerate(boxes):  # error path only: pairwise is fine
        for b in boxes[i + 1:]:
            common = a.intersect(b)
            if common is not None:
                return f"{describe(common)} is covered twice"
    # Disjoint, so the problem is a gap: the grid of every box edge splits the tensor into cells
    # each wholly covered or wholly uncovered; the first uncovered cell in row-major order holds
    # the first uncovered element at its corner.
    edges = [sorted({0, shape[d], *(b.offsets[d] for b in boxes), *(b.offsets[d] + b.shape[d] for b in boxes)})
             for d in range(ndim)]
    cell_first = _first_uncovered_cell(boxes, edges, 0, [], [])
    assert cell_first is not None, "disjoint boxes that miss no cell cover the tensor"
    offsets, sizes = cell_first
    first = sum(o * s for o, s in zip(offsets, row_major_strides(shape)))
    return _gap_text(first, describe(ChunkBox(tuple(offsets), tuple(sizes))), shape)


def _first_uncovered_cell(boxes: list[ChunkBox], edges: list[list[int]], d: int, offs: list[int],
                          sizes: list[int]) -> tuple[list[int], list[int]] | None:
    for lo, hi in zip(edges[d], edges[d][1:]):
        live = [b for b in boxes if b.offsets[d] <= lo and hi <= b.offsets[d] + b.shape[d]]
        if not live:
            return offs + [lo] + [0 for _ in edges[d + 1:]], sizes + [hi - lo] + [e[-1] for e in edges[d + 1:]]
        if d + 1 < len(edges):
            found = _first_uncovered_cell(live, edges, d + 1, offs + [lo], sizes + [hi - lo])
            if found is not None:
                return found
    return None
