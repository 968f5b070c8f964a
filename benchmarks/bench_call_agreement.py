"""What agreeing on a collective call costs: bytes each rank sends and time per save and load.

W real processes (gloo, CPU) repeatedly save a small state (16 replicated tensors of 4 KiB and
one 1 MiB tensor sharded by rows: small, so that coordination dominates), asynchronously too,
and load it back. Reported per operation: the pickled bytes each rank sent in each kind of
collective (:func:`resurgo.dist.comm.sent_bytes`, summed over ranks) and the median time of the
slowest rank, between barriers. Run it against two source trees to compare them:

    PYTHONPATH=src .venv/bin/python benchmarks/bench_call_agreement.py [--world 4] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _state(rank: int, world: int) -> dict:
    import torch

    import resurgo

    rows = 256
    a, b = rank * rows // world, (rank + 1) * rows // world
    full = torch.arange(rows * 1024, dtype=torch.float32).reshape(rows, 1024)
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(16)}
    state["w"] = resurgo.Shard(full[a:b].clone(), (rows, 1024), (a, 0))
    state["step"] = 1
    return state


def _worker(rank: int, world: int, root: str, repeats: int) -> dict:
    import torch.distributed as dist

    import resurgo
    from resurgo.dist.comm import sent_bytes

    state = _state(rank, world)
    ops = {
        "save": lambda i: resurgo.save(state, Path(root, f"s{i}")),
        "async_save": lambda i: resurgo.async_save(state, Path(root, f"a{i}")).wait(),
        "load": lambda i: resurgo.load(state, Path(root, f"s{i}")),
    }
    out: dict = {}
    for name, op in ops.items():
        op(-1 - repeats)  # warm: groups made, plan held
        times, sent = [], []
        for i in range(repeats):
            dist.barrier()
            before = sent_bytes()
            t0 = time.perf_counter()
            op(i)
            times.append(time.perf_counter() - t0)
            after = sent_bytes()
            sent.append({k: after[k] - before[k] for k in after})
        out[name] = {"times": times, "sent": sent}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    opts = parser.parse_args()
    from resurgo.dist.launch import run_ranks

    with tempfile.TemporaryDirectory(prefix="resurgo-bench-agree-") as root:
        ranks = run_ranks(opts.world, "bench_call_agreement:_worker", root, opts.repeats,
                          sys_path=[str(Path(__file__).resolve().parent)])
    report = {}
    for name in ranks[0]:
        slowest = [max(r[name]["times"][i] for r in ranks) for i in range(opts.repeats)]
        kinds = ranks[0][name]["sent"][0].keys()
        per_op = {k: statistics.median(sum(r[name]["sent"][i][k] for r in ranks) for i in range(opts.repeats))
                  for k in kinds}
        report[name] = {"median_ms": round(1000 * statistics.median(slowest), 2), "bytes_sent_all_ranks": per_op}
    print(json.dumps({"world": opts.world, "repeats": opts.repeats, **report}, indent=1))


if __name__ == "__main__":
    main()
