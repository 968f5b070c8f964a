"""What a checkpoint's tensors take against the stored bytes they are read from: the bound on
what reading one may allocate or write without the caller's consent.

A manifest may place chunks of several tensors on the same bytes of a data file (tied weights
saved once: two keys on one range), so a small manifest beside a small data file can declare
tensors many times larger than both. Loading into new tensors, converting and importing refuse
more than :data:`MAX_EXPANSION` times the distinct bytes read unless the caller allows it
(``allow_expansion=True``). Pure: a manifest in, numbers and errors out.
"""

from __future__ import annotations

import math
import os

from resurgo.errors import ExpansionError
from resurgo.format import dtypes
from resurgo.format.manifest import Manifest, TensorEntry

# Tied weights saved once double a tensor's bytes; anything beyond a few times is a manifest
# placing many tensors on the same bytes (or a stride-0 view, for an import).
MAX_EXPANSION = 4


def entry_bytes(entry: TensorEntry) -> int:
    """The bytes of the whole tensor ``entry`` declares."""
    return math.prod(entry.shape) * dtypes.itemsize(entry.dtype)


def distinct_bytes(manifest: Manifest) -> int:
    """The distinct bytes the manifest's chunks read: per data file (this checkpoint's own, or an
    earlier one's it references), the size of the union of their byte ranges. Of a version 4
    manifest, of the chunks resolved into it."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for entry in manifest.tensors.values():
        for chunk in entry.chunks:
            for file, start, stop in chunk.spans:
                ranges.setdefault(file, []).append((start, stop))
    total = 0
    for spans in ranges.values():
        end = None
        for start, stop in sorted(spans):
            if end is None or start >= end:
                total, end = total + stop - start, stop
            elif stop > end:
                total, end = total + stop - end, stop
    return total


def span_bytes(manifest: Manifest) -> int:
    """The bytes of the manifest's distinct chunk spans: what checking every chunk reads when a span
    several chunks share whole is read once (tied weights), but spans that overlap at other offsets
    are each read in full."""
    spans = {span for entry in manifest.tensors.values() for chunk in entry.chunks for span in chunk.spans}
    return sum(stop - start for _, start, stop in spans)


def expansion_error(source: str | os.PathLike, what: str, taken: int, distinct: int, consent: str) -> ExpansionError:
    """The refusal of ``what`` (e.g. "its 51 tensors take") ``taken`` bytes read from ``distinct``
    stored bytes; ``consent`` says how to allow it."""
    return ExpansionError(
        f"{source}: {what} {taken} bytes, {taken / max(1, distinct):.1f} times the {distinct} distinct bytes "
        f"their chunks read (more than {MAX_EXPANSION} times is refused: chunks of several tensors share "
        f"bytes); {consent} if the checkpoint is trusted")
