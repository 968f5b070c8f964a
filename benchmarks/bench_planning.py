"""What a distributed save's planning and a load's metadata cost as the job grows, simulated in one
process (every rank's declarations built here, the coordinator's work timed), with DCP's
``.metadata`` and resurgo's manifest measured on real gloo processes beside it.

For R ranks x T tensors, FSDP-style (every tensor Shard(0) over all ranks, plus a few replicated
ones and a per-rank RNG value), per R:
- uncached plan: the coordinator validating and planning every rank's declarations (plan_global);
- cached plan: a repeated layout, from every rank's summary (PlanCache.reuse, the merged tree),
  and what building that summary costs each rank;
- bytes each rank sends to the coordinator per save (its pickled summary, or its declarations) and
  what the coordinator broadcasts (the merged tree, or the whole plan);
- the manifest the coordinator would write (one chunk entry per tensor per rank), which is what
  one loading rank reads today, and that rank's load plan (parse the manifest, plan its reads).
Figures beyond what this machine measures in a few minutes are extrapolated (sizes affine in the
ranks through the two largest measured worlds, times proportional to the ranks from the largest)
and marked so (``*`` in the table, ``extrapolated`` in the JSON).

    .venv/bin/python benchmarks/bench_planning.py [--ranks 1 64 512 4096 16384] [--tensors 1000]
        [--max-planned 512] [--max-manifest 64] [--dcp-ranks 2 4 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from resurgo.dist.comm import Comm
from resurgo.format import checksum
from resurgo.format.index import INDEX_FORMAT, RankIndex, data_file_name, parse_index, ranks_needed, resolve
from resurgo.format.manifest import (INDEXED_VERSION, BoxPlace, ChunkEntry, FileEntry, GridEntry, Manifest, RankFiles,
                                     TensorEntry, parse_manifest)
from resurgo.layout.box import ChunkBox
from resurgo.plan import core_plan
from resurgo.plan.global_plan import PlanCache, RankDecl, TensorDecl, plan_global
from resurgo.plan.load_plan import Target, plan_reads

COLS = 1024


def _rows(i: int) -> int:
    return 4096 + i % 7


def _bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(start, rows) of ``rank``'s shard: DTensor's Shard(0), torch.chunk's rule (trailing shards empty)."""
    step = -(-rows // world)
    start = min(rank * step, rows)
    return start, min(start + step, rows) - start


def _tree_items(tensors: int) -> list:
    """The tree of a training state, without its RNG: a model's tensors, a few replicated ones and a step."""
    def tensor(key: str) -> dict:
        return {"type": "tensor", "key": key}

    model = [[f"layers.{i}.weight", tensor(f"model.layers.{i}.weight")] for i in range(tensors)]
    norm = [[str(i), tensor(f"norm.{i}")] for i in range(4)]
    return [["model", {"type": "ordered_dict", "items": model}], ["norm", {"type": "dict", "items": norm}],
            ["step", {"type": "int", "value": 100}]]


def _rank_tree(shared: list, rank: int) -> dict:
    """A rank's tree: the shared items (the same objects on every simulated rank: the simulation's
    memory, not a rank's) and its RNG value."""
    return {"type": "dict", "items": shared + [["rng", {"type": "per_rank", "items": [{"type": "int", "value": rank}]}]]}


def rank_decl(rank: int, world: int, tensors: int, shared: list | None = None) -> RankDecl:
    decls = []
    for i in range(tensors):
        start, n = _bounds(_rows(i), world, rank)
        decls.append(TensorDecl(f"model.layers.{i}.weight", "torch", "bfloat16", (_rows(i), COLS),
                                (ChunkBox((start, 0), (n, COLS)),), True))
    for i in range(4):  # replicated: every rank holds them, one writes
        decls.append(TensorDecl(f"norm.{i}", "torch", "float32", (1024,), (ChunkBox.whole((1024,)),), False, "0" * 32))
    return RankDecl(_rank_tree(shared if shared is not None else _tree_items(tensors), rank), tuple(decls))


def _sent(obj: object) -> int:
    """The bytes Comm.gather sends for ``obj`` (it pickles what it sends, with the flag beside it)."""
    return len(pickle.dumps((obj, False), protocol=pickle.HIGHEST_PROTOCOL))


def _median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cached_path(world: int, tensors: int, repeats: int) -> dict:
    """A repeated layout at ``world`` ranks: the coordinator's time from the summaries, and what one
    rank sends and spends. The coordinator's cache holds a plan with the real layout fingerprints
    and tree but no tensors: reusing it never reads the plan's tensors, so its size does not matter."""
    shared = _tree_items(tensors)
    mine_rank = min(1, world - 1)
    mine = rank_decl(mine_rank, world, tensors, shared)  # one real rank (rank 1, or 0 alone)
    layouts = [xxhash.xxh3_128_hexdigest(f"layout of rank {r}".encode()) for r in range(world)]  # distinct, as FSDP's are
    layouts[mine_rank] = mine.layout
    stubs = [RankDecl(_rank_tree(shared, r), (), layout=layouts[r]) for r in range(world)]
    cache = PlanCache()
    held = cache.plan(stubs, checksum.block_bytes_for, None)
    plan_id, per_rank = cache.ticket()
    cache.hold(plan_id, held, per_rank)
    summary = cache.summarize(mine)  # what each rank does, on its own declarations
    summary_s = _median_time(lambda: cache.summarize(mine), repeats)
    first = cache.summarize(stubs[0])
    summaries = [dataclasses.replace(first, layout=layouts[r], values=(stubs[r].tree["items"][-1][1],))
                 for r in range(world)]
    summaries[mine_rank] = dataclasses.replace(summary, shared=first.shared)  # its compared digests aside
    merged: list = [None]

    def coordinator() -> None:
        merged[0] = cache.reuse(stubs[0].tree, summaries, None)
        cache.reused(merged[0])

    seconds = _median_time(coordinator, repeats)
    assert merged[0] is not None, "the cache did not hold"
    return {"cached_plan_seconds": seconds, "summary_seconds_per_rank": summary_s,
            "gathered_bytes_per_rank_cached": _sent(summary), "gathered_bytes_per_rank_uncached": _sent(mine),
            "broadcast_bytes_cached": len(pickle.dumps(merged[0], protocol=pickle.HIGHEST_PROTOCOL))}


def core_and_indexes(world: int, tensors: int, ranks: set[int]) -> tuple[bytes, dict[int, bytes], float]:
    """The format version 4 metadata of the FSDP-style state on ``world`` ranks, built by the
    writer's own code: the core manifest (each tensor's layout found by
    :func:`resurgo.plan.core_plan.grid_of_arrays` from its ``world`` boxes as the planner's
    arrays, as the writer's :func:`~resurgo.plan.core_plan.describe_layouts` does; every rank's index size and
    digest) and the indexes of ``ranks`` (their chunks, one checksum per block); and the seconds
    the layouts took. Other ranks' indexes are not built: the core gives them the size of the
    first built one and a digest of 32 hex digits."""
    tensors_core: dict[str, TensorEntry] = {}
    layouts_s = 0.0
    for i in range(tensors):
        rows = _rows(i)
        bounds = np.array([_bounds(rows, world, r) for r in range(world)], dtype=np.int64)
        offsets = np.stack([bounds[:, 0], np.zeros(world, np.int64)], axis=1)
        sizes = np.stack([bounds[:, 1], np.full(world, COLS, np.int64)], axis=1)
        t0 = time.perf_counter()  # the writer's work: the planner's arrays in, the layout out
        layout: Any = core_plan.grid_of_arrays((rows, COLS), offsets, sizes, np.arange(world, dtype=np.int64))
        if layout is None:
            layout = core_plan.layout_of((rows, COLS), [(ChunkBox((int(a), 0), (int(n), COLS)), r)
                                                        for r, (a, n) in enumerate(bounds.tolist()) if n])
        layouts_s += time.perf_counter() - t0
        tensors_core[f"model.layers.{i}.weight"] = TensorEntry(
            kind="torch", dtype="bfloat16", shape=[rows, COLS],
            **({"grid": layout} if isinstance(layout, GridEntry) else {"pieces": layout}))
    for i in range(4):  # replicated: written by one rank each, as the plan balances them
        tensors_core[f"norm.{i}"] = TensorEntry(kind="torch", dtype="float32", shape=[1024],
                                                grid=GridEntry(parts=[1], offset=i % world, strides=[0]))
    indexes = {rank: _index_of(rank, world, tensors) for rank in sorted(ranks)}
    size = len(next(iter(indexes.values())))
    sizes, digests = [size] * world, [f"{r:032x}" for r in range(world)]
    for rank, raw in indexes.items():
        sizes[rank], digests[rank] = len(raw), checksum.digest(raw)
    tree = {"type": "dict", "items": _tree_items(tensors) + [
        ["rng", {"type": "per_rank", "items": [{"type": "int", "value": r} for r in range(world)]}]]}
    core = Manifest(format="resurgo.checkpoint", version=INDEXED_VERSION, created_at="2026-01-01T00:00:00.000+00:00",
                    step=100, library={"resurgo": "0"}, world={"size": world}, checksum_algorithm="xxh3-128",
                    pickled=False, files={}, tensors=tensors_core, tree=tree, file_tag="",
                    ranks=RankFiles(files=[1] * world, index_bytes=sizes, index_checksums=digests))
    return core.to_json_bytes(), indexes, layouts_s


def _index_of(rank: int, world: int, tensors: int) -> bytes:
    """Rank ``rank``'s index: its shard of every tensor and the replicated tensors it writes."""
    mine: dict[str, list[ChunkEntry]] = {}
    offset, n_sums = 4096, 0

    def add(key: str, place: BoxPlace, nbytes: int, block_bytes: int) -> None:
        nonlocal offset, n_sums
        sums = [f"{n_sums + j:032x}" for j in range(max(1, math.ceil(nbytes / block_bytes)))]
        n_sums += len(sums)
        mine[key] = [ChunkEntry(box=place, file=data_file_name(rank, 0), byte_range=[offset, offset + nbytes],
                                block_bytes=block_bytes, checksums=sums)]
        offset += nbytes

    for i in range(tensors):
        rows = _rows(i)
        start, n = _bounds(rows, world, rank)
        if n:
            add(f"model.layers.{i}.weight", BoxPlace(offsets=[start, 0], shape=[n, COLS]), n * COLS * 2,
                checksum.block_bytes_for(rows * COLS * 2, COLS * 2))
    for i in range(4):
        if i % world == rank:
            add(f"norm.{i}", BoxPlace(offsets=[0], shape=[1024]), 4096, 65536)
    return RankIndex(format=INDEX_FORMAT, version=INDEXED_VERSION, rank=rank, chunks=mine,
                     files={data_file_name(rank, 0): FileEntry(bytes=offset, header_bytes=4096, header_checksum="0" * 32)}
                     ).encode()


def load_plan_of(core_raw: bytes, indexes: dict[int, bytes], rank: int, world: int, tensors: int) -> tuple[float, int]:
    """(seconds for one rank to parse the core and the indexes it needs, resolve its chunks and plan
    its reads; the metadata bytes it reads). The rank loads its shards and the replicated tensors."""
    t0 = time.perf_counter()
    core = parse_manifest(core_raw)
    wanted: dict = {}
    targets = []
    for i in range(tensors):
        start, n = _bounds(_rows(i), world, rank)
        key = f"model.layers.{i}.weight"
        wanted[key] = [ChunkBox((start, 0), (n, COLS))]
        targets.append(Target(key, ChunkBox((start, 0), (n, COLS)), n * COLS * 2))
    for i in range(4):
        wanted[f"norm.{i}"] = None
        targets.append(Target(f"norm.{i}", ChunkBox.whole((1024,)), 4096))
    needed = ranks_needed(core, wanted)
    parsed = {r: parse_index(indexes[r], core, r, "index") for r in needed}
    resolved = resolve(core, parsed, wanted, lambda r: f"rank {r}'s index")
    plan_reads(targets, resolved.tensors)
    return time.perf_counter() - t0, len(core_raw) + sum(len(indexes[r]) for r in needed)


LOADING_RANK = 1  # holds a row of every tensor at every world (rows run out past rank 4,095)


def dcp_worker(rank: int, world: int, root: str, tensors: int) -> dict | None:
    """One real rank: the same sharded state (small tensors) saved by DCP and by resurgo."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import resurgo

    mesh = init_device_mesh("cpu", (world,))
    state = {f"model.layers.{i}.weight": distribute_tensor(torch.zeros(64, 16), mesh, [Shard(0)], src_data_rank=None)
             for i in range(tensors)}
    dcp.save(state, checkpoint_id=f"{root}/dcp")
    resurgo.save(state, f"{root}/resurgo")
    if rank:
        return None
    return {"dcp_metadata_bytes": os.path.getsize(f"{root}/dcp/.metadata"),
            "resurgo_manifest_bytes": os.path.getsize(f"{root}/resurgo/manifest.json")}


def real_metadata(worlds: list[int], tensors: int) -> list[dict]:
    from resurgo.dist.launch import run_ranks

    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory(prefix="bench-planning-") as root:
            got = run_ranks(world, "bench_planning:dcp_worker", root, tensors, timeout=600,
                            sys_path=[str(Path(__file__).resolve().parent)])[0]
        rows.append({"ranks": world, **got,
                     "dcp_bytes_per_tensor_per_rank": got["dcp_metadata_bytes"] / (tensors * world),
                     "resurgo_bytes_per_tensor_per_rank": got["resurgo_manifest_bytes"] / (tensors * world)})
    return rows


def extrapolate(points: list[tuple[int, float]], world: int, affine: bool = True) -> float:
    """Sizes: affine in the ranks through the two largest measurements (a part that does not grow
    with the ranks, such as the checksums of the same bytes, plus one per chunk). Times (noisy on
    a shared machine, where a slope between two of them can come out negative), or a single
    measurement: proportional to the ranks from the largest one."""
    if len(points) == 1 or not affine:
        w, v = points[-1]
        return v * world / w
    (w0, v0), (w1, v1) = points[-2:]
    return v1 + (v1 - v0) / (w1 - w0) * (world - w1)


def _fmt(value: float, unit: str, extrapolated: bool) -> str:
    text = {"s": f"{value:.3f}", "ms": f"{1000 * value:.2f}", "MB": f"{value / 1e6:.2f}", "B": f"{value:.0f}"}[unit]
    return text + ("*" if extrapolated else "")


COLUMNS = [("ranks", "ranks", "B"), ("uncached s", "plan_seconds", "s"), ("uncached ms/rank", "plan_seconds_per_rank", "ms"),
           ("cached s", "cached_plan_seconds", "s"),
           ("summary ms/rank", "summary_seconds_per_rank", "ms"),
           ("sent/rank cached B", "gathered_bytes_per_rank_cached", "B"),
           ("sent/rank uncached B", "gathered_bytes_per_rank_uncached", "B"),
           ("bcast cached MB", "broadcast_bytes_cached", "MB"), ("bcast uncached MB", "broadcast_bytes_uncached", "MB"),
           ("core manifest MB", "manifest_bytes", "MB"), ("layouts s", "layouts_seconds", "s"),
           ("load reads MB", "load_metadata_bytes", "MB"), ("load plan s", "load_plan_seconds", "s")]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 64, 512, 4096, 16384])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-planned", type=int, default=512, help="largest world whose uncached plan is measured")
    ap.add_argument("--dcp-ranks", type=int, nargs="*", default=[2, 4, 8], help="real gloo worlds (none: skip)")
    ap.add_argument("--out", default="bench-results/planning.json")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    measured: dict[str, list[tuple[int, float]]] = {}  # field -> its (world, value) measurements
    for world in args.ranks:
        row: dict = {"ranks": world, "tensors": args.tensors, "extrapolated": []}
        row.update(cached_path(world, args.tensors, args.repeats))
        if world <= args.max_planned:
            decls = [rank_decl(r, world, args.tensors) for r in range(world)]
            plan: list = [None]
            row["plan_seconds"] = _median_time(lambda: plan.__setitem__(0, plan_global(decls, checksum.block_bytes_for)),
                                               1 if world >= 256 else args.repeats)
            row["broadcast_bytes_uncached"] = len(pickle.dumps(plan[0], protocol=pickle.HIGHEST_PROTOCOL))
            per_rank = plan[0].bytes_per_rank()
            row["max_over_mean_bytes"] = max(per_rank) / (sum(per_rank) / len(per_rank))
            del decls
            del plan
        rank = min(LOADING_RANK, world - 1)
        core_raw, indexes, row["layouts_seconds"] = core_and_indexes(world, args.tensors, {rank} | set(range(min(4, world))))
        row["manifest_bytes"] = len(core_raw)
        row["load_metadata_bytes"] = load_plan_of(core_raw, indexes, rank, world, args.tensors)[1]
        row["load_plan_seconds"] = _median_time(lambda: load_plan_of(core_raw, indexes, rank, world, args.tensors),
                                                args.repeats)
        del core_raw, indexes
        for field in ("plan_seconds", "broadcast_bytes_uncached"):
            if field in row:
                measured.setdefault(field, []).append((world, row[field]))
            elif field in measured:
                row[field] = extrapolate(measured[field], world, affine=not field.endswith("seconds"))
                row["extrapolated"].append(field)
        if "plan_seconds" in row:  # flat while the plan grows linearly
            row["plan_seconds_per_rank"] = row["plan_seconds"] / world
            if "plan_seconds" in row["extrapolated"]:
                row["extrapolated"].append("plan_seconds_per_rank")
        rows.append(row)
        print(" ".join(f"{name}={_fmt(row[f], unit, f in row['extrapolated'])}" for name, f, unit in COLUMNS if f in row),
              file=sys.stderr, flush=True)
    print("  ".join(f"{name:>{max(len(name), 8)}}" for name, _, _ in COLUMNS))
    for row in rows:
        print("  ".join(f"{_fmt(row[f], unit, f in row['extrapolated']) if f in row else '-':>{max(len(name), 8)}}"
                        for name, f, unit in COLUMNS))
    print("* extrapolated from the measured worlds: sizes affine in the ranks, times proportional to them")
    real = real_metadata(args.dcp_ranks, args.tensors) if args.dcp_ranks else []
    for r in real:
        print(f"real gloo, {r['ranks']} ranks x {args.tensors} tensors: DCP .metadata {r['dcp_metadata_bytes'] / 1e6:.2f} MB "
              f"({r['dcp_bytes_per_tensor_per_rank']:.0f} B/tensor/rank), resurgo manifest "
              f"{r['resurgo_manifest_bytes'] / 1e6:.2f} MB ({r['resurgo_bytes_per_tensor_per_rank']:.0f} B/tensor/rank)")
    beyond = {}  # the real sizes at the simulated worlds, extrapolated
    if real:
        for what in ("dcp_metadata_bytes", "resurgo_manifest_bytes"):
            points = [(r["ranks"], float(r[what])) for r in real]
            beyond[what] = {str(w): extrapolate(points, w) for w in args.ranks if w > real[-1]["ranks"]}
        for w in beyond["dcp_metadata_bytes"]:
            print(f"extrapolated to {w} ranks: DCP .metadata {beyond['dcp_metadata_bytes'][w] / 1e6:.0f} MB, "
                  f"resurgo manifest {beyond['resurgo_manifest_bytes'][w] / 1e6:.2f} MB")
    doc = {"rows": rows, "real_metadata": real, "real_metadata_extrapolated": beyond}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
