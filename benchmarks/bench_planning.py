"""Coordinator planning cost of a distributed save, simulated in one process.

For R ranks x T tensors (FSDP-style: every tensor Shard(0) over all ranks, plus a few replicated
ones and per-rank RNG values), build every rank's declarations as ``prepare_save`` would send them
and time :func:`resurgo.plan.global_plan.plan_global` on them, plus the pickled size of what the
gather moves. Prints the time per rank (it should stay flat: the coordinator's work grows
linearly with ranks) and writes bench-results/planning.json.

    .venv/bin/python benchmarks/bench_planning.py [--ranks 1 8 64 512 4096] [--tensors 1000]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from pathlib import Path

from resurgo.format import checksum
from resurgo.layout.box import ChunkBox
from resurgo.plan.global_plan import PlanCache, RankDecl, TensorDecl, plan_global


def rank_decl(rank: int, world: int, tensors: int) -> RankDecl:
    decls = []
    items = []
    for i in range(tensors):
        rows, cols = 4096 + i % 7, 1024
        base, extra = divmod(rows, world)
        start = rank * base + min(rank, extra)
        n = base + (1 if rank < extra else 0)
        key = f"model.layers.{i}.weight"
        decls.append(TensorDecl(key, "torch", "bfloat16", (rows, cols), (ChunkBox((start, 0), (n, cols)),), True))
        items.append([key, {"type": "tensor", "key": key}])
    for i in range(4):  # replicated: every rank holds them, one writes
        key = f"norm.{i}"
        decls.append(TensorDecl(key, "torch", "float32", (1024,), (ChunkBox.whole((1024,)),), False, "0" * 32))
        items.append([key, {"type": "tensor", "key": key}])
    items.append(["step", {"type": "int", "value": 100}])
    items.append(["rng", {"type": "per_rank", "items": [{"type": "int", "value": rank}]}])
    return RankDecl({"type": "dict", "items": items}, tuple(decls))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench-results/planning.json")
    args = ap.parse_args()
    rows = []
    print(f"{'ranks':>6} {'plan s':>9} {'ms/rank':>8} {'reused s':>9} {'reused/plan':>12} {'gathered MB':>12} "
          f"{'max/mean bytes':>15}")
    for world in args.ranks:
        decls = [rank_decl(r, world, args.tensors) for r in range(world)]
        gathered = sum(len(pickle.dumps(d)) for d in decls)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan = plan_global(decls, checksum.block_bytes_for)
            times.append(time.perf_counter() - t0)
        # A later save of the same layout: the coordinator's cache merges the trees, reuses the rest.
        cache = PlanCache()
        cache.plan(decls, checksum.block_bytes_for, None)
        reused = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            cache.plan(decls, checksum.block_bytes_for, None)
            reused.append(time.perf_counter() - t0)
        assert cache.hits == args.repeats
        per_rank = plan.bytes_per_rank()
        balance = max(per_rank) / (sum(per_rank) / len(per_rank))
        t, tr = statistics.median(times), statistics.median(reused)
        rows.append({"ranks": world, "tensors": args.tensors, "plan_seconds": t, "ms_per_rank": 1000 * t / world,
                     "reused_plan_seconds": tr, "gathered_bytes": gathered, "max_over_mean_bytes": balance})
        print(f"{world:>6} {t:>9.3f} {1000 * t / world:>8.2f} {tr:>9.3f} {tr / t:>11.2f}x {gathered / 1e6:>12.1f} "
              f"{balance:>15.3f}")
        del decls, plan
    first, last = rows[0], rows[-1]
    growth = (last["plan_seconds"] / first["plan_seconds"]) / (last["ranks"] / first["ranks"])
    print(f"time grows {growth:.2f}x as fast as the rank count from {first['ranks']} to {last['ranks']} ranks "
          "(<= 1: at most linear)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "growth_vs_linear": growth}, indent=2))


if __name__ == "__main__":
    main()
