"""Restricted unpickling of foreign checkpoints: the one place that decides which globals a
pickle may name.

A foreign pickle is read by :class:`RestrictedUnpickler` with one allowlist. Each allowlist maps
``(module, name)`` to what the pickle gets instead of the real global:

- :data:`TORCH_SAVE`: what torch.save writes for tensors and plain containers
  (``torch._utils._rebuild_tensor_v2`` and ``_rebuild_parameter``, the typed storage classes,
  ``collections.OrderedDict``, ``torch.Size``). Each builds a record, never a tensor: a tensor
  becomes a :class:`TensorRef`, the location of its bytes in the archive.
- :data:`DEEPSPEED`: what DeepSpeed's ``*_model_states.pt`` and ``*_optim_states.pt`` files hold
  beyond that: its loss scaler, ``fragment_address`` and ``ZeroStageEnum`` become plain records
  and ints (deepspeed is never imported), and tensors rebuilt through ``torch.Tensor``'s
  ``_rebuild_from_type_v2`` stay TensorRefs.
- :func:`dcp_metadata_allowed`: what a ``torch.distributed.checkpoint`` ``.metadata`` file holds:
  DCP's metadata and save-plan dataclasses (plain records whose construction runs no code of the file's
  choosing), torch dtypes, ``torch.Size``, the layout lookup and pure paths.

Any other global, ``os.system`` or ``builtins.eval`` as much as a user's class, raises
PickleNotAllowedError naming it before it is imported or called.
"""

from __future__ import annotations

import functools
import io
import math
import pathlib
import pickle
import reprlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from resurgo.errors import CorruptCheckpointError, ImportSpecError, PickleNotAllowedError
from resurgo.format import dtypes

# The walk of an unpickled structure (:func:`check_structure`): deeper is refused (a state dict
# nests a dozen levels; the walkers that follow recurse), and so is a structure that expands, as
# a tree, to more nodes than this many per pickle byte plus BASE_NODES.
MAX_DEPTH = 200
EXPANSION = 2
BASE_NODES = 10_000
MAX_NDIM = 64

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


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr, that also never calls the repr of an object of another type (a
    dataclass's repr walks its fields, shared or not)."""

    def repr_instance(self, x: Any, level: int) -> str:
        if x is None or isinstance(x, (bool, float, complex, torch.dtype)):
            return repr(x)
        if isinstance(x, tuple):  # torch.Size, named tuples
            return f"{type(x).__name__}({self.repr_tuple(x, level)})"
        return f"<{type(x).__name__}>"

    def repr_int(self, x: int, level: int) -> str:
        return repr(x) if x.bit_length() < 128 else f"<an int of {x.bit_length()} bits>"


_SHORT = _ShortRepr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 3, 6, 6, 4, 4
_SHORT.maxstring, _SHORT.maxother = 60, 60


def shown(value: Any, limit: int = 100) -> str:
    """A short repr of an untrusted value for a message, at a cost bounded whatever the value holds
    (the full repr of a structure a pickle shares can be exponential in the pickle's size)."""
    try:
        return _SHORT.repr(value)[:limit]
    except (ValueError, RecursionError, TypeError):
        return f"<a {type(value).__name__}>"


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise CorruptCheckpointError("_rebuild_tensor_v2 without a storage reference")
    if not (isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list)) and len(size) <= MAX_NDIM
            and all(_is_int(v) for v in (storage_offset, *size, *stride))):
        raise ImportSpecError(f"a tensor of storage {storage.key!r:.50}: storage offset {shown(storage_offset)}, size "
                              f"{shown(size)} and stride {shown(stride)} must be ints (at most {MAX_NDIM} dimensions)")
    ref = TensorRef(storage, storage_offset, tuple(size), tuple(stride))
    what = (f"a tensor of storage {storage.key!r:.50} (storage offset {shown(ref.offset)}, size {shown(list(ref.shape))}, "
            f"stride {shown(list(ref.strides))})")
    if ref.offset < 0 or any(d < 0 for d in ref.shape) or any(s < 0 for s in ref.strides) or len(ref.strides) != len(ref.shape):
        raise ImportSpecError(f"{what}: offset, sizes and strides must be non-negative, one stride per dimension")
    if math.prod(ref.shape) and ref.offset + 1 + sum((d - 1) * s for d, s in zip(ref.shape, ref.strides)) > storage.numel:
        raise ImportSpecError(f"{what}: reaches past its storage of {storage.numel} elements")
    return ref


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # a Parameter is stored as its tensor


class _StorageType:
    def __init__(self, name: str):
        self.dtype = STORAGE_DTYPES[name]


