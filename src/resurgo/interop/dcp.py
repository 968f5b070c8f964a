"""A spec from a ``torch.distributed.checkpoint`` (DCP) directory: ``.metadata`` and the
``__<rank>_<n>.distcp`` files that ``dcp.save`` writes with its FileSystemWriter (torch 2.x).

``.metadata`` is a pickle, read by the restricted unpickler of :mod:`.unpickle` with the DCP
allowlist. It lists every global tensor (dtype, global shape, chunks: offsets and sizes in it)
and every non-tensor item, and maps each chunk or item to a byte range of a ``.distcp`` file.
A tensor chunk's range holds a torch.save archive of the chunk: its ``data.pkl`` is read with the
torch.save allowlist, and the piece points straight at the chunk's bytes in the stored storage
member, with the chunk's offsets and sizes as its destination box. A non-tensor item's range
holds a torch.save archive of the object: a plain value (None, bool, int, float, str, lists and
dicts of them) becomes a spec value; anything else becomes a pickled object, imported only with
``allow_pickle``. Keys are DCP's flat names (``model.layers.0.weight``, ``optim.state.0.exp_avg``).
"""

from __future__ import annotations

import io
import json
import math
import os
import zipfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ImportSpecError,
    NotACheckpointError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from resurgo.format import dtypes
from resurgo.interop.source_files import check_relative, open_file_inside, resolve_inside
from resurgo.interop.spec import Box, ImportSpec, Piece, PickledObject, TensorSpec, row_major_strides
from resurgo.interop.torch_file import MAX_PICKLE_BYTES, ZipSlice, damaged_archive, member_start, read_archive
from resurgo.interop.unpickle import TensorRef, dcp_metadata_allowed, restricted_load, shown

METADATA = ".metadata"
MAX_NDIM = 64
ZIP_MAGIC = b"PK\x03\x04"


def read_metadata(root: Path) -> Any:
    """DCP's Metadata object of the checkpoint at ``root``, built without running its code."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: not found")
    path = root / METADATA
    if not path.is_file():
        raise NotACheckpointError(f"{root}: not a DCP checkpoint (no {METADATA} file; dcp.save writes it last)")
    with open_file_inside(resolve_inside(root, METADATA, "the DCP metadata")) as f:
        data = f.read()
    md = restricted_load(data, str(path), dcp_metadata_allowed(), "a torch.distributed.checkpoint .metadata")
    if not (isinstance(md, Metadata) and isinstance(getattr(md, "state_dict_metadata", None), dict)
            and isinstance(getattr(md, "storage_data", None), dict)):
        raise CorruptCheckpointError(f"{path}: not DCP metadata written by a filesystem writer "
                                     "(expected a Metadata with state_dict_metadata and storage_data)")
    check_metadata(md, str(path))
    return md


def _sizes(value: Any, what: str) -> list[int]:
    if not (isinstance(value, (list, tuple)) and len(value) <= MAX_NDIM
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)):
        raise ImportSpecError(f"{what} is {shown(value)}, expected a list of at most {MAX_NDIM} non-negative ints")
    return list(value)


def _count(value: Any, what: str) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ImportSpecError(f"{what} is {shown(value)}, expected a non-negative int")
    return value


def check_metadata(md: Any, where: str) -> None:
    """Every field the import reads, of the type DCP writes (ImportSpecError naming ``where`` and the
    entry otherwise): the pickle builds DCP's dataclasses with whatever it holds in their fields."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    for fqn, item in md.state_dict_metadata.items():
        what = f"{where}: item {shown(fqn, 200)}"
        if not isinstance(fqn, str) or not fqn:
            raise ImportSpecError(f"{what}: its name is not a non-empty str")
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise ImportSpecError(f"{what}: is a {type(item).__name__}, neither a tensor nor a bytes item")
        if not isinstance(getattr(getattr(item, "properties", None), "dtype", None), torch.dtype):
            raise ImportSpecError(f"{what}: properties.dtype is not a torch dtype")
        ndim = len(_sizes(getattr(item, "size", None), f"{what}: size"))
        chunks = getattr(item, "chunks", None)
        if not isinstance(chunks, list):
            raise ImportSpecError(f"{what}: chunks is {shown(chunks)}, expected a list")
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, ChunkStorageMetadata):
                raise ImportSpecError(f"{what}: chunk {i} is a {type(chunk).__name__}, not a ChunkStorageMetadata")
            offsets = _sizes(getattr(chunk, "offsets", None), f"{what}: chunk {i} offsets")
            sizes = _sizes(getattr(chunk, "sizes", None), f"{what}: chunk {i} sizes")
            if len(offsets) != ndim or len(sizes) != ndim:
                raise ImportSpecError(f"{what}: chunk {i} has offsets {offsets} and sizes {sizes} for a tensor of "
                                      f"{ndim} dimensions")
    for index, info in md.storage_data.items():
        fqn = getattr(index, "fqn", None)
        what = f"{where}: storage entry of {shown(fqn, 200)}"
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str):
            raise ImportSpecError(f"{what}: its key is not a MetadataIndex with a str fqn")
        if getattr(index, "offset", None) is not None:
            _sizes(index.offset, f"{what}: offset")
        if not isinstance(info, _StorageInfo):
            raise ImportSpecError(f"{what}: is a {type(info).__name__}, not a _StorageInfo")
        check_relative(getattr(info, "relative_path", None), f"{what}: relative_path")
        _count(getattr(info, "offset", None), f"{what}: offset")
        _count(getattr(info, "length", None), f"{what}: length")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise ImportSpecError(f"{what}: transform_descriptors is {shown(descriptors)}, expected a list of str")


