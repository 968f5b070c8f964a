"""A spec from a DeepSpeed ZeRO checkpoint directory (stages 1, 2 and 3, fp32 optimizer files),
without importing deepspeed and without executing any of its pickles.

The directory holds ``latest`` (the tag) and ``<tag>/``, or is ``<tag>/`` itself. In it:
``mp_rank_00_model_states.pt`` (ZeRO 1/2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
(ZeRO 3, one per rank) with the parameter names and shapes, and one
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank with that rank's partition
of the fp32 master weights and the Adam moments. All are torch.save archives read by the
restricted unpickler with its DeepSpeed allowlist (:data:`.unpickle.DEEPSPEED`).

The parameters are rebuilt as DeepSpeed's ``zero_to_fp32`` rebuilds them, as pieces that point at
the partitions' bytes (flat ranges of each parameter):

- ZeRO 1/2: per parameter group, the ranks' fp32 partitions laid end to end (in rank order) are
  the group's parameters laid end to end, in ``param_shapes`` order; the padding after the last
  one is never read.
- ZeRO 3: each parameter is split in ``ceil(numel / world)`` elements per rank, and each rank's
  flat groups hold its part of each parameter in ``param_shapes`` order.

``exp_avg`` and ``exp_avg_sq`` are laid out as the fp32 partitions. Keys: ``model.<name>`` for
the fp32 parameters (and frozen parameters and buffers), ``optim.state.<name>.exp_avg``,
``.exp_avg_sq`` and ``.step`` (each rank's copy of the step must be equal), tied parameters
(``shared_params``) under their own names with the pieces of the parameter they share.
"""

from __future__ import annotations

import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resurgo.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError, UnsupportedValueError
from resurgo.format import dtypes
from resurgo.interop.spec import Box, Flat, ImportSpec, Piece, Source, TensorSpec, row_major_strides
from resurgo.interop.torch_file import read_objects
from resurgo.interop.unpickle import DEEPSPEED, TensorRef

HOLDS = "a DeepSpeed checkpoint file"
OPTIM = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
ZERO3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
ZERO12_MODEL = "mp_rank_00_model_states.pt"


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
    latest = root / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise CorruptCheckpointError(f"{latest}: holds {tag!r}, not the name of a checkpoint folder")
        if not (root / tag).is_dir():
            raise CorruptCheckpointError(f"{latest}: names {tag!r}, but {root / tag} is missing")
        return root / tag, tag
    if root.is_dir() and any(OPTIM.match(p.name) for p in root.iterdir()):
        return root, ""
    raise NotACheckpointError(f"{root}: not a DeepSpeed checkpoint (no 'latest' file and no "
                              "zero_pp_rank_*_mp_rank_00_optim_states.pt files)")


