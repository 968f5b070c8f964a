"""A spec from a torch.save file (zip format), without executing any of its pickle; and the
reading of torch.save archives that other importers share (an archive inside a larger file, the
start of a stored member's data).

The archive's ``data.pkl`` is read by the restricted unpickler of :mod:`.unpickle` with its
torch.save allowlist: a tensor becomes the location of its bytes (archive member
``<prefix>/data/<storage>``, byte offset, shape, element strides, dtype), and any other global
raises PickleNotAllowedError before it is called.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ImportSpecError,
    ResurgoError,
    UnsupportedValueError,
)
from resurgo.format import dtypes
from resurgo.format.tree import path_key
from resurgo.interop.source_files import open_file_inside
from resurgo.interop.spec import Box, ImportSpec, Piece, TensorSpec, row_major_strides
from resurgo.interop.unpickle import TORCH_SAVE, TensorRef, restricted_load
from resurgo.layout.box import ChunkBox

MAX_PICKLE_BYTES = 1 << 30
# What zipfile raises on a damaged or crafted archive (names that are not UTF-8, unknown compression
# or encryption, sizes past the end, bad CRC): each one a damaged source, never a crash. A
# ResurgoError raised inside (some are OSError or ValueError subclasses) is re-raised before these.
ZIP_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, UnicodeDecodeError, NotImplementedError,
    RuntimeError, zlib.error, struct.error, OverflowError, ValueError)


@contextmanager
def damaged_archive(what: str, hint: str = "was it truncated or damaged?") -> Iterator[None]:
    """Any of ZIP_ERRORS raised inside becomes ``CorruptCheckpointError("<what> (<error>); <hint>")``;
    a ResurgoError passes as it was raised."""
    try:
        yield
    except ResurgoError:
        raise
    except ZIP_ERRORS as e:
        raise CorruptCheckpointError(f"{what} ({type(e).__name__}: {e!s:.300}); {hint}") from None


LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field
TORCH_SAVE_HOLDS = "a torch.save of tensors and plain values"


class ZipSlice(io.RawIOBase):
    """A read-only file of the bytes ``[start, start + size)`` of ``f``: a zip archive written
    into a larger file (DCP writes each chunk with torch.save at an offset of its file)."""

    def __init__(self, f: io.BufferedIOBase, start: int, size: int):
        super().__init__()
        self._f, self._start, self._size, self._pos = f, start, size, 0

    @property
    def size(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


def member_start(fp: io.RawIOBase | io.BufferedIOBase, info: zipfile.ZipInfo, where: str) -> int:
    """Where a stored member's data begin in ``fp`` (they follow its local header)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ImportSpecError(f"{where}: member {info.filename!r} is compressed; only stored members can be imported")
    fp.seek(info.header_offset)
    local = fp.read(LOCAL_HEADER)
    if len(local) != LOCAL_HEADER or local[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: member {info.filename!r} has no valid local header")
    return info.header_offset + LOCAL_HEADER + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")


def stored_member(fp: io.RawIOBase | io.BufferedIOBase, member: str, where: str) -> tuple[int, int]:
    """(where its data begin in ``fp``, its size) of stored member ``member`` of the zip archive
    ``fp``: KeyError when the archive has no such member (the caller says what that means), a
    damaged archive CorruptCheckpointError."""
    with damaged_archive(f"{where}: not a readable zip archive", "was it truncated?"):
        with zipfile.ZipFile(fp) as z:
            info = z.getinfo(member)
        return member_start(fp, info, where), info.file_size


def read_archive(z: zipfile.ZipFile, where: str, allowed: Mapping[tuple[str, str], Any] = TORCH_SAVE,
                 holds: str = TORCH_SAVE_HOLDS) -> tuple[Any, str]:
    """(the structure a torch.save archive pickles, with TensorRefs for tensors; its prefix);
    ``allowed``: the globals its pickle may name (default: tensors and plain containers)."""
    with damaged_archive(f"{where}: not a readable zip archive"):
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise CorruptCheckpointError(f"{where}: expected one '<name>/data.pkl' member, found {len(pkl)}")
        prefix = pkl[0][: -len("/data.pkl")]
        order = f"{prefix}/byteorder"
        if order in z.namelist() and (z.getinfo(order).file_size > 16 or z.read(order) != b"little"):
            raise UnsupportedValueError(f"{where}: tensors were saved big-endian; only little-endian is supported")
        info = z.getinfo(pkl[0])
        if info.compress_type != zipfile.ZIP_STORED:  # torch.save stores; a compressed pickle could be a zip bomb
            raise CorruptCheckpointError(f"{where}: {pkl[0]} is compressed, which torch.save never does")
        if info.file_size > MAX_PICKLE_BYTES:
            raise CorruptCheckpointError(f"{where}: {pkl[0]} is larger than {MAX_PICKLE_BYTES} bytes")
        data = z.read(pkl[0])
    return restricted_load(data, f"{where}:{pkl[0]}", allowed, holds, storages=True), prefix


def read_objects(path: Path, allowed: Mapping[tuple[str, str], Any] = TORCH_SAVE,
                 holds: str = TORCH_SAVE_HOLDS) -> tuple[Any, str]:
    """(the unpickled structure with TensorRefs for tensors, the archive's prefix)."""
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: torch.save file not found")
    with open_file_inside(path) as f:  # the file checked inside its source, still
        with damaged_archive(f"{path}: not a readable zip archive"):
            if not zipfile.is_zipfile(f):  # which raises, for an end record naming several disks
                raise UnsupportedValueError(f"{path}: not a zip-format torch.save file (the legacy format is not "
                                            "supported; load it with torch and save it again)")
            with zipfile.ZipFile(f) as z:
                return read_archive(z, str(path), allowed, holds)


def spec_from_torch_file(path: str | Path, rel: str | None = None) -> ImportSpec:
    """The spec of a torch.save file: every tensor under its flat key (``model.fc.weight``), every
    plain value (None, bool, int, float, str; tuples become lists) under its key in ``values``.
    ``rel``: the file's name in the spec (default: its name; specs are relative to its folder)."""
    path = Path(path)
    obj, prefix = read_objects(path)
    rel = rel or path.name
    tensors: list[TensorSpec] = []
    values: dict[str, Any] = {}
    holds: dict[int, bool] = {}  # by id: the structure was checked to be a finite tree of bounded size

    def holds_tensor(node: Any) -> bool:
        if id(node) not in holds:
            if isinstance(node, dict):
                holds[id(node)] = any(holds_tensor(v) for v in node.values())
            elif isinstance(node, (list, tuple)):
                holds[id(node)] = any(holds_tensor(v) for v in node)
            else:
                holds[id(node)] = isinstance(node, TensorRef)
        return holds[id(node)]

    def walk(node: Any, keys: tuple) -> None:
        key = path_key(keys)
        if isinstance(node, TensorRef):
            tensors.append(_tensor_spec(key, node, rel, prefix))
        elif isinstance(node, dict) and node:
            for k, v in node.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise UnsupportedValueError(f"{path}: key {key!r} holds a dict key {k!r} that is not a str or int")
                walk(v, keys + (k,))
        elif isinstance(node, (list, tuple)) and holds_tensor(node):
            for i, v in enumerate(node):
                walk(v, keys + (i,))
        else:
            if not key:
                raise UnsupportedValueError(f"{path}: holds a single {type(node).__name__}, not a dict of tensors")
            try:
                json.dumps(node, allow_nan=False)
            except (TypeError, ValueError):
                raise UnsupportedValueError(
                    f"{path}: key {key!r} holds a {type(node).__name__} that is not plain JSON data; "
                    "only tensors and JSON values are imported") from None
            values[key] = node

    walk(obj, ())
    return ImportSpec(tensors=tensors, values=values)


def _tensor_spec(key: str, t: TensorRef, rel: str, prefix: str) -> TensorSpec:
    size = dtypes.itemsize(t.storage.dtype)
    strides = None if t.strides == row_major_strides(t.shape) or math.prod(t.shape) == 0 else list(t.strides)
    piece = Piece(file=rel, member=f"{prefix}/data/{t.storage.key}", offset=t.offset * size, shape=list(t.shape),
                  strides=strides, box=Box(offsets=[0] * len(t.shape), shape=list(t.shape)))
    return TensorSpec(key=key, dtype=t.storage.dtype, shape=list(t.shape),
                      pieces=[piece] if ChunkBox.whole(t.shape).numel > 0 else [])
