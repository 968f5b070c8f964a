"""The Megatron-Core distributed optimizer's bucket-space state, mapped onto the model's parameters.

Megatron-Core's DistributedOptimizer keeps its state (fp32 main parameters, Adam's moments) in the
layout of its gradient buckets: per model-parallel domain (``dp_group_idx_<g>``, one per tensor- x
pipeline-parallel rank) and buffer, each bucket is a flat tensor holding that domain's parameters
one after another, each starting at a multiple of 64 elements, with unwritten padding between. Its
``dp_reshardable`` checkpoint format (Megatron-LM's default) saves those tensors as they are, under
``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<d>.bucket_idx_<b>.<state>``, and the
legacy layout's ``distrib_optim.pt`` per rank holds each buffer's buckets one after another
(coalesced, each cut at its last parameter's end); which element belongs to which parameter is not
in the files (Megatron recomputes it from the model it is handed).

An import has no model, so it finds each parameter by its values: the ``param`` bucket holds the
main parameters, and a main parameter cast to the model's dtype is the model's weight (the
optimizer copies it there after each step). Walking a bucket from its start, each parameter
starts with the values of one of the model's saved chunks (one layer's tensor-parallel shard of a
weight; a SwiGLU fc1 shard is its gate chunk, then its up chunk right after); after a chunk comes
a further chunk of the same tensor, or else the next parameter at the next multiple of 64. A chunk's state is what the other buckets of the same
bucket (``exp_avg``, ``exp_avg_sq``, ...) hold at the same positions; where a chunk is found in
several domains (tensor-parallel replicas, tied embeddings), the first domain's is taken, which is
the copy Megatron saves as the main replica.

What values cannot tell apart is refused where it matters: chunks of equal values (layer norms at
their initial 1.0) may sit at each other's positions, so they are accepted only where every
position found for them holds the same state, bit for bit. A position no chunk matches, a tensor
found only in part, a chunk found in one domain more often than the model holds it: a
CorruptCheckpointError naming the bucket and the element.

The cost: every model chunk is read and hashed once, and each bucket of main parameters once more;
the moments are not read (their pieces point into the files).
"""

from __future__ import annotations

import io
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from resurgo.errors import CorruptCheckpointError, UnsupportedValueError
from resurgo.format import dtypes
from resurgo.interop.source_files import open_file_inside, resolve_inside
from resurgo.interop.spec import Box, Piece, TensorSpec, row_major_strides
from resurgo.interop.torch_file import stored_member
from resurgo.layout.box import FlatRange
from resurgo.layout.regions import flat_range_boxes

BUCKET = re.compile(r"^(?P<domain>(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+)\."
                    r"(?P<bucket>gbuf_idx_\d+\.dtype_.+\.bucket_idx_\d+)\.(?P<state>\w+)$")
# Megatron's formats whose state is kept in buckets (the older name first)
BUCKET_SPACE = ("fully_sharded_bucket_space", "dp_reshardable")
ALIGN = 64  # a parameter starts at a multiple of this many elements of its bucket
PREFIX = 8  # elements that index a chunk for the search
MODEL_DTYPES = ("float32", "bfloat16", "float16")
MAIN = "param"


@dataclass(frozen=True)
class Chunk:
    """A saved chunk of a model tensor: its key, where it lies in the tensor, where its bytes are."""

    key: str
    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str
    member: str | None
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ValueClass:
    """Chunks of one dtype, size and digest: what the search cannot tell apart."""

    dtype: str
    numel: int
    digest: str


@dataclass(frozen=True)
class Found:
    """A value class found at ``start`` of a bucket of a domain."""

    cls: ValueClass
    domain: str
    bucket: str
    start: int


