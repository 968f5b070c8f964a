"""A spec from a DeepSpeed ZeRO checkpoint directory (stages 1, 2 and 3; fp32 or bf16 optimizer
files; or ``ds_to_universal``'s output), without importing deepspeed and without executing any of
its pickles. A checkpoint with tensor or pipeline parallelism (``mp_rank_01`` and up, ``layer_*``
files) goes to :mod:`.deepspeed_mp`.

The directory holds ``latest`` (or ``latest_universal``) naming the tag and ``<tag>/``, or is
``<tag>/`` itself. In it: ``mp_rank_00_model_states.pt`` (ZeRO 1/2) or
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (ZeRO 3, one per rank) with the parameter names
and shapes, and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank
with that rank's partition of the fp32 master weights and the Adam moments. All are torch.save
archives read by the restricted unpickler with its DeepSpeed allowlist (:data:`.unpickle.DEEPSPEED`).

The parameters are rebuilt as DeepSpeed's ``zero_to_fp32`` rebuilds them, as pieces that point at
the partitions' bytes (flat ranges of each parameter):

- ZeRO 1/2: per parameter group, the ranks' fp32 partitions laid end to end (in rank order) are
  the group's parameters laid end to end, in ``param_shapes`` order, each followed by its
  alignment gap (``param_alignment_paddings``); the gaps and the padding are never read.
- ZeRO 3: each parameter is split in ``ceil(numel / world)`` elements per rank, and each rank's
  flat groups hold its part of each parameter in ``param_shapes`` order.
- ``ds_to_universal`` (of ZeRO 1, 2 or 3): whole tensors, one file per parameter and state.

``exp_avg`` and ``exp_avg_sq`` are laid out as the fp32 partitions. The state nests as a training
job's (each tensor's spec ``path``), so that ``resurgo.load`` fills a model, a torch optimizer and
a scheduler: ``model.<name>`` for the parameters (frozen, tied and buffers too),
``optimizer.state.<i>.exp_avg``, ``.exp_avg_sq`` and ``.step`` (``i``: the parameter's number in
the optimizer; each rank's copy of the step must be equal), ``optimizer.param_groups``,
``scheduler`` (the ``lr_scheduler`` state), and the counters. Tied parameters
(``shared_params``) come under their own names with the pieces of the parameter they share.
"""

from __future__ import annotations

import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from resurgo.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedValueError,
)
from resurgo.format import dtypes
from resurgo.format.tree import path_key
from resurgo.interop.deepspeed_mp import is_model_parallel, spec_model_parallel
from resurgo.interop.megatron import MEGATRON
from resurgo.interop.source_files import open_file_inside, resolve_inside
from resurgo.interop.spec import Box, Flat, ImportSpec, Piece, Source, TensorSpec, from_fields, row_major_strides
from resurgo.interop.torch_file import ZIP_ERRORS, read_objects
from resurgo.interop.unpickle import DEEPSPEED, TensorRef, shown

HOLDS = "a DeepSpeed checkpoint file"
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
ZERO3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
ZERO12_MODEL = "mp_rank_00_model_states.pt"
UNIVERSAL = "zero/optimizer_state.pt"  # in the output of DeepSpeed's ds_to_universal
MAX_TAG_BYTES = 4096  # a tag is a folder name


@dataclass(frozen=True)
class _File:
    rel: str  # relative to the source directory
    prefix: str  # the archive's prefix
    obj: Any


@dataclass(frozen=True)
class _Run:
    """A run of ``numel`` elements of one saved tensor: a rank's flat partition (or part of one)."""

    file: _File
    ref: TensorRef
    start: int = 0  # elements into ``ref``

    def piece(self, start: int, numel: int, dest: int) -> Piece:
        return Piece(file=self.file.rel, member=f"{self.file.prefix}/data/{self.ref.storage.key}",
                     offset=(self.ref.offset + self.start + start) * dtypes.itemsize(self.ref.storage.dtype),
                     shape=[numel], flat=Flat(start=dest, stop=dest + numel))


