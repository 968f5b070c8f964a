"""A spec from a Megatron-LM checkpoint in the legacy layout (``--ckpt-format torch``), without
importing megatron and without executing any of its pickles; a ``torch_dist`` checkpoint
(``metadata.json`` in the iteration folder) is handed to :mod:`.megatron_dist`.

The directory holds ``latest_checkpointed_iteration.txt`` naming the iteration (or ``release``)
and ``iter_<7 digits>/`` (``release/``), or is that folder itself. In it, one folder per model-parallel
rank: ``mp_rank_<tp:02d>`` (no pipeline parallelism) or ``mp_rank_<tp:02d>_<pp:03d>``, each with
``model_optim_rng.pt``: a torch.save dict of ``model`` (the rank's state dict), ``optimizer``,
``opt_param_scheduler``, ``rng_state``, ``args`` (an argparse Namespace), ``iteration`` and
``checkpoint_version``. The files are read by the restricted unpickler (:data:`MEGATRON`).

The consolidated tensors are those a run with one tensor- and one pipeline-parallel rank holds,
built as pieces of the shards' bytes (the steps of the spec; the sub-parameters of Universal
Checkpointing):

- tensor-parallel shards are laid side by side along the parameter's partition dimension: 0 for
  column-parallel weights and biases (``linear_qkv``/``query_key_value``, ``linear_fc1``/
  ``dense_h_to_4h``, word embeddings, ``output_layer``), 1 for row-parallel weights
  (``linear_proj``/``self_attention.dense``, ``linear_fc2``/``dense_4h_to_h``); every other
  tensor is replicated, and each rank's copy must equal rank 0's bit for bit;
- a gated MLP's ``fc1`` (SwiGLU: ``args.swiglu`` or ``args.gated_linear_unit``) holds two
  sub-parameters on each rank, [gate; up]; each is gathered over the ranks on its own, so the
  result is [gate of all ranks; up of all ranks]. The fused QKV of Megatron-Core and of Megatron-LM
  is laid out per query group (per head), which the tensor-parallel ranks split whole, so laying
  the shards side by side is already the one-rank layout;
- the vocabulary padding of the word embeddings and output layer is dropped when the true
  vocabulary size is known (``vocab_size=``, or ``args.vocab_size``);
- a pipeline stage's ``layers.<i>`` are renumbered to global layer numbers: ``i`` plus the number
  of layers of the stages before it.

The optimizer state (a torch Adam's ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter) is
gathered the same way and numbered as the optimizer of a one-rank run numbers it: group after
group (the groups as saved), the parameters of a group in global model order. Megatron numbers
each rank's parameters by group, and puts a parameter in the group of no weight decay
(``wd_mult`` 0) when it is a bias or one-dimensional; the importer reads the numbers back by that
rule and checks every moment's shape against its parameter's. A mixed-precision run's fp32 main
params (``fp32_from_fp16_params``) are consolidated likewise, under
``optimizer.fp32_from_fp16_params.<name>``. The distributed optimizer's state, each rank's
``distrib_optim.pt`` beside its ``model_optim_rng.pt``, is found in its buffers by value
(:mod:`.megatron_buckets`) and goes under each parameter's name: ``optimizer.state.<name>.exp_avg``,
``.exp_avg_sq`` and ``optimizer.fp32_from_fp16_params.<name>``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedValueError,
)
from resurgo.format import dtypes
from resurgo.format.tree import path_key
from resurgo.interop.megatron_buckets import states_by_value
from resurgo.interop.megatron_dist import METADATA_JSON, spec_from_torch_dist, whole_tensor
from resurgo.interop.source_files import open_file_inside, resolve_inside
from resurgo.interop.spec import Box, ImportSpec, Piece, Source, TensorSpec, from_fields, row_major_strides
from resurgo.interop.torch_file import read_objects
from resurgo.interop.unpickle import DEEPSPEED, Record, TensorRef, shown

HOLDS = "a Megatron-LM checkpoint file"
TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM = "distrib_optim.pt"  # the distributed optimizer's state, beside RANK_FILE
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
EXPERT_DIR = re.compile(r"^mp_rank_\d{2}_\d{3}_\d{3}$")
ITER_DIR = re.compile(r"^iter_\d{7}$")
LAYER = re.compile(r"^(.*?\blayers)\.(\d+)\.(.+)$")
MAX_TRACKER_BYTES = 64
# The last two names of a tensor-parallel weight or bias -> its partition dimension; biases of
# row-parallel layers are replicated.
COLUMN = ("linear_qkv", "query_key_value", "linear_fc1", "dense_h_to_4h", "word_embeddings", "output_layer")
ROW = ("linear_proj", "linear_fc2", "dense_4h_to_h")
GATED = ("linear_fc1", "dense_h_to_4h")
VOCAB = ("word_embeddings", "output_layer")


class _Globals(Mapping):
    """The globals a Megatron file may name: torch.save's and DeepSpeed's, torch dtypes (as their
    names), and inert records for ``argparse.Namespace``, numpy arrays (the RNG state), ``io.BytesIO``
    (Transformer Engine's extra state), DeepSpeed's ``SubparamShape`` and any class of megatron (enums of its arguments): a record
    keeps its pickled arguments and state as data, and nothing is imported."""

    RECORDS = {("argparse", "Namespace"), ("numpy", "ndarray"), ("numpy", "dtype"), ("io", "BytesIO"),
               ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
               # Universal Checkpointing's description of fused sub-parameters, in Megatron-DeepSpeed's files
               ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
               ("deepspeed.checkpoint.constants", "SubparamShape")}

    def __init__(self) -> None:
        dtype_names = {("torch", str(dt).removeprefix("torch.")): name for dt, name in dtypes.TORCH_DTYPE_NAMES.items()}
        self.fixed = {**DEEPSPEED, ("_codecs", "encode"): _latin1, **dtype_names}

    def __getitem__(self, key: tuple[str, str]) -> Any:
        found = self.fixed.get(key)
        if found is not None:
            return found
        if key in self.RECORDS or key[0] == "megatron" or key[0].startswith("megatron."):
            return Record
        raise KeyError(key)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.fixed)

    def __len__(self) -> int:
        return len(self.fixed)


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """What pickle protocol 2 writes for bytes (numpy's RNG state): ``_codecs.encode(str, 'latin1')``."""
    if not isinstance(text, str) or encoding != "latin1":
        raise CorruptCheckpointError(f"_codecs.encode of {shown(text)} with {shown(encoding)}: only latin1 text is "
                                     "read")
    return text.encode("latin1")


MEGATRON = _Globals()


@dataclass(frozen=True)
class _File:
    rel: str  # relative to the source directory
    prefix: str
    obj: dict
    tp: int
    pp: int


@dataclass(frozen=True)
class _Param:
    """One tensor of the consolidated model: its global key and its shard on each tensor-parallel rank."""

    key: str
    shards: list[tuple[_File, TensorRef]]  # in tensor-parallel rank order


def find_iteration_dir(root: Path) -> tuple[Path, str]:
    """(the folder of the rank folders, its path relative to ``root``: '' or ``iter_<N>``/``release``)."""
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: not found")
    tracker = root / TRACKER
    if tracker.is_file():
        with open_file_inside(resolve_inside(root, TRACKER, "the iteration file")) as f:
            text = f.read(MAX_TRACKER_BYTES + 1).decode("utf-8", errors="replace").strip()
        if text == "release":
            name = "release"
        elif text.isdigit() and len(text) <= 12:
            name = f"iter_{int(text):07d}"
        else:
            raise CorruptCheckpointError(f"{tracker}: holds {text[:MAX_TRACKER_BYTES]!r}, expected an iteration "
                                         "number or 'release'")
        if not (root / name).is_dir():
            raise CorruptCheckpointError(f"{tracker}: names iteration {text!r}, but {root / name} is missing")
        return root / name, name
    if root.is_dir() and ((root / METADATA_JSON).is_file() or any(RANK_DIR.match(p.name) for p in root.iterdir())):
        return root, ""
    raise NotACheckpointError(f"{root}: not a Megatron checkpoint (no {TRACKER}, no {METADATA_JSON} and no mp_rank_* "
                              "folders)")


def spec_from_megatron(directory: str | Path, vocab_size: int | None = None) -> ImportSpec:
    """The spec of the Megatron-LM checkpoint (legacy layout) in ``directory``, consolidated to one
    tensor- and pipeline-parallel rank (see the module docstring); ``vocab_size``: the true
    vocabulary size, which drops the padding rows of the word embeddings and output layer."""
    return from_fields(directory, "Megatron", lambda: _spec(Path(directory), vocab_size))


def _rank_grid(folder: Path) -> tuple[int, int, bool]:
    """(tensor-parallel size, pipeline-parallel size, whether the folder names carry a stage)."""
    found: set[tuple[int, int | None]] = set()
    for p in folder.iterdir():
        if EXPERT_DIR.match(p.name):
            raise UnsupportedValueError(f"{p}: an expert-parallel rank's folder; Megatron checkpoints with expert "
                                        "parallelism do not import")
        m = RANK_DIR.match(p.name)
        if m:
            found.add((int(m.group(1)), None if m.group(2) is None else int(m.group(2))))
    if not found:
        raise NotACheckpointError(f"{folder}: no mp_rank_* folders: not a Megatron checkpoint in the legacy layout")
    staged = {pp is not None for _, pp in found}
    if len(staged) > 1:
        raise CorruptCheckpointError(f"{folder}: holds both mp_rank_XX and mp_rank_XX_YYY folders: files of two "
                                     "different runs are mixed")
    tp = 1 + max(t for t, _ in found)
    pp = 1 + max(p or 0 for _, p in found)
    with_stage = staged == {True}
    for t in range(tp):
        for s in range(pp):
            if (t, s if with_stage else None) not in found:
                raise CorruptCheckpointError(
                    f"{folder / _rank_name(t, s, with_stage)}: missing (a checkpoint of {tp} tensor- and {pp} "
                    "pipeline-parallel ranks needs a folder for each pair; was one rank's folder not copied?)")
    return tp, pp, with_stage


def _rank_name(tp: int, pp: int, with_stage: bool) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}" if with_stage else f"mp_rank_{tp:02d}"


def _spec(root: Path, vocab_size: int | None) -> ImportSpec:
    folder, it = find_iteration_dir(root)
    if (folder / METADATA_JSON).is_file():
        if vocab_size is not None:
            raise UnsupportedValueError(f"{folder}: a torch_dist checkpoint imports as dist_checkpointing.load gives "
                                        f"it, padded vocabulary included; vocab_size={vocab_size} applies to the "
                                        "legacy layout only")
        return spec_from_torch_dist(root, folder, it, MEGATRON, HOLDS, _json_part, _record_namespace)
    tp_size, pp_size, with_stage = _rank_grid(folder)
    files = _rank_files(root, it, tp_size, pp_size, with_stage)
    first = files[0, 0]
    args = _namespace(first)
    for key, size in (("tensor_model_parallel_size", tp_size), ("pipeline_model_parallel_size", pp_size)):
        if isinstance(args.get(key), int) and args[key] != size:
            raise CorruptCheckpointError(f"{first.rel}: args.{key} is {args[key]}, but {folder} holds rank folders "
                                         f"for {size}: was a rank's folder not copied, or are two runs mixed?")
    if "model" not in first.obj:
        chunks = [k for k in first.obj if isinstance(k, str) and k.startswith("model")]
        raise UnsupportedValueError(f"{first.rel}: holds {chunks or 'no model'} but not 'model': checkpoints with a "
                                    "virtual pipeline (model0, model1, ...) do not import")
    gated = bool(args.get("swiglu") or args.get("gated_linear_unit"))
    if vocab_size is None and isinstance(args.get("vocab_size"), int) and not isinstance(args.get("vocab_size"), bool):
        vocab_size = args["vocab_size"]

    params, order, local_names, offset = _model_params(files, tp_size, pp_size)
    tensors = [_tensor(params[n], ("model", n), gated, vocab_size) for n in order]
    distributed = {f.rel for f in files.values() if (root / f.rel).parent.joinpath(DISTRIB_OPTIM).exists()}
    if distributed:
        # the distributed optimizer's state: found in its buffers by the untrimmed weights' values
        whole = [_tensor(params[n], ("model", n), gated, None) for n in order]
        optimizer = states_by_value(whole, _distrib_optim(root, files, distributed), root, str(folder),
                                    coalesced=True, shapes={t.key: list(t.shape) for t in tensors})
        groups = None
    else:
        optimizer, groups = _optimizer(files, local_names, params, tp_size, gated, vocab_size)
    tensors += optimizer
    values = _values(first, args, groups, tp_size, pp_size, offset)
    if distributed:
        values["optimizer"] = _json_part(first.obj.get("optimizer"))
    tensors += _rng(files)
    return ImportSpec(tensors=tensors, values=values)


def _rank_files(root: Path, it: str, tp_size: int, pp_size: int, with_stage: bool) -> dict[tuple[int, int], _File]:
    """Each (tensor, pipeline) rank's ``model_optim_rng.pt``, read."""
    files: dict[tuple[int, int], _File] = {}
    for pp in range(pp_size):
        for tp in range(tp_size):
            rel = f"{_rank_name(tp, pp, with_stage)}/{RANK_FILE}"
            rel = f"{it}/{rel}" if it else rel
            try:
                path = resolve_inside(root, rel, "a Megatron rank file")
            except CheckpointNotFoundError:
                raise CorruptCheckpointError(f"{root / rel}: missing (the rank's folder holds no {RANK_FILE})"
                                             ) from None
            obj, prefix = read_objects(path, MEGATRON, HOLDS)
            if not isinstance(obj, dict):
                raise CorruptCheckpointError(f"{path}: holds a {type(obj).__name__}, not the dict Megatron saves")
            files[tp, pp] = _File(rel, prefix, obj, tp, pp)
    return files


def _model_params(files: dict[tuple[int, int], _File], tp_size: int, pp_size: int
                  ) -> tuple[dict[str, _Param], list[str], dict[tuple[int, int], list[tuple[str, TensorRef]]], int]:
    """Per stage, its tensors in order, renamed to global layer numbers: each name's pieces on the
    tensor-parallel ranks, the names in order, each file's renamed tensors, and the layer count."""
    params: dict[str, _Param] = {}
    order: list[str] = []
    local_names: dict[tuple[int, int], list[tuple[str, TensorRef]]] = {}
    offset = 0
    for pp in range(pp_size):
        layers: set[int] = set()
        for tp in range(tp_size):
            f = files[tp, pp]
            renamed = []
            for name, ref in _flat(f, f.obj.get("model"), "model"):
                m = LAYER.match(name)
                if m:
                    layers.add(int(m.group(2)))
                    name = f"{m.group(1)}.{offset + int(m.group(2))}.{m.group(3)}"
                renamed.append((name, ref))
            local_names[tp, pp] = renamed
        for tp in range(tp_size):
            keys = [n for n, _ in local_names[tp, pp]]
            if keys != [n for n, _ in local_names[0, pp]]:
                other = sorted(set(keys) ^ {n for n, _ in local_names[0, pp]})
                raise CorruptCheckpointError(
                    f"{files[tp, pp].rel}: its model holds other tensors than {files[0, pp].rel} "
                    f"({shown(other, 200)} in one only): files of two different runs are mixed?")
        for i, (name, ref) in enumerate(local_names[0, pp]):
            if name in params:
                raise CorruptCheckpointError(f"{files[0, pp].rel}: model key {name!r} is also held by an earlier "
                                             "pipeline stage")
            params[name] = _Param(name, [(files[tp, pp], local_names[tp, pp][i][1]) for tp in range(tp_size)])
            order.append(name)
        offset += len(layers)

    return params, order, local_names, offset


def _distrib_optim(root: Path, files: dict[tuple[int, int], _File], distributed: set[str]
                   ) -> dict[tuple[str, str], dict[str, TensorSpec]]:
    """Each rank's ``distrib_optim.pt`` (the distributed optimizer's state gathered from its DP
    ranks: per buffer and dtype, its buckets one after another, a flat tensor per state), as
    :func:`.megatron_buckets.states_by_value` takes them."""
    out: dict[tuple[str, str], dict[str, TensorSpec]] = {}
    for f in files.values():
        rel = str(PurePosixPath(f.rel).parent / DISTRIB_OPTIM)
        if f.rel not in distributed:
            raise CorruptCheckpointError(f"{root / rel}: missing, while other ranks' folders hold theirs")
        obj, arch = read_objects(resolve_inside(root, rel, "a distributed optimizer's state"), MEGATRON, HOLDS)
        if isinstance(obj, list):
            raise UnsupportedValueError(f"{root / rel}: holds {len(obj)} chained optimizers' states; only a single "
                                        "distributed optimizer's imports")
        if not isinstance(obj, dict) or obj.get("buckets_coalesced") is not True:
            raise UnsupportedValueError(f"{root / rel}: not the distributed optimizer's state as megatron-core writes "
                                        "it (a dict with buckets_coalesced: buffers of coalesced buckets)")
        for g, by_dtype in obj.items():
            if g == "buckets_coalesced" or g in ("per_bucket_numel", "per_bucket_numel_unpadded"):
                continue
            if not isinstance(g, int) or not isinstance(by_dtype, dict):
                raise CorruptCheckpointError(f"{root / rel}: holds {shown(g)}: {shown(by_dtype)}, expected a buffer "
                                             "number and its states per dtype")
            for dtype, states in by_dtype.items():
                if not isinstance(states, dict):
                    raise CorruptCheckpointError(f"{root / rel}: buffer {g} {shown(dtype)} holds {shown(states)}, "
                                                 "expected its states")
                bucket = out.setdefault((rel, f"buffer {g} {shown(dtype)}"), {})
                for name, ref in states.items():
                    if isinstance(ref, TensorRef):
                        if len(ref.shape) != 1:
                            raise CorruptCheckpointError(f"{root / rel}: buffer {g} {name!r} has the shape "
                                                         f"{list(ref.shape)}; a buffer is one-dimensional")
                        bucket[str(name)] = whole_tensor(f"{rel}:{g}:{name}", ref, rel, None,
                                                         member=f"{arch}/data/{ref.storage.key}")
    return out


def _flat(f: _File, node: Any, where: str) -> list[tuple[str, TensorRef]]:
    """The tensors of a (nested) state dict as (dotted name, ref); ``_extra_state`` entries and
    other non-tensors are left out."""
    if not isinstance(node, dict):
        raise CorruptCheckpointError(f"{f.rel}: {where!r} is a {type(node).__name__}, expected a state dict")
    out: list[tuple[str, TensorRef]] = []
    for k, v in node.items():
        if not isinstance(k, str):
            raise CorruptCheckpointError(f"{f.rel}: {where!r} holds the key {shown(k)}, expected a str")
        if isinstance(v, TensorRef):
            if not k.endswith("_extra_state"):
                out.append((k, v))
        elif isinstance(v, dict):
            out += [(f"{k}.{n}", r) for n, r in _flat(f, v, f"{where}.{k}")]
    return out


def _rule(key: str, gated: bool) -> tuple[int | None, int]:
    """(the partition dimension of the tensor ``key``, or None if replicated; its sub-parameters)."""
    parts = key.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        return None, 1
    module = parts[-2]
    if module == "dense" and len(parts) >= 3 and parts[-3] in ("self_attention", "attention", "inter_attention"):
        module = "linear_proj"
    if module in COLUMN:
        return 0, 2 if gated and module in GATED else 1
    if module in ROW and parts[-1] == "weight":
        return 1, 1
    return None, 1


def _tensor(param: _Param, path: tuple[str | int, ...], gated: bool, vocab_size: int | None,
            shards: list[tuple[_File, Any]] | None = None, name: str | None = None,
            sub_sizes: tuple[int, ...] | None = None) -> TensorSpec:
    """The consolidated tensor of ``shards`` (default: the parameter's), partitioned as ``param``'s key
    says; ``sub_sizes``: the consolidated sizes along dimension 0 of the sub-parameters each rank holds
    a slice of, in order (a fused [q; k; v] held as [q_t; k_t; v_t] by rank t: Universal
    Checkpointing's ``SubparamShape``), which overrides the rule's."""
    shards = shards if shards is not None else param.shards
    what = name or param.key
    dim, subs = _rule(param.key, gated)
    if sub_sizes is not None:
        dim, subs = 0, len(sub_sizes)
    f0, r0 = shards[0]
    for f, ref in shards:
        if not isinstance(ref, TensorRef):
            raise CorruptCheckpointError(f"{f.rel}: {what!r} is {shown(ref)}, expected a tensor")
        if ref.shape != r0.shape or ref.storage.dtype != r0.storage.dtype:
            raise CorruptCheckpointError(
                f"{f.rel}: {what!r} is a {ref.storage.dtype} tensor of shape {list(ref.shape)}, but in {f0.rel} a "
                f"{r0.storage.dtype} tensor of shape {list(r0.shape)}: tensor-parallel shards must match")
    shape = list(r0.shape)
    if dim is None or dim >= len(shape):
        piece = _piece(f0, r0, list(r0.shape), [0] * len(shape), [0] * len(shape))
        replicas = [Source(file=f.rel, member=_member(f, r), offset=r.offset * dtypes.itemsize(r.storage.dtype),
                           strides=_strides(r, list(r.shape))) for f, r in shards[1:]]
        pieces = [piece.model_copy(update={"replicas": replicas})] if math.prod(shape) else []
        return TensorSpec(key=path_key(path), path=list(path), dtype=r0.storage.dtype, shape=shape, pieces=pieces)
    n = len(shards)
    if sub_sizes is not None:
        if any(size % n for size in sub_sizes) or sum(sub_sizes) != shape[dim] * n:
            raise CorruptCheckpointError(f"{f0.rel}: {what!r} of shape {shape} on each of {n} tensor-parallel ranks "
                                         f"does not hold a 1/{n} slice of each of its sub-parameters of sizes "
                                         f"{list(sub_sizes)} along dimension 0 (universal_checkpoint_info's "
                                         "sub_param_shape)")
        sizes = [size // n for size in sub_sizes]
    elif shape[dim] % subs:
        raise CorruptCheckpointError(f"{f0.rel}: {what!r} of shape {shape} holds {subs} sub-parameters (gate and up) "
                                     f"along dimension {dim}, which {shape[dim]} does not divide")
    else:
        sizes = [shape[dim] // subs] * subs
    full = list(shape)
    full[dim] = shape[dim] * n
    keep = full[dim]
    if vocab_size is not None and param.key.split(".")[-2] in VOCAB and dim == 0:
        if vocab_size > full[0]:
            raise CorruptCheckpointError(f"{f0.rel}: {what!r} holds {full[0]} vocabulary rows over {n} ranks, fewer "
                                         f"than the vocabulary size {vocab_size}")
        keep = full[0] = vocab_size
    pieces = []
    for k, sub in enumerate(sizes):
        before = sum(sizes[:k])  # the rank's rows of the sub-parameters before this one
        for t, (f, ref) in enumerate(shards):
            start = before * n + t * sub  # the sub-parameter's rows of this rank, in the consolidated tensor
            rows = min(sub, keep - start)
            if rows <= 0:
                continue
            part = list(shape)
            part[dim] = rows
            src = [0] * len(shape)
            src[dim] = before
            dest = [0] * len(shape)
            dest[dim] = start
            if math.prod(part):
                pieces.append(_piece(f, ref, part, src, dest))
    return TensorSpec(key=path_key(path), path=list(path), dtype=r0.storage.dtype, shape=full, pieces=pieces)


def _member(f: _File, ref: TensorRef) -> str:
    return f"{f.prefix}/data/{ref.storage.key}"


def _strides(ref: TensorRef, shape: list[int]) -> list[int] | None:
    return None if tuple(ref.strides) == row_major_strides(shape) else list(ref.strides)


def _piece(f: _File, ref: TensorRef, shape: list[int], src: list[int], dest: list[int]) -> Piece:
    """Elements ``src`` + ``shape`` of ``ref`` placed at ``dest``."""
    first = ref.offset + sum(o * s for o, s in zip(src, ref.strides))
    return Piece(file=f.rel, member=_member(f, ref), offset=first * dtypes.itemsize(ref.storage.dtype), shape=shape,
                 strides=_strides(ref, shape), box=Box(offsets=dest, shape=shape))


def _namespace(f: _File) -> dict[str, Any]:
    """The attributes of the file's ``args`` (an argparse Namespace), or {}."""
    return _record_namespace(f.obj.get("args"))


def _record_namespace(args: Any) -> dict[str, Any]:
    state = getattr(args, "state", None) if isinstance(args, Record) else None
    if isinstance(state, tuple) and state and isinstance(state[0], dict):  # copyreg's (dict, slots)
        state = state[0]
    return {k: v for k, v in state.items() if isinstance(k, str)} if isinstance(state, dict) else {}


def _no_decay(name: str, ref: TensorRef) -> bool:
    return name.endswith(".bias") or len(ref.shape) == 1


def _optimizer_dicts(files: dict[tuple[int, int], _File]
                     ) -> tuple[dict[tuple[int, int], dict], dict[tuple[int, int], Any]] | None:
    """Per rank: the torch optimizer's state dict, and a mixed-precision run's fp32 main params per
    group (where saved); None when the files hold no optimizer."""
    inner: dict[tuple[int, int], dict] = {}
    masters: dict[tuple[int, int], Any] = {}
    for at, f in files.items():
        opt = f.obj.get("optimizer")
        if opt is None:
            return None
        if isinstance(opt, list):
            raise UnsupportedValueError(f"{f.rel}: 'optimizer' holds {len(opt)} chained optimizers; only a single "
                                        "optimizer's state imports")
        if not isinstance(opt, dict):
            raise CorruptCheckpointError(f"{f.rel}: 'optimizer' is a {type(opt).__name__}, expected a dict")
        o = opt.get("optimizer", opt)  # mixed precision: the torch optimizer's state under 'optimizer'
        if not isinstance(o, dict) or not isinstance(o.get("param_groups"), list):
            raise CorruptCheckpointError(f"{f.rel}: 'optimizer' holds no param_groups (not a Megatron optimizer "
                                         "of a version resurgo reads?)")
        inner[at] = o
        if o is not opt and opt.get("fp32_from_fp16_params") is not None:
            masters[at] = opt["fp32_from_fp16_params"]
    return inner, masters


def _rank_numbers(files: dict[tuple[int, int], _File], inner: dict[tuple[int, int], dict],
                  masters: dict[tuple[int, int], Any], local_names: dict[tuple[int, int], list[tuple[str, TensorRef]]]
                  ) -> tuple[dict[int, list[str]], dict[tuple[str, int], Any], dict[tuple[str, int], Any]]:
    """(each group's parameters in global model order; per (global key, tensor-parallel rank): the
    rank's optimizer state entry, and its fp32 main param where saved)."""
    groups0 = inner[0, 0]["param_groups"]
    by_group: dict[int, list[str]] = defaultdict(list)
    state_of: dict[tuple[str, int], Any] = {}
    master_of: dict[tuple[str, int], Any] = {}
    for (tp, pp), f in sorted(files.items(), key=lambda item: (item[0][1], item[0][0])):
        o = inner[tp, pp]
        pgs = o["param_groups"]
        if len(pgs) != len(groups0):
            raise CorruptCheckpointError(f"{f.rel}: the optimizer holds {len(pgs)} param groups, "
                                         f"{files[0, 0].rel} {len(groups0)}: files of two different runs are mixed?")
        members = _group_members(f, pgs, local_names[tp, pp])
        state = o.get("state")
        if not isinstance(state, dict):
            raise CorruptCheckpointError(f"{f.rel}: the optimizer's 'state' is a {type(state).__name__}, "
                                         "expected a dict")
        for g, (pg, names) in enumerate(zip(pgs, members)):
            ids = pg.get("params")
            if not isinstance(ids, list) or len(ids) != len(names):
                raise CorruptCheckpointError(
                    f"{f.rel}: optimizer param group {g} numbers {_count(ids)} parameters, but the model holds "
                    f"{len(names)} of that group (wd_mult {pg.get('wd_mult')!r}); cannot tell which is which")
            for i, name in zip(ids, names):
                state_of[name, tp] = state.get(i)
                if tp == 0:
                    by_group[g].append(name)
            if (tp, pp) in masters:
                main = masters[tp, pp]
                if not isinstance(main, list) or len(main) != len(pgs) or not isinstance(main[g], list) \
                        or len(main[g]) != len(names):
                    raise CorruptCheckpointError(f"{f.rel}: fp32_from_fp16_params does not hold one fp32 tensor "
                                                 f"per parameter of group {g} ({len(names)})")
                for name, ref in zip(names, main[g]):
                    master_of[name, tp] = ref
    return by_group, state_of, master_of


def _optimizer(files: dict[tuple[int, int], _File], local_names: dict[tuple[int, int], list[tuple[str, TensorRef]]],
               params: dict[str, _Param], tp_size: int, gated: bool, vocab_size: int | None
               ) -> tuple[list[TensorSpec], list[dict] | None]:
    """The Adam state of every parameter, numbered as a one-rank run's optimizer numbers it, and the
    param groups (hyperparameters, ``params`` renumbered); ([], None) when the files hold no optimizer."""
    found = _optimizer_dicts(files)
    if found is None:
        return [], None
    inner, masters = found
    groups0 = inner[0, 0]["param_groups"]
    by_group, state_of, master_of = _rank_numbers(files, inner, masters, local_names)
    tensors: list[TensorSpec] = []
    number = 0
    renumbered = []
    for g, pg in enumerate(groups0):
        ids = []
        for name in by_group[g]:
            ids.append(number)
            entries = [state_of[name, tp] for tp in range(tp_size)]
            shards = params[name].shards
            if all(e is None for e in entries):
                number += 1
                continue
            for (f, ref), e in zip(shards, entries):
                if not isinstance(e, dict):
                    raise CorruptCheckpointError(f"{f.rel}: no optimizer state for {name!r}, which other ranks hold")
            for moment in ("exp_avg", "exp_avg_sq"):
                refs = [(f, e.get(moment)) for (f, _), e in zip(shards, entries)]
                for (f, ref), (_, m) in zip(shards, refs):
                    if not isinstance(m, TensorRef) or m.shape != ref.shape:
                        raise CorruptCheckpointError(
                            f"{f.rel}: the optimizer's {moment} for {name!r} is {shown(m)}, expected a tensor of the "
                            f"parameter's shape {list(ref.shape)}: the optimizer's parameter numbers do not follow "
                            "Megatron's grouping (biases and 1-D tensors without weight decay)")
                tensors.append(_tensor(params[name], ("optimizer", "state", number, moment), gated, vocab_size,
                                       shards=refs, name=f"{name} {moment}"))
            steps = [(f, e.get("step")) for (f, _), e in zip(shards, entries)]
            if all(isinstance(s, TensorRef) for _, s in steps):
                step_param = _Param(f"{name}.step", steps)  # a scalar: replicated on every rank
                tensors.append(_tensor(step_param, ("optimizer", "state", number, "step"), gated, None))
            number += 1
        renumbered.append({**{str(k): v for k, v in _json_part(pg).items() if k != "params"}, "params": ids})
    return tensors + _main_params(by_group, master_of, params, gated, vocab_size), renumbered


def _main_params(by_group: dict[int, list[str]], master_of: dict[tuple[str, int], Any], params: dict[str, _Param],
                 gated: bool, vocab_size: int | None) -> list[TensorSpec]:
    """A mixed-precision run's fp32 main params, consolidated as their parameters."""
    out = []
    for name in (n for g in sorted(by_group) for n in by_group[g]):
        if (name, 0) in master_of:
            shards = [(f, master_of[name, tp]) for tp, (f, _) in enumerate(params[name].shards)]
            for (f, ref), (_, m) in zip(params[name].shards, shards):
                if not isinstance(m, TensorRef) or m.shape != ref.shape or m.storage.dtype != "float32":
                    raise CorruptCheckpointError(f"{f.rel}: the fp32 main param of {name!r} is {shown(m)}, expected a "
                                                 f"float32 tensor of the parameter's shape {list(ref.shape)}")
            out.append(_tensor(params[name], ("optimizer", "fp32_from_fp16_params", name), gated, vocab_size,
                               shards=shards, name=f"{name} fp32 main param"))
    return out


def _group_members(f: _File, pgs: list, names: list[tuple[str, TensorRef]]) -> list[list[str]]:
    """Each param group's parameters of the rank, in the rank's order: all in one group; or by
    Megatron's rule, biases and 1-D tensors in the group of ``wd_mult`` 0, the rest in the other."""
    if len(pgs) == 1:
        return [[n for n, _ in names]]
    mults = [pg.get("wd_mult") if isinstance(pg, dict) else None for pg in pgs]
    decays = [m != 0 for m in mults]
    if any(not isinstance(m, (int, float)) for m in mults) or sorted(decays) != [False, True]:
        raise UnsupportedValueError(
            f"{f.rel}: the optimizer has {len(pgs)} param groups with wd_mult {mults}: which parameter is in which "
            "group cannot be told (only Megatron's default grouping, by weight decay, imports)")
    return [[n for n, r in names if _no_decay(n, r) != decay] for decay in decays]


def _count(value: Any) -> Any:
    return len(value) if isinstance(value, list) else "no"


def _json_part(value: Any) -> Any:
    """``value`` as JSON data (tuples as lists; dict entries that are not plain left out), or None."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        items = [_json_part(v) for v in value]
        return items if all(i is not None or v is None for i, v in zip(items, value)) else None
    if isinstance(value, dict):
        return {k: p for k, v in value.items()
                if isinstance(k, str) and ((p := _json_part(v)) is not None or v is None)}
    return None


def _values(first: _File, args: dict[str, Any], groups: list[dict] | None, tp: int, pp: int,
            layers: int) -> dict[str, Any]:
    values: dict[str, Any] = {}
    it = first.obj.get("iteration")
    if isinstance(it, int) and not isinstance(it, bool):
        values["iteration"] = values["step"] = it
    for k in ("checkpoint_version", "num_floating_point_operations_so_far"):
        v = _json_part(first.obj.get(k))
        if v is not None:
            values[k] = v
    if args:
        values["args"] = _json_part(args)
    scheduler = _json_part(first.obj.get("opt_param_scheduler"))
    if isinstance(scheduler, dict):
        values["opt_param_scheduler"] = scheduler
    if groups is not None:
        values["optimizer"] = {"param_groups": groups}
    values["megatron"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "num_layers": layers}
    return values


def _rng(files: dict[tuple[int, int], _File]) -> list[TensorSpec]:
    """Each rank's torch RNG states (``rng_state``: a list, one per data-parallel rank saved), as
    tensors under ``rng.mp_rank_<tp>_<pp>.<i>.<name>``; Python's and numpy's states are not tensors
    and are left out."""
    out = []
    for (tp, pp), f in sorted(files.items()):
        states = f.obj.get("rng_state")
        if not isinstance(states, list):
            continue
        for i, st in enumerate(states):
            if not isinstance(st, dict):
                continue
            for name, ref in _flat(f, st, "rng_state"):
                path: tuple[str | int, ...] = ("rng", f"mp_rank_{tp:02d}_{pp:03d}", i, *name.split("."))
                whole = _Param(name, [(f, ref)])
                out.append(_tensor(whole, path, False, None))
    return out
