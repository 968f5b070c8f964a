"""A spec from a DeepSpeed checkpoint with tensor or pipeline parallelism, as Megatron-DeepSpeed
writes it, consolidated to one rank: the model weights and, where the files hold it, the ZeRO
optimizer state.

In the tag folder, either (tensor parallelism alone) one ``mp_rank_<t:02d>_model_states.pt`` per
tensor-parallel rank ``t`` whose ``module`` is the rank's state dict; or (pipeline parallelism,
DeepSpeed's PipelineModule) one ``layer_<i:02d>-model_<t:02d>-model_states.pt`` per layer ``i``
that holds parameters and tensor-parallel rank ``t``, holding that layer's state dict, the
layers numbered globally by the PipelineModule (so no renumbering is needed), and one
``mp_rank_<m:02d>_model_states.pt`` per model-parallel rank ``m = stage * tp + t`` (DeepSpeed's
pipe-major grid) with the counters, Megatron's ``args`` and the rank's ``param_shapes``.

The tensors are consolidated by Megatron's rules (:mod:`.megatron`: partition dimension by name,
a gated ``dense_h_to_4h`` gathered as [gate; up], replicated tensors checked equal, the
vocabulary padding dropped when the true size is known) and named as the PipelineModule names
them, ``model.<layer>.<name>`` (``model.<name>`` without pipeline parallelism). Where the model
states hold Universal Checkpointing's ``universal_checkpoint_info``, its sub-parameter patterns are
steps of the spec too: a parameter matching ``parameter_with_sub_params`` (a fused [q; k; v] that
rank ``t`` holds as its own [q_t; k_t; v_t]) is split per rank and each sub-parameter gathered on
its own, [q of all ranks; k of all ranks; v of all ranks], as ``ds_to_universal`` merges it;
``parameter_with_2_sub_params_cat_dim_0`` likewise as [gate; up].

The optimizer: ZeRO 1/2 (or DeepSpeed's bf16 optimizer, partitioned as ZeRO 1) files
``[bf16_]zero_pp_rank_<d>_mp_rank_<m:02d>_optim_states.pt`` per data-parallel rank ``d`` and
model-parallel rank ``m``. Each model-parallel rank's files are read as
:mod:`.deepspeed` reads a ZeRO checkpoint (its ``param_shapes``, the data-parallel partitions laid
end to end), which gives each parameter's shard of the fp32 weights and Adam moments as flat runs;
the shards are then placed in the consolidated tensor by the same rules as the weights (a flat run
cut into boxes of the shard, each box moved to its place). The state is numbered as a one-rank
run's optimizer numbers it: group after group, in a group the stages in order and each stage's
parameters in its order; a tied parameter (``tied_modules.<key>.<name>``) is the first layer's
that holds ``<name>``, counted once. Under ``optimizer.state.<i>`` (``exp_avg``, ``exp_avg_sq``,
``step``), ``optimizer.param_groups``, and, when the weights are not float32, the fp32 weights
under ``optimizer.fp32_from_fp16_params.<name>`` (as :mod:`.megatron` names a mixed-precision run's).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

from resurgo.errors import CorruptCheckpointError, UnsupportedValueError
from resurgo.format import dtypes
from resurgo.format.tree import path_key
from resurgo.interop.megatron import (
    _File,
    _flat,
    _json_part,
    _Param,
    _record_namespace,
    _rule,
    _tensor,
    VOCAB,
)
from resurgo.interop.spec import Box, ImportSpec, Piece, Source, TensorSpec, row_major_strides
from resurgo.interop.unpickle import Record, shown

LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
MP_RANK = re.compile(r"(?:^|_)mp_rank_(\d+)_")  # in the model states' and the ZeRO optimizer files' names
OPTIM_MP = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
UCP_INFO = "universal_checkpoint_info"
TIED = "tied_modules."

Load = Callable[[str], tuple[str, str, Any]]


def is_model_parallel(folder: Path) -> bool:
    """Whether the tag folder holds pipeline stages' layer files or a second model-parallel rank's files."""
    for p in folder.iterdir():
        m = MP_RANK.search(p.name)
        if LAYER_FILE.match(p.name) or (m and int(m.group(1)) != 0):
            return True
    return False


def spec_model_parallel(folder: Path, load: Load, vocab_size: int | None = None) -> ImportSpec:
    """The consolidated checkpoint of the tag folder ``folder``; ``load(name)`` reads one of its files
    (deepspeed's loader: inside the source, restricted unpickling) and returns (rel, prefix, obj);
    ``vocab_size``: the true vocabulary size (default ``args.vocab_size``, or the
    ``original_vocab_size`` of ``universal_checkpoint_info``)."""
    layers: dict[int, set[int]] = {}
    ranks: set[int] = set()
    for p in folder.iterdir():
        if m := LAYER_FILE.match(p.name):
            layers.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        elif m := MP_FILE.match(p.name) or OPTIM_MP.match(p.name):
            ranks.add(int(m.group(m.re.groups)))
    first = _file(load("mp_rank_00_model_states.pt"), 0)
    args = _record_namespace(first.obj.get("args"))
    gated = bool(args.get("swiglu") or args.get("gated_linear_unit"))
    if vocab_size is None and isinstance(args.get("vocab_size"), int) and not isinstance(args.get("vocab_size"), bool):
        vocab_size = args["vocab_size"]
    subs = _SubParams(first)
    if vocab_size is None and isinstance(subs.vocab_size, int) and not isinstance(subs.vocab_size, bool):
        vocab_size = subs.vocab_size  # universal_checkpoint_info's original_vocab_size
    params: dict[str, _Param] = {}
    if layers:
        tp = 1 + max(t for ts in layers.values() for t in ts)
        for i in sorted(layers):
            missing = sorted(set(range(tp)) - layers[i])
            if missing:
                raise CorruptCheckpointError(f"{folder / f'layer_{i:02d}-model_{missing[0]:02d}-model_states.pt'}: "
                                             f"missing (layer {i} of a checkpoint of {tp} tensor-parallel ranks)")
            files = [_file(load(f"layer_{i:02d}-model_{t:02d}-model_states.pt"), t) for t in range(tp)]
            params.update(_params(files, lambda f: f.obj, f"{i}."))
    else:
        tp = 1 + max(ranks)
        missing = sorted(set(range(tp)) - ranks)
        if missing:
            raise CorruptCheckpointError(f"{folder / f'mp_rank_{missing[0]:02d}_model_states.pt'}: missing (a "
                                         f"checkpoint of {tp} tensor-parallel ranks)")
        files = [first] + [_file(load(f"mp_rank_{t:02d}_model_states.pt"), t) for t in range(1, tp)]
        params.update(_params(files, lambda f: f.obj.get("module"), ""))
    tensors = [_tensor(p, ("model", key), gated, vocab_size, sub_sizes=subs.sizes(p)) for key, p in params.items()]
    values: dict[str, Any] = {k: first.obj[k] for k in ("global_steps", "global_samples", "iteration", "ds_version")
                              if isinstance(first.obj.get(k), (int, str)) and not isinstance(first.obj.get(k), bool)}
    step = values.get("iteration", values.get("global_steps"))
    if isinstance(step, int):
        values["step"] = step
    if args:
        values["args"] = _json_part(args)
    values["tensor_model_parallel_size"] = tp
    layout = _Layout(params, tp, gated, vocab_size, subs, bool(layers))
    optimizer, groups = _optimizer(folder, load, layout, (1 + max(ranks)) // tp if layers else 1)
    if groups is not None:
        values["optimizer"] = {"param_groups": groups}
    return ImportSpec(tensors=tensors + optimizer, values=values)


def _file(found: tuple[str, str, Any], tp: int) -> _File:
    rel, prefix, obj = found
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{rel}: holds a {type(obj).__name__}, not the dict DeepSpeed saves")
    return _File(rel, prefix, obj, tp, 0)


def _params(files: list[_File], state_of: Callable[[_File], Any], prefix: str) -> dict[str, _Param]:
    named = [_flat(f, state_of(f), "module") for f in files]
    keys = [n for n, _ in named[0]]
    for f, these in zip(files[1:], named[1:]):
        if [n for n, _ in these] != keys:
            other = sorted(set(keys) ^ {n for n, _ in these})
            raise CorruptCheckpointError(f"{f.rel}: holds other tensors than {files[0].rel} ({shown(other, 200)} in "
                                         "one only): files of two different runs are mixed?")
    return {f"{prefix}{name}": _Param(f"{prefix}{name}", [(f, these[j][1]) for f, these in zip(files, named)])
            for j, name in enumerate(keys)}


class _SubParams:
    """Universal Checkpointing's sub-parameter patterns of the model states (``universal_checkpoint_info``):
    per parameter name, the consolidated sizes along dimension 0 of the sub-parameters each rank slices."""

    def __init__(self, first: _File) -> None:
        self.rel = first.rel
        info = first.obj.get(UCP_INFO)
        info = info if isinstance(info, dict) else {}
        self.shapes: list[tuple[list[str], Any]] = []
        self.vocab_size = info.get("original_vocab_size")
        for entry in info.get("parameter_with_sub_params") or []:
            # a dict of SubparamShape's fields (DeepSpeed's current form), or a pickled SubparamShape
            state = entry.state if isinstance(entry, Record) else entry
            state = state[0] if isinstance(state, tuple) and state else state
            if not isinstance(state, dict) or not isinstance(state.get("patterns"), list) \
                    or not isinstance(state.get("shape"), (list, tuple)) or not state["shape"]:
                raise CorruptCheckpointError(f"{self.rel}: {UCP_INFO}'s parameter_with_sub_params holds "
                                             f"{shown(entry, 200)}, expected SubparamShape(patterns, shape, "
                                             "partition_dim)")
            if state.get("partition_dim") != 0:
                raise UnsupportedValueError(f"{self.rel}: {UCP_INFO}: sub-parameters {state['patterns']} are split "
                                            f"along dimension {state.get('partition_dim')!r}; only dimension 0 imports")
            self.shapes.append((state["patterns"], state["shape"]))
        self.halves = [p for p in info.get("parameter_with_2_sub_params_cat_dim_0") or [] if isinstance(p, str)]

    def sizes(self, param: _Param) -> tuple[int, ...] | None:
        """The sub-parameter sizes of ``param`` in rows of its consolidated tensor, or None (Megatron's rule)."""
        shard = param.shards[0][1]
        rows = shard.shape[0] * len(param.shards) if shard.shape else 0
        if any(re.match(p, param.key) for p in self.halves):
            return (rows // 2, rows - rows // 2)
        for patterns, shape in self.shapes:
            if any(isinstance(p, str) and re.match(p, param.key) for p in patterns):
                if not isinstance(shape[0], (list, tuple)):  # a count of equal sub-parameters
                    count = shape[0]
                    if not isinstance(count, int) or count < 1 or rows % count:
                        raise CorruptCheckpointError(f"{param.shards[0][0].rel}: {param.key!r} of {rows} rows "
                                                     f"cannot hold the {shown(count)} equal sub-parameters the "
                                                     f"sub_param_shape {shown(shape, 120)} of {self.rel} names")
                    return (rows // count,) * count
                heads = tuple(shape[0])
                unit = math.prod(sum(d) if isinstance(d, (list, tuple)) else d for d in shape[1:])
                row = math.prod(shard.shape[1:])
                if not all(isinstance(h, int) and h > 0 for h in heads) or unit <= 0 or unit % row \
                        or sum(heads) * (unit // row) != rows:
                    raise CorruptCheckpointError(
                        f"{param.shards[0][0].rel}: {param.key!r} of shape {list(shard.shape)} on each of "
                        f"{len(param.shards)} ranks does not fit the sub_param_shape {shown(shape, 120)} of {self.rel}")
                return tuple(h * (unit // row) for h in heads)
        return None


class _Layout:
    """Where each element of a tensor-parallel shard goes in the consolidated tensor (the weights' rules)."""

    def __init__(self, params: dict[str, _Param], tp: int, gated: bool, vocab_size: int | None, subs: _SubParams,
                 pipeline: bool) -> None:
        self.params, self.tp, self.gated, self.vocab_size, self.subs = params, tp, gated, vocab_size, subs
        self.pipeline = pipeline

    def key_of(self, name: str, rel: str) -> str:
        """The consolidated key of ``name`` of ``param_shapes``: a tied module's parameter is that of the
        first layer holding it."""
        if name in self.params:
            return name
        if self.pipeline and name.startswith(TIED):
            rest = name[len(TIED):].split(".", 1)[-1]
            held = sorted((int(k.split(".", 1)[0]), k) for k in self.params if k.split(".", 1)[-1] == rest)
            if held:
                return held[0][1]
        raise CorruptCheckpointError(f"{rel}: param_shapes names {name!r}, which no model states file holds: files "
                                     "of two different runs are mixed?")

    def boxes(self, key: str, t: int, offsets: list[int], shape: list[int]) -> list[tuple[list[int], list[int], int]]:
        """The shard box (``offsets``, ``shape``) of rank ``t`` as (consolidated offsets, shape, element
        offset into the box's source): split at sub-parameter bounds, padding rows dropped."""
        param = self.params[key]
        sub_sizes = self.subs.sizes(param)
        dim, nsubs = _rule(key, self.gated)
        if sub_sizes is not None:
            dim = 0
        if dim is None or dim >= len(shape):
            return [(offsets, shape, 0)]
        n = self.tp
        local = param.shards[0][1].shape[dim]
        sizes = [s // n for s in sub_sizes] if sub_sizes is not None else [local // nsubs] * nsubs
        keep = None
        if self.vocab_size is not None and key.split(".")[-2] in VOCAB and dim == 0:
            keep = self.vocab_size
        stride = math.prod(shape[dim + 1:])
        out = []
        lo, hi = offsets[dim], offsets[dim] + shape[dim]
        before = 0
        for size in sizes:
            a, b = max(lo, before), min(hi, before + size)
            start = before * n + t * size + (a - before)
            rows = b - a if keep is None else min(b - a, keep - start)
            if rows > 0:
                dest, part = list(offsets), list(shape)
                dest[dim], part[dim] = start, rows
                out.append((dest, part, (a - lo) * stride))
            before += size
        return out


def _flat_boxes(shape: list[int], a: int, b: int) -> list[tuple[list[int], list[int]]]:
    """The flat range [a, b) of a row-major tensor of ``shape`` as boxes (offsets, shape), in order."""
    if a >= b:
        return []
    if not shape:
        return [([], [])]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(a, inner)
    r1, c1 = divmod(b, inner)
    out = []
    if c0:
        end = b if r1 == r0 else (r0 + 1) * inner
        out += [([r0] + o, [1] + s) for o, s in _flat_boxes(shape[1:], c0, end - r0 * inner)]
        r0 += 1
        if r0 * inner >= b:
            return out
    if r1 > r0:
        out.append(([r0] + [0] * (len(shape) - 1), [r1 - r0] + list(shape[1:])))
    if c1:
        out += [([r1] + o, [1] + s) for o, s in _flat_boxes(shape[1:], 0, c1)]
    return out


def _placed(layout: _Layout, key: str, t: int, shard: TensorSpec) -> list[Piece]:
    """The flat pieces of rank ``t``'s shard of ``key`` as box pieces of the consolidated tensor."""
    strides = list(row_major_strides(shard.shape))
    size = dtypes.itemsize(shard.dtype)
    out = []
    for p in shard.pieces:
        assert p.flat is not None
        for offsets, shape in _flat_boxes(shard.shape, p.flat.start, p.flat.stop):
            first = sum(o * s for o, s in zip(offsets, strides)) - p.flat.start
            for dest, part, skip in layout.boxes(key, t, offsets, shape):
                mine = None if tuple(strides) == row_major_strides(part) else strides
                out.append(Piece(file=p.file, member=p.member, offset=p.offset + (first + skip) * size, shape=part,
                                 strides=mine, box=Box(offsets=dest, shape=part)))
    return out


def _consolidated(layout: _Layout, key: str, path: tuple[str | int, ...], shards: list[TensorSpec],
                  full: list[int]) -> TensorSpec:
    """One tensor of the optimizer from each tensor-parallel rank's ``shards`` (flat pieces); a
    replicated parameter's other ranks are replicas of rank 0's, compared bit for bit."""
    dim, _ = _rule(key, layout.gated)
    if layout.subs.sizes(layout.params[key]) is None and (dim is None or dim >= len(full)):
        pieces = _placed(layout, key, 0, shards[0])
        for t, shard in enumerate(shards[1:], 1):
            theirs = _placed(layout, key, t, shard)
            if [(p.box, p.shape) for p in theirs] != [(p.box, p.shape) for p in pieces]:
                raise CorruptCheckpointError(f"{theirs[0].file if theirs else key}: the optimizer partitions of "
                                             f"{key!r} differ between tensor-parallel ranks 0 and {t}")
            pieces = [p.model_copy(update={"replicas": p.replicas + [
                Source(file=q.file, member=q.member, offset=q.offset, strides=q.strides)]})
                for p, q in zip(pieces, theirs)]
    else:
        pieces = [p for t, shard in enumerate(shards) for p in _placed(layout, key, t, shard)]
    return TensorSpec(key=path_key(path), path=list(path), dtype=shards[0].dtype, shape=full, pieces=pieces)


def _optimizer(folder: Path, load: Load, layout: _Layout, stages: int) -> tuple[list[TensorSpec], list[dict] | None]:
    """The ZeRO 1/2 optimizer state of every model-parallel rank, consolidated (see the module
    docstring); ([], None) without optimizer files."""
    from resurgo.interop import deepspeed as zero  # it imports this module: read its ZeRO layout late

    found = [(m.group(1) or "", int(m.group(2)), int(m.group(3))) for p in folder.iterdir()
             if (m := OPTIM_MP.match(p.name))]
    if not found:
        return [], None
    kinds = sorted({k for k, _, _ in found})
    if len(kinds) > 1:
        raise CorruptCheckpointError(f"{folder}: holds both zero_pp_rank_* and bf16_zero_pp_rank_* optimizer files: "
                                     "files of two different runs are mixed (keep one run's files)")
    name = kinds[0] + "zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt"
    world = 1 + max(d for _, d, _ in found)
    tp = layout.tp
    for mp in range(tp * stages):
        for d in range(world):
            if (kinds[0], d, mp) not in found:
                raise CorruptCheckpointError(f"{folder / name.format(d, mp)}: missing (a checkpoint of {tp * stages} "
                                             f"model- and {world} data-parallel ranks has an optimizer file for "
                                             "each pair)")
    # Per model-parallel rank: its parameters' shards (flat pieces), keyed by consolidated key.
    shards: dict[tuple[str, str, int], TensorSpec] = {}
    order: list[list[str]] = []
    first_groups: Any = None
    for stage in range(stages):
        for t in range(tp):
            mp = stage * tp + t
            model = zero._File(*load(f"mp_rank_{mp:02d}_model_states.pt"))
            optims = [zero._File(*load(name.format(d, mp))) for d in range(world)]
            osd = zero._get(optims[0], "optimizer_state_dict", dict)
            # DeepSpeed's bf16 optimizer (no ZeRO stage; Megatron-DeepSpeed's usual one) partitions
            # each group's flat weights over the data-parallel ranks as ZeRO 1 does
            bf16_optimizer = kinds[0] and osd.get("zero_stage") is None and "single_partition_of_fp32_groups" in osd
            if osd.get("zero_stage") not in (1, 2) and not bf16_optimizer:
                raise UnsupportedValueError(f"{optims[0].rel}: ZeRO stage {osd.get('zero_stage')!r}; of checkpoints "
                                            "with tensor or pipeline parallelism, the optimizer of ZeRO 1 and 2 "
                                            "and the bf16 optimizer import")
            groups, index = zero._groups(model)
            if first_groups is None:
                inner = osd.get("base_optimizer_state")
                first_groups = inner.get("param_groups") if isinstance(inner, dict) else None
                order = [[] for _ in groups]
            if len(groups) != len(order):
                raise CorruptCheckpointError(f"{model.rel}: {len(groups)} param groups, rank 0's {len(order)}: files "
                                             "of two different runs are mixed?")
            number = {i: n for n, i in index.items()}
            for spec in zero._zero12(groups, optims, folder, index):
                path = spec.path or []
                if path[0] == "model":
                    kind, pname = "fp32", str(path[1])
                else:
                    kind, pname = str(path[3]), number[int(path[2])]
                key = layout.key_of(pname, model.rel)
                if (kind, key, t) not in shards:
                    shards[kind, key, t] = spec
            if t == 0:
                for g, members in enumerate(groups):
                    for pname, _ in members:
                        key = layout.key_of(pname, model.rel)
                        if not any(key in o for o in order):
                            order[g].append(key)
    return _optimizer_tensors(layout, shards, order), _param_groups(first_groups, order, folder)


def _optimizer_tensors(layout: _Layout, shards: dict[tuple[str, str, int], TensorSpec],
                       order: list[list[str]]) -> list[TensorSpec]:
    """Per parameter of ``order`` (group after group), numbered from 0: its moments, step and (bf16
    weights) fp32 weights, each rank's shard laid in place."""
    out = []
    number = 0
    for members in order:
        for key in members:
            param = layout.params[key]
            ref = param.shards[0][1]
            full = _tensor(param, ("model", key), layout.gated, layout.vocab_size,
                           sub_sizes=layout.subs.sizes(param)).shape
            for kind in ("exp_avg", "exp_avg_sq", "fp32"):
                these = []
                for t in range(layout.tp):
                    s = shards.get((kind, key, t))
                    if s is None or s.shape != list(ref.shape):
                        raise CorruptCheckpointError(
                            f"{param.shards[t][0].rel}: the ZeRO partitions give {key!r} "
                            f"{'no ' + kind if s is None else f'the shape {s.shape}'}, its weights of rank {t} the "
                            f"shape {list(ref.shape)}: files of two different runs are mixed?")
                    these.append(s)
                if kind != "fp32":
                    out.append(_consolidated(layout, key, ("optimizer", "state", number, kind), these, full))
                elif ref.storage.dtype != "float32":  # a bf16 run's fp32 weights; an fp32 run's are its weights
                    out.append(_consolidated(layout, key, ("optimizer", "fp32_from_fp16_params", key), these, full))
            steps = [s for t in range(layout.tp) if (s := shards.get(("step", key, t))) is not None and s.pieces]
            if len(steps) == layout.tp:
                head = steps[0].pieces[0]
                others = [r for s in steps[1:] for p in s.pieces
                          for r in [Source(file=p.file, member=p.member, offset=p.offset), *p.replicas]]
                out.append(TensorSpec(key=path_key(("optimizer", "state", number, "step")),
                                      path=["optimizer", "state", number, "step"], dtype="float32", shape=[],
                                      pieces=[head.model_copy(update={"replicas": head.replicas + others})]))
            number += 1
    return out


def _param_groups(groups: Any, order: list[list[str]], folder: Path) -> list[dict]:
    """Rank 0's param groups (plain values), ``params`` numbered as :func:`_optimizer_tensors` numbers them."""
    if not isinstance(groups, list) or len(groups) != len(order):
        count = len(groups) if isinstance(groups, list) else "no"
        raise CorruptCheckpointError(f"{folder}: the optimizer holds {count} param groups, the model states "
                                     f"{len(order)}: files of two different runs are mixed?")
    out, number = [], 0
    for pg, members in zip(groups, order):
        plain = _json_part(pg) if isinstance(pg, dict) else {}
        out.append({**{str(k): v for k, v in (plain or {}).items() if k != "params"},
                    "params": list(range(number, number + len(members)))})
        number += len(members)
    return out