class _Files:
    """Bytes of the source's files (or of stored members of the zip archives torch.save writes),
    each file resolved inside the source directory once, each read checked to lie inside."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.open: dict[str, io.BufferedReader] = {}
        self.members: dict[tuple[str, str], tuple[int, int]] = {}  # (start, size) in the file

    def read(self, rel: str, offset: int, nbytes: int, member: str | None = None) -> bytes:
        f = self.open.get(rel)
        if f is None:
            f = self.open[rel] = open_file_inside(resolve_inside(self.root, rel, "a checkpoint file"))
        if member is not None:
            if (rel, member) not in self.members:
                try:
                    self.members[(rel, member)] = stored_member(f, member, str(self.root / rel))
                except KeyError:
                    raise CorruptCheckpointError(f"{self.root / rel}: no stored member {member!r}") from None
            start, size = self.members[(rel, member)]
            if offset + nbytes > size:
                raise CorruptCheckpointError(f"{self.root / rel}: member {member!r} ends before byte "
                                             f"{offset + nbytes}, where a tensor's bytes should be")
            offset += start
        f.seek(offset)
        data = f.read(nbytes)
        if len(data) != nbytes:
            raise CorruptCheckpointError(f"{self.root / rel}: ends before byte {offset + nbytes}, where a tensor's "
                                         "bytes should be")
        return data

    def chunk(self, c: Chunk) -> bytes:
        """The bytes of a model tensor's saved chunk."""
        return self.read(c.file, c.offset, c.numel * dtypes.itemsize(c.dtype), c.member)

    def close(self) -> None:
        for f in self.open.values():
            f.close()


class _Flat:
    """A one-dimensional saved tensor (a bucket): its pieces in order, read by element ranges."""

    def __init__(self, t: TensorSpec, where: str) -> None:
        if len(t.shape) != 1:
            raise CorruptCheckpointError(f"{where}: {t.key!r} has the shape {t.shape}; a bucket is one-dimensional")
        self.spec = t
        self.itemsize = dtypes.itemsize(t.dtype)
        self.runs: list[tuple[int, int, str, str | None, int]] = []  # (start, stop, file, member, byte offset)
        at = 0
        for p in sorted(t.pieces, key=lambda p: p.box.offsets[0] if p.box else -1):
            if p.box is None or p.strides is not None or p.box.offsets[0] != at:
                raise CorruptCheckpointError(f"{where}: {t.key!r} is not stored as runs of elements from its start")
            self.runs.append((at, at + p.shape[0], p.file, p.member, p.offset))
            at += p.shape[0]
        if at != t.shape[0]:
            raise CorruptCheckpointError(f"{where}: {t.key!r} holds {at} of its {t.shape[0]} elements")
        self.length = at

    def parts(self, start: int, stop: int) -> list[tuple[int, int, str, str | None, int]]:
        """(start, stop, file, member, byte offset of start) of each stored run that [start, stop) overlaps."""
        out = []
        for lo, hi, file, member, offset in self.runs:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                out.append((a, b, file, member, offset + (a - lo) * self.itemsize))
        return out

    def read(self, files: _Files, start: int, stop: int) -> bytes:
        return b"".join(files.read(f, off, (b - a) * self.itemsize, m) for a, b, f, m, off in self.parts(start, stop))


def _cast(raw: bytes, src: str, dst: str) -> bytes:
    if src == dst:
        return raw
    t = torch.frombuffer(bytearray(raw), dtype=dtypes.TORCH_DTYPES[src]).to(dtypes.TORCH_DTYPES[dst])
    return t.view(torch.uint8).numpy().tobytes()


