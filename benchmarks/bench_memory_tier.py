"""The memory tier against a local-disk save and an upload to S3 (a local SeaweedFS server): the
same state, 4 gloo ranks on 2 simulated nodes (node = rank // 2), in one run.

Measured per repetition (each figure is the slowest rank's, every rank starting together):
- memory: the training stall of an asynchronous save into the memory tier (``save()`` returning)
  and the time until it is safe against a node loss (committed on both nodes, replicas verified);
  a synchronous save, as every save after a job's second runs (its files take over the pages of
  the step deleted before it), and the job's second save, whose files land on fresh pages;
- disk: a synchronous ``resurgo.save`` of every rank's share to a local directory (durable);
- s3: a synchronous ``resurgo.save`` to ``s3://`` (the same state);
- restore from local memory, from a peer (node 1's root wiped first, so its ranks' reads come
  from node 0's replicas; node 1 gets the whole step back after the restore returns, in the
  background, which ``close()`` waits for: timed apart), from disk (page cache dropped where
  possible) and from S3; each into a blank state made before the timer starts (a memory restore
  through a manager made before it, too).
References measured in the same run: a gloo send of each rank's state bytes to its replica holder
(while receiving as many) and a plain write of them into a new ``/dev/shm`` file. For every
figure the CPU seconds of all ranks (``time.process_time``, every thread) are reported beside
the wall time. Every restore is compared bit for bit with the state saved (outside the timed part). Where the
time goes: what is left of the replication of the synchronous memory save once its own files are
written (it starts before they are: the rest of the transfers, verifying the replicas), the peer
restore's load (its reads received from peers) and the re-replication after it. Reported:
medians and the ratios the memory tier aims at: time-to-safe <= 0.5x the disk save, restore from
a peer >= 3x faster than from S3; and that target of the time-to-safe over the gloo send alone
(below 1, the target is under what moving the bytes costs on the machine).

    .venv/bin/python benchmarks/bench_memory_tier.py [--mib-per-rank 256] [--repeats 5] [--out bench-results/memory_tier.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
SCHEMA = "resurgo-bench-memory-tier/1"
WORLD = 4
FIGURES = ("stall", "time_to_safe", "sync_safe", "sync_safe_fresh", "disk_save", "s3_save", "restore_local", "restore_peer", "restore_disk",
           "restore_s3", "ref_gloo_send", "ref_shm_copy")
# Where the time goes (the slowest rank's seconds inside the figure named first).
PARTS = ("sync_safe: replication after the write", "restore_peer: reads received from peers",
         "restore_peer: re-replication after it")


def _state(rank: int, world: int, mib: float, seed: int) -> dict:
    """This rank's shard (``mib`` MiB) of two global tensors sharded by rows over the ranks."""
    import torch

    import resurgo

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    n = int(mib * (1 << 20)) // 8
    return {"layers": {k: resurgo.Shard(torch.randn(n, generator=g), (world * n,), (rank * n,)) for k in "wv"},
            "step": 1}


def _blank(state: dict) -> dict:
    import torch

    import resurgo

    return {"layers": {k: resurgo.Shard(torch.zeros_like(v.local), v.global_shape, v.offsets)
                       for k, v in state["layers"].items()}, "step": -1}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a["step"] == b["step"] and all(torch.equal(a["layers"][k].local, b["layers"][k].local) for k in a["layers"])


