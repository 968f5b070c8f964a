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


MIN_FINE_BLOCK_BYTES = 1 << 12
FINE_BLOCKS_FROM_BYTES = 1 << 20  # tensors this large get blocks of at most 1/256 of their size
BLOCKS_PER_TENSOR = 256


def block_bytes_for(tensor_nbytes: int, row_bytes: int = 1) -> int:
    """The default checksum block size of a tensor's chunks, from the size of the whole tensor.

    A reader fetching part of a chunk reads whole blocks: at most one extra block at each end of a
    range it needs. Tensors of 1 MiB or more get the largest power of two at most 1/256 of the
    tensor (within [4 KiB, 1 MiB]), whatever the chunk, so a rank loading 1/M of it in another
    layout reads at most 2n/256 extra bytes: under 5% for M <= 6. Smaller tensors get 64 KiB
    blocks (one block for most), which keeps the manifest small where partial reads matter
    little. 32 hex digits per block: 256 to 512 digests per large tensor.
    """
    if tensor_nbytes < FINE_BLOCKS_FROM_BYTES:
        return MIN_BLOCK_BYTES
    size = MIN_FINE_BLOCK_BYTES
    while size < MAX_DEFAULT_BLOCK_BYTES and size * 2 * BLOCKS_PER_TENSOR <= tensor_nbytes:
        size *= 2
    return size


MAX_INCREMENTAL_BLOCKS = 1 << 16


ROWS_PER_BLOCK = 8


def incremental_block_bytes_for(tensor_nbytes: int, row_bytes: int = 1) -> int:
    """The checksum block size of a tensor's chunks in checkpoints that reuse each other's bytes.

    The block is the unit of reuse: an updated element dirties its whole block. Tensors of 1 MiB
    or more get blocks of 8 rows (``row_bytes``: the bytes of one index of the first dimension),
    rounded up to a power of two and at least 4 KiB: an updated row dirties at most 8 rows' bytes,
    so with 1% of an embedding's rows updated at random about 8% of its blocks change. Blocks
    grow (up to 1 MiB) while a tensor would have more than 65536 of them (the manifest holds 34
    bytes per block: at most 0.8% of the data). Smaller tensors get 64 KiB blocks, one block for
    most: they are reused or written whole.
    """
    if tensor_nbytes < FINE_BLOCKS_FROM_BYTES:
        return MIN_BLOCK_BYTES
    size = MIN_FINE_BLOCK_BYTES
    while size < MAX_DEFAULT_BLOCK_BYTES and (size < ROWS_PER_BLOCK * row_bytes
                                              or size * MAX_INCREMENTAL_BLOCKS < tensor_nbytes):
        size *= 2
    return size


def block_count(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def digest(buf: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(buf)


def digest_of(*parts: bytes | memoryview) -> str:
    """The digest of the parts' concatenation, without concatenating them."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def block_digests(buf: memoryview, block_bytes: int) -> list[str]:
    """Hex digests of every block of ``buf`` (a flat byte memoryview)."""
    h = xxhash.xxh3_128_hexdigest
    return [h(buf[i : i + block_bytes]) for i in range(0, len(buf), block_bytes)]


def block_digests_reusing(buf: memoryview, block_bytes: int, known: dict[int, str], first_block: int = 0) -> list[str]:
    """:func:`block_digests`, taking the digests of blocks already hashed from ``known`` (chunk
    block index -> digest; ``buf`` starts at block ``first_block`` of the chunk)."""
    n = -(-len(buf) // block_bytes)
    out: list[str] = []
    at = 0  # the runs of blocks between known ones are hashed as block_digests does: no per-block lookup
    for j in sorted(i - first_block for i in known if first_block <= i < first_block + n):
        out += block_digests(buf[at * block_bytes : j * block_bytes], block_bytes)
        out.append(known[first_block + j])
        at = j + 1
    return out + block_digests(buf[at * block_bytes :], block_bytes)


def first_bad_block(buf: memoryview, block_bytes: int, expected: list[str], first_block: int = 0) -> int | None:
    """Index of the first block of ``buf`` whose digest differs from ``expected``, or None.

    ``buf`` starts at block ``first_block`` of the chunk; it may end mid-chunk only at its last block.
    """
    h = xxhash.xxh3_128_hexdigest
    for j, start in enumerate(range(0, len(buf), block_bytes)):
        if h(buf[start : start + block_bytes]) != expected[first_block + j]:
            return first_block + j
    return None
