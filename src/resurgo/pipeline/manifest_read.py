"""Reading a checkpoint's manifest: its bytes from storage, checked and parsed by format/.

Storage returns bytes and knows nothing of their meaning; format/ parses and checks bytes and
knows nothing of where they came from. Every reader of a checkpoint joins the two here, so
messages name the manifest the same way everywhere.

A version 4 manifest is a core: the chunks are in the indexes of the ranks that wrote them
(:mod:`resurgo.format.index`). Tools that look at a whole checkpoint get it resolved in full
(every index read); a load reads the core, then only the indexes holding the chunks its own
layout needs (:func:`resolve_for`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from resurgo.errors import CorruptCheckpointError
from resurgo.format.index import RankIndex, index_file_name, parse_index, ranks_needed, resolve
from resurgo.format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from resurgo.layout.box import Place
from resurgo.storage.base import Checkpoint

INDEX_READERS = 8  # indexes read at once (object stores: one request each)


def read_manifest_and_bytes(ckpt: Checkpoint, resolved: bool = True) -> tuple[Manifest, bytes]:
    """The checkpoint's manifest, validated and checked against its own checksum, and its bytes.
    Of a version 4 checkpoint: with every rank's index read in (``resolved``), else the core."""
    raw = ckpt.read_manifest_bytes()
    manifest = parse_manifest(raw, ckpt.describe(MANIFEST_NAME))
    if manifest.indexed and resolved:
        manifest = resolve_for(ckpt, manifest, None)
    return manifest, raw


def read_manifest_of(ckpt: Checkpoint) -> Manifest:
    """The checkpoint's manifest, validated and checked against its own checksum (resolved)."""
    return read_manifest_and_bytes(ckpt)[0]


def read_index(ckpt: Checkpoint, core: Manifest, rank: int) -> tuple[RankIndex, int]:
    """Rank ``rank``'s index, checked against the core; and its size."""
    assert core.ranks is not None and core.file_tag is not None
    name = index_file_name(rank, core.file_tag)
    size = core.ranks.index_bytes[rank]
    handle = ckpt.open_read(name)
    try:
        if handle.size != size:
            raise CorruptCheckpointError(f"{ckpt.describe(name)}: rank {rank}'s index has {handle.size} bytes, "
                                         f"the manifest records {size} (truncated or altered)")
        raw = handle.read_at(0, size)
    finally:
        handle.close()
    return parse_index(raw, core, rank, ckpt.describe(name)), size


def resolve_for(ckpt: Checkpoint, core: Manifest, wanted: Mapping[str, Iterable[Place] | None] | None,
                read: dict[str, int] | None = None) -> Manifest:
    """A version 4 core with the chunks ``wanted`` (key -> places needed, None: the whole tensor;
    ``wanted`` None: everything) read from the ranks' indexes that hold them, and nothing else.
    ``read`` collects the bytes of each index file read."""
    assert core.file_tag is not None
    wanted = None if wanted is None else {k: (None if v is None else list(v)) for k, v in wanted.items()}
    ranks = ranks_needed(core, wanted)
    if len(ranks) <= 1:
        found = [read_index(ckpt, core, r) for r in ranks]
    else:
        with ThreadPoolExecutor(min(INDEX_READERS, len(ranks)), thread_name_prefix="resurgo-index") as pool:
            found = list(pool.map(lambda r: read_index(ckpt, core, r), ranks))
    if read is not None:
        read.update({index_file_name(r, core.file_tag): size for r, (_, size) in zip(ranks, found)})
    tag = core.file_tag
    return resolve(core, {r: ix for r, (ix, _) in zip(ranks, found)}, wanted,
                   lambda r: ckpt.describe(index_file_name(r, tag)))