def find_tag_dir(root: Path) -> tuple[Path, str]:
    """(the directory of the checkpoint's files, its path relative to ``root``: '' or the tag)."""
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: not found")
    for latest in (root / "latest", root / "latest_universal"):  # the latter: ds_to_universal's
        if latest.is_file():
            with open_file_inside(resolve_inside(root, latest.name, "the tag file")) as f:
                raw = f.read(MAX_TAG_BYTES)
            tag = raw.decode("utf-8", errors="replace").strip()
            if not tag or "/" in tag or tag in (".", ".."):
                raise CorruptCheckpointError(f"{latest}: holds {tag!r}, not the name of a checkpoint folder")
            if not (root / tag).is_dir():
                raise CorruptCheckpointError(f"{latest}: names {tag!r}, but {root / tag} is missing")
            return root / tag, tag
    if root.is_dir() and (any(OPTIM.match(p.name) for p in root.iterdir()) or (root / UNIVERSAL).is_file()):
        return root, ""
    raise NotACheckpointError(f"{root}: not a DeepSpeed checkpoint (no 'latest' or 'latest_universal' file, no "
                              f"zero_pp_rank_*_mp_rank_00_optim_states.pt files and no {UNIVERSAL})")


def spec_from_deepspeed(directory: str | Path, vocab_size: int | None = None) -> ImportSpec:
    """The spec of the DeepSpeed ZeRO checkpoint in ``directory`` (see the module docstring);
    ``vocab_size``: of a checkpoint with tensor parallelism, the true vocabulary size, which drops
    the padding rows of the word embeddings."""
    return from_fields(directory, "DeepSpeed", lambda: _spec_from_deepspeed(Path(directory), vocab_size))


def _spec_from_deepspeed(root: Path, vocab_size: int | None = None) -> ImportSpec:
    folder, tag = find_tag_dir(root)

    def load(name: str, holds: type | tuple[type, ...] = dict, allowed: Any = DEEPSPEED) -> _File:
        try:
            path = resolve_inside(root, f"{tag}/{name}" if tag else name, "a DeepSpeed file")
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(f"{folder / name}: missing ({folder} lacks this file; was one rank's file "
                                         "not copied?)") from None
        with open_file_inside(path) as f:
            try:
                archive = zipfile.is_zipfile(f)
            except ZIP_ERRORS:  # an end record naming several disks, ...
                archive = False
            if not archive:
                raise CorruptCheckpointError(f"{path}: not a readable torch.save archive (no zip directory at its "
                                             "end); the file is truncated or damaged")
        obj, prefix = read_objects(path, allowed, HOLDS)
        if not isinstance(obj, holds):
            raise CorruptCheckpointError(f"{path}: holds a {type(obj).__name__}, not what DeepSpeed writes there")
        return _File(f"{tag}/{name}" if tag else name, prefix, obj)

    if is_model_parallel(folder):
        def read(name: str) -> tuple[str, str, Any]:
            f = load(name, allowed=MEGATRON)  # Megatron-DeepSpeed's files also hold Megatron's args
            return f.rel, f.prefix, f.obj

        return spec_model_parallel(folder, read, vocab_size)
    if vocab_size is not None:
        raise UnsupportedValueError(f"{folder}: vocab_size={vocab_size} applies to checkpoints with tensor "
                                    "parallelism (their shards pad the vocabulary); this one has none")
    if (folder / UNIVERSAL).is_file():
        return _universal(folder, load)

    found = [(m.group(1) or "", int(m.group(2))) for p in folder.iterdir() if (m := OPTIM.match(p.name))]
    kinds = sorted({k for k, _ in found})  # '' or 'bf16_'
    if len(kinds) > 1:
        raise CorruptCheckpointError(f"{folder}: holds both zero_pp_rank_* and bf16_zero_pp_rank_* optimizer files: "
                                     "files of two different runs are mixed (keep one run's files)")
    kind = kinds[0] if kinds else ""
    optim_name = kind + "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    ranks = sorted(r for _, r in found)
    first = load(optim_name.format(ranks[0] if ranks else 0))
    osd = _get(first, "optimizer_state_dict", dict)
    stage = osd.get("zero_stage")
    if stage not in (1, 2, 3):
        without = (" (DeepSpeed's bf16 optimizer without ZeRO, which zero_to_fp32 does not read either)"
                   if kind and stage is None else "")
        raise UnsupportedValueError(f"{folder / _name(first)}: ZeRO stage {stage!r}{without}; "
                                    "only ZeRO stages 1, 2 and 3 import")
    world = _world(osd, folder / _name(first))
    missing = [r for r in range(world) if r not in ranks]
    if missing or len(ranks) != world:
        raise CorruptCheckpointError(
            f"{folder}: a ZeRO-{stage} checkpoint of {world} ranks, but the optimizer files of rank(s) "
            f"{missing or sorted(set(ranks) - set(range(world)))} are {'missing' if missing else 'extra'} "
            f"(expected {optim_name.format(f'0..{world - 1}')})")
    optims = [first] + [load(optim_name.format(r)) for r in range(1, world)]
    models = [load(ZERO3_MODEL.format(r)) for r in range(world)] if stage == 3 else [load(ZERO12_MODEL)]
    for f in optims[1:]:
        o = _get(f, "optimizer_state_dict", dict)
        if o.get("zero_stage") != stage or o.get("partition_count") != osd.get("partition_count"):
            raise CorruptCheckpointError(f"{folder / _name(f)}: ZeRO stage {o.get('zero_stage')!r} of "
                                         f"{o.get('partition_count')!r} ranks, but rank 0's file says {stage!r} of "
                                         f"{osd.get('partition_count')!r}: files of two different runs are mixed")
    groups, index = _groups(models[0])
    if stage == 3:
        tensors = _zero3(groups, optims, models, world, index)
    else:
        tensors = _zero12(groups, optims, folder, index)
    tensors += _module_tensors(models, stage, set(index))
    inner = osd.get("base_optimizer_state" if stage < 3 else "optimizer_state_dict")
    param_groups = inner.get("param_groups") if isinstance(inner, dict) else None
    return ImportSpec(tensors=_with_shared(tensors, models[0]),
                      values=_values(models[0], first, param_groups, stage, groups, index))


