"""A spec from a Megatron-Core ``torch_dist`` checkpoint (``dist_checkpointing.save``), without
importing megatron and without executing any of its pickles.

The iteration folder holds ``metadata.json`` (``sharded_backend: "torch_dist"``), ``common.pt``
(a torch.save of the state that is the same on every rank: ``args``, ``iteration``, the scheduler,
...), and a DCP checkpoint (``.metadata`` and ``__<rank>_<n>.distcp``) of the sharded state: each
ShardedTensor under its key, as one global tensor (a stack of layers is one tensor with a leading
layer axis, the tensor-parallel shards sit in their places along the partition axis, a gated fc1
is saved by Megatron already as [gate; up] of all ranks), and each ShardedObject as a bytes item
``<key>/shard_<offsets>_<shape>`` holding a torch.save of a list of its data.

The spec is the DCP importer's (:func:`resurgo.interop.dcp.spec_from_dcp`) for the tensors, which is
the view ``dist_checkpointing.load`` gives one rank loading every tensor whole, plus:

- each ShardedObject read with Megatron's allowlist (:data:`.megatron.MEGATRON`): its tensors
  (RNG states) as tensors at their bytes inside the ``.distcp`` file, its plain values as values,
  under ``<unique key>.<index>...``; parts that are neither (numpy's RNG state) are left out;
- ``common.pt`` the same way: ``args`` as a dict of its plain attributes, ``iteration`` (also as
  ``step``), the scheduler and every other plain value and tensor under its key;
- the distributed optimizer's state, where saved in model space (``optimizer.param_state_sharding_type``
  ``fully_reshardable``: the DP-sharded flat buffers gathered and cut into tensors of each
  parameter's shape, under ``optimizer.state.<param|exp_avg|exp_avg_sq>.<key>``), under its
  parameter: ``optimizer.state.<key>.exp_avg``, ``.exp_avg_sq``, and the fp32 main param under
  ``optimizer.fp32_from_fp16_params.<key>`` (as the legacy import names a mixed-precision run's);
  the param groups (with the step) stay values under ``optimizer.optimizer`` (of a ChainedOptimizer
  of several, ``optimizer.<i>.optimizer``, whose tensors' keys may start ``chained_<i>.``). The bucket-space
  formats (``dp_reshardable``, ``dp_zero_gather_scatter``) keep their flat buffers as saved: which
  element belongs to which parameter follows from the model's bucket layout, which the files lack.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any

from resurgo.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from resurgo.format import dtypes
from resurgo.interop.dcp import spec_from_dcp
from resurgo.interop.megatron_buckets import BUCKET_SPACE, check_main_params, per_parameter
from resurgo.interop.source_files import open_file_inside, resolve_inside
from resurgo.interop.spec import Box, ImportSpec, Piece, TensorSpec, row_major_strides
from resurgo.interop.torch_file import MAX_PICKLE_BYTES, ZIP_ERRORS, member_start, read_archive, read_objects
from resurgo.interop.unpickle import Record, TensorRef

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
MAX_METADATA_BYTES = 1 << 20
# The distributed optimizer's format that saves its state in model space, one tensor per parameter
# and state (megatron.core's DistributedOptimizer.sharded_param_state_fully_reshardable).
MODEL_SPACE = "fully_reshardable"
STATE_PREFIX = "optimizer.state."
STATE_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.")  # a ChainedOptimizer's prefix
STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")


def spec_from_torch_dist(root: Path, folder: Path, it: str, allowed: Any, holds: str,
                         json_part: Any, namespace_of: Any) -> ImportSpec:
    """The spec of the torch_dist checkpoint in ``folder`` (``it``: its path relative to ``root``)."""
    where = folder / METADATA_JSON
    with open_file_inside(resolve_inside(root, f"{it}/{METADATA_JSON}" if it else METADATA_JSON, "metadata.json")) as f:
        raw = f.read(MAX_METADATA_BYTES + 1)
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: not JSON ({e})") from None
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise UnsupportedValueError(f"{where}: sharded_backend {backend!r}; of Megatron's distributed checkpoints only "
                                    "'torch_dist' imports")
    prefix = f"{it}/" if it else ""
    base = spec_from_dcp(folder)
    tensors = [_rebased(t, prefix) for t in base.tensors]
    values: dict[str, Any] = dict(base.values)
    for key, obj in base.objects.items():
        rel = prefix + obj.file
        if obj.length > MAX_PICKLE_BYTES:
            raise CorruptCheckpointError(f"{folder / obj.file}: item {key!r} is larger than {MAX_PICKLE_BYTES} bytes")
        with open_file_inside(resolve_inside(root, rel, "a .distcp file")) as f:
            f.seek(obj.offset)
            data = f.read(obj.length)
        name = f"{folder / obj.file}[{obj.offset}:]"
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                value, arch = read_archive(z, name, allowed, holds)
                starts = _starts(z, io.BytesIO(data), value, arch, name)
        except ZIP_ERRORS as e:
            raise CorruptCheckpointError(f"{name}: item {key!r} is not a readable torch.save archive ({e})") from None
        _walk(value, key, lambda k, ref: tensors.append(whole_tensor(k, ref, rel, obj.offset + starts[ref.storage.key])),
              values, json_part)
    common_rel = f"{prefix}{COMMON}"
    try:
        path = resolve_inside(root, common_rel, "common.pt")
    except CheckpointNotFoundError:
        raise CorruptCheckpointError(f"{folder / COMMON}: missing (torch_dist checkpoints keep the state common to "
                                     "every rank in it)") from None
    common, arch = read_objects(path, allowed, holds)
    if not isinstance(common, dict):
        raise CorruptCheckpointError(f"{path}: holds a {type(common).__name__}, not the dict Megatron saves")
    for key, node in common.items():
        if not isinstance(key, str):
            continue
        if key == "args" and isinstance(node, Record):
            values["args"] = json_part(namespace_of(node))
            continue
        _walk(node, key, lambda k, ref: tensors.append(
            whole_tensor(k, ref, common_rel, None, member=f"{arch}/data/{ref.storage.key}")), values, json_part)
    if isinstance(values.get("iteration"), int):
        values["step"] = values["iteration"]
    optimizer = common.get("optimizer")
    if isinstance(optimizer, dict) and optimizer and all(isinstance(k, int) for k in optimizer):
        # a ChainedOptimizer of several (dense and expert parameters): one state dict per optimizer,
        # its tensors' keys prefixed chained_<i>. (or not, where Megatron was told to avoid it)
        values["optimizer"] = {str(i): json_part(o) for i, o in sorted(optimizer.items())}
        chained = list(optimizer.values())
    else:
        chained = [optimizer]
    kinds = {o.get("param_state_sharding_type") if isinstance(o, dict) else None for o in chained}
    if kinds == {MODEL_SPACE}:
        tensors = _per_parameter(tensors, folder)
        mains = {str(t.path[-1]): t for t in tensors if t.path and t.path[:2] == ["optimizer", "fp32_from_fp16_params"]}
        check_main_params({t.key: t for t in tensors}, mains, root, str(folder))
    elif kinds and kinds <= set(BUCKET_SPACE):
        tensors = per_parameter(tensors, root, str(folder))
    return ImportSpec(tensors=tensors, values=values)


def _per_parameter(tensors: list[TensorSpec], folder: Path) -> list[TensorSpec]:
    """The distributed optimizer's model-space state (``optimizer.state.<kind>.<key>``, each of the
    shape of the model tensor ``<key>``) under its parameter: ``optimizer.state.<key>.exp_avg``,
    ``.exp_avg_sq`` and the fp32 main param ``optimizer.fp32_from_fp16_params.<key>``."""
    model = {t.key: t for t in tensors if not STATE_KEY.match(t.key)}
    out: list[TensorSpec] = []
    found: dict[str, set[str]] = {}
    for t in tensors:
        if not (m := STATE_KEY.match(t.key)):
            out.append(t)
            continue
        kind, _, key = t.key[m.end():].partition(".")
        param = model.get(key)
        if kind not in STATE_KINDS or param is None:
            raise CorruptCheckpointError(f"{folder / '.metadata'}: {t.key!r} is not the state of a model tensor "
                                         f"(expected {STATE_PREFIX}<{'|'.join(STATE_KINDS)}>.<a model tensor's key>)")
        if t.shape != param.shape:
            raise CorruptCheckpointError(f"{folder / '.metadata'}: {t.key!r} has the shape {t.shape}, its parameter "
                                         f"{key!r} {param.shape}: the distributed optimizer's model-space state "
                                         "takes each parameter's shape")
        path = ["optimizer", "fp32_from_fp16_params", key] if kind == "param" else ["optimizer", "state", key, kind]
        out.append(t.model_copy(update={"key": ".".join(path), "path": path}))
        found.setdefault(key, set()).add(kind)
    for key, kinds in found.items():
        if kinds != set(STATE_KINDS):
            raise CorruptCheckpointError(f"{folder / '.metadata'}: the distributed optimizer's state of {key!r} lacks "
                                         f"{sorted(set(STATE_KINDS) - kinds)}")
    return out


def _rebased(t: TensorSpec, prefix: str) -> TensorSpec:
    if not prefix:
        return t
    return t.model_copy(update={"pieces": [p.model_copy(update={
        "file": prefix + p.file, "replicas": [r.model_copy(update={"file": prefix + r.file}) for r in p.replicas]})
        for p in t.pieces]})


def _starts(z: zipfile.ZipFile, fp: io.BytesIO, value: Any, arch: str, name: str) -> dict[str, int]:
    """Per storage key of the archive: the byte offset of its member's data in the archive."""
    out: dict[str, int] = {}
    for ref in _refs(value):
        if ref.storage.key not in out:
            try:
                info = z.getinfo(f"{arch}/data/{ref.storage.key}")
            except KeyError:
                raise CorruptCheckpointError(f"{name}: the archive lacks the member of storage "
                                             f"{ref.storage.key!r}") from None
            start = member_start(fp, info, name)
            if start + info.file_size > len(fp.getvalue()):
                raise CorruptCheckpointError(f"{name}: storage {ref.storage.key!r} runs past the item's bytes")
            out[ref.storage.key] = start
    return out


