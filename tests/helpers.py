"""Shared test helpers: exact (bitwise) comparison of nested states; damaging a checkpoint."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import torch

import resurgo
from resurgo.format.manifest import SEAL_FIELD, seal
from resurgo.pipeline.buffers import as_copyable


def bits_equal(a, b) -> bool:
    """True when ``a`` and ``b`` have the same structure, types, dtypes, shapes and bytes."""
    if type(a) is not type(b) and not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        ab = as_copyable(a.detach()).contiguous().reshape(-1).view(torch.uint8)
        bb = as_copyable(b.detach()).contiguous().reshape(-1).view(torch.uint8)
        return torch.equal(ab, bb)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return bits_equal(a.real, b.real) and bits_equal(a.imag, b.imag)
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(
            type(k1) is type(k2) for k1, k2 in zip(a.keys(), b.keys())
        ) and all(bits_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))
    return a == b


def random_tensor(dtype: torch.dtype, shape, seed=0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (any bit pattern: NaN payloads included)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def nan_with_payload(payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000000 | payload))[0]


assert math.isnan(nan_with_payload(5))


def flip_stored_bit(path: Path, key: str) -> str:
    """Flip one bit inside the stored bytes of tensor ``key``; returns the data file's name."""
    chunk = resurgo.read_manifest(path).tensors[key].chunks[0]
    f = Path(path) / chunk.file
    raw = bytearray(f.read_bytes())
    raw[chunk.byte_range[0] + 1] ^= 0x10
    f.write_bytes(bytes(raw))
    return chunk.file


def resealed(raw: bytes) -> bytes:
    """Manifest bytes after an edit, sealed again as a writer would (any old seal dropped).

    Tests that hand-edit a manifest to reach one of the reader's other checks use this, since an
    edit alone now fails the manifest's own checksum first. Bytes that are not one JSON object
    are returned as they are.
    """
    body = raw.rstrip(b" \t\r\n")
    cut = body.rfind(b',"' + SEAL_FIELD.encode() + b'":"')
    if cut >= 0 and body.endswith(b'"}'):
        body = body[:cut] + b"}"
    return seal(body) if body.lstrip().startswith(b"{") and body.endswith(b"}") else raw


def sealed_manifest(doc: dict) -> bytes:
    """A manifest document as compact, sealed JSON (a stale seal in ``doc`` is dropped)."""
    doc = {k: v for k, v in doc.items() if k != SEAL_FIELD}
    return seal(json.dumps(doc, separators=(",", ":")).encode())
