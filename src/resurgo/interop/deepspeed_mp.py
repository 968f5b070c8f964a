"""A spec from a DeepSpeed checkpoint with tensor or pipeline parallelism, as Megatron-DeepSpeed
writes it: the model weights consolidated to one rank.

In the tag folder, either (tensor parallelism alone) one ``mp_rank_<t:02d>_model_states.pt`` per
tensor-parallel rank ``t`` whose ``module`` is the rank's state dict; or (pipeline parallelism,
DeepSpeed's PipelineModule) one ``layer_<i:02d>-model_<t:02d>-model_states.pt`` per layer ``i``
that holds parameters and tensor-parallel rank ``t``, holding that layer's state dict, the
layers numbered globally by the PipelineModule (so no renumbering is needed). Beside them,
``mp_rank_00_model_states.pt`` holds the counters and Megatron's ``args``.

The tensors are consolidated by Megatron's rules (:mod:`.megatron`: partition dimension by name,
a gated ``dense_h_to_4h`` gathered as [gate; up], replicated tensors checked equal) and named as
the PipelineModule names them, ``model.<layer>.<name>`` (``model.<name>`` without pipeline
parallelism). The ZeRO optimizer files of such a checkpoint are not read: only the weights import.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from resurgo.errors import CorruptCheckpointError
from resurgo.interop.megatron import _File, _flat, _json_part, _Param, _record_namespace, _tensor
from resurgo.interop.spec import ImportSpec, TensorSpec
from resurgo.interop.unpickle import shown

LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
MP_RANK = re.compile(r"(?:^|_)mp_rank_(\d+)_")  # in the model states' and the ZeRO optimizer files' names


def is_model_parallel(folder: Path) -> bool:
    """Whether the tag folder holds pipeline stages' layer files or a second tensor-parallel rank's model states."""
    for p in folder.iterdir():
        m = MP_RANK.search(p.name)
        if LAYER_FILE.match(p.name) or (m and int(m.group(1)) != 0):
            return True
    return False


def spec_model_parallel(folder: Path, load: Callable[..., Any]) -> ImportSpec:
    """The consolidated weights of the tag folder ``folder``; ``load(name)`` reads one of its files
    (deepspeed's loader: inside the source, restricted unpickling) and returns (rel, prefix, obj)."""
    layers: dict[int, set[int]] = {}
    ranks: set[int] = set()
    for p in folder.iterdir():
        if m := LAYER_FILE.match(p.name):
            layers.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        elif m := MP_RANK.search(p.name):
            ranks.add(int(m.group(1)))
    first = _file(load("mp_rank_00_model_states.pt"), 0)
    args = _record_namespace(first.obj.get("args"))
    gated = bool(args.get("swiglu") or args.get("gated_linear_unit"))
    tensors: list[TensorSpec] = []
    if layers:
        tp = 1 + max(t for ts in layers.values() for t in ts)
        for i in sorted(layers):
            missing = sorted(set(range(tp)) - layers[i])
            if missing:
                raise CorruptCheckpointError(f"{folder / f'layer_{i:02d}-model_{missing[0]:02d}-model_states.pt'}: "
                                             f"missing (layer {i} of a checkpoint of {tp} tensor-parallel ranks)")
            files = [_file(load(f"layer_{i:02d}-model_{t:02d}-model_states.pt"), t) for t in range(tp)]
            tensors += _consolidated(files, lambda f: f.obj, f"{i}.", gated)
    else:
        tp = 1 + max(ranks)
        missing = sorted(set(range(tp)) - ranks)
        if missing:
            raise CorruptCheckpointError(f"{folder / f'mp_rank_{missing[0]:02d}_model_states.pt'}: missing (a "
                                         f"checkpoint of {tp} tensor-parallel ranks)")
        files = [first] + [_file(load(f"mp_rank_{t:02d}_model_states.pt"), t) for t in range(1, tp)]
        tensors += _consolidated(files, lambda f: f.obj.get("module"), "", gated)
    values: dict[str, Any] = {k: first.obj[k] for k in ("global_steps", "global_samples", "iteration", "ds_version")
                              if isinstance(first.obj.get(k), (int, str)) and not isinstance(first.obj.get(k), bool)}
    step = values.get("iteration", values.get("global_steps"))
    if isinstance(step, int):
        values["step"] = step
    if args:
        values["args"] = _json_part(args)
    values["tensor_model_parallel_size"] = tp
    return ImportSpec(tensors=tensors, values=values)


def _file(found: tuple[str, str, Any], tp: int) -> _File:
    rel, prefix, obj = found
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{rel}: holds a {type(obj).__name__}, not the dict DeepSpeed saves")
    return _File(rel, prefix, obj, tp, 0)


def _consolidated(files: list[_File], state_of: Callable[[_File], Any], prefix: str, gated: bool) -> list[TensorSpec]:
    named = [_flat(f, state_of(f), "module") for f in files]
    keys = [n for n, _ in named[0]]
    for f, these in zip(files[1:], named[1:]):
        if [n for n, _ in these] != keys:
            other = sorted(set(keys) ^ {n for n, _ in these})
            raise CorruptCheckpointError(f"{f.rel}: holds other tensors than {files[0].rel} ({shown(other, 200)} in "
                                         "one only): files of two different runs are mixed?")
    out = []
    for j, name in enumerate(keys):
        param = _Param(f"{prefix}{name}", [(f, these[j][1]) for f, these in zip(files, named)])
        out.append(_tensor(param, ("model", f"{prefix}{name}"), gated, None))
    return out
