"""safetensors data files: the header that makes each data file a valid safetensors file.

Layout (the safetensors format): 8-byte little-endian header length N, N bytes of JSON header
(padded with spaces to a multiple of 8), then the tensors' bytes back to back in header order.
The header is computed from the plan before any data is written, so data streams straight from
the tensors into the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

from resurgo.plan.save_plan import WriteItem

METADATA = {"format": "pt", "producer": "resurgo"}


def build_header(items: Sequence[WriteItem]) -> tuple[bytes, list[tuple[int, int]]]:
    """(header bytes including the length prefix, absolute byte range of each item in the file)."""
    header: dict = {"__metadata__": METADATA}
    offset = 0
    relative = []
    for item in items:
        header[item.name] = {
            "dtype": item.safetensors_dtype,
            "shape": item.safetensors_shape,
            "data_offsets": [offset, offset + item.nbytes],
        }
        relative.append((offset, offset + item.nbytes))
        offset += item.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    prefix = struct.pack("<Q", len(body))
    start = len(prefix) + len(body)
    return prefix + body, [(start + a, start + b) for a, b in relative]
