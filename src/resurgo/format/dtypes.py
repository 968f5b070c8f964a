"""Element types: the names the manifest uses, their sizes, and how they map to torch, numpy and
safetensors.

The manifest names every dtype by its torch name without the ``torch.`` prefix (``float32``,
``bfloat16``, ``float8_e4m3fn``, ``uint16``...). numpy arrays use the same names. Data files store
a chunk under its safetensors dtype when safetensors has one; otherwise as raw bytes (``U8``),
and the manifest's dtype is the truth.
"""

from __future__ import annotations

import numpy as np
import torch

# torch dtypes that cannot be stored as plain bytes: their values depend on side data (scale,
# zero point) that a byte copy would lose.
_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _all_torch_dtypes() -> dict[str, torch.dtype]:
    found: dict[str, torch.dtype] = {}
    for attr in dir(torch):
        value = getattr(torch, attr)
        if isinstance(value, torch.dtype) and value not in _QUANTIZED:
            found[str(value).removeprefix("torch.")] = value
    return found


TORCH_DTYPES: dict[str, torch.dtype] = _all_torch_dtypes()
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

# Same names as torch; only native little-endian, non-object types are plain data.
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}

# safetensors dtype codes for the torch dtypes it knows; everything else is stored as U8 bytes.
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}


def itemsize(name: str) -> int:
    """Bytes per element of a manifest dtype name (KeyError if unknown)."""
    if name in TORCH_DTYPES:
        return TORCH_DTYPES[name].itemsize
    return NUMPY_DTYPES[name].itemsize


def is_known(name: str) -> bool:
    return name in TORCH_DTYPES or name in NUMPY_DTYPES


def numpy_dtype_name(dtype: np.dtype) -> str | None:
    """The manifest name of a numpy dtype, or None if it is not plain data we store."""
    if dtype.byteorder == ">" or dtype.hasobject or dtype.fields is not None:
        return None
    name = dtype.name
    return name if name in NUMPY_DTYPES and NUMPY_DTYPES[name] == dtype else None


def uninitialized(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor of ``shape`` and ``dtype``, allocated as bytes and viewed.

    ``torch.empty`` fills new memory when deterministic algorithms are on
    (``torch.use_deterministic_algorithms(True)``, as Lightning's ``deterministic=True`` sets),
    and has no fill for the sub-byte and bit dtypes (``bits16``, ``int4``, ``float4_e2m1fn_x2``):
    it raises. Bytes can always be allocated (and filled), and every dtype views them."""
    shape = tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    return torch.empty(numel * dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(shape)
