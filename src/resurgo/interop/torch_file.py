"""A spec from a torch.save file (zip format), without executing any of its pickle.

The file's ``data.pkl`` is read by a restricted unpickler that admits only what torch.save
writes for tensors and plain containers (:data:`ALLOWED`): ``torch._utils._rebuild_tensor_v2``
and ``_rebuild_parameter``, the typed storage classes, ``collections.OrderedDict`` and
``torch.Size``. Each of them builds a record, never a tensor: a tensor becomes the location of
its bytes (archive member ``<prefix>/data/<storage>``, byte offset, shape, element strides,
dtype). Any other global, ``os.system`` or ``builtins.eval`` as much as a user's class, raises
PickleNotAllowedError before it is called.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from resurgo.errors import CheckpointNotFoundError, CorruptCheckpointError, PickleNotAllowedError, UnsupportedValueError
from resurgo.format import dtypes
from resurgo.format.tree import path_key
from resurgo.interop.spec import Box, ImportSpec, Piece, TensorSpec, row_major_strides
from resurgo.layout.box import ChunkBox

MAX_PICKLE_BYTES = 1 << 30

# Storage class names torch.save writes (``torch.FloatStorage``...) -> the dtype of their elements.
STORAGE_DTYPES: dict[str, str] = {
    name: dtypes.TORCH_DTYPE_NAMES[dt] for dt, name in torch.storage._dtype_to_storage_type_map().items()
    if dt in dtypes.TORCH_DTYPE_NAMES}


@dataclass(frozen=True)
class StorageRef:
    key: str  # the storage's member name under <prefix>/data/
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    storage: StorageRef
    offset: int  # elements
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise CorruptCheckpointError("_rebuild_tensor_v2 without a storage reference")
    return TensorRef(storage, int(storage_offset), tuple(int(d) for d in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # a Parameter is stored as its tensor


class _StorageType:
    def __init__(self, name: str):
        self.dtype = STORAGE_DTYPES[name]


ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): tuple,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise PickleNotAllowedError(
                f"{self.where}: the pickle needs the global {module}.{name}, which a torch.save of tensors and "
                "plain values never holds; it was not imported or called (allow_pickle is not supported by import)")
        return found

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise PickleNotAllowedError(f"{self.where}: unknown persistent id {pid!r:.200}")
        return StorageRef(str(pid[2]), pid[1].dtype, int(pid[4]))


def read_objects(path: Path) -> tuple[Any, str]:
    """(the unpickled structure with TensorRefs for tensors, the archive's prefix)."""
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: torch.save file not found")
    if not zipfile.is_zipfile(path):
        raise UnsupportedValueError(f"{path}: not a zip-format torch.save file (the legacy format is not supported; "
                                    "load it with torch and save it again)")
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise CorruptCheckpointError(f"{path}: expected one '<name>/data.pkl' member, found {len(pkl)}")
            prefix = pkl[0][: -len("/data.pkl")]
            if f"{prefix}/byteorder" in z.namelist() and z.read(f"{prefix}/byteorder") != b"little":
                raise UnsupportedValueError(f"{path}: tensors were saved big-endian; only little-endian is supported")
            if z.getinfo(pkl[0]).file_size > MAX_PICKLE_BYTES:
                raise CorruptCheckpointError(f"{path}: {pkl[0]} is larger than {MAX_PICKLE_BYTES} bytes")
            data = z.read(pkl[0])
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{path}: not a readable zip archive ({e}); was it truncated?") from None
    try:
        return _Restricted(data, f"{path}:{pkl[0]}").load(), prefix
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, IndexError, AttributeError) as e:
        if isinstance(e, (PickleNotAllowedError, CorruptCheckpointError)):
            raise
        raise CorruptCheckpointError(f"{path}:{pkl[0]}: not a valid pickle ({type(e).__name__}: {e})") from None


def spec_from_torch_file(path: str | Path, rel: str | None = None) -> ImportSpec:
    """The spec of a torch.save file: every tensor under its flat key (``model.fc.weight``), every
    plain value (None, bool, int, float, str; tuples become lists) under its key in ``values``.
    ``rel``: the file's name in the spec (default: its name; specs are relative to its folder)."""
    path = Path(path)
    obj, prefix = read_objects(path)
    rel = rel or path.name
    tensors: list[TensorSpec] = []
    values: dict[str, Any] = {}

    def walk(node: Any, keys: tuple) -> None:
        key = path_key(keys)
        if isinstance(node, TensorRef):
            tensors.append(_tensor_spec(key, node, rel, prefix))
        elif isinstance(node, dict) and node:
            for k, v in node.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise UnsupportedValueError(f"{path}: key {key!r} holds a dict key {k!r} that is not a str or int")
                walk(v, keys + (k,))
        elif isinstance(node, (list, tuple)) and any(_holds_tensor(v) for v in node):
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


def _holds_tensor(node: Any) -> bool:
    if isinstance(node, TensorRef):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(v) for v in node)
    return False


def _tensor_spec(key: str, t: TensorRef, rel: str, prefix: str) -> TensorSpec:
    size = dtypes.itemsize(t.storage.dtype)
    strides = None if t.strides == row_major_strides(t.shape) or math.prod(t.shape) == 0 else list(t.strides)
    piece = Piece(file=rel, member=f"{prefix}/data/{t.storage.key}", offset=t.offset * size, shape=list(t.shape),
                  strides=strides, box=Box(offsets=[0] * len(t.shape), shape=list(t.shape)))
    return TensorSpec(key=key, dtype=t.storage.dtype, shape=list(t.shape),
                      pieces=[piece] if ChunkBox.whole(t.shape).numel > 0 else [])
