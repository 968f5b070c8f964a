"""Flat byte views of tensors and arrays, without copying when the memory allows it."""

from __future__ import annotations

import numpy as np
import torch

from resurgo.state.flatten import Array


# Integer dtypes of each item size: copying through them moves the same bits for any dtype,
# including those torch has no copy kernel for (int1, bits8, float4_e2m1fn_x2...).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_copyable(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with a dtype torch can copy, holding the same bits (same strides)."""
    alias = _SAME_SIZE_INT.get(t.dtype.itemsize)
    return t.view(alias) if alias is not None and t.dtype != alias else t


def source_bytes(value: Array) -> np.ndarray:
    """A flat uint8 array with the value's bytes in row-major order (copies only when it must:
    non-CPU, non-contiguous, or lazily conjugated/negated tensors)."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    t = value.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = as_copyable(t).contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


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
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(flat).view(dtype).reshape(shape)