def _refs(node: Any) -> list[TensorRef]:
    if isinstance(node, TensorRef):
        return [node]
    if isinstance(node, dict):
        return [r for v in node.values() for r in _refs(v)]
    if isinstance(node, (list, tuple)):
        return [r for v in node for r in _refs(v)]
    return []


def _walk(node: Any, key: str, tensor: Any, values: dict[str, Any], json_part: Any) -> None:
    """Tensors of ``node`` to ``tensor(key, ref)``, its plain parts to ``values``; the rest (records) left out."""
    if isinstance(node, TensorRef):
        tensor(key, node)
    elif isinstance(node, dict) and _refs(node):
        for k, v in node.items():
            if isinstance(k, (str, int)) and not isinstance(k, bool):
                _walk(v, f"{key}.{k}", tensor, values, json_part)
    elif isinstance(node, (list, tuple)) and _refs(node):
        for i, v in enumerate(node):
            _walk(v, f"{key}.{i}", tensor, values, json_part)
    else:
        plain = json_part(node)
        if plain is not None or node is None:
            values[key] = plain


def whole_tensor(key: str, ref: TensorRef, rel: str, base: int | None, member: str | None = None) -> TensorSpec:
    """The whole of ``ref``: in ``rel`` at ``base`` plus the element offset (``base`` None: in ``member``)."""
    size = dtypes.itemsize(ref.storage.dtype)
    shape = list(ref.shape)
    strides = None if tuple(ref.strides) == row_major_strides(shape) else list(ref.strides)
    pieces = [Piece(file=rel, member=member, offset=(base or 0) + ref.offset * size, shape=shape, strides=strides,
                    box=Box(offsets=[0] * len(shape), shape=shape))] if all(shape) else []
    return TensorSpec(key=key, dtype=ref.storage.dtype, shape=shape, pieces=pieces)