def _digest(raw: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(raw)


def chunks_of(tensors: list[TensorSpec]) -> list[Chunk]:
    """The model's saved chunks that can be a parameter's: floating, stored row-major in one run."""
    out = []
    for t in tensors:
        if t.dtype not in MODEL_DTYPES:
            continue
        for p in t.pieces:
            if p.box is not None and p.strides is None and p.numel:
                out.append(Chunk(t.key, t.dtype, tuple(p.box.offsets), tuple(p.box.shape), p.file, p.member, p.offset))
    return out


class _Search:
    """The model's chunks indexed by their first elements and grouped by their values."""

    def __init__(self, chunks: list[Chunk], files: _Files) -> None:
        self.files = files
        self.members: dict[ValueClass, list[Chunk]] = defaultdict(list)
        self.by_prefix: dict[tuple[str, int, bytes], set[ValueClass]] = defaultdict(set)
        for c in chunks:
            raw = files.chunk(c)
            cls = ValueClass(c.dtype, c.numel, _digest(raw))
            self.members[cls].append(c)
            k = min(PREFIX, c.numel)
            self.by_prefix[(c.dtype, k, raw[:k * dtypes.itemsize(c.dtype)])].add(cls)
        self.prefixes = sorted({(dtype, k) for dtype, k, _ in self.by_prefix})

    def at(self, bucket: _Flat, start: int, keys: set[str] | None = None) -> list[ValueClass]:
        """The value classes whose chunks' values the main parameters at ``start`` hold (cast to
        the chunk's dtype); with ``keys``, only classes with a chunk of one of those tensors."""
        found: list[ValueClass] = []
        hashed: dict[tuple[str, int], str] = {}
        for dtype, k in self.prefixes:
            if start + k > bucket.length:
                continue
            head = _cast(bucket.read(self.files, start, start + k), bucket.spec.dtype, dtype)
            for cls in self.by_prefix.get((dtype, k, head), ()):
                if start + cls.numel > bucket.length:
                    continue
                if keys is not None and not keys & {c.key for c in self.members[cls]}:
                    continue
                if (dtype, cls.numel) not in hashed:
                    raw = bucket.read(self.files, start, start + cls.numel)
                    hashed[(dtype, cls.numel)] = _digest(_cast(raw, bucket.spec.dtype, dtype))
                if hashed[(dtype, cls.numel)] == cls.digest:
                    found.append(cls)
        return found


def _walk(search: _Search, domain: str, name: str, bucket: _Flat, where: str, coalesced: bool) -> list[Found]:
    """Where each parameter of one bucket starts, and whose values it holds: after a chunk, a chunk
    of the same tensor right after it (SwiGLU's up half after its gate half), else the next
    parameter at the next multiple of ``ALIGN`` from its bucket's start. ``coalesced``: the buckets
    of a buffer one after another, each cut at its last parameter's end, so a parameter right after
    a chunk may also start the next bucket (and a chunk of the same tensor right after one may have
    started it: the multiples are counted from there too)."""
    out: list[Found] = []
    end, keys, bases = 0, set[str](), [0]
    while True:
        start = end
        found = search.at(bucket, end, keys) if out and end < bucket.length else []
        if found and coalesced:
            bases.append(end)
        elif not found:
            for base in bases if out else [0]:
                start = base + -(-(end - base) // ALIGN) * ALIGN
                found = search.at(bucket, start) if start < bucket.length else []
                if found:
                    bases = [base]
                    break
            if not found and coalesced and out and end < bucket.length:
                start, found = end, search.at(bucket, end)
                bases = [end]
            if not found and (not out or end >= bucket.length or not coalesced) and start >= bucket.length:
                return out
        if not found:
            raise CorruptCheckpointError(f"{where}: no model tensor's chunk holds the values at element {start} of "
                                         f"{domain} {name} {MAIN!r} (after the one ending at element {end}); not the "
                                         "bucket layout Megatron's distributed optimizer writes")
        if len(found) > 1:
            raise UnsupportedValueError(
                f"{where}: element {start} of {domain} {name} {MAIN!r} starts the values of chunks of different "
                f"sizes ({', '.join(sorted({repr(c.key) for cls in found for c in search.members[cls]})[:4])}): "
                "which parameter is there cannot be told; save the optimizer in model space (Megatron-LM: "
                "--dist-ckpt-optim-fully-reshardable)")
        cls = found[0]
        out.append(Found(cls, domain, name, start))
        end = start + cls.numel
        keys = {c.key for c in search.members[cls]}


def per_parameter(tensors: list[TensorSpec], root: Path, where: str) -> list[TensorSpec]:
    """``tensors`` of a ``torch_dist`` checkpoint with the bucket-space state replaced by each
    parameter's (:func:`states_by_value`)."""
    buckets: dict[tuple[str, str], dict[str, TensorSpec]] = defaultdict(dict)
    rest: list[TensorSpec] = []
    for t in tensors:
        if m := BUCKET.match(t.key):
            buckets[(m["domain"], m["bucket"])][m["state"]] = t
        else:
            rest.append(t)
    if not buckets:
        return tensors
    model = [t for t in rest if not t.key.startswith(("optimizer.", "chained_"))]
    return rest + states_by_value(model, buckets, root, where)


def states_by_value(model: list[TensorSpec], buckets: dict[tuple[str, str], dict[str, TensorSpec]], root: Path,
                    where: str, coalesced: bool = False, shapes: dict[str, list[int]] | None = None
                    ) -> list[TensorSpec]:
    """Each model tensor's optimizer state found in ``buckets`` (per (domain, bucket): its flat
    tensor per state, ``param`` among them): ``optimizer.state.<name>.<state>`` and the main params
    ``optimizer.fp32_from_fp16_params.<name>``, ``<name>`` the tensor's last path element (its key
    without one); ``coalesced``: each is a buffer's buckets one after another (see :func:`_walk`);
    ``shapes``: per key, the shape to cut the states to (the model's rows of vocabulary padding
    dropped), where it differs from the tensor's."""
    files = _Files(root)
    try:
        search = _Search(chunks_of(model), files)
        flats: dict[tuple[str, str], dict[str, _Flat]] = {}
        placed: list[Found] = []
        for (domain, name) in sorted(buckets, key=_numbered):
            states = buckets[(domain, name)]
            if MAIN not in states:
                raise CorruptCheckpointError(f"{where}: {domain} {name} has no {MAIN!r} state (the main parameters, "
                                             "by which the parameters are found)")
            flats[(domain, name)] = {s: _Flat(t, where) for s, t in states.items()}
            lengths = {f.length for f in flats[(domain, name)].values()}
            if len(lengths) != 1:
                raise CorruptCheckpointError(f"{where}: the states of {domain} {name} differ in length {sorted(lengths)}")
            placed += _walk(search, domain, name, flats[(domain, name)][MAIN], where, coalesced)
        chosen = _choose(placed, search, flats, files, where)
    finally:
        files.close()
    return _state_tensors(model, chosen, flats, where, shapes or {})


def _numbered(key: tuple[str, str]) -> tuple:
    """Domains and buckets in numeric order (dp_group_idx_10 after dp_group_idx_9)."""
    return tuple(int(p) if p.isdigit() else p for part in key for p in re.split(r"(\d+)", part))


def _choose(placed: list[Found], search: _Search, flats: dict[tuple[str, str], dict[str, _Flat]],
            files: _Files, where: str) -> dict[Chunk, Found]:
    """Per chunk, the position whose state it takes: its class's first, after checking that the
    class is found no more often in a domain than it has chunks, and, for a class of several
    chunks, that every position holds the same state."""
    by_class: dict[ValueClass, list[Found]] = defaultdict(list)
    for f in placed:
        by_class[f.cls].append(f)
    chosen: dict[Chunk, Found] = {}
    for cls, found in by_class.items():
        members = search.members[cls]
        per_domain: dict[str, int] = defaultdict(int)
        for f in found:
            per_domain[f.domain] += 1
            if per_domain[f.domain] > len(members):
                raise CorruptCheckpointError(f"{where}: {f.domain} holds the values of {members[0].key!r} "
                                             f"{members[0].offsets} {per_domain[f.domain]} times (element {f.start} "
                                             f"of {f.bucket}); the model holds them {len(members)} time(s)")
        if len(members) > 1:
            first = found[0]
            states = {state: _digest(flat.read(files, first.start, first.start + cls.numel))
                      for state, flat in flats[(first.domain, first.bucket)].items()}
            for f in found[1:]:
                for state, digest in states.items():
                    other = flats[(f.domain, f.bucket)].get(state)
                    if other is None or _digest(other.read(files, f.start, f.start + cls.numel)) != digest:
                        keys = sorted({f"{c.key!r} {list(c.offsets)}" for c in members})
                        raise UnsupportedValueError(
                            f"{where}: {len(members)} chunks hold equal values ({', '.join(keys[:4])}"
                            f"{', ...' if len(keys) > 4 else ''}) but their optimizer state ({state!r}) differs: which "
                            "state is whose cannot be told from the files; save the optimizer in model space "
                            "(Megatron-LM: --dist-ckpt-optim-fully-reshardable)")
        for c in members:
            chosen[c] = found[0]
    return chosen


def _state_tensors(model: list[TensorSpec], chosen: dict[Chunk, Found],
                   flats: dict[tuple[str, str], dict[str, _Flat]], where: str,
                   shapes: dict[str, list[int]]) -> list[TensorSpec]:
    out: list[TensorSpec] = []
    for t in model:
        name = str(t.path[-1]) if t.path else t.key
        shape = shapes.get(t.key, list(t.shape))
        chunks = chunks_of([t])
        if not any(c in chosen for c in chunks):
            continue  # not trained (frozen, or not a parameter): no optimizer state
        missing = [c for c in chunks if c not in chosen]
        if missing:
            raise CorruptCheckpointError(f"{where}: the distributed optimizer's buckets hold {t.key!r} only in part: "
                                         f"its chunk at {list(missing[0].offsets)} {list(missing[0].shape)} is in none")
        states = set.intersection(*(set(flats[(chosen[c].domain, chosen[c].bucket)]) for c in chunks))
        for state in sorted(states):
            pieces: list[Piece] = []
            dtype = None
            for c in chunks:
                f = chosen[c]
                flat = flats[(f.domain, f.bucket)][state]
                dtype = flat.spec.dtype
                pieces += _pieces(c, flat, f.start, shape[0] if shape else 0)
            path: list[str | int] = (["optimizer", "fp32_from_fp16_params", name] if state == MAIN
                                     else ["optimizer", "state", name, state])
            assert dtype is not None
            out.append(TensorSpec(key=".".join(map(str, path)), dtype=dtype, shape=shape, pieces=pieces, path=path))
    return out


def _pieces(c: Chunk, flat: _Flat, start: int, rows: int) -> list[Piece]:
    """Chunk ``c``'s state in ``flat`` from element ``start``: a piece per box of each stored run,
    cut to the first ``rows`` rows of the tensor (a box's first rows are a prefix of its elements)."""
    strides = row_major_strides(c.shape)
    out = []
    for a, b, file, member, offset in flat.parts(start, start + c.numel):
        lo = a - start
        for box in flat_range_boxes(FlatRange(lo, b - start), c.shape):
            first = sum(o * s for o, s in zip(box.offsets, strides))
            offsets = [o + p for o, p in zip(c.offsets, box.offsets)]
            shape = list(box.shape)
            if shape and offsets[0] + shape[0] > rows:
                shape[0] = rows - offsets[0]
                if shape[0] <= 0:
                    continue
            out.append(Piece(file=file, member=member, offset=offset + (first - lo) * flat.itemsize, shape=shape,
                             box=Box(offsets=offsets, shape=shape)))
    return out


def check_main_params(model: dict[str, TensorSpec], main: dict[str, TensorSpec], root: Path, where: str) -> None:
    """Each saved main parameter (``main``, per model key), cast to its weight's dtype, is the weight:
    CorruptCheckpointError naming the first that is not. Compared chunk by chunk where both are saved
    in the same boxes (Megatron saves the model-space state in its parameter's boxes)."""
    files = _Files(root)
    try:
        for key, m in main.items():
            w = model.get(key)
            if w is None or w.dtype not in MODEL_DTYPES or m.dtype not in MODEL_DTYPES:
                continue
            boxes = {tuple(c.offsets): c for c in chunks_of([m])}
            for c in chunks_of([w]):
                mc = boxes.get(c.offsets)
                if mc is None or mc.shape != c.shape:
                    continue
                if files.chunk(c) != _cast(files.chunk(mc), mc.dtype, c.dtype):
                    raise CorruptCheckpointError(
                        f"{where}: the distributed optimizer's main parameter of {key!r} at {list(c.offsets)} is not "
                        "the model's weight there: the optimizer's state was saved out of place (megatron-core's "
                        "fully_reshardable writer does so when a buffer has several buckets), so its moments cannot be "
                        "trusted either; save in dp_reshardable, which imports")
    finally:
        files.close()
