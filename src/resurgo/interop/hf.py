"""A spec from a Hugging Face model directory: ``model.safetensors``, shards listed by
``model.safetensors.index.json``, ``pytorch_model.bin`` (a torch.save file), or its shards listed
by ``pytorch_model.bin.index.json``.

Only the safetensors headers are read (:func:`resurgo.format.safetensors_file.read_header`): every
tensor is one piece, at its byte offset in its file, covering the whole tensor. ``.bin`` files
are read as torch.save files (:func:`resurgo.interop.torch_file.spec_from_torch_file`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ImportSpecError,
    NotACheckpointError,
    UnsupportedValueError,
)
from resurgo.format import dtypes
from resurgo.format.safetensors_file import read_header
from resurgo.interop.source_files import open_file_inside, resolve_inside
from resurgo.interop.spec import Box, ImportSpec, Piece, TensorSpec
from resurgo.interop.torch_file import spec_from_torch_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
_DTYPE_OF_CODE = {code: name for name, code in dtypes.SAFETENSORS_CODES.items()}


def spec_from_hf(directory: str | Path) -> ImportSpec:
    root = Path(directory)
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: not found")
    if (root / INDEX).is_file():
        return _sharded(root, INDEX, lambda f: ImportSpec(tensors=_safetensors_tensors(root, f)))
    if (root / SINGLE).is_file():
        return ImportSpec(tensors=_safetensors_tensors(root, SINGLE))
    if (root / TORCH_BIN_INDEX).is_file():
        return _sharded(root, TORCH_BIN_INDEX, lambda f: spec_from_torch_file(_shard_path(root, f), rel=f))
    if (root / TORCH_BIN).is_file():
        return spec_from_torch_file(_shard_path(root, TORCH_BIN), rel=TORCH_BIN)
    raise NotACheckpointError(f"{root}: not a Hugging Face model directory (expected {SINGLE}, {INDEX}, {TORCH_BIN} "
                              f"or {TORCH_BIN_INDEX})")


def _sharded(root: Path, index: str, spec_of_shard: Callable[[str], ImportSpec]) -> ImportSpec:
    """One spec of the shards an index names; the index and the shards must list the same tensors."""
    index_path = _shard_path(root, index)
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{root / index}: not a valid index ({type(e).__name__}: {e})") from None
    for f in files:
        if not isinstance(f, str) or Path(f).is_absolute() or ".." in Path(f).parts:
            raise ImportSpecError(f"{root / index}: names the shard {f!r}, which is not a file name inside {root}")
    shards = [spec_of_shard(f) for f in files]
    tensors = [t for s in shards for t in s.tensors]
    listed, found = set(weight_map), {t.key for t in tensors}
    if listed != found or len(found) != len(tensors):
        raise CorruptCheckpointError(f"{root / index}: lists tensors its shards do not hold, or the reverse, or a "
                                     f"tensor is in two shards: {sorted(listed ^ found)[:10]}")
    return ImportSpec(tensors=tensors, values={k: v for s in shards for k, v in s.values.items()})


def _shard_path(root: Path, rel: str) -> Path:
    """The real path of the file ``rel`` of the model directory (inside it, or in its cache's blobs)."""
    try:
        return resolve_inside(root, rel, "a model file")
    except CheckpointNotFoundError:
        raise NotACheckpointError(f"{root / rel}: shard named by the index not found") from None


def _safetensors_tensors(root: Path, rel: str) -> list[TensorSpec]:
    path = root / rel
    real = _shard_path(root, rel)
    try:
        with open_file_inside(real) as f:
            header = read_header(f.read(8), f.read)
    except FileNotFoundError:
        raise NotACheckpointError(f"{path}: shard named by the index not found") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    tensors = []
    for name, (start, stop) in sorted(header.entries.items(), key=lambda e: e[1]):
        if not 0 <= start <= stop:  # past the file's end: the executor's check names the truncation
            raise ImportSpecError(f"{path}: tensor {name!r:.200} has data_offsets [{start}, {stop}]; expected "
                                  "0 <= begin <= end, counted from the end of the header")
        entry = header.raw[name]
        code, shape = entry.get("dtype"), entry.get("shape")
        if not isinstance(code, str) or code not in _DTYPE_OF_CODE:
            raise UnsupportedValueError(f"{path}: tensor {name!r} has dtype {code!r}, which resurgo does not know")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CorruptCheckpointError(f"{path}: tensor {name!r} has no valid shape")
        dtype = _DTYPE_OF_CODE[code]
        numel = 1
        for d in shape:
            numel *= d
        if stop - start != numel * dtypes.itemsize(dtype):
            raise CorruptCheckpointError(f"{path}: tensor {name!r} spans {stop - start} bytes, its shape {shape} "
                                         f"and dtype {dtype} need {numel * dtypes.itemsize(dtype)}")
        pieces = [Piece(file=rel, offset=header.data_start + start, shape=shape,
                        box=Box(offsets=[0] * len(shape), shape=shape))] if numel else []
        tensors.append(TensorSpec(key=name, dtype=dtype, shape=shape, pieces=pieces))
    return tensors
