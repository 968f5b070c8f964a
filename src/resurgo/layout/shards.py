"""What part of a global tensor a rank holds: the adapters from DTensor, Shard, FlatShard and plain
tensors to :class:`LocalPiece` s (a place in the global tensor plus the local tensor holding it).

``Shard`` and ``FlatShard`` are the public declarations for hand-written parallelism; DTensor
describes itself through its mesh and placements. A plain tensor is the whole of its global
tensor: in a distributed job every rank holding the same place is a replica, written once.
Geometry only: no I/O and no collectives (DTensor's mesh coordinates are local information).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from resurgo.errors import UnsupportedValueError
from resurgo.layout.box import ChunkBox, FlatRange, Place


def _int_tuple(values: Any, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except TypeError:
        raise UnsupportedValueError(f"{what} must be a sequence of ints, not {type(values).__name__}") from None
    if any(type(v) is bool for v in values):
        raise UnsupportedValueError(f"{what} must be ints, not bools")
    return out


class Shard:
    """A block of a global tensor held by this rank: ``local`` sits at ``offsets`` of a tensor of
    ``global_shape`` (Megatron-style tensor parallelism, written by hand).

    Ranks holding the same block are replicas (written once); blocks of different ranks must tile
    the global tensor exactly. Load fills ``local`` in place with its block of the saved tensor.
    """

    def __init__(self, local: torch.Tensor, global_shape: Any, offsets: Any):
        self.local = local
        self.global_shape = _int_tuple(global_shape, "Shard global_shape")
        self.offsets = _int_tuple(offsets, "Shard offsets")
        box = ChunkBox(self.offsets, tuple(local.shape))
        if not box.fits_in(self.global_shape):
            raise UnsupportedValueError(
                f"Shard of shape {list(local.shape)} at offsets {list(self.offsets)} does not fit in the global "
                f"shape {list(self.global_shape)}")

    def __repr__(self) -> str:
        return f"Shard(local={list(self.local.shape)}, global_shape={list(self.global_shape)}, offsets={list(self.offsets)})"


class FlatShard:
    """A contiguous range of the row-major flattened global tensor: elements
    ``[start, start + local.numel())`` (ZeRO- or FSDP1-style partitions; padding excluded)."""

    def __init__(self, local: torch.Tensor, global_shape: Any, start: int):
        if local.dim() != 1:
            raise UnsupportedValueError(f"FlatShard needs a 1-D local tensor, got shape {list(local.shape)}")
        self.local = local
        self.global_shape = _int_tuple(global_shape, "FlatShard global_shape")
        if type(start) is not int:
            raise UnsupportedValueError(f"FlatShard start must be an int, not {type(start).__name__}")
        self.start = start
        if not FlatRange(start, start + local.numel()).fits_in(self.global_shape):
            raise UnsupportedValueError(
                f"FlatShard [{start}, {start + local.numel()}) lies outside a tensor of {math.prod(self.global_shape)} "
                f"elements (global shape {list(self.global_shape)})")

    def __repr__(self) -> str:
        return f"FlatShard(local={self.local.numel()}, global_shape={list(self.global_shape)}, start={self.start})"


@dataclass(frozen=True)
class LocalPiece:
    """``tensor`` (a view of local memory) holds exactly the elements of ``place``, in row-major order."""

    place: Place
    tensor: torch.Tensor


@dataclass(frozen=True)
class LocalLayout:
    """What this rank holds of one global tensor."""

    global_shape: tuple[int, ...]
    pieces: tuple[LocalPiece, ...]
    local: torch.Tensor  # the tensor the user handed us (a DTensor's local tensor)


class Pieces:
    """Several blocks or flat ranges of one global tensor held by this process, each a tensor
    whose elements, in row-major order, are those of its place (an import's source pieces, read
    where they lie in foreign files). ``empty``: the tensor to describe one with no pieces."""

    def __init__(self, global_shape: tuple[int, ...], pieces: tuple["LocalPiece", ...], empty: torch.Tensor):
        self.global_shape = tuple(global_shape)
        self.pieces = tuple(pieces)
        self.local = pieces[0].tensor if pieces else empty

    def __repr__(self) -> str:
        return f"Pieces({len(self.pieces)} pieces, global_shape={list(self.global_shape)})"


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local") and hasattr(value, "placements")


def is_sharded(value: Any) -> bool:
    return isinstance(value, (Shard, FlatShard, Pieces)) or is_dtensor(value)


def local_layout(value: Any, key: str) -> LocalLayout:
    """The layout of a Shard, FlatShard, DTensor or plain tensor (the whole of itself)."""
    if isinstance(value, Shard):
        box = ChunkBox(value.offsets, tuple(value.local.shape))
        return LocalLayout(value.global_shape, (LocalPiece(box, value.local),), value.local)
    if isinstance(value, FlatShard):
        rng = FlatRange(value.start, value.start + value.local.numel())
        return LocalLayout(value.global_shape, (LocalPiece(rng, value.local),), value.local)
    if isinstance(value, Pieces):
        return LocalLayout(value.global_shape, value.pieces, value.local)
    if is_dtensor(value):
        return _dtensor_layout(value, key)
    return LocalLayout(tuple(value.shape), (LocalPiece(ChunkBox.whole(tuple(value.shape)), value),), value)


def _dtensor_layout(dt: Any, key: str) -> LocalLayout:
    """A DTensor's local boxes: one for Shard/Replicate placements; several when a dimension is
    split twice with a stride (FSDP2 over tensor parallelism uses ``_StridedShard``)."""
    local = dt.to_local()
    global_shape = tuple(int(d) for d in dt.shape)
    placements = tuple(dt.placements)
    for p in placements:
        if p.is_partial():
            raise UnsupportedValueError(
                f"key {key!r}: a DTensor with a Partial placement holds unreduced values; reduce it "
                "(full_tensor() or redistribute to Shard/Replicate) before saving")
        if not (p.is_shard() or p.is_replicate() or _is_strided_shard(p)):
            raise UnsupportedValueError(f"key {key!r}: DTensor placement {p} is not supported")
    mesh = dt.device_mesh
    coords = mesh.get_coordinate()
    if coords is None:  # this rank is not in the mesh: it holds nothing
        return LocalLayout(global_shape, (), local)
    # For each tensor dim, the global indices this rank holds, narrowed mesh dim by mesh dim in
    # order (DTensor applies placements left to right; a strided shard interleaves).
    index = [torch.arange(d) for d in global_shape]
    for mesh_dim, p in enumerate(placements):
        if p.is_replicate():
            continue
        d = p.dim
        n = mesh.size(mesh_dim)
        # Split an index vector laid along dim d exactly as DTensor splits the tensor.
        along = index[d].reshape([-1 if i == d else 1 for i in range(len(global_shape))])
        parts = p._split_tensor(along, n, with_padding=False)[0]
        index[d] = parts[coords[mesh_dim]].reshape(-1) if coords[mesh_dim] < len(parts) else index[d][:0]
    if tuple(len(i) for i in index) != tuple(local.shape):
        raise UnsupportedValueError(
            f"key {key!r}: DTensor local shape {list(local.shape)} differs from the {[len(i) for i in index]} its "
            f"placements {placements} imply on mesh coordinate {coords}")
    runs_per_dim = [_runs(i.tolist()) for i in index]
    pieces = []
    for combo in _product(runs_per_dim):
        offsets = tuple(g for g, _, _ in combo)
        shape = tuple(n for _, _, n in combo)
        view = local[tuple(slice(lo, lo + n) for _, lo, n in combo)]
        pieces.append(LocalPiece(ChunkBox(offsets, shape), view))
    if not pieces and local.numel() == 0:
        pieces = [LocalPiece(ChunkBox(tuple(0 for _ in global_shape), tuple(local.shape)), local)]
    return LocalLayout(global_shape, tuple(pieces), local)


def _is_strided_shard(p: Any) -> bool:
    # FSDP2 over tensor parallelism: a dim split twice; torch calls it _StridedShard (private).
    return type(p).__name__ == "_StridedShard" and hasattr(p, "dim") and hasattr(p, "_split_tensor")


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: (global start, local start, length)."""
    runs: list[tuple[int, int, int]] = []
    for pos, g in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == g:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, pos, 1))
    return runs


def _product(lists: list[list[tuple[int, int, int]]]) -> list[tuple[tuple[int, int, int], ...]]:
    out: list[tuple[tuple[int, int, int], ...]] = [()]
    for options in lists:
        out = [prefix + (o,) for prefix in out for o in options]
    return out