def _groups(model: _File) -> tuple[list[list[tuple[str, tuple[int, ...]]]], dict[str, int]]:
    """(each parameter group's trained parameters (name, shape), each one's number in the optimizer)."""
    shapes = _get(model, "param_shapes", list)
    if not all(isinstance(g, dict) for g in shapes):
        raise CorruptCheckpointError(f"{model.rel}: param_shapes is not a list of dicts")
    for g, group in enumerate(shapes):
        for name, shape in group.items():
            if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
                raise CorruptCheckpointError(f"{model.rel}: param_shapes group {g} gives {shown(name, 100)} the shape "
                                             f"{shown(shape, 120)}, expected a torch.Size of non-negative ints")
    groups = [[(str(n), tuple(s)) for n, s in g.items()] for g in shapes]
    # The optimizer's parameter numbers: DeepSpeed's order, the client optimizer's (param_shapes lists
    # the trained parameters group by group as the optimizer holds them).
    return groups, {name: i for i, (name, _) in enumerate(p for g in groups for p in g)}


def _with_shared(tensors: list[TensorSpec], model: _File) -> list[TensorSpec]:
    """``tensors`` and each tied parameter (``shared_params``) under its own name, with the pieces
    of the parameter it shares."""
    by_key = {t.key: t for t in tensors}
    shared = model.obj.get("shared_params") or {}
    return tensors + [by_key[f"model.{target}"].model_copy(update=_at("model", name)) for name, target in shared.items()
                      if f"model.{target}" in by_key and f"model.{name}" not in by_key]


def _values(model: _File, optim: _File, param_groups: Any, stage: int,
            groups: list[list[tuple[str, tuple[int, ...]]]], index: dict[str, int]) -> dict[str, Any]:
    """The counters, the optimizer's param groups (hyperparameters, with ``params`` numbered as
    ``optimizer.state``) and the learning-rate scheduler's state: plain values only."""
    values = {k: model.obj[k] for k in ("global_steps", "global_samples", "skipped_steps", "ds_version")
              if isinstance(model.obj.get(k), (int, str))}
    values["zero_stage"] = stage
    if isinstance(values.get("global_steps"), int):
        values["step"] = values["global_steps"]
    if not isinstance(param_groups, list) or len(param_groups) != len(groups):
        raise CorruptCheckpointError(f"{optim.rel}: the optimizer holds {_count(param_groups)} param groups, the model "
                                     f"states {len(groups)}: files of two different runs are mixed?")
    values["optimizer"] = {"param_groups": [
        {**{str(k): v for k, v in _json_part(pg).items() if k != "params"}, "params": [index[n] for n, _ in params]}
        for pg, params in zip(param_groups, groups)]}
    scheduler = _json_part(model.obj.get("lr_scheduler"))
    if isinstance(scheduler, dict):
        values["scheduler"] = scheduler
    return values


