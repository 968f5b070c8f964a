"""Block checksums: xxh3-128 over fixed-size blocks of a chunk's bytes.

Blocks let a reader verify any block-aligned part of a chunk without reading all of it. The
digest of block ``i`` covers bytes ``[i*B, min((i+1)*B, n))`` of the chunk; digests are stored as
32 lowercase hex characters (the canonical big-endian xxh3-128 digest).
"""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3-128"
MIN_BLOCK_BYTES = 1 << 16
MAX_DEFAULT_BLOCK_BYTES = 1 << 20
BLOCKS_PER_CHUNK = 64


def block_bytes_for(nbytes: int) -> int:
    """The default block size of a chunk: about 64 blocks, a power of two in [64 KiB, 1 MiB].

    Small blocks bound what a partial read must fetch beyond what it needs (one block at each
    end, at most 1/64 of the chunk); large ones keep the manifest small (32 hex digits per block:
    at most 0.05% of the data) and let xxhash hash without holding the GIL.
    """
    size = MIN_BLOCK_BYTES
    while size < MAX_DEFAULT_BLOCK_BYTES and size * BLOCKS_PER_CHUNK < nbytes:
        size *= 2
    return size


MIN_RESHARD_BLOCK_BYTES = 1 << 12
BLOCKS_PER_TENSOR = 256


def block_bytes_for_resharding(tensor_nbytes: int) -> int:
    """The block size of a distributed save's chunks: the largest power of two at most 1/256 of the
    whole tensor, within [4 KiB, 1 MiB], whatever the chunk.

    A load by another layout reads whole blocks: at most one extra block at each end of every
    range it needs. Sizing blocks by the global tensor (not by the saving rank's chunk) bounds
    that overhead for any target layout: a rank needing 1/M of a tensor of n >= 1 MiB bytes reads
    at most 2n/256 extra, under 5% for M <= 6; the manifest holds 256 to 512 digests per tensor.
    """
    size = MIN_RESHARD_BLOCK_BYTES
    while size < MAX_DEFAULT_BLOCK_BYTES and size * 2 * BLOCKS_PER_TENSOR <= tensor_nbytes:
        size *= 2
    return size


def block_count(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def digest(buf: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(buf)


def block_digests(buf: memoryview, block_bytes: int) -> list[str]:
    """Hex digests of every block of ``buf`` (a flat byte memoryview)."""
    h = xxhash.xxh3_128_hexdigest
    return [h(buf[i : i + block_bytes]) for i in range(0, len(buf), block_bytes)]


def first_bad_block(buf: memoryview, block_bytes: int, expected: list[str], first_block: int = 0) -> int | None:
    """Index of the first block of ``buf`` whose digest differs from ``expected``, or None.

    ``buf`` starts at block ``first_block`` of the chunk; it may end mid-chunk only at its last block.
    """
    h = xxhash.xxh3_128_hexdigest
    for j, start in enumerate(range(0, len(buf), block_bytes)):
        if h(buf[start : start + block_bytes]) != expected[first_block + j]:
            return first_block + j
    return None
