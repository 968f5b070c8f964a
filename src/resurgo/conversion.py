"""Conversion behind ``resurgo.convert``: a checkpoint as one safetensors file, Hugging Face sharded safetensors, a
torch.save file, or a PyTorch Distributed Checkpoint (DCP) directory.

The source is a checkpoint directory or URL (``s3://...``, with ``storage_options``); the output is
local. Every tensor is read through the load pipeline (so chunks are assembled and every checksum is
verified; from an object store, in ranged requests) and the output appears atomically: it is written under a temporary sibling name and
renamed at the end. The safetensors targets stream: the header is written first (sizes are known
from the manifest), then the tensors' bytes, a batch within ``buffer_bytes`` at a time
(:mod:`resurgo.pipeline.stream_read`). A torch.save file needs every tensor as an object, so
``to="torch"`` holds the whole state in memory, and so does ``to="dcp"`` (DCP's writer takes the
state dict as objects, and one directory is written by one ``dcp.save``).

What each target keeps (docs/convert.md):
- safetensors: every tensor under its flat key; in ``__metadata__``, the non-tensor values that are JSON scalars
  (None, bool, int, str, finite float) as one JSON object under ``resurgo.values``, the step and
  the user metadata; other values (bytes, complex, NaN, numpy scalars, pickles, ...) are dropped
  and listed in the report. Dtypes safetensors lacks are stored as resurgo stores them in its
  own data files: raw bytes (``U8``, shape ``[nbytes]``), with the real dtype and shape under
  ``resurgo.raw_dtypes``.
- hf: tensors only, in shards named and indexed as ``transformers`` writes them.
- torch: the nested structure ``resurgo.load_dict`` returns, in types ``torch.load`` accepts with
  its default ``weights_only=True``: a value saved per rank becomes a list indexed by rank, a numpy
  array a torch tensor of the same dtype, shape and bytes, a numpy scalar a Python number
  (:func:`weights_only_loadable`). Pickled values (``allow_pickle=True``) stay objects.
- dcp: that structure flattened as DCP flattens a nested state dict (dict keys joined by ".", lists
  holding tensors or dicts indexed, other values whole), written by DCP's own ``dcp.save`` and
  ``FileSystemWriter``: tensors whole (one chunk each), other values as DCP byte items. So
  ``dcp.load`` fills a nested target (``{"model": model.state_dict()}``) or a flat one, on any
  world size and in any sharding.
- peft: the adapters a model saved adapter-only holds (:mod:`resurgo.format.adapter`), as
  ``PeftModel.save_pretrained`` writes them: ``adapter_model.safetensors`` (with the base model's
  digest in its metadata) and ``adapter_config.json``, the adapter ``default`` at the top and each
  other in a folder of its name. ``only``: the key of the model saved adapter-only (``model.``),
  needed only when the checkpoint holds several.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import re
import shutil
import struct
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resurgo.api import DEFAULT_IO_THREADS, load_dict
from resurgo.errors import (
    CheckpointExistsError,
    KeyMismatchError,
    MemoryBudgetError,
    StorageError,
    UnsupportedValueError,
    storage_error,
)
from resurgo.format import adapter as peft_format
from resurgo.format import dtypes, values
from resurgo.format.expansion import MAX_EXPANSION, distinct_bytes, expansion_error
from resurgo.format.manifest import Manifest
from resurgo.format.safetensors_file import METADATA as SAFETENSORS_PRODUCER, HeaderEntry, build_header, read_header
from resurgo.format.tree import iter_values
from resurgo.pipeline import data_files
from resurgo.pipeline.manifest_read import read_manifest_of
from resurgo.pipeline.stream_read import TensorByteStream, tensor_nbytes
from resurgo.plan.convert_plan import HF_INDEX_FILE, is_hf_output_file, plan_shards, shard_file_names
from resurgo.renamed import renamed_keywords
from resurgo.reports import ConvertReport
from resurgo.state.per_rank import PerRank
from resurgo.storage.base import Checkpoint
from resurgo.storage.atomic_output import AtomicOutput
from resurgo.storage.open import is_url, local_path, open_checkpoint
from resurgo.storage.ownership import DIR, FILE

TARGETS = ("safetensors", "hf", "torch", "dcp", "peft")
DEFAULT_MEMORY_BUDGET = 1 << 30
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # "5GB", the default of transformers and huggingface_hub
SAFETENSORS_RESERVED = "__metadata__"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string like ``"5GB"`` (10^9, as Hugging Face counts) or ``"2GiB"`` (2^30)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of bytes or a string like '5GB', not {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.fullmatch(str(value))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}: {value!r} is not a size (examples: 1048576, '500MB', '5GB', '2GiB')")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return n


@renamed_keywords("resurgo.convert", memory_budget="buffer_bytes")
def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, buffer_bytes: int | str | None = None,
            max_shard_bytes: int | str | None = None, only: str | None = None, overwrite: bool = False,
            allow_pickle: bool = False, io_threads: int = DEFAULT_IO_THREADS,
            progress: Callable[[int], None] | None = None, storage_options: dict | None = None,
            allow_expansion: bool = False) -> ConvertReport:
    """Convert the checkpoint at ``src`` (a directory or a URL such as ``s3://bucket/run/step_100``)
    into the local path ``dst``; returns a :class:`ConvertReport`.

    ``to``: ``"safetensors"`` (one file), ``"hf"`` (a directory of ``model-0000i-of-0000N.safetensors``
    shards of at most ``max_shard_bytes`` tensor bytes each, default 5GB, plus
    ``model.safetensors.index.json``; a single shard is ``model.safetensors``) or ``"torch"`` (one
    torch.save file) or ``"dcp"`` (a directory ``torch.distributed.checkpoint.load`` reads: ``.metadata``
    and ``*.distcp`` files) or ``"peft"`` (a directory ``PeftModel.from_pretrained`` loads: the
    adapters of a model saved adapter-only, ``only`` the model's key where the checkpoint holds
    several). ``only``: keep the tensors whose key starts with this prefix, stripped
    (``only="model."`` gives names a Hugging Face model loads); safetensors, hf and dcp (where the
    non-tensor values under the prefix are kept too).
    ``buffer_bytes`` (bytes or ``"2GB"``; old name ``memory_budget``, deprecated): the most tensor
    bytes held at once, default 1 GiB for the streaming targets; for ``"torch"`` and ``"dcp"``, which
    hold the whole state, a ``buffer_bytes`` smaller than the state raises MemoryBudgetError before
    anything is read. Refuses an existing ``dst`` unless
    ``overwrite=True``; then replaces it atomically. ``allow_pickle`` is needed only for
    ``"torch"`` and ``"dcp"`` from a checkpoint with pickled values (the other targets never unpickle: such
    values are dropped). ``progress`` is called with each number of tensor bytes written.
    ``storage_options`` go to fsspec for a URL ``src`` (credentials, ``endpoint_url``, ...).
    ``allow_expansion``: convert a checkpoint whose tensors take more than :data:`MAX_EXPANSION`
    times the distinct bytes their chunks read (a manifest can place many chunks on the same
    bytes); ExpansionError otherwise, before anything is written.
    """
    t_start = time.perf_counter()
    if to not in TARGETS:
        raise ValueError(f"to must be one of {', '.join(map(repr, TARGETS))}, not {to!r}")
    if max_shard_bytes is not None and to != "hf":
        raise ValueError(f"max_shard_bytes applies to to='hf' only, not to={to!r}")
    if only is not None and to == "torch":
        raise ValueError("only= applies to the safetensors, hf and dcp targets; to='torch' keeps the whole structure")
    budget = None if buffer_bytes is None else parse_size(buffer_bytes, "buffer_bytes")
    if is_url(dst):
        raise UnsupportedValueError(f"{dst}: convert writes a local file or directory, not a URL")
    dst = local_path(dst)
    ckpt = open_checkpoint(src, storage_options)
    manifest = read_manifest_of(ckpt)
    try:
        same = not is_url(src) and os.path.realpath(dst) == os.path.realpath(local_path(src))
    except OSError as e:  # a symlink on the way replaced while it was followed (EINVAL)
        raise storage_error(e, dst, "could not be resolved", "was it changed meanwhile?") from None
    if same:
        raise CheckpointExistsError(f"{dst}: is the source checkpoint; convert into another path")
    data_files.check_sizes(ckpt, manifest)  # before any output exists
    if not allow_expansion:
        check_expansion(manifest, src)
    check_free_space(dst, sum(tensor_nbytes(e) for e in manifest.tensors.values()), "the conversion")
    if to == "peft":
        report = _to_peft(ckpt, manifest, Path(dst), only, DEFAULT_MEMORY_BUDGET if budget is None else budget,
                          overwrite, io_threads, progress)
    elif to == "dcp":
        report = _to_dcp(src, storage_options, ckpt, manifest, Path(dst), only, budget, overwrite, allow_pickle,
                         io_threads, progress)
    elif to == "torch":
        report = _to_torch(src, storage_options, ckpt, manifest, Path(dst), budget, overwrite, allow_pickle,
                           io_threads, progress)
    else:
        shard_limit = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else parse_size(max_shard_bytes, "max_shard_bytes")
        report = _to_safetensors(ckpt, manifest, Path(dst), to, only, shard_limit,
                                 DEFAULT_MEMORY_BUDGET if budget is None else budget, overwrite, io_threads, progress)
    report.seconds["total"] = time.perf_counter() - t_start
    return report


# -- safetensors and hf -------------------------------------------------------------------------
def _to_safetensors(ckpt: Checkpoint, manifest: Manifest, dst: Path, to: str, only: str | None,
                    shard_limit: int, budget: int, overwrite: bool, threads: int,
                    progress: Callable[[int], None] | None) -> ConvertReport:
    names = select_tensors(manifest, only, str(ckpt.path))
    kept, dropped = json_scalars(manifest.tree, only)
    if to == "hf":
        shards = plan_shards([(k, tensor_nbytes(manifest.tensors[k])) for k in names], shard_limit)
        files: list[tuple[str | None, list[str], dict[str, str]]] = [
            (name, keys, {}) for name, keys in zip(shard_file_names(len(shards)), shards)]
        dropped = list(kept) + dropped  # a model directory holds weights only
    else:
        extra: dict[str, str] = {}
        if kept:
            extra["resurgo.values"] = json.dumps(kept, allow_nan=False)
        if manifest.step is not None:
            extra["resurgo.step"] = str(manifest.step)
        if manifest.metadata:
            extra["resurgo.metadata"] = json.dumps(manifest.metadata)
        files = [(None, list(names), extra)]
    output = AtomicOutput(dst, directory=(to == "hf"), overwrite=overwrite,
                          owned=_hf_owned, owned_file=_is_resurgo_output)
    stream = TensorByteStream(ckpt, manifest, budget, threads)
    seconds = {"read": 0.0, "write": 0.0}
    written: list[str] = []
    bytes_written = 0
    raw_keys: list[str] = []
    try:
        for rel, keys, metadata in files:
            items = [_output_item(names[k], k, manifest) for k in keys]
            raw = {i.name: {"dtype": i.dtype, "shape": list(i.shape)} for i in items if i.declared_as_raw_bytes}
            if raw:
                metadata = {**metadata, "resurgo.raw_dtypes": json.dumps(raw)}
                raw_keys.extend(k for k, i in zip(keys, items) if i.name in raw)
            bytes_written += _write_file(output, rel, items, metadata, keys, stream, seconds, progress)
            written.append(rel or dst.name)
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(tensor_nbytes(manifest.tensors[k]) for k in names)},
                     "weight_map": {names[k]: rel for rel, keys, _ in files for k in keys}}
            bytes_written += _write_bytes(output, HF_INDEX_FILE,
                                          (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
            written.append(HF_INDEX_FILE)
        output.publish()
    except BaseException:
        output.abort()
        raise
    return ConvertReport(
        src=str(ckpt.path), dst=str(dst), to=to, files=written, num_tensors=len(names),
        tensor_bytes=sum(tensor_nbytes(manifest.tensors[k]) for k in names), bytes_written=bytes_written,
        bytes_read=stream.bytes_read, peak_buffer_bytes=stream.peak_buffer_bytes,
        tensors_skipped=[k for k in manifest.tensors if k not in names], values_dropped=dropped,
        raw_dtype_keys=raw_keys, seconds=seconds)


# -- peft ---------------------------------------------------------------------------------------
def _to_peft(ckpt: Checkpoint, manifest: Manifest, dst: Path, only: str | None, budget: int, overwrite: bool,
             threads: int, progress: Callable[[int], None] | None) -> ConvertReport:
    found = _adapters_to_convert(manifest, only, str(ckpt.path))
    output = AtomicOutput(dst, directory=True, overwrite=overwrite, owned=_peft_owned, owned_file=_is_peft_output)
    stream = TensorByteStream(ckpt, manifest, budget, threads)
    seconds = {"read": 0.0, "write": 0.0}
    written: list[str] = []
    bytes_written = 0
    metadata = {"format": "pt"}  # what PeftModel.save_pretrained writes
    if found.base_model_digest is not None:
        metadata[peft_format.DIGEST_METADATA] = found.base_model_digest
    try:
        for name in sorted(found.adapters, key=lambda n: n != peft_format.DEFAULT_ADAPTER):
            adapter = found.adapters[name]
            folder = "" if name == peft_format.DEFAULT_ADAPTER else f"{name}/"
            if folder:
                output.path(name).mkdir()
            keys = [adapter.tensors[k] for k in sorted(adapter.tensors)]
            items = [_output_item(k, adapter.tensors[k], manifest) for k in sorted(adapter.tensors)]
            bytes_written += _write_file(output, folder + peft_format.PEFT_WEIGHTS_FILE, items, metadata, keys, stream,
                                         seconds, progress)
            bytes_written += _write_bytes(output, folder + peft_format.PEFT_CONFIG_FILE, str(adapter.config).encode())
            written += [folder + peft_format.PEFT_WEIGHTS_FILE, folder + peft_format.PEFT_CONFIG_FILE]
        output.publish()
    except BaseException:
        output.abort()
        raise
    converted = {k for a in found.adapters.values() for k in a.tensors.values()}
    return ConvertReport(
        src=str(ckpt.path), dst=str(dst), to="peft", files=written, num_tensors=len(converted),
        tensor_bytes=sum(tensor_nbytes(manifest.tensors[k]) for k in converted), bytes_written=bytes_written,
        bytes_read=stream.bytes_read, peak_buffer_bytes=stream.peak_buffer_bytes,
        tensors_skipped=[k for k in manifest.tensors if k not in converted], values_dropped=[],
        raw_dtype_keys=[], seconds=seconds)


def _adapters_to_convert(manifest: Manifest, only: str | None, where: str) -> peft_format.SavedAdapters:
    """The one adapter subtree of the checkpoint (the one under ``only`` where it has several)."""
    found = peft_format.find_adapters(manifest.tree)
    prefixes = ", ".join(repr(f.prefix + "." if f.prefix else "") for f in found)
    if only is not None:
        found = [f for f in found if f.prefix == only.rstrip(".")]
    if len(found) != 1:
        if not found:
            raise KeyMismatchError(
                f"{where}: holds no adapters saved adapter-only{f' under {only!r}' if only is not None else ''} (a "
                "PEFT model saved by ResurgoTrainer, ResurgoAccelerator, or TrainState(model=AdapterOnly(model)))"
                + (f"; it holds them under {prefixes}" if prefixes and only is not None else ""), missing=[only or ""])
        raise UnsupportedValueError(f"{where}: holds adapters under several keys ({prefixes}); choose one with "
                                    "only= (--only)")
    for adapter in found[0].adapters.values():
        if adapter.config is None or not adapter.tensors:
            raise KeyMismatchError(f"{where}: adapter {adapter.name!r} under {found[0].prefix!r} lacks its config or its "
                                   "weights", missing=[adapter.name])
        for name in adapter.tensors:
            if name in ("", SAFETENSORS_RESERVED):
                raise UnsupportedValueError(f"{where}: adapter {adapter.name!r} has a tensor named {name!r}, which a "
                                            "safetensors file cannot hold")
    return found[0]


def _peft_owned(rel: str, kind: str) -> bool:
    """What a conversion to peft writes: the only entries an overwrite of its directory replaces."""
    parts = rel.split("/")
    if kind == DIR:
        return len(parts) == 1
    return kind == FILE and len(parts) <= 2 and parts[-1] in (peft_format.PEFT_WEIGHTS_FILE, peft_format.PEFT_CONFIG_FILE)


def _is_peft_output(path: Path) -> bool:
    """An adapter's weights carry resurgo's producer mark; its config has none."""
    return path.name == peft_format.PEFT_CONFIG_FILE or is_resurgo_safetensors(path)


def check_expansion(manifest: Manifest, src: str | os.PathLike) -> None:
    """ExpansionError when the tensors take more than MAX_EXPANSION times the distinct bytes stored."""
    written = sum(tensor_nbytes(e) for e in manifest.tensors.values())
    stored = distinct_bytes(manifest)
    if written > MAX_EXPANSION * stored:
        raise expansion_error(src, f"its {len(manifest.tensors)} tensors take", written, stored,
                              "pass allow_expansion=True (--allow-expansion)")


def check_free_space(dst: str | os.PathLike, need: int, what: str) -> None:
    """StorageError when the filesystem of the local path ``dst`` says it has less than ``need``
    bytes free (checked before anything is written); where it cannot say, the write finds out."""
    where = Path(os.path.abspath(dst))
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if need > free:
        raise StorageError(f"{dst}: {what} needs {need} bytes for its tensors, but the filesystem of {where} has "
                           f"{free} bytes free; nothing was written")


def select_tensors(manifest: Manifest, only: str | None, where: str) -> dict[str, str]:
    """{tensor key: its name in the output}, in manifest order: the keys under ``only``, stripped."""
    if only is None:
        names = {k: k for k in manifest.tensors}
    else:
        names = {k: k[len(only):] for k in manifest.tensors if k.startswith(only)}
        if not names:
            firsts = sorted({k.split(".")[0] + "." for k in manifest.tensors})
            raise KeyMismatchError(
                f"{where}: no tensor key starts with {only!r} (the keys start with: "
                f"{', '.join(map(repr, firsts[:10])) or 'no tensors at all'})", missing=[only])
    for key, name in names.items():
        if name in ("", SAFETENSORS_RESERVED):
            raise UnsupportedValueError(
                f"{where}: tensor {key!r} would be named {name!r} in a safetensors file, which is not allowed"
                + (f" (choose a shorter prefix than only={only!r})" if only else ""))
    return names


def _hf_owned(rel: str, kind: str) -> bool:
    """What a conversion to hf writes: the only entries an overwrite of its directory replaces."""
    return kind == FILE and is_hf_output_file(rel)


def _is_resurgo_output(path: Path) -> bool:
    """A safetensors output (file or shard) carries resurgo's producer mark; an hf index has none."""
    return path.name == HF_INDEX_FILE or is_resurgo_safetensors(path)


def is_resurgo_safetensors(path: Path) -> bool:
    """True when ``path`` is a safetensors file whose header names resurgo as its producer."""
    try:
        with open(path, "rb") as f:
            header = read_header(f.read(8), f.read)
    except (OSError, ValueError):
        return False
    metadata = header.raw.get("__metadata__")
    return isinstance(metadata, dict) and metadata.get("producer") == SAFETENSORS_PRODUCER["producer"]


# The comment of a torch.save archive converted by resurgo: torch.load ignores a zip comment, and an
# overwrite= of the file checks for it (the proof that resurgo wrote what it replaces).
TORCH_FILE_MARK = b"written by resurgo convert"
_EOCD = b"PK\x05\x06"  # the zip end-of-central-directory record: 22 bytes, its comment length last


def mark_torch_file(f: io.BufferedRandom) -> None:
    """Give the just-written torch.save archive in ``f`` resurgo's mark as its zip comment. Only
    the last record's comment length changes, and the mark follows it; an archive that does not
    end as torch.save ends its archives (no comment yet) is left unmarked, never rewritten."""
    f.seek(-22, os.SEEK_END)
    record = f.read(22)
    if record[:4] != _EOCD or record[20:] != b"\0\0":
        return
    f.seek(-2, os.SEEK_END)
    f.write(struct.pack("<H", len(TORCH_FILE_MARK)) + TORCH_FILE_MARK)


def is_resurgo_torch_file(path: Path) -> bool:
    """True when ``path`` is a zip archive (torch.save's format) carrying resurgo's mark."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.comment == TORCH_FILE_MARK
    except (OSError, zipfile.BadZipFile):
        return False


def _output_item(name: str, key: str, manifest: Manifest) -> HeaderEntry:
    entry = manifest.tensors[key]
    return HeaderEntry(name, entry.dtype, tuple(entry.shape), tensor_nbytes(entry))


def _write_file(output: AtomicOutput, rel: str | None, items: list[HeaderEntry], metadata: dict[str, str],
                keys: list[str], stream: TensorByteStream, seconds: dict[str, float],
                progress: Callable[[int], None] | None) -> int:
    """Header first, then every tensor's bytes as the stream delivers them, then fsync."""
    header, _ = build_header(items, metadata)
    handle = output.create(rel)
    waited_since = time.perf_counter()

    def write(piece: memoryview) -> None:
        nonlocal waited_since
        t0 = time.perf_counter()
        handle.write(piece)
        seconds["read"] += t0 - waited_since
        waited_since = time.perf_counter()
        seconds["write"] += waited_since - t0
        if progress is not None:
            progress(len(piece))

    try:
        handle.write(memoryview(header))
        stream.copy_to(keys, write)
        handle.fsync()
        return handle.bytes_written
    finally:
        handle.close()


def _write_bytes(output: AtomicOutput, rel: str, data: bytes) -> int:
    handle = output.create(rel)
    try:
        handle.write(memoryview(data))
        handle.fsync()
        return handle.bytes_written
    finally:
        handle.close()


# -- non-tensor values --------------------------------------------------------------------------
_JSON_SCALARS = ("none", "bool", "int", "str", "float")


def json_scalars(tree: dict, only: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """({key: value} of the non-tensor leaves that are JSON scalars, keys of the other non-tensor
    leaves), in tree order, restricted to keys under ``only`` (stripped). JSON scalars: None, bool,
    int, str, finite float (exact in JSON); not empty containers nor anything else. Nothing is
    unpickled."""
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for leaf in iter_values(tree):
        key, node = leaf.key, leaf.node
        if only is not None:
            if not key.startswith(only):
                continue
            key = key[len(only):]
        value = values.decode_scalar(node, f"tree node {key!r}", allow_pickle=False) if node["type"] in _JSON_SCALARS else None
        if node["type"] in _JSON_SCALARS and not (isinstance(value, float) and not math.isfinite(value)):
            kept[key] = value
        else:
            dropped.append(key)
    return kept, dropped


# -- torch --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def torch_save_supports(dtype: str) -> bool:
    """Whether torch.save can store a tensor of this dtype (it cannot the sub-byte placeholders)."""
    try:
        torch.save(torch.empty(0, dtype=dtypes.TORCH_DTYPES[dtype]), io.BytesIO())
    except Exception:
        return False
    return True


def weights_only_loadable(value: Any) -> Any:
    """``value`` (what ``load_dict`` returns) with only what ``torch.load(weights_only=True)``
    reads: per-rank values as a list indexed by rank, numpy arrays as torch tensors (sharing their
    memory), numpy scalars as Python numbers (equal, so dict keys stay distinct); containers keep
    their types, other values are kept."""
    if isinstance(value, PerRank):
        return [weights_only_loadable(v) for v in (value.saved if value.saved is not None else [value.value])]
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    if type(value) in (list, tuple):
        return type(value)(weights_only_loadable(v) for v in value)
    if isinstance(value, dict):
        return type(value)((weights_only_loadable(k), weights_only_loadable(v)) for k, v in value.items())
    return value


def _check_whole_state(ckpt: Checkpoint, manifest: Manifest, budget: int | None, what: str) -> int:
    """The tensor bytes of the whole state, which ``what`` holds in memory and stores with torch.save;
    refuses a state over ``budget`` or with a dtype torch.save cannot store, before reading anything."""
    total = manifest.tensor_bytes
    if budget is not None and total > budget:
        raise MemoryBudgetError(
            f"{ckpt.path}: {what} needs the whole state in memory ({total} bytes of tensors), "
            f"more than buffer_bytes={budget}; raise buffer_bytes, or convert to safetensors or hf, which stream")
    for key, entry in manifest.tensors.items():
        if entry.kind == "torch" and not torch_save_supports(entry.dtype):
            raise UnsupportedValueError(
                f"{ckpt.path}: tensor {key!r} has dtype {entry.dtype}, which torch.save cannot store; "
                "convert to safetensors instead (it keeps the raw bytes)")
    return total


def _to_torch(src: str | os.PathLike, storage_options: dict | None, ckpt: Checkpoint, manifest: Manifest, dst: Path,
              budget: int | None, overwrite: bool, allow_pickle: bool, threads: int,
              progress: Callable[[int], None] | None) -> ConvertReport:
    total = _check_whole_state(ckpt, manifest, budget, "a torch.save file")
    output = AtomicOutput(dst, directory=False, overwrite=overwrite, owned_file=is_resurgo_torch_file)
    seconds: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        # convert checked the expansion already, or was allowed it
        state = weights_only_loadable(load_dict(src, verify=True, allow_pickle=allow_pickle, io_threads=threads,
                                             storage_options=storage_options, allow_expansion=True))
        t1 = time.perf_counter()
        with open(output.path(), "x+b") as f:
            torch.save(state, f)
            mark_torch_file(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        seconds = {"read": t1 - t0, "write": time.perf_counter() - t1}
        output.publish()
    except BaseException:
        output.abort()
        raise
    if progress is not None:
        progress(total)
    return ConvertReport(
        src=str(ckpt.path), dst=str(dst), to="torch", files=[dst.name], num_tensors=len(manifest.tensors),
        tensor_bytes=total, bytes_written=size, bytes_read=total,  # load_dict reads every stored byte once
        peak_buffer_bytes=total, tensors_skipped=[], values_dropped=[], raw_dtype_keys=[], seconds=seconds)


# -- dcp ----------------------------------------------------------------------------------------
DCP_METADATA = ".metadata"
_DCP_DATA = re.compile(r"[^/]+\.distcp")


def is_dcp_output_file(name: str) -> bool:
    """True for the names DCP's FileSystemWriter writes (what an overwrite of a dcp output may replace)."""
    return name == DCP_METADATA or _DCP_DATA.fullmatch(name) is not None


def _dcp_owned(rel: str, kind: str) -> bool:
    return kind == FILE and is_dcp_output_file(rel)


def dcp_items(state: Any, only: str | None, where: str) -> tuple[dict[str, Any], list[str]]:
    """({key: value} as DCP stores ``state``, tensor keys outside ``only``): the state flattened by
    DCP's own rule, so that ``dcp.load`` of a nested target finds its keys; under ``only``, the keys
    that start with it, stripped."""
    # DCP's flattening is private API, but it is the rule dcp.load applies to every target: using it
    # (rather than a copy) keeps the keys identical. Stable since torch 2.4.
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    if not isinstance(state, dict):
        raise UnsupportedValueError(
            f"{where}: the checkpoint's root is a {type(state).__name__}; a DCP state dict is a dict "
            "(convert to torch instead)")
    try:
        flat, _ = flatten_state_dict(state)
    except ValueError as e:  # two paths that join to one key ({"a.b": x, "a": {"b": y}})
        raise UnsupportedValueError(f"{where}: cannot be a DCP state dict: {e}") from None
    if only is None:
        return flat, []
    kept = {k[len(only):]: v for k, v in flat.items() if k.startswith(only)}
    if not kept:
        firsts = sorted({k.split(".")[0] + ("." if "." in k else "") for k in flat})
        raise KeyMismatchError(
            f"{where}: no key starts with {only!r} (the keys start with: "
            f"{', '.join(map(repr, firsts[:10])) or 'nothing: the state is empty'})", missing=[only])
    if "" in kept:
        raise UnsupportedValueError(f"{where}: {only!r} is a whole key, which would be named ''; choose a shorter prefix")
    return kept, [k for k, v in flat.items() if isinstance(v, torch.Tensor) and not k.startswith(only)]


def _to_dcp(src: str | os.PathLike, storage_options: dict | None, ckpt: Checkpoint, manifest: Manifest, dst: Path,
            only: str | None, budget: int | None, overwrite: bool, allow_pickle: bool, threads: int,
            progress: Callable[[int], None] | None) -> ConvertReport:
    import torch.distributed.checkpoint as dcp

    total = _check_whole_state(ckpt, manifest, budget, "a DCP checkpoint")
    output = AtomicOutput(dst, directory=True, overwrite=overwrite, owned=_dcp_owned)
    try:
        t0 = time.perf_counter()
        # convert checked the expansion already, or was allowed it
        state = weights_only_loadable(load_dict(src, verify=True, allow_pickle=allow_pickle, io_threads=threads,
                                             storage_options=storage_options, allow_expansion=True))
        items, skipped = dcp_items(state, only, str(ckpt.path))
        t1 = time.perf_counter()
        with warnings.catch_warnings():  # no_dist is the point here: one process writes the whole state
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(items, storage_writer=dcp.FileSystemWriter(output.path(), sync_files=True), no_dist=True)
        files = sorted(os.listdir(output.path()))
        size = sum(output.path(name).stat().st_size for name in files)
        seconds = {"read": t1 - t0, "write": time.perf_counter() - t1}
        output.publish()
    except BaseException:
        output.abort()
        raise
    tensors = [v for v in items.values() if isinstance(v, torch.Tensor)]
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if progress is not None:
        progress(tensor_bytes)
    return ConvertReport(
        src=str(ckpt.path), dst=str(dst), to="dcp", files=files, num_tensors=len(tensors),
        tensor_bytes=tensor_bytes, bytes_written=size, bytes_read=total,  # load_dict reads every stored byte once
        peak_buffer_bytes=total, tensors_skipped=skipped, values_dropped=[], raw_dtype_keys=[], seconds=seconds)
