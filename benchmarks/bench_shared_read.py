"""Shared reads: W gloo ranks load one replicated state, each byte read from storage once or by every rank.

Rank 0 saves a replicated state of ``--size-mib`` (``--tensors`` float32 tensors) with resurgo and
with PyTorch DCP. Each repetition, in rotating order, every rank loads the whole state: resurgo
with ``share_reads=True`` (each byte read by one rank, sent to the others over gloo), resurgo with
``share_reads=False`` (every rank reads everything) and ``dcp.load``; the page cache is evicted
(posix_fadvise DONTNEED on every file) before each load. Two references, in the same rotation,
bound what a shared load can cost: each rank reading its W-th of every data file (cache evicted
first), and the state's bytes moved between the ranks as a shared load moves them (16 MiB pieces,
each sent by one rank to every other with gloo isend/irecv, into preallocated tensors, no storage).
Reports the bytes read from storage over the state's bytes (all ranks together) and wall times,
the slowest rank's between barriers, medians of ``--repeats``, with ratios against the unshared
load, DCP and the references measured in the same run.

    .venv/bin/python benchmarks/bench_shared_read.py [--world 4] [--size-mib 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, evict  # noqa: E402

MODES = ["shared", "unshared", "dcp", "read 1/W", "send/recv"]
PIECE_BYTES = 16 << 20


def _state(size_mib: int, tensors: int, fill: bool) -> dict:
    import torch

    numel = size_mib * (1 << 20) // 4 // tensors
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(numel, generator=g) if fill else torch.zeros(numel) for i in range(tensors)}


def _read_share(root: Path, rank: int, world: int) -> None:
    """Read this rank's W-th of every data file (the reference for a shared load's reads)."""
    import numpy as np

    for f in sorted(root.rglob("*.safetensors")):
        size = f.stat().st_size
        lo, hi = size * rank // world, size * (rank + 1) // world
        buf = np.empty(hi - lo, dtype=np.uint8)
        fd = os.open(f, os.O_RDONLY)
        try:
            at = 0
            while at < len(buf):
                at += os.preadv(fd, [buf[at:]], lo + at)
        finally:
            os.close(fd)


def _send_recv(target: dict, rank: int, world: int) -> None:
    """The target's bytes in pieces, piece i sent by rank i % W to every other rank (the
    reference for a shared load's transfers)."""
    import torch
    import torch.distributed as dist

    pieces = [t.view(-1).view(torch.uint8)[a:a + PIECE_BYTES] for t in target.values()
              for a in range(0, t.numel() * t.element_size(), PIECE_BYTES)]
    requests = []
    for i, piece in enumerate(pieces):
        if i % world == rank:
            requests += [dist.isend(piece, dst=r, tag=i) for r in range(world) if r != rank]
        else:
            requests.append(dist.irecv(piece, src=i % world, tag=i))
    for r in requests:
        r.wait()


def _digest(state: dict) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for t in state.values():
        h.update(t.view(-1).numpy().data)
    return h.hexdigest()


def worker(rank: int, world: int, root: str, size_mib: int, tensors: int, repeats: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import resurgo

    state = _state(size_mib, tensors, fill=True)
    saved = _digest(state)
    resurgo.save(state, f"{root}/resurgo")
    dcp.save(state, checkpoint_id=f"{root}/dcp")
    del state
    times: dict[str, list[float]] = {m: [] for m in MODES}
    storage: dict[str, list[int]] = {"shared": [], "unshared": []}
    received: list[int] = []
    plan_bytes = 0
    for rep in range(repeats):
        for mode in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:
            target = _state(size_mib, tensors, fill=False)
            dist.barrier()
            if rank == 0:
                evict(Path(root))
            dist.barrier()
            t0 = time.perf_counter()
            report = None
            if mode == "dcp":
                dcp.load(target, checkpoint_id=f"{root}/dcp")
            elif mode == "read 1/W":
                _read_share(Path(root) / "resurgo", rank, world)
            elif mode == "send/recv":
                _send_recv(target, rank, world)
            else:
                report = resurgo.load(target, f"{root}/resurgo", share_reads=mode == "shared")
            elapsed = time.perf_counter() - t0
            if report is not None:
                if rep == 0 and _digest(target) != saved:  # bit-exact or nothing
                    raise AssertionError(f"rank {rank}: the {mode} load is not bit-exact")
                storage[mode].append(report.bytes_read)
                if mode == "shared":
                    received.append(report.bytes_received)
                    plan_bytes = report.share_plan_bytes_sent
            dist.barrier()
            times[mode].append(elapsed)
            del target
    return {"times": times, "storage": storage, "received": received, "plan_bytes": plan_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--root", default=".", help="where the checkpoints go (a disk, not tmpfs)")
    args = parser.parse_args()

    from resurgo.dist.launch import run_ranks

    state_bytes = args.size_mib * (1 << 20) // 4 // args.tensors * 4 * args.tensors
    with tempfile.TemporaryDirectory(prefix="bench-shared-", dir=args.root) as root:
        results = run_ranks(args.world, "bench_shared_read:worker", root, args.size_mib, args.tensors, args.repeats,
                            sys_path=[str(Path(__file__).resolve().parent)])
    # per repetition, the slowest rank
    slowest = {m: [max(r["times"][m][i] for r in results) for i in range(args.repeats)] for m in MODES}
    median = {m: statistics.median(v) for m, v in slowest.items()}
    read_ratio = {m: statistics.median(sum(r["storage"][m][i] for r in results) for i in range(args.repeats)) / state_bytes
                  for m in ("shared", "unshared")}
    out = {
        "world": args.world, "state_bytes": state_bytes, "repeats": args.repeats,
        "bytes_read_over_state": read_ratio,
        "bytes_received_per_rank": [statistics.median(r["received"]) for r in results],
        "plan_bytes_sent_per_rank": [r["plan_bytes"] for r in results],
        "seconds_median": median,
        "shared_over_unshared": median["shared"] / median["unshared"],
        "shared_over_dcp": median["shared"] / median["dcp"],
        "shared_over_read_plus_send": median["shared"] / (median["read 1/W"] + median["send/recv"]),
        "environment": environment(),
    }
    print(f"{args.world} ranks, replicated state of {state_bytes / (1 << 20):.0f} MiB, medians of {args.repeats}")
    print(f"  bytes read from storage / state: shared {read_ratio['shared']:.2f}x, unshared {read_ratio['unshared']:.2f}x")
    for m in MODES:
        print(f"  {m:9s} {median[m]:7.2f} s")
    print(f"  shared / unshared {out['shared_over_unshared']:.2f}, shared / DCP {out['shared_over_dcp']:.2f}, "
          f"shared / (read 1/W + send/recv) {out['shared_over_read_plus_send']:.2f}")
    print(f"  bytes each rank sent to plan the sharing: {out['plan_bytes_sent_per_rank']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
