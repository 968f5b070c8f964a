"""safetensors data files: the header that makes each data file a valid safetensors file.

Layout (the safetensors format): 8-byte little-endian header length N, N bytes of JSON header
(padded with spaces to a multiple of 8), then the tensors' bytes back to back in header order.
The header is computed from the plan before any data is written, so data streams straight from
the tensors into the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from resurgo.format import dtypes, strict_json

METADATA = {"format": "pt", "producer": "resurgo"}


DATA_ALIGN = 64  # where the data area of a file resurgo writes starts (a multiple of 8)


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a data file's header declares it: its name, its resurgo dtype, the shape of
    its elements and its byte count."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def declared_dtype(self) -> str:
        """The safetensors dtype code; raw bytes (``U8``) for dtypes safetensors lacks."""
        return dtypes.SAFETENSORS_CODES.get(self.dtype, "U8")

    @property
    def declared_shape(self) -> list[int]:
        """The shape the header declares: the tensor's own, or its byte count for raw bytes."""
        return list(self.shape) if self.dtype in dtypes.SAFETENSORS_CODES else [self.nbytes]

    @property
    def declared_as_raw_bytes(self) -> bool:
        """True when a reader of the file sees bytes rather than the tensor's dtype."""
        return self.declared_dtype == "U8" and self.dtype != "uint8"


def build_header(items: Sequence[HeaderEntry], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """(header bytes including the length prefix, absolute byte range of each item in the file).

    ``metadata`` adds string entries to ``__metadata__`` (safetensors allows only strings there).
    """
    header: dict = {"__metadata__": {**METADATA, **(metadata or {})}}
    offset = 0
    relative = []
    for item in items:
        header[item.name] = {
            "dtype": item.declared_dtype,
            "shape": item.declared_shape,
            "data_offsets": [offset, offset + item.nbytes],
        }
        relative.append((offset, offset + item.nbytes))
        offset += item.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    # Padded so the data area starts on a cache line: staging buffers take the data's offset
    # within a 4 KiB block (for direct I/O), and copies into cache-line-misaligned buffers are
    # ~20% slower. safetensors allows any space padding; N stays a multiple of 8.
    body += b" " * (-(8 + len(body)) % DATA_ALIGN)
    prefix = struct.pack("<Q", len(body))
    start = len(prefix) + len(body)
    return prefix + body, [(start + a, start + b) for a, b in relative]


MAX_HEADER_BYTES = 100 << 20  # the limit safetensors itself enforces


@dataclass
class SafetensorsHeader:
    data_start: int
    entries: dict[str, tuple[int, int]]  # name -> [start, stop) relative to data_start
    raw: dict


def read_header(prefix: bytes, read_body: Callable[[int], bytes]) -> SafetensorsHeader:
    """Parse a safetensors header from its 8-byte prefix and a reader of the JSON body. ValueError if invalid."""
    if len(prefix) != 8:
        raise ValueError("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    body = read_body(n)
    if len(body) != n:
        raise ValueError("file ends inside the header")
    doc = strict_json.loads(body)  # DuplicateKeyError is a ValueError
    if not isinstance(doc, dict):
        raise ValueError("header is not a JSON object")
    entries = {}
    for name, e in doc.items():
        if name == "__metadata__":
            continue
        offs = e.get("data_offsets") if isinstance(e, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs)):
            raise ValueError(f"entry {name!r} has no valid data_offsets")
        entries[name] = (offs[0], offs[1])
    return SafetensorsHeader(8 + n, entries, doc)