def _at(*path: str | int) -> dict[str, Any]:
    """The key and path of a tensor at ``path`` of the nested state (``model``/``optimizer`` as
    their ``state_dict()``s nest, so that ``resurgo.load`` fills a model and an optimizer)."""
    return {"key": path_key(path), "path": list(path)}


def _count(value: Any) -> Any:
    return len(value) if isinstance(value, list) else "no"


def _json_part(value: Any) -> Any:
    """``value`` as JSON data (tuples as lists; dict entries that are not plain left out), or None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_json_part(v) for v in value]
        return items if all(i is not None or v is None for i, v in zip(items, value)) else None
    if isinstance(value, dict):
        return {k: p for k, v in value.items() if isinstance(k, str) and ((p := _json_part(v)) is not None or v is None)}
    return None


def _name(f: _File) -> str:
    return f.rel.rsplit("/", 1)[-1]


def _get(f: _File, key: str, kind: type) -> Any:
    value = f.obj.get(key)
    if not isinstance(value, kind):
        raise CorruptCheckpointError(f"{f.rel}: {key!r} is a {type(value).__name__}, expected a {kind.__name__} "
                                     "(not a DeepSpeed checkpoint of a supported version?)")
    return value


def _ref(f: _File, value: Any, what: str, dtype: str | None = "float32") -> TensorRef:
    """``value``, a flat tensor of ``dtype`` (None: any dtype, the parameter's own)."""
    if not isinstance(value, TensorRef) or len(value.shape) > 1 or dtype not in (None, value.storage.dtype):
        raise UnsupportedValueError(f"{f.rel}: {what} is not a flat {dtype or ''} tensor (found {shown(value, 120)})")
    return value


def _numel(ref: TensorRef) -> int:
    return math.prod(ref.shape)


def _pieces(runs: list[tuple[int, _Run, int]], lo: int, hi: int, base: int = 0) -> list[Piece]:
    """Pieces of the flat range [lo, hi) of runs laid end to end ((start, run, numel) each), as flat
    ranges of a tensor whose element ``base`` is element ``lo`` of the runs."""
    out = []
    for start, run, numel in runs:
        a, b = max(lo, start), min(hi, start + numel)
        if a < b:
            out.append(run.piece(a - start, b - a, a - lo + base))
    return out


def _moment_state(f: _File, base: dict, group: int, what: str) -> dict:
    state = base.get("state")
    entry = state.get(group) if isinstance(state, dict) else None
    if not isinstance(entry, dict):
        raise UnsupportedValueError(f"{f.rel}: no optimizer state for parameter group {group} ({what}); "
                                    "only Adam-style optimizers (exp_avg, exp_avg_sq) import")
    return entry


def _optim_tensors(i: int, shape: tuple[int, ...], numel: int, runs_of: dict[str, list], lo: int,
                   steps: list[Piece]) -> list[TensorSpec]:
    out = []
    for moment, runs in runs_of.items():
        out.append(TensorSpec(**_at("optimizer", "state", i, moment), dtype="float32", shape=list(shape),
                              pieces=_pieces(runs, lo, lo + numel) if numel else []))
    return out + _step_tensor(i, steps)


def _step_tensor(i: int, steps: list[Piece]) -> list[TensorSpec]:
    """The parameter's Adam step: rank 0's scalar, every other rank's as a replica that must equal it."""
    if not steps:
        return []
    replicas = [Source(file=s.file, member=s.member, offset=s.offset) for s in steps[1:]]
    return [TensorSpec(**_at("optimizer", "state", i, "step"), dtype="float32", shape=[],
                       pieces=[steps[0].model_copy(update={"replicas": replicas})])]


def _step_pieces(optims: list[_File], states: list[dict], group: int) -> list[Piece]:
    pieces = []
    for f, entry in zip(optims, states):
        step = entry.get("step")
        if not isinstance(step, TensorRef):
            return []  # a step kept as a number: nothing to carry as a tensor
        if step.shape != () or step.storage.dtype != "float32":
            raise UnsupportedValueError(f"{f.rel}: group {group}'s step is not a float32 scalar")
        pieces.append(_Run(f, step).piece(0, 1, 0).model_copy(update={"shape": [], "flat": None,
                                                                       "box": Box(offsets=[], shape=[])}))
    return pieces


def _zero12(groups: list[list[tuple[str, tuple[int, ...]]]], optims: list[_File], folder: Path,
            index: dict[str, int]) -> list[TensorSpec]:
    # Optional alignment gaps after each parameter (ZeRO's parameter_alignment), as zero_to_fp32 reads them.
    gaps = _get(optims[0], "optimizer_state_dict", dict).get("param_alignment_paddings")
    tensors: list[TensorSpec] = []
    for g, params in enumerate(groups):
        runs: dict[str, list[tuple[int, _Run, int]]] = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
        states, total = [], 0
        for f in optims:
            osd = _get(f, "optimizer_state_dict", dict)
            flat = osd.get("single_partition_of_fp32_groups")
            base = osd.get("base_optimizer_state")
            if not isinstance(flat, list) or len(flat) != len(groups) or not isinstance(base, dict):
                raise CorruptCheckpointError(f"{f.rel}: holds {len(flat) if isinstance(flat, list) else 'no'} fp32 "
                                             f"partition groups, the model states {len(groups)}: files of two "
                                             "different runs are mixed?")
            part = _ref(f, flat[g], f"fp32 group {g}")
            n = _numel(part)
            runs["fp32"].append((total, _Run(f, part), n))
            entry = _moment_state(f, base, g, f"group {g}")
            states.append(entry)
            for moment in ("exp_avg", "exp_avg_sq"):
                ref = _ref(f, entry.get(moment), f"group {g}'s {moment}")
                if _numel(ref) < n:
                    raise CorruptCheckpointError(f"{f.rel}: group {g}'s {moment} holds {_numel(ref)} elements, "
                                                 f"fewer than its {n} fp32 weights")
                runs[moment].append((total, _Run(f, ref), n))  # the moments keep the padding; only n are read
            total += n
        group_gaps = gaps[g] if isinstance(gaps, list) and g < len(gaps) else None
        if group_gaps is not None and (not isinstance(group_gaps, list) or len(group_gaps) != len(params)
                                       or not all(isinstance(c, int) and c >= 0 for c in group_gaps)):
            raise CorruptCheckpointError(f"{optims[0].rel}: param_alignment_paddings of group {g} is not one count "
                                         f"per parameter ({len(params)})")
        wanted = sum(math.prod(s) for _, s in params) + sum(group_gaps or [])
        if wanted > total:
            raise CorruptCheckpointError(f"{folder}: parameter group {g} needs {wanted} elements, the ranks' fp32 "
                                         f"partitions hold {total}: files of two different runs are mixed?")
        steps = _step_pieces(optims, states, g)
        lo = 0
        for j, (name, shape) in enumerate(params):
            numel = math.prod(shape)
            tensors.append(TensorSpec(**_at("model", name), dtype="float32", shape=list(shape),
                                      pieces=_pieces(runs["fp32"], lo, lo + numel)))
            tensors += _optim_tensors(index[name], shape, numel, {m: runs[m] for m in ("exp_avg", "exp_avg_sq")},
                                      lo, steps)
            lo += numel + (group_gaps[j] if group_gaps else 0)
    return tensors


def _zero3(groups: list[list[tuple[str, tuple[int, ...]]]], optims: list[_File], models: list[_File],
           world: int, index: dict[str, int]) -> list[TensorSpec]:
    # Per rank: its flat groups end to end, for the weights and each moment.
    per_rank: list[dict[str, list[tuple[int, _Run, int]]]] = []
    states: list[list[dict]] = []
    for f in optims:
        osd = _get(f, "optimizer_state_dict", dict)
        flat = osd.get("fp32_flat_groups")
        inner = osd.get("optimizer_state_dict")
        if not isinstance(flat, list) or not isinstance(inner, dict):
            raise CorruptCheckpointError(f"{f.rel}: no fp32_flat_groups (not a ZeRO-3 optimizer file?)")
        rank_runs: dict[str, list[tuple[int, _Run, int]]] = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
        rank_states, total = [], 0
        for g, value in enumerate(flat):
            weights = _ref(f, value, f"fp32 flat group {g}")
            n = _numel(weights)
            rank_runs["fp32"].append((total, _Run(f, weights), n))
            entry = _moment_state(f, inner, g, f"flat group {g}")
            rank_states.append(entry)
            for moment in ("exp_avg", "exp_avg_sq"):
                rank_runs[moment].append((total, _Run(f, _ref(f, entry.get(moment), f"group {g}'s {moment}")), n))
            total += n
        per_rank.append(rank_runs)
        states.append(rank_states)
    tensors: list[TensorSpec] = []
    offset = 0
    steps = _step_pieces(optims, [s[0] for s in states], 0) if states and states[0] else []
    for name, shape in (p for g in groups for p in g):
        numel = math.prod(shape)
        part = -(-numel // world)
        pieces: dict[str, list[Piece]] = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
        for r in range(world):
            lo, hi = r * part, min((r + 1) * part, numel)
            if lo >= hi:
                continue
            for kind, kind_runs in per_rank[r].items():
                found = _pieces(kind_runs, offset, offset + hi - lo, base=lo)
                if sum(p.numel for p in found) != hi - lo:
                    raise CorruptCheckpointError(f"{optims[r].rel}: its flat groups end before parameter {name!r}'s "
                                                 "part: files of two different runs are mixed?")
                pieces[kind] += found
        offset += part
        tensors.append(TensorSpec(**_at("model", name), dtype="float32", shape=list(shape), pieces=pieces["fp32"]))
        for moment in ("exp_avg", "exp_avg_sq"):
            tensors.append(TensorSpec(**_at("optimizer", "state", index[name], moment), dtype="float32",
                                      shape=list(shape), pieces=pieces[moment]))
        tensors += _step_tensor(index[name], steps)
    return tensors + _zero3_frozen(models, world)


def _zero3_frozen(models: list[_File], world: int) -> list[TensorSpec]:
    """ZeRO-3's frozen parameters: each rank's model states hold ``ceil(numel / world)`` elements
    of each, as zero_to_fp32 reads them."""
    tensors: list[TensorSpec] = []
    for name, shape in (models[0].obj.get("frozen_param_shapes") or {}).items():
        numel, pieces_f, dtype = math.prod(shape), [], None
        part = -(-numel // world)
        for r, m in enumerate(models):
            frag = (m.obj.get("frozen_param_fragments") or {}).get(name)
            lo, hi = r * part, min((r + 1) * part, numel)
            if lo < hi:
                ref = _ref(m, frag, f"frozen parameter {name!r}", dtype)  # kept in its own dtype (bf16 runs)
                dtype = ref.storage.dtype
                if _numel(ref) < hi - lo:
                    raise CorruptCheckpointError(f"{m.rel}: frozen parameter {name!r} holds {_numel(ref)} elements, "
                                                 f"expected {hi - lo}")
                pieces_f.append(_Run(m, ref).piece(0, hi - lo, lo))
        tensors.append(TensorSpec(**_at("model", name), dtype=dtype or "float32", shape=[int(d) for d in shape],
                                  pieces=pieces_f))
    return tensors


def _module_tensors(models: list[_File], stage: int, trainable: set[str]) -> list[TensorSpec]:
    """Buffers, and (ZeRO 1/2) frozen parameters: whole tensors in the model states' module."""
    module = models[0].obj.get("module")
    if not isinstance(module, dict):
        return []
    shared = set(models[0].obj.get("shared_params") or {})
    buffers = set(models[0].obj.get("buffer_names") or [])
    out = []
    for name, ref in module.items():
        if name in trainable or name in shared or (stage == 3 and name not in buffers):
            continue
        if isinstance(ref, TensorRef):
            out.append(_whole(models[0], ref, ("model", name)))
    return out


def _whole(f: _File, ref: TensorRef, path: tuple[str | int, ...]) -> TensorSpec:
    """The tensor at ``path``: all of ``ref`` (of ``f``), in its own dtype and shape."""
    pieces = [] if _numel(ref) == 0 else [Piece(
        file=f.rel, member=f"{f.prefix}/data/{ref.storage.key}", offset=ref.offset * dtypes.itemsize(ref.storage.dtype),
        shape=list(ref.shape), strides=None if ref.strides == row_major_strides(ref.shape) else list(ref.strides),
        box=Box(offsets=[0] * len(ref.shape), shape=list(ref.shape)))]
    return TensorSpec(**_at(*path), dtype=ref.storage.dtype, shape=list(ref.shape), pieces=pieces)


def _universal(folder: Path, load: Callable[..., _File]) -> ImportSpec:
    """The output of DeepSpeed's ``ds_to_universal``: per trained parameter (``param_shapes`` of the
    model states), ``zero/<name>/fp32.pt``, ``exp_avg.pt`` and ``exp_avg_sq.pt``, whole tensors (of
    ZeRO 1/2: in the parameter's shape under ``param`` of a dict; of ZeRO 3: flat and bare); the Adam
    step in ``zero/<name>/step.pt`` (ZeRO 1/2) or, for ZeRO 3, in ``zero/optimizer_state.pt``, which
    keeps rank 0's optimizer state (one step per parameter group); the optimizer's param groups in
    ``zero/optimizer_state.pt``; the model states as in the original (frozen parameters, buffers,
    counters, scheduler; ZeRO 3: one file per rank, each with its part of the frozen parameters)."""
    common = load(UNIVERSAL)
    stage = common.obj.get("zero_stage")
    if stage not in (1, 2, 3):
        raise UnsupportedValueError(f"{folder / UNIVERSAL}: ds_to_universal output of ZeRO stage {stage!r}; only that "
                                    "of ZeRO stages 1, 2 and 3 imports")
    world = _world(common.obj, folder / UNIVERSAL) if stage == 3 else 1
    models = [load(ZERO3_MODEL.format(r)) for r in range(world)] if stage == 3 else [load(ZERO12_MODEL)]
    groups, index = _groups(models[0])
    inner = _get(common, "optimizer_state_dict", dict) if stage == 3 else {}
    tensors = []
    for g, params in enumerate(groups):
        steps = _step_pieces([common], [_moment_state(common, inner, g, f"group {g}")], g) if stage == 3 else []
        for name, shape in params:
            i = index[name]
            kinds = [("fp32", ("model", name)), ("exp_avg", ("optimizer", "state", i, "exp_avg")),
                     ("exp_avg_sq", ("optimizer", "state", i, "exp_avg_sq"))]
            for what, path in kinds + ([("step", ("optimizer", "state", i, "step"))] if stage < 3 else []):
                rel = f"zero/{name}/{what}.pt"
                tensors.append(_universal_tensor(load(rel, (dict, TensorRef)), folder / rel, name,
                                                 shape if what != "step" else (), path))
            tensors += _step_tensor(i, steps)
    if stage == 3:
        tensors += _zero3_frozen(models, world)
    tensors += _module_tensors(models, stage, set(index))
    return ImportSpec(tensors=_with_shared(tensors, models[0]),
                      values=_values(models[0], common, common.obj.get("param_groups"), stage, groups, index))


def _universal_tensor(f: _File, where: Path, name: str, shape: tuple[int, ...],
                      path: tuple[str | int, ...]) -> TensorSpec:
    """A ``ds_to_universal`` file's float32 tensor at ``path``: in ``shape``, or flat (ZeRO 3's)."""
    ref = f.obj.get("param") if isinstance(f.obj, dict) else f.obj
    numel = math.prod(shape)
    if isinstance(ref, TensorRef) and ref.storage.dtype == "float32":
        if ref.shape == shape:
            return _whole(f, ref, path)
        if shape and ref.shape == (numel,) and ref.strides == (1,):
            return TensorSpec(**_at(*path), dtype="float32", shape=list(shape),
                              pieces=[_Run(f, ref).piece(0, numel, 0)] if numel else [])
    raise CorruptCheckpointError(f"{where}: expected a float32 tensor of shape {list(shape)}"
                                 f"{f' (or flat, of {numel} elements)' if shape else ''} for parameter {name!r}, "
                                 f"found {shown(ref, 120)}")


def _world(osd: dict, where: Path) -> int:
    """The data-parallel world size of ``osd``, an optimizer state dict of ``where``."""
    world = osd.get("partition_count")
    world = world[0] if isinstance(world, list) and world else world
    if not isinstance(world, int) or world < 1:
        raise CorruptCheckpointError(f"{where}: partition_count {world!r} is not a world size")
    return world
