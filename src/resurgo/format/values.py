"""Exact JSON encoding of non-tensor values (the manifest's ``tree`` nodes for scalars).

Every node is a JSON object with a ``type`` tag, so a reader never has to guess: ``bool`` and
``int`` stay distinct, ints are JSON integers of any size, floats are stored as their 64 IEEE bits
in hex (NaN payloads, -0.0 and infinities survive), bytes are base64. Pickled values exist only
when the writer allowed them and load only when the reader allows them.
"""

from __future__ import annotations

import base64
import pickle
import re
import struct
from typing import Any

import numpy as np
import torch

from resurgo.errors import ManifestError, PickleNotAllowedError, UnsupportedValueError
from resurgo.format import dtypes

MAX_INT_BITS = 8192

KEY_TYPES = ("none", "bool", "int", "float", "complex", "str", "bytes", "numpy_scalar", "torch_dtype", "torch_device")
SCALAR_TYPES = ("none", "bool", "int", "float", "complex", "str", "bytes", "numpy_scalar",
                "torch_dtype", "torch_device", "pickle")


def _float_bits(x: float) -> str:
    return "%016x" % struct.unpack("<Q", struct.pack("<d", x))[0]


_HEX64 = re.compile(r"[0-9a-f]{16}")


def _bits_float(bits: Any) -> float:
    # fullmatch, not int(bits, 16) alone: that also takes "-000000000000001", "0x..." and spaces
    if not isinstance(bits, str) or not _HEX64.fullmatch(bits):
        raise ManifestError(f"float bits must be 16 lowercase hex characters, found {str(bits)[:40]!r}")
    return struct.unpack("<d", struct.pack("<Q", int(bits, 16)))[0]


def encode_scalar(value: Any) -> dict | None:
    """The tagged node for a plain scalar, or None if ``value`` is not one."""
    if value is None:
        return {"type": "none"}
    if isinstance(value, bool):  # before int: bool is an int subclass
        return {"type": "bool", "value": value}
    if type(value) is int:
        # JSON readers (Python's included) refuse integers of more than ~4300 digits.
        return {"type": "int", "value": value} if value.bit_length() <= MAX_INT_BITS else None
    if type(value) is float:
        return {"type": "float", "bits": _float_bits(value)}
    if type(value) is complex:
        return {"type": "complex", "real": _float_bits(value.real), "imag": _float_bits(value.imag)}
    if type(value) is str:
        return {"type": "str", "value": value}
    if type(value) is bytes:
        return {"type": "bytes", "base64": base64.b64encode(value).decode()}
    if isinstance(value, np.generic) and not isinstance(value, np.ndarray):
        name = dtypes.numpy_dtype_name(value.dtype)
        if name is not None:
            return {"type": "numpy_scalar", "dtype": name, "hex": value.tobytes().hex()}
        return None
    if isinstance(value, torch.dtype) and value in dtypes.TORCH_DTYPE_NAMES:
        return {"type": "torch_dtype", "value": dtypes.TORCH_DTYPE_NAMES[value]}
    if isinstance(value, torch.device):
        return {"type": "torch_device", "value": str(value)}
    return None


def encode_key(key: Any) -> str | dict | None:
    """A dict key in the tree: a str key is a plain JSON string, any other scalar a tagged node.

    (Most keys are strings; writing them bare keeps the manifest small.) None if not plain.
    """
    if type(key) is str:
        return key
    node = encode_scalar(key)
    return node if node is not None and node["type"] in KEY_TYPES else None


def decode_key(node: Any, where: str) -> Any:
    if isinstance(node, str):
        return node
    if not isinstance(node, dict) or node.get("type") not in KEY_TYPES:
        raise ManifestError(f"{where}: a dict key must be a string or a tagged scalar node")
    return decode_scalar(node, where, allow_pickle=False)


def encode_pickle(value: Any, where: str) -> dict:
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception as e:
        raise UnsupportedValueError(f"{where}: {type(value).__name__} cannot be pickled: {e}") from None
    return {"type": "pickle", "class": f"{type(value).__module__}.{type(value).__qualname__}",
            "base64": base64.b64encode(data).decode()}


def _field(node: dict, name: str, kind: type, where: str) -> Any:
    value = node.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"{where}: node of type {node.get('type')!r} needs a {kind.__name__} field {name!r}")
    return value


def decode_scalar(node: dict, where: str, allow_pickle: bool) -> Any:
    """Inverse of :func:`encode_scalar` (and of :func:`encode_pickle` when allowed)."""
    t = node.get("type")
    if t == "none":
        return None
    if t == "bool":
        return _field(node, "value", bool, where)
    if t == "int":
        return _field(node, "value", int, where)
    if t == "float":
        return _bits_float(node.get("bits"))
    if t == "complex":
        return complex(_bits_float(node.get("real")), _bits_float(node.get("imag")))
    if t == "str":
        return _field(node, "value", str, where)
    if t == "bytes":
        try:
            return base64.b64decode(_field(node, "base64", str, where), validate=True)
        except ValueError:
            raise ManifestError(f"{where}: invalid base64 in a bytes node") from None
    if t == "numpy_scalar":
        name = _field(node, "dtype", str, where)
        if name not in dtypes.NUMPY_DTYPES:
            raise ManifestError(f"{where}: unknown numpy scalar dtype {name[:40]!r}")
        dt = dtypes.NUMPY_DTYPES[name]
        try:
            raw = bytes.fromhex(_field(node, "hex", str, where))
        except ValueError:
            raise ManifestError(f"{where}: invalid hex in a numpy scalar node") from None
        if len(raw) != dt.itemsize:
            raise ManifestError(f"{where}: numpy {name} scalar needs {dt.itemsize} bytes, found {len(raw)}")
        return np.frombuffer(raw, dtype=dt)[0]
    if t == "torch_dtype":
        name = _field(node, "value", str, where)
        if name not in dtypes.TORCH_DTYPES:
            raise ManifestError(f"{where}: unknown torch dtype {name[:40]!r}")
        return dtypes.TORCH_DTYPES[name]
    if t == "torch_device":
        try:
            return torch.device(_field(node, "value", str, where))
        except (RuntimeError, ValueError, TypeError):
            raise ManifestError(f"{where}: invalid torch device") from None
    if t == "pickle":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{where}: holds a pickled {str(node.get('class'))[:100]}; loading it could run code from the file. "
                "Pass allow_pickle=True only if you trust this checkpoint."
            )
        try:
            return pickle.loads(base64.b64decode(_field(node, "base64", str, where)))
        except Exception as e:
            raise ManifestError(f"{where}: pickled value does not load: {type(e).__name__}: {e}") from None
    raise ManifestError(f"{where}: unknown value type {str(t)[:40]!r}")
