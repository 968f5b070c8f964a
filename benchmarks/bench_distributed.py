"""Multi-rank save and load throughput: resurgo against PyTorch DCP on the same DTensor state.

W real processes (gloo, CPU) hold a state of ``--size-mib`` (global) as DTensors sharded on
dim 0. Each repetition, in rotating order: resurgo.save and dcp.save of the state; then loads
into the same layout and into another one (Shard(1): every rank needs a strided part of every
saved chunk), page cache evicted before each load. Times are the slowest rank's, between
barriers; medians of ``--repeats``; ratios resurgo/DCP (below 1: resurgo faster). All ranks share
this machine's cores and disk, so absolute GB/s say little; the ratios are the result.

    .venv/bin/python benchmarks/bench_distributed.py [--worlds 2 4] [--size-mib 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, evict, jsonable  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(world: int, size_mib: int, placement: str, fill: bool) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    n_tensors = 16
    rows = size_mib * (1 << 20) // 4 // n_tensors // 1024
    out = {}
    for i in range(n_tensors):
        full = torch.randn(rows, 1024, generator=g) if fill else torch.zeros(rows, 1024)
        out[f"layer{i}.weight"] = distribute_tensor(full, mesh, [Shard(0 if placement == "s0" else 1)], src_data_rank=None)
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import resurgo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(args.dir)
    state = _state(world, args.size_mib, "s0", True)
    results: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        results.setdefault(name, []).append(time.perf_counter() - t0)

    def evict_all() -> None:
        if rank == 0:
            for p in root.iterdir():
                evict(p)
        dist.barrier()

    for rep in range(args.repeats):
        for p in ("resurgo", "dcp"):
            if rank == 0 and (root / p).exists():
                shutil.rmtree(root / p)
        dist.barrier()
        order = ["resurgo", "dcp"] if rep % 2 == 0 else ["dcp", "resurgo"]
        for mech in order:
            if mech == "resurgo":
                timed("save resurgo", lambda: resurgo.save(state, root / "resurgo"))
            else:
                timed("save dcp", lambda: dcp.save(state, checkpoint_id=str(root / "dcp")))
        for layout in ("s0", "s1"):
            for mech in order:
                target = _state(world, args.size_mib, layout, False)
                evict_all()
                if mech == "resurgo":
                    timed(f"load {layout} resurgo", lambda: resurgo.load(target, root / "resurgo"))
                else:
                    timed(f"load {layout} dcp", lambda: dcp.load(target, checkpoint_id=str(root / "dcp")))
                expected = _state(world, args.size_mib, layout, True)
                for k in expected:
                    if not torch.equal(target[k].to_local(), expected[k].to_local()):
                        raise AssertionError(f"{mech} {layout}: {k} differs after load")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        slowest = {k: [max(r[k][i] for r in gathered) for i in range(args.repeats)] for k in results}
        Path(out).write_text(json.dumps(slowest))
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(dir=args.scratch) as d, tempfile.NamedTemporaryFile(suffix=".json") as out:
        args.dir = d
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args, out.name)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scratch", default=None, help="directory for the checkpoints (default: the system temp dir)")
    ap.add_argument("--out", default="bench-results/distributed.json")
    args = ap.parse_args()
    gb = args.size_mib * (1 << 20) / 1e9
    rows = []
    print(f"state: {args.size_mib} MiB global, 16 DTensors Shard(0); slowest rank, median of {args.repeats}")
    print(f"{'ranks':>5} {'operation':<12} {'resurgo s':>10} {'DCP s':>8} {'resurgo/DCP':>12} {'resurgo GB/s':>13}")
    for world in args.worlds:
        res = run_world(world, args)
        for op in ("save", "load s0", "load s1"):
            r, d = statistics.median(res[f"{op} resurgo"]), statistics.median(res[f"{op} dcp"])
            ratio = statistics.median([a / b for a, b in zip(res[f"{op} resurgo"], res[f"{op} dcp"])])
            rows.append({"ranks": world, "operation": op, "resurgo_s": r, "dcp_s": d, "ratio": ratio,
                         "raw": {"resurgo": res[f"{op} resurgo"], "dcp": res[f"{op} dcp"]}})
            print(f"{world:>5} {op:<12} {r:>10.3f} {d:>8.3f} {ratio:>11.2f}x {gb / r:>13.2f}")
    print("load s1 = resharded: saved Shard(0), loaded Shard(1) on the same ranks")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(jsonable({"environment": environment(), "size_mib": args.size_mib,
                                                   "rows": rows}), indent=2))


if __name__ == "__main__":
    main()