class _DistcpFiles:
    """The .distcp files the metadata names: checked to exist once each, opened once each."""

    def __init__(self, root: Path):
        self.root = root
        self._open: dict[str, Any] = {}

    def slice(self, info: Any, what: str) -> tuple[Path, ZipSlice, bytes]:
        """(the file, a view of the item's byte range, its first 4 bytes)."""
        rel = info.relative_path
        path = self.root / rel
        if rel not in self._open:
            try:
                real = resolve_inside(self.root, rel, f"{self.root / METADATA}: the file of {what}")
            except CheckpointNotFoundError:
                raise CorruptCheckpointError(
                    f"{path}: missing; {self.root / METADATA} places {what} in it (was one rank's file not copied?)"
                ) from None
            self._open[rel] = open_file_inside(real)  # closed by close()
        f = self._open[rel]
        size = os.fstat(f.fileno()).st_size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise CorruptCheckpointError(
                f"{path}: {what} needs bytes [{info.offset}, {info.offset + info.length}) but the file holds {size} "
                "bytes; it is truncated")
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedValueError(f"{path}: {what} was written through storage extensions "
                                        f"{list(info.transform_descriptors)} (compression?); only plain items import")
        view = ZipSlice(f, info.offset, info.length)
        head = view.read(4)
        view.seek(0)
        return path, view, head

    def close(self) -> None:
        for f in self._open.values():
            f.close()


