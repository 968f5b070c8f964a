"""Flat byte views of tensors and arrays, without copying when the memory allows it."""

from __future__ import annotations

import numpy as np
import torch

from resurgo.format import dtypes
from resurgo.state.flatten import Array


# Integer dtypes of each item size: copying through them moves the same bits for any dtype,
# including those torch has no copy kernel for (int1, bits8, float4_e2m1fn_x2...).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_copyable(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with a dtype torch can copy, holding the same bits (same strides)."""
    alias = _SAME_SIZE_INT.get(t.dtype.itemsize)
    return t.view(alias) if alias is not None and t.dtype != alias else t


def source_for_write(value: Array) -> "np.ndarray | TensorStream":
    """The tensor's own bytes when they are one flat host buffer (no copy), else a stream."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    t = value.detach()
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return t.reshape(-1).view(torch.uint8).numpy()
    return TensorStream(t)


class TensorStream:
    """A tensor whose bytes are not one flat host buffer (on a device, strided, lazily
    conjugated): its row-major bytes are copied out a slice at a time into a buffer the writer
    owns, so writing it never holds a second full copy."""

    def __init__(self, tensor: torch.Tensor):
        t = tensor.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()  # rare: a lazily conjugated view is materialized
        self.tensor = t
        self.nbytes = t.numel() * t.element_size()

    def read_into(self, offset: int, out: np.ndarray) -> memoryview:
        """Copy bytes ``[offset, offset + len(out))`` (item-aligned) into ``out``; return them."""
        size = self.tensor.element_size()
        first, count = offset // size, len(out) // size
        dst = as_copyable(typed_view(out, self.tensor.dtype, (count,)))
        copy_flat_range(as_copyable(self.tensor), first, first + count, dst)
        return out.data.cast("B")


def copy_flat_range(t: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
    """Copy elements ``[start, stop)`` of ``t`` in row-major order into the 1-d ``out``, using no
    memory beyond ``out``: whole rows in one strided copy, partial rows by recursion."""
    if stop <= start:
        return
    if t.is_contiguous() or t.dim() <= 1:
        out.copy_(t.reshape(-1)[start:stop] if t.is_contiguous() else t[start:stop])
        return
    inner = t[0].numel()
    pos = 0
    row = start // inner
    while start < stop:
        lo, hi = start - row * inner, min(stop - row * inner, inner)
        if lo == 0 and hi == inner:  # a run of whole rows
            rows = min((stop - start) // inner, t.shape[0] - row)
            out[pos : pos + rows * inner].view(rows, *t.shape[1:]).copy_(t[row : row + rows])
            n = rows * inner
            row += rows
        else:
            n = hi - lo
            copy_flat_range(t[row], lo, hi, out[pos : pos + n])
            row += 1
        pos += n
        start += n


def writable_bytes(dest: Array) -> np.ndarray | None:
    """The destination's own memory as a flat writable uint8 array, or None if it has none we can
    write into directly (GPU, non-contiguous, read-only)."""
    if isinstance(dest, np.ndarray):
        if dest.flags.c_contiguous and dest.flags.writeable:
            return dest.reshape(-1).view(np.uint8)
        return None
    if dest.device.type != "cpu" or not dest.is_contiguous() or dest.is_conj() or dest.is_neg():
        return None
    return dest.detach().reshape(-1).view(torch.uint8).numpy()


def typed_view(flat: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Reinterpret flat bytes as a torch tensor of ``dtype`` and ``shape`` (no copy)."""
    if flat.size == 0:  # torch gives an empty array stride 0, and view() to a wider dtype then fails
        return dtypes.uninitialized(shape, dtype)
    return torch.from_numpy(flat).view(dtype).reshape(shape)