TORCH_SAVE: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): tuple,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class Record:
    """A stand-in for a foreign class that holds only data: its pickled attributes, nothing run."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        # A plain dict (or copyreg's (dict, slots) pair) of attributes; kept as data, never set on a real class.
        self.state = state


class _NoClass:
    """The class argument of ``_rebuild_from_type_v2``: named, never instantiated."""


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func is not _rebuild_tensor_v2 or new_type is not _NoClass or not isinstance(args, tuple):
        raise CorruptCheckpointError("_rebuild_from_type_v2 that does not rebuild a plain tensor")
    return func(*args)


def _zero_stage(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3:
        raise CorruptCheckpointError(f"ZeroStageEnum({shown(value)}) is not a ZeRO stage 0-3")
    return value


DEEPSPEED: dict[tuple[str, str], Any] = {
    **TORCH_SAVE,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _NoClass,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): Record,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): Record,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): Record,
}


@functools.cache
def dcp_metadata_allowed() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` pickle may name (torch 2.x): its dataclasses, enums, dtypes."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    md = "torch.distributed.checkpoint.metadata"
    names = ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
             "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    # Megatron's torch_dist writer also keeps every rank's save plan in the metadata (all_local_plans).
    plans = ("SavePlan", "WriteItem", "TensorWriteData", "WriteItemType")
    return {
        **{(md, n): getattr(metadata, n) for n in names},
        **{("torch.distributed.checkpoint.planner", n): getattr(planner, n) for n in plans},
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        **{("torch", str(dt).removeprefix("torch.")): dt for dt in dtypes.TORCH_DTYPE_NAMES},
        # StorageMeta.checkpoint_id: kept as a pure path, which touches no file system
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
        ("collections", "OrderedDict"): OrderedDict,
    }


_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}


def _layout(name: Any) -> torch.layout:
    if name not in _LAYOUTS:
        raise CorruptCheckpointError(f"unknown tensor layout {shown(name)}")
    return _LAYOUTS[name]


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves globals only through ``allowed``; ``holds`` says, for the
    refusal message, what the pickle is expected to hold. With ``storages``, torch.save's
    persistent storage ids become StorageRefs; any other persistent id is refused."""

    def __init__(self, data: bytes, where: str, allowed: Mapping[tuple[str, str], Any], holds: str,
                 storages: bool = False):
        super().__init__(io.BytesIO(data))
        self.where, self.allowed, self.holds, self.storages = where, allowed, holds, storages

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise PickleNotAllowedError(
                f"{self.where}: the pickle needs the global {module}.{name}, which {self.holds} never holds; "
                "it was not imported or called")
        return found

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (self.storages and isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise PickleNotAllowedError(f"{self.where}: unknown persistent id {shown(pid, 200)}")
        if not (isinstance(pid[2], str) and len(pid[2]) <= 256 and _is_int(pid[4]) and pid[4] >= 0):
            raise ImportSpecError(f"{self.where}: storage {shown(pid[2])} has {shown(pid[4])} elements, expected a "
                                  "name (a str) and a non-negative int")
        return StorageRef(pid[2], pid[1].dtype, pid[4])


def restricted_load(data: bytes, where: str, allowed: Mapping[tuple[str, str], Any], holds: str,
                    storages: bool = False) -> Any:
    """The object ``data`` pickles, built through ``allowed`` only; PickleNotAllowedError for any
    other global, CorruptCheckpointError naming ``where`` for a pickle that is not valid."""
    try:
        obj = RestrictedUnpickler(data, where, allowed, holds, storages).load()
    except (PickleNotAllowedError, CorruptCheckpointError):
        raise
    except ImportSpecError as e:
        raise ImportSpecError(f"{where}: {e}") from None
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, IndexError, AttributeError, KeyError,
            RuntimeError, OverflowError, MemoryError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not a valid pickle ({type(e).__name__}: {e!s:.500})") from None
    check_structure(obj, where, len(data))
    return obj


def _children(node: Any) -> Iterable[Any]:
    """What a walk of an unpickled structure visits under ``node``: container items, dict keys and
    values, the attributes of a record (DCP's dataclasses, :class:`Record`, :class:`TensorRef`)."""
    if isinstance(node, (str, bytes, bytearray, int, float, complex, type(None), torch.dtype)):
        return ()
    if isinstance(node, dict):
        return (*node.keys(), *node.values())
    if isinstance(node, (list, tuple, set, frozenset)):
        return node
    attrs = getattr(node, "__dict__", None)
    return tuple(attrs.values()) if isinstance(attrs, dict) else ()


def _weight(node: Any) -> int:
    """A leaf's share of the budget: 1, and a long string's length in 16-byte units (a string the
    pickle stores once and refers to many times is that long each time a walk reaches it)."""
    return 1 + len(node) // 16 if isinstance(node, (str, bytes, bytearray)) else 1


def check_structure(obj: Any, where: str, data_bytes: int) -> None:
    """Refuse an unpickled structure that a walk would find deeper than :data:`MAX_DEPTH`,
    circular, or larger, expanded as a tree (a shared object counted each time it is reached),
    than :data:`EXPANSION` nodes per pickle byte plus :data:`BASE_NODES`: ImportSpecError naming
    ``where``. Each distinct object is visited once (by id), so this costs time linear in the
    pickle's size, whatever it expands to; it recurses on nothing."""
    limit = EXPANSION * data_bytes + BASE_NODES
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(obj, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = _children(node)
            size[key] = min(limit + 1, 1 + sum(size[id(k)] for k in kids))
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            on_path.discard(key)
            if depth[key] > MAX_DEPTH:
                raise ImportSpecError(f"{where}: the pickled structure nests deeper than {MAX_DEPTH} levels")
            if size[key] > limit:
                raise ImportSpecError(
                    f"{where}: the pickled structure expands to more than {limit} nodes when walked (objects it "
                    f"refers to many times count each time) from {data_bytes} bytes; at most {EXPANSION} per byte "
                    f"and {BASE_NODES} more are read")
            continue
        if key in size:
            continue
        if key in on_path:
            raise ImportSpecError(f"{where}: the pickled structure contains itself (a cycle), which no checkpoint holds")
        kids = _children(node)
        if not kids:
            size[key], depth[key] = _weight(node), 1
            continue
        if len(on_path) >= MAX_DEPTH:
            raise ImportSpecError(f"{where}: the pickled structure nests deeper than {MAX_DEPTH} levels")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