def worker(rank: int, world: int, work: str, disk_work: str, url: str, options: dict, mib: float,
           repeats: int) -> dict:
    """Every repetition, on every rank: the saves and restores above, memory roots under ``work``
    (/dev/shm), disk saves under ``disk_work``."""
    import torch.distributed as dist

    import resurgo
    from resurgo.manager import CheckpointManager, MemoryTier
    from resurgo.pipeline import replicate
    from resurgo.pipeline.peer_read import PeerLoad

    import common

    def slowest(seconds: float) -> float:
        out = [0.0] * world
        dist.all_gather_object(out, seconds)
        return max(out)

    def total(seconds: float) -> float:
        out = [0.0] * world
        dist.all_gather_object(out, seconds)
        return sum(out)

    cpu: dict[str, list[float]] = {k: [] for k in FIGURES}

    def timed(fn, figure: str | None = None) -> float:  # the slowest rank's seconds
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall, used = time.perf_counter() - t0, time.process_time() - c0
        if figure is not None:
            cpu[figure].append(total(used))  # every rank's CPU seconds (all its threads)
        return slowest(wall)

    def gloo_send() -> None:
        """The reference for the replication: each rank sends its state's bytes to the rank that
        holds its replica and receives as many from the rank whose replica it holds, at once."""
        peer = (rank + 2) % world
        reqs = [dist.isend(send_buf, dst=peer), dist.irecv(recv_buf, src=peer)]
        for r in reqs:
            r.wait()

    def shm_copy(rep: int) -> None:
        """The reference for the local copy: this rank's state bytes written to a new /dev/shm file."""
        path = Path(work) / f"copy-{rep}-{rank}"
        with open(path, "wb") as f:
            f.write(memoryview(data))
        path.unlink()

    import torch

    nbytes = 2 * (int(mib * (1 << 20)) // 8) * 4  # the state's two float32 tensors
    send_buf, recv_buf = torch.ones(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)  # touched once
    data = send_buf.numpy()
    gloo_send()  # untimed: the first exchange between two ranks connects them

    part: dict[str, float] = {}

    def clocked(fn, name: str):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                part[name] = time.perf_counter() - t0
        return run

    # What is left of a save's replication once its own files are written (the rest of the
    # transfers, verifying the replicas: SaveExchange.finish; it started before the write) and a
    # peer restore's load (its reads of the files node 1 lost received from node 0), timed where they run.
    replicate.SaveExchange.finish = clocked(replicate.SaveExchange.finish, "exchange")  # type: ignore[method-assign]
    PeerLoad.transfer = clocked(PeerLoad.transfer, "peer_load")  # type: ignore[method-assign]
    figures: dict[str, list[float]] = {k: [] for k in FIGURES + PARTS}
    exact = True
    for rep in range(repeats):
        state = _state(rank, world, mib, rep)
        mem = Path(work) / f"mem-{rep}"
        tier = MemoryTier(replicas=1, keep_last=1, root=str(mem / "node{node}"), node=rank // 2)

        mgr = CheckpointManager(tiers=[tier], async_save=False)
        mgr.save(state, 0)  # untimed: the first save of a job also makes its process groups
        figures["ref_gloo_send"].append(timed(gloo_send, "ref_gloo_send"))
        figures["ref_shm_copy"].append(timed(lambda: shm_copy(rep), "ref_shm_copy"))
        # Step 0 is kept until step 1 is complete: step 1's files land on fresh pages. Step 2's
        # take over step 0's (spare pages), as every later save of a job does.
        figures["sync_safe_fresh"].append(timed(lambda: mgr.save(state, 1), "sync_safe_fresh"))
        figures["sync_safe"].append(timed(lambda: mgr.save(state, 2), "sync_safe"))
        figures["sync_safe: replication after the write"].append(slowest(part["exchange"]))
        mgr.close()
        mgr = CheckpointManager(tiers=[tier], async_save=True)
        mgr.save(state, 3)
        mgr.wait()
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        mgr.save(state, 4)
        stall = time.perf_counter() - t0
        cpu["stall"].append(total(time.process_time() - c0))
        mgr.wait()
        safe = time.perf_counter() - t0
        cpu["time_to_safe"].append(total(time.process_time() - c0))
        mgr.close()
        for name, value in (("stall", stall), ("time_to_safe", safe)):
            out = [0.0] * world
            dist.all_gather_object(out, value)
            figures[name].append(max(out))

        disk = Path(disk_work) / f"disk-{rep}"  # one checkpoint, every rank writing its share
        figures["disk_save"].append(timed(lambda: resurgo.save(state, disk), "disk_save"))
        s3 = f"{url}/rep{rep}"
        figures["s3_save"].append(timed(lambda: resurgo.save(state, s3, storage_options=options), "s3_save"))

        def restore(figure: str) -> None:
            """A restart's restore through a new manager (made untimed, as a disk or S3 load's
            target is), into a blank state compared with the saved one untimed."""
            nonlocal exact
            target = _blank(state)
            m = CheckpointManager(tiers=[tier])
            restored: list[int | None] = []
            figures[figure].append(timed(lambda: restored.append(m.restore(target)), figure))
            t0 = time.perf_counter()
            m.close()  # after a peer restore: waits for node 1 to hold the step again
            part["close"] = time.perf_counter() - t0
            exact = exact and restored == [4] and _same(target, state)

        restore("restore_local")
        dist.barrier()
        if rank == 2:
            shutil.rmtree(mem / "node1")
        restore("restore_peer")
        figures["restore_peer: reads received from peers"].append(slowest(part["peer_load"]))
        figures["restore_peer: re-replication after it"].append(slowest(part["close"]))

        if rank == 0:
            common.evict(disk)
        target = _blank(state)
        figures["restore_disk"].append(timed(lambda: resurgo.load(target, disk), "restore_disk"))
        exact = exact and _same(target, state)
        target = _blank(state)
        figures["restore_s3"].append(timed(lambda: resurgo.load(target, s3, storage_options=options), "restore_s3"))
        exact = exact and _same(target, state)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(mem, ignore_errors=True)
            shutil.rmtree(Path(disk_work) / f"disk-{rep}", ignore_errors=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, exact)
    return {"figures": figures, "cpu": cpu, "exact": all(everyone)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib-per-rank", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench-results/memory_tier.json")
    args = ap.parse_args()

    import s3fs

    from resurgo.dist import launch
    from seaweed import SeaweedServer

    work = Path(tempfile.mkdtemp(prefix="resurgo-bench-memory-", dir="/dev/shm"))
    disk_work = Path(tempfile.mkdtemp(prefix="resurgo-bench-memory-disk-"))
    server = SeaweedServer(Path(tempfile.mkdtemp(prefix="resurgo-bench-memory-s3-")))
    server.start()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**server.storage_options).mkdir(bucket)
        results = launch.run_ranks(WORLD, "bench_memory_tier:worker", str(work), str(disk_work),
                                   f"s3://{bucket}", server.storage_options, args.mib_per_rank, args.repeats,
                                   sys_path=[str(HERE), str(HERE.parent / "tests")], timeout=3600)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk_work, ignore_errors=True)
    figures = results[0]["figures"]
    med = {k: statistics.median(v) for k, v in figures.items()}
    cpu = {k: statistics.median(v) for k, v in results[0]["cpu"].items()}
    ratios = {"time_to_safe / disk_save": med["time_to_safe"] / med["disk_save"],
              "sync_safe / disk_save": med["sync_safe"] / med["disk_save"],
              "sync_safe_fresh / sync_safe": med["sync_safe_fresh"] / med["sync_safe"],
              "disk_save * 0.5 / ref_gloo_send": 0.5 * med["disk_save"] / med["ref_gloo_send"],
              "stall / disk_save": med["stall"] / med["disk_save"],
              "restore_s3 / restore_peer": med["restore_s3"] / med["restore_peer"],
              "restore_disk / restore_local": med["restore_disk"] / med["restore_local"],
              "time_to_safe / (ref_gloo_send + ref_shm_copy)": med["time_to_safe"] / (med["ref_gloo_send"] + med["ref_shm_copy"])}
    total = WORLD * args.mib_per_rank
    print(f"memory tier: {WORLD} ranks on 2 nodes, {args.mib_per_rank:g} MiB per rank ({total:g} MiB), "
          f"{args.repeats} repeats, medians (slowest rank), every restore bit-exact: {results[0]['exact']}")
    print(f"  {'':14s} {'wall':>8s}   {'CPU (all ranks)':>15s}")
    for k in FIGURES:
        print(f"  {k:14s} {med[k]:8.3f} s {cpu[k]:8.3f} s")
    for k in PARTS:
        print(f"  {k:34s} {med[k]:8.3f} s")
    print(f"  time-to-safe / disk save   {ratios['time_to_safe / disk_save']:.2f}x  (target <= 0.5)")
    print(f"  sync memory save / disk save  {ratios['sync_safe / disk_save']:.2f}x")
    print(f"  sync memory save on fresh pages / on spare pages  {ratios['sync_safe_fresh / sync_safe']:.2f}x")
    print(f"  the time-to-safe target (0.5x disk save) / gloo send alone  {ratios['disk_save * 0.5 / ref_gloo_send']:.2f}x"
          "  (< 1: below this machine's transport floor)")
    print(f"  S3 restore / peer restore  {ratios['restore_s3 / restore_peer']:.2f}x  (target >= 3)")
    print(f"  stall / disk save          {ratios['stall / disk_save']:.2f}x")
    print(f"  disk restore / local restore {ratios['restore_disk / restore_local']:.2f}x")
    print(f"  time-to-safe / (gloo send + shm copy) {ratios['time_to_safe / (ref_gloo_send + ref_shm_copy)']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"schema": SCHEMA, "mib_per_rank": args.mib_per_rank, "world": WORLD,
                               "repeats": args.repeats, "figures": figures, "medians": med, "cpu_medians": cpu, "ratios": ratios,
                               "exact": results[0]["exact"]}, indent=2))
    return 0 if results[0]["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
