"""Copying a committed checkpoint to another location (another tier), byte for byte.

The data files are streamed in pieces from the source's read handles into a save at the
destination, several files at once, and committed there with the source's manifest, unchanged:
the destination's commit protocol applies (temporary directory and rename on a filesystem; data
objects, then the manifest, on an object store), so a copy cut short is never a checkpoint.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from resurgo.storage.base import check_size
from resurgo.storage.open import open_checkpoint

PIECE_BYTES = 16 << 20


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, src_options: dict | None = None,
                    dst_options: dict | None = None, overwrite: bool = False, threads: int = 4) -> int:
    """Copy the checkpoint ``src`` to ``dst``; returns the bytes copied (data files and manifest).

    Up to ``threads`` data files are copied at once, each through its own buffer."""
    import json

    source = open_checkpoint(src, src_options)
    manifest = source.read_manifest_bytes()
    files = sorted((name, int(entry["bytes"])) for name, entry in json.loads(manifest)["files"].items())
    staging = open_checkpoint(dst, dst_options).stage(overwrite)

    def copy_file(name: str, size: int) -> int:
        buf = bytearray(min(PIECE_BYTES, size))
        reader = source.open_read(name)
        try:
            check_size(source.path, name, reader.size, size)
            writer = staging.create(name)
            try:
                for off in range(0, size, PIECE_BYTES):
                    view = memoryview(buf)[: min(PIECE_BYTES, size - off)]
                    reader.read_into(off, view)
                    writer.write(view)
                writer.fsync()
            finally:
                writer.close()
        finally:
            reader.close()
        return size

    try:
        workers = max(1, min(threads, len(files)))
        if workers == 1:
            total = sum(copy_file(name, size) for name, size in files)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="resurgo-copy-file") as pool:
                total = sum(pool.map(lambda f: copy_file(*f), files))
        staging.commit(manifest)
    except BaseException:
        staging.abort()
        raise
    return total + len(manifest)