def spec_from_deepspeed(directory: str | Path) -> ImportSpec:
    """The spec of the DeepSpeed ZeRO checkpoint in ``directory`` (see the module docstring)."""
    root = Path(directory)
    folder, tag = find_tag_dir(root)

    def load(name: str) -> _File:
        path = folder / name
        if not path.is_file():
            raise CorruptCheckpointError(f"{path}: missing ({folder} lacks this file; was one rank's file not copied?)")
        if not zipfile.is_zipfile(path):
            raise CorruptCheckpointError(f"{path}: not a readable torch.save archive (no zip directory at its end); "
                                         "the file is truncated or damaged")
        obj, prefix = read_objects(path, DEEPSPEED, HOLDS)
        if not isinstance(obj, dict):
            raise CorruptCheckpointError(f"{path}: holds a {type(obj).__name__}, not DeepSpeed's dict")
        return _File(f"{tag}/{name}" if tag else name, prefix, obj)

    ranks = sorted(int(m.group(1)) for p in folder.iterdir() if (m := OPTIM.match(p.name)))
    if not ranks and any(p.name.startswith("bf16_zero_pp_rank_") for p in folder.iterdir()):
        raise UnsupportedValueError(f"{folder}: holds bf16_zero_pp_rank_* optimizer files (DeepSpeed's bf16 "
                                    "optimizer), which do not import yet; only fp32 ZeRO optimizer files do")
    first = load(f"zero_pp_rank_{ranks[0] if ranks else 0}_mp_rank_00_optim_states.pt")
    osd = _get(first, "optimizer_state_dict", dict)
    stage = osd.get("zero_stage")
    if stage not in (1, 2, 3):
        raise UnsupportedValueError(f"{folder}: ZeRO stage {stage!r}; stages 1, 2 and 3 import (a bf16 optimizer's "
                                    "bf16_zero_pp_rank_* files or stage 0 do not yet)")
    world = osd.get("partition_count")
    world = world[0] if isinstance(world, list) and world else world
    if not isinstance(world, int) or world < 1:
        raise CorruptCheckpointError(f"{folder / _name(first)}: partition_count {world!r} is not a world size")
    missing = [r for r in range(world) if r not in ranks]
    if missing or len(ranks) != world:
        raise CorruptCheckpointError(
            f"{folder}: a ZeRO-{stage} checkpoint of {world} ranks, but the optimizer files of rank(s) "
            f"{missing or sorted(set(ranks) - set(range(world)))} are {'missing' if missing else 'extra'} "
            f"(expected zero_pp_rank_0..{world - 1}_mp_rank_00_optim_states.pt)")
    optims = [first] + [load(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(1, world)]
    models = [load(ZERO3_MODEL.format(r)) for r in range(world)] if stage == 3 else [load(ZERO12_MODEL)]
    for f in optims[1:]:
        o = _get(f, "optimizer_state_dict", dict)
        if o.get("zero_stage") != stage or o.get("partition_count") != osd.get("partition_count"):
            raise CorruptCheckpointError(f"{folder / _name(f)}: ZeRO stage {o.get('zero_stage')!r} of "
                                         f"{o.get('partition_count')!r} ranks, but rank 0's file says {stage!r} of "
                                         f"{osd.get('partition_count')!r}: files of two different runs are mixed")
    shapes = _get(models[0], "param_shapes", list)
    if not all(isinstance(g, dict) for g in shapes):
        raise CorruptCheckpointError(f"{folder / _name(models[0])}: param_shapes is not a list of dicts")
    groups = [[(str(n), tuple(int(d) for d in s)) for n, s in g.items()] for g in shapes]
    if stage == 3:
        tensors = _zero3(groups, optims, models, world)
    else:
        tensors = _zero12(groups, optims, folder)
    tensors += _module_tensors(models, stage, {n for g in groups for n, _ in g})
    by_key = {t.key: t for t in tensors}
    shared = models[0].obj.get("shared_params") or {}
    for name, target in shared.items():
        if f"model.{target}" in by_key and f"model.{name}" not in by_key:
            tensors.append(by_key[f"model.{target}"].model_copy(update={"key": f"model.{name}"}))
    values = {k: models[0].obj[k] for k in ("global_steps", "global_samples", "skipped_steps", "ds_version")
              if isinstance(models[0].obj.get(k), (int, str))}
    values["zero_stage"] = stage
    return ImportSpec(tensors=tensors, values=values)


def _name(f: _File) -> str:
    return f.rel.rsplit("/", 1)[-1]


def _get(f: _File, key: str, kind: type) -> Any:
    value = f.obj.get(key)
    if not isinstance(value, kind):
        raise CorruptCheckpointError(f"{f.rel}: {key!r} is a {type(value).__name__}, expected a {kind.__name__} "
                                     "(not a DeepSpeed checkpoint of a supported version?)")
    return value


def _ref(f: _File, value: Any, what: str) -> TensorRef:
    if not isinstance(value, TensorRef) or len(value.shape) > 1 or value.storage.dtype != "float32":
        raise UnsupportedValueError(f"{f.rel}: {what} is not a flat float32 tensor (found {value!r:.120})")
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


def _optim_tensors(name: str, shape: tuple[int, ...], numel: int, runs_of: dict[str, list], lo: int,
                   steps: list[Piece]) -> list[TensorSpec]:
    out = []
    for moment, runs in runs_of.items():
        out.append(TensorSpec(key=f"optim.state.{name}.{moment}", dtype="float32", shape=list(shape),
                              pieces=_pieces(runs, lo, lo + numel) if numel else []))
    return out + _step_tensor(name, steps)


def _step_tensor(name: str, steps: list[Piece]) -> list[TensorSpec]:
    """The parameter's Adam step: rank 0's scalar, every other rank's as a replica that must equal it."""
    if not steps:
        return []
    replicas = [Source(file=s.file, member=s.member, offset=s.offset) for s in steps[1:]]
    return [TensorSpec(key=f"optim.state.{name}.step", dtype="float32", shape=[],
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


def _zero12(groups: list[list[tuple[str, tuple[int, ...]]]], optims: list[_File], folder: Path) -> list[TensorSpec]:
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
        wanted = sum(math.prod(s) for _, s in params)
        if wanted > total:
            raise CorruptCheckpointError(f"{folder}: parameter group {g} needs {wanted} elements, the ranks' fp32 "
                                         f"partitions hold {total}: files of two different runs are mixed?")
        steps = _step_pieces(optims, states, g)
        lo = 0
        for name, shape in params:
            numel = math.prod(shape)
            tensors.append(TensorSpec(key=f"model.{name}", dtype="float32", shape=list(shape),
                                      pieces=_pieces(runs["fp32"], lo, lo + numel)))
            tensors += _optim_tensors(name, shape, numel, {m: runs[m] for m in ("exp_avg", "exp_avg_sq")}, lo, steps)
            lo += numel
    return tensors


def _zero3(groups: list[list[tuple[str, tuple[int, ...]]]], optims: list[_File], models: list[_File],
           world: int) -> list[TensorSpec]:
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
        tensors.append(TensorSpec(key=f"model.{name}", dtype="float32", shape=list(shape), pieces=pieces["fp32"]))
        for moment in ("exp_avg", "exp_avg_sq"):
            tensors.append(TensorSpec(key=f"optim.state.{name}.{moment}", dtype="float32", shape=list(shape),
                                      pieces=pieces[moment]))
        tensors += _step_tensor(name, steps)
    # Frozen parameters: each rank holds ceil(numel / world) elements of each, as zero_to_fp32 reads them.
    for name, shape in (models[0].obj.get("frozen_param_shapes") or {}).items():
        numel, pieces_f = math.prod(shape), []
        part = -(-numel // world)
        for r, m in enumerate(models):
            frag = (m.obj.get("frozen_param_fragments") or {}).get(name)
            lo, hi = r * part, min((r + 1) * part, numel)
            if lo < hi:
                ref = _ref(m, frag, f"frozen parameter {name!r}")
                if _numel(ref) < hi - lo:
                    raise CorruptCheckpointError(f"{m.rel}: frozen parameter {name!r} holds {_numel(ref)} elements, "
                                                 f"expected {hi - lo}")
                pieces_f.append(_Run(m, ref).piece(0, hi - lo, lo))
        tensors.append(TensorSpec(key=f"model.{name}", dtype="float32", shape=[int(d) for d in shape],
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
        if not isinstance(ref, TensorRef):
            continue
        pieces = [] if _numel(ref) == 0 else [Piece(
            file=models[0].rel, member=f"{models[0].prefix}/data/{ref.storage.key}",
            offset=ref.offset * dtypes.itemsize(ref.storage.dtype), shape=list(ref.shape),
            strides=None if ref.strides == row_major_strides(ref.shape) else list(ref.strides),
            box=Box(offsets=[0] * len(ref.shape), shape=list(ref.shape)))]
        out.append(TensorSpec(key=f"model.{name}", dtype=ref.storage.dtype, shape=list(ref.shape), pieces=pieces))
    return out