def spec_from_dcp(directory: str | Path) -> ImportSpec:
    """The spec of the DCP checkpoint in ``directory``: every tensor under its DCP name, pieced
    from its chunks; every non-tensor item as a value, or as a pickled object when it is not plain."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    root = Path(directory)
    md = read_metadata(root)
    where = str(root / METADATA)
    storage = {(idx.fqn, None if idx.offset is None else tuple(idx.offset)): info
               for idx, info in md.storage_data.items()}
    files = _DistcpFiles(root)
    tensors: list[TensorSpec] = []
    values: dict[str, Any] = {}
    objects: dict[str, PickledObject] = {}
    try:
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                tensors.append(_tensor(fqn, item, storage, files, where))
            elif isinstance(item, BytesStorageMetadata):
                info = _info(storage, fqn, None, where)
                value, plain = _bytes_item(fqn, info, files)
                if plain:
                    values[fqn] = value
                else:
                    objects[fqn] = PickledObject(file=info.relative_path, offset=info.offset, length=info.length)
            else:
                raise CorruptCheckpointError(f"{where}: item {fqn!r} is a {type(item).__name__}, neither a tensor "
                                             "nor a bytes item")
    finally:
        files.close()
    return ImportSpec(tensors=tensors, values=values, objects=objects)


def _info(storage: dict, fqn: str, offset: tuple[int, ...] | None, where: str) -> Any:
    info = storage.get((fqn, offset))
    if info is None:
        at = "" if offset is None else f" chunk at offsets {list(offset)}"
        raise CorruptCheckpointError(f"{where}: {fqn!r}{at} has no storage entry (the metadata is incomplete)")
    return info


def _tensor(fqn: str, item: Any, storage: dict, files: _DistcpFiles, where: str) -> TensorSpec:
    dtype = dtypes.TORCH_DTYPE_NAMES.get(item.properties.dtype)
    if dtype is None:
        raise UnsupportedValueError(f"{where}: tensor {fqn!r} has dtype {item.properties.dtype}, which resurgo "
                                    "does not store")
    pieces = []
    for chunk in item.chunks:
        offsets, sizes = [int(o) for o in chunk.offsets], [int(s) for s in chunk.sizes]
        if math.prod(sizes) == 0:
            continue
        info = _info(storage, fqn, tuple(offsets), where)
        what = f"tensor {fqn!r} chunk at offsets {offsets}"
        path, view, head = files.slice(info, what)
        if head == ZIP_MAGIC:
            offset, strides = _archived_chunk(path, view, info.offset, dtype, sizes, what)
        elif info.length == math.prod(sizes) * dtypes.itemsize(dtype):  # written raw, not with torch.save
            offset, strides = info.offset, None
        else:
            raise CorruptCheckpointError(f"{path}: {what} at byte {info.offset} is neither a torch.save archive nor "
                                         f"{math.prod(sizes)} raw {dtype} elements")
        pieces.append(Piece(file=info.relative_path, offset=offset, shape=sizes, strides=strides,
                            box=Box(offsets=offsets, shape=sizes)))
    return TensorSpec(key=fqn, dtype=dtype, shape=[int(d) for d in item.size], pieces=pieces)


def _damaged_item(path: Path, what: str, at: int) -> AbstractContextManager[None]:
    """Reading the torch.save archive of ``what`` at byte ``at`` of ``path``: what zipfile raises
    on it says the file is damaged."""
    return damaged_archive(f"{path}: {what} at byte {at} is not a readable archive", "the file is damaged or truncated")


def _archived_chunk(path: Path, view: ZipSlice, base: int, dtype: str, sizes: list[int],
                    what: str) -> tuple[int, list[int] | None]:
    """(the byte offset in the .distcp file of the chunk's first element, its strides or None)."""
    name = f"{path}[{base}:]"
    try:
        with _damaged_item(path, what, base), zipfile.ZipFile(view) as z:
            ref, prefix = read_archive(z, name)
            if not isinstance(ref, TensorRef):
                raise CorruptCheckpointError(f"{name}: {what} holds a {type(ref).__name__}, not a tensor")
            info = z.getinfo(f"{prefix}/data/{ref.storage.key}")
    except KeyError:
        raise CorruptCheckpointError(f"{name}: {what}: the archive lacks its storage member") from None
    if ref.storage.dtype != dtype or list(ref.shape) != sizes:
        raise CorruptCheckpointError(f"{name}: {what} holds a {ref.storage.dtype} tensor of shape {list(ref.shape)}; "
                                     f"the metadata says {dtype} {sizes}")
    start = member_start(view, info, name)
    if start + info.file_size > view.size:
        raise ImportSpecError(f"{name}: {what}: its storage member, {info.file_size} bytes from byte {start}, runs past "
                              f"the {view.size} bytes the metadata gives the item")
    itemsize = dtypes.itemsize(dtype)
    span = 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.strides))
    if (ref.offset + span) * itemsize > info.file_size:
        raise CorruptCheckpointError(f"{name}: {what} reaches past its storage of {info.file_size} bytes")
    strides = None if ref.strides == row_major_strides(ref.shape) else list(ref.strides)
    return base + start + ref.offset * itemsize, strides


def _bytes_item(fqn: str, info: Any, files: _DistcpFiles) -> tuple[Any, bool]:
    """(the item's plain value, True), or (None, False) when only full unpickling can build it."""
    what = f"item {fqn!r}"
    path, view, head = files.slice(info, what)
    if head != ZIP_MAGIC:
        raise UnsupportedValueError(f"{path}: {what} at byte {info.offset} is raw bytes (an io.BytesIO in the "
                                    "saved state), which import does not carry")
    if info.length > MAX_PICKLE_BYTES:
        raise CorruptCheckpointError(f"{path}: {what} is larger than {MAX_PICKLE_BYTES} bytes")
    name = f"{path}[{info.offset}:]"
    try:
        with _damaged_item(path, what, info.offset), zipfile.ZipFile(io.BytesIO(view.read())) as z:
            value, _ = read_archive(z, name)
    except PickleNotAllowedError:
        return None, False
    if _is_json_data(value):
        return value, True
    return None, False


def _is_json_data(value: Any) -> bool:
    """Whether the value is JSON data (tuples count: they become lists) with str keys."""
    if isinstance(value, TensorRef):
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_data(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_is_json_data(v) for v in value)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
