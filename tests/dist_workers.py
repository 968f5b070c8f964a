"""Functions the multi-rank tests run on every rank (see dist_harness.run_ranks).

A *layout* says how a global tensor is held: ``plain`` (every rank holds it all), ``dt_s0`` /
``dt_s1`` / ``dt_rep`` (DTensor on a 1-D mesh), ``dt_2d`` (DTensor on a 2-D mesh, Shard(0) x
Shard(1)), ``manual`` (resurgo.Shard: uneven row blocks), ``flat`` (resurgo.FlatShard: uneven
ranges of the flattened tensor).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import resurgo

LAYOUTS = ["plain", "dt_s0", "dt_s1", "dt_rep", "dt_2d", "manual", "flat"]
DIM0_LAYOUTS = ["dt_s0", "manual", "flat"]


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "a": torch.randn(64, 48, generator=g),
        "b": torch.randn(33, 17, generator=g).to(torch.bfloat16),  # uneven on every world size
        "c": torch.randint(0, 1 << 30, (5, 3, 4), generator=g, dtype=torch.int64),
        "d": torch.randn(512, 1024, generator=g),  # 2 MiB: the byte-count check
        "e": torch.randn(7, generator=g).to(torch.float64),
    }


def _bounds(n: int, parts: int, rank: int) -> tuple[int, int]:
    """Uneven contiguous split: earlier ranks get one more (like numpy.array_split)."""
    base, extra = divmod(n, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def hold(layout: str, full: torch.Tensor, rank: int, world: int) -> object:
    """``full`` as this rank holds it in ``layout`` (a fresh copy)."""
    if layout == "plain":
        return full.clone()
    if layout in ("dt_s0", "dt_s1", "dt_rep"):
        mesh = init_device_mesh("cpu", (world,))
        placement = {"dt_s0": Shard(0), "dt_s1": Shard(1 if full.dim() > 1 else 0), "dt_rep": Replicate()}[layout]
        return distribute_tensor(full.clone(), mesh, [placement], src_data_rank=None)
    if layout == "dt_2d":
        rows = 2 if world % 2 == 0 else 1
        mesh = init_device_mesh("cpu", (rows, world // rows), mesh_dim_names=("dp", "tp"))
        placements = [Shard(0), Shard(1 if full.dim() > 1 else 0)]
        return distribute_tensor(full.clone(), mesh, placements, src_data_rank=None)
    if layout == "manual":
        a, b = _bounds(full.shape[0], world, rank)
        offsets = (a,) + (0,) * (full.dim() - 1)
        return resurgo.Shard(full[a:b].clone(), full.shape, offsets)
    if layout == "flat":
        a, b = _bounds(full.numel(), world, rank)
        return resurgo.FlatShard(full.reshape(-1)[a:b].clone(), full.shape, a)
    raise ValueError(layout)


def local_of(held: object) -> torch.Tensor:
    if isinstance(held, (resurgo.Shard, resurgo.FlatShard)):
        return held.local
    if type(held).__name__ == "DTensor":
        return held.to_local()  # type: ignore[attr-defined]
    assert isinstance(held, torch.Tensor)
    return held


def state(layout: str, rank: int, world: int, fill: bool) -> dict:
    ref = reference()
    out: dict = {}
    for k, v in ref.items():
        held = hold(layout, v if fill else torch.zeros_like(v), rank, world)
        out[k] = held
    out["step"] = 11 if fill else 0
    return out


def bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def save_layouts(rank: int, world: int, root: str, layouts: list[str]) -> dict:
    reports = {}
    for layout in layouts:
        s = state(layout, rank, world, fill=True)
        s["rank_value"] = rank  # differs between ranks: kept per rank
        s["rng"] = resurgo.PerRank(torch.full((4,), rank, dtype=torch.int32))
        r = resurgo.save(s, f"{root}/n{world}-{layout}")
        reports[layout] = (r.bytes_written, r.tensor_bytes)
    return reports


def load_layouts(rank: int, world: int, root: str, saved: list[tuple[int, str]], layouts: list[str]) -> dict:
    """Load every saved checkpoint into every layout; return mismatches and the bytes read for "d"."""
    ref = reference()
    problems: list[str] = []
    d_bytes: dict[str, tuple[int, int]] = {}
    for n, save_layout in saved:
        path = f"{root}/n{n}-{save_layout}"
        for layout in layouts:
            target = state(layout, rank, world, fill=False)
            report = resurgo.load(target, path, strict=False)
            expected = state(layout, rank, world, fill=True)
            for k in ref:
                if bits(local_of(target[k])) != bits(local_of(expected[k])):
                    problems.append(f"{path} -> {layout} world {world} rank {rank}: {k} differs")
            if target["step"] != 11:
                problems.append(f"{path} -> {layout}: step {target['step']}")
            if report.missing_keys or report.unexpected_keys != ["rank_value", "rng"]:
                problems.append(f"{path} -> {layout}: keys {report.missing_keys} {report.unexpected_keys}")
            # bytes read for "d" alone, for dim-0 resharding
            if layout not in DIM0_LAYOUTS or save_layout not in DIM0_LAYOUTS + ["plain", "dt_rep"]:
                continue
            only_d = {"d": hold(layout, torch.zeros_like(ref["d"]), rank, world)}
            rep = resurgo.load(only_d, path, strict=False)
            need = local_of(only_d["d"]).numel() * 4
            d_bytes[f"n{n}-{save_layout}->{layout}"] = (rep.bytes_read, need)
    return {"problems": problems, "d_bytes": d_bytes}


def per_rank_roundtrip(rank: int, world: int, path: str, saved_world: int) -> dict:
    """Load the per-rank values of a checkpoint saved by ``saved_world`` ranks."""
    out: dict = {}
    target = {"rank_value": -1, "rng": resurgo.PerRank(torch.zeros(4, dtype=torch.int32))}
    if saved_world == world:
        resurgo.load(target, path, strict=False)
        out["rank_value"] = target["rank_value"]
        out["rng"] = target["rng"].value.tolist()
        return out
    try:
        resurgo.load({"rng": resurgo.PerRank(torch.zeros(4, dtype=torch.int32))}, path, strict=False)
        out["plain_error"] = None
    except resurgo.WorldSizeMismatchError as e:
        out["plain_error"] = str(e)
    resized = {"rng": resurgo.PerRank(torch.zeros(4, dtype=torch.int32),
                                      on_resize=lambda saved, r, w: saved[r % len(saved)] + 100)}
    resurgo.load(resized, path, strict=False)
    out["resized"] = resized["rng"].value.tolist()
    out["saved_count"] = len(resized["rng"].saved)
    return out


def overlapping_shards(rank: int, world: int, path: str) -> str:
    # Rank r declares rows [r, r + 2): neighbours overlap.
    full = torch.arange(world + 1, dtype=torch.float32)
    s = {"x": resurgo.Shard(full[rank:rank + 2].clone(), (world + 1,), (rank,))}
    try:
        resurgo.save(s, path)
    except resurgo.ShardingError as e:
        return f"ShardingError: {e}"
    return "saved"


def failing_rank(rank: int, world: int, path: str, bad_rank: int) -> str:
    """Save, with fsync failing (ENOSPC) on ``bad_rank``; return what this rank raised."""
    import os

    real = os.fsync

    def broken(fd: int) -> None:
        raise OSError(28, "No space left on device (injected)")

    if rank == bad_rank:
        os.fsync = broken
    s = {"x": hold("dt_s0", torch.arange(64, dtype=torch.float32).reshape(8, 8), rank, world)}
    try:
        resurgo.save(s, path)
    except Exception as e:  # noqa: BLE001 - the test compares type and message across ranks
        return f"{type(e).__name__}: {e}"
    finally:
        os.fsync = real
    return "saved"


def world_size_of(path: str) -> int:
    return resurgo.read_manifest(path).world["size"]


__all__ = ["LAYOUTS", "DIM0_LAYOUTS", "math", "dist"]


def async_then_load(rank: int, world: int, path: str) -> list[str]:
    """async_save on every rank, mutate right after the call, then load into another layout."""
    ref = reference()
    s = {k: hold("dt_s0", v, rank, world) for k, v in ref.items()}
    handle = resurgo.async_save(s, path)
    for v in s.values():  # the checkpoint must hold the values of the moment of the call
        local_of(v).zero_()
    handle.wait()
    target = {k: hold("dt_s1", torch.zeros_like(v), rank, world) for k, v in ref.items()}
    resurgo.load(target, path)
    expected = {k: hold("dt_s1", v, rank, world) for k, v in ref.items()}
    return [k for k in ref if bits(local_of(target[k])) != bits(local_of(expected[k]))]


def good_then_failing(rank: int, world: int, good: str, bad: str, bad_rank: int) -> tuple[str, str]:
    return failing_rank(rank, world, good, -1), failing_rank(rank, world, bad, bad_rank)


def refused_layouts(rank: int, world: int, path: str) -> tuple[str, str]:
    """(overlapping shards outcome, Partial DTensor outcome)."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        resurgo.save({"p": partial}, path + "-partial")
        outcome = "saved"
    except resurgo.UnsupportedValueError as e:
        outcome = f"UnsupportedValueError: {e}"
    return overlapping_shards(rank, world, path), outcome


def manager_async_every_step(rank: int, world: int, root: str) -> list[int]:
    """Async saves every step under a CheckpointManager: its decisions (training thread) and the
    saves' commits (background thread) run collectives at the same time on every rank."""
    state = {"w": hold("dt_s0", torch.arange(4096, dtype=torch.float32).reshape(64, 64), rank, world), "step": 0}
    with resurgo.CheckpointManager(root, every_steps=1, keep_last=2) as mgr:
        for step in range(1, 13):
            local_of(state["w"]).add_(1)
            state["step"] = step
            mgr.maybe_save(state, step)
        mgr.wait()
    dist.barrier()  # every rank's manager closed (retention deletes done) before listing
    return sorted(int(p.name.split("_")[1]) for p in __import__("pathlib").Path(root).iterdir() if p.name.startswith("step_"))


def tiers_fast_lost(rank: int, world: int, fast: str, durable: str, options: dict) -> dict:
    """A CheckpointManager with a fast local tier (every step) and a durable S3 tier (every second
    step, copied in the background): saves steps 1..5, restores from the fast tier, then rank 0
    deletes the fast tier (the node is replaced) and every rank restores from S3. Returns the steps
    each tier holds, the steps restored and this rank's shards' bytes as saved and as restored."""
    import shutil

    from resurgo.manager import Tier

    ref = reference()
    w, d = hold("dt_s0", ref["a"], rank, world), hold("manual", ref["d"], rank, world)
    state = {"w": w, "d": d, "step": 0}
    tiers = [Tier(fast, keep_last=2), Tier(durable, copy_every_steps=2, keep_last=2, storage_options=options)]
    saved: dict[int, list[bytes]] = {}
    with resurgo.CheckpointManager(tiers=tiers, every_steps=1) as mgr:
        for step in range(1, 6):
            local_of(w).add_(step)
            local_of(d).mul_(-1.5)
            state["step"] = step
            mgr.maybe_save(state, step)
            saved[step] = [bits(local_of(w)), bits(local_of(d))]
        mgr.wait()
        dist.barrier()  # rank 0 copies and deletes: done on every rank's return from wait() only there
        held = (mgr.steps(), mgr.steps(tier=1))

    def restore() -> tuple[int | None, list[bytes], int]:
        target = {"w": hold("dt_s0", torch.zeros_like(ref["a"]), rank, world),
                  "d": hold("manual", torch.zeros_like(ref["d"]), rank, world), "step": -1}
        with resurgo.CheckpointManager(tiers=tiers) as mgr:
            step = mgr.restore(target)
        return step, [bits(local_of(target["w"])), bits(local_of(target["d"]))], target["step"]

    from_fast = restore()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(fast)
    dist.barrier()
    from_durable = restore()
    return {"held": held, "saved": saved, "from_fast": from_fast, "from_durable": from_durable}


def repeated_saves(rank: int, world: int, root: str) -> dict:
    """Three saves of one layout with changing values: planned once, then the plan is reused."""
    from resurgo.pipeline import save as save_module

    full = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)
    out = {}
    for step in (1, 2, 3):
        state = {"w": hold("dt_s0", full * step, rank, world), "step": step,
                 "s": torch.tensor(float(step))}  # replicated; its value changes, equal on every rank
        resurgo.save(state, f"{root}/c{step}")
    out["hits"] = save_module._plans.hits
    # A new layout: planned afresh.
    resurgo.save({"w": hold("dt_s1", full, rank, world), "step": 4}, f"{root}/c4")
    out["hits_after_new_layout"] = save_module._plans.hits
    return out


def load_while_replaced(rank: int, world: int, path: str, other: str, how: str) -> tuple[int, int | None, float]:
    """Rank 1's first read of the manifest sees a replacement (``how="error"``) or another version
    (``how="version"``: the manifest of ``other``); returns (manifest reads, step, value loaded)."""
    from resurgo.errors import CheckpointReplacedError
    from resurgo.storage import local

    original = local.PinnedCheckpointDir.read_manifest_bytes
    reads = [0]

    def read(self):  # type: ignore[no-untyped-def]
        reads[0] += 1
        if rank == 1 and reads[0] == 1:
            if how == "error":
                raise CheckpointReplacedError(f"{self.path}: replaced (injected)")
            return local.CheckpointDir(other).read_manifest_bytes()
        return original(self)

    local.PinnedCheckpointDir.read_manifest_bytes = read  # type: ignore[method-assign]
    target = {"w": torch.zeros(8)}
    report = resurgo.load(target, path)
    return reads[0], report.step, float(target["w"][0])


def shared_reads(rank: int, world: int, root: str) -> dict:
    """Save the reference state replicated, then load it with shared reads (compared bitwise with
    an unshared load), with mixed needs (ranks 0 and 1 the whole of "d", the others a half each),
    and with a damaged chunk (every rank must raise the same error)."""
    from pathlib import Path

    ref = reference()
    path = f"{root}/replicated"
    resurgo.save({k: v.clone() for k, v in ref.items()}, path)
    out: dict = {}
    shared = {k: torch.zeros_like(v) for k, v in ref.items()}
    report = resurgo.load(shared, path, share_reads=True)
    alone = {k: torch.zeros_like(v) for k, v in ref.items()}
    unshared = resurgo.load(alone, path, share_reads=False)
    out["equal"] = all(bits(shared[k]) == bits(alone[k]) == bits(ref[k]) for k in ref)
    out["shared"] = (report.shared, report.bytes_read, report.bytes_received, report.share_plan_bytes_sent)
    out["unshared"] = (unshared.shared, unshared.bytes_read, unshared.bytes_received)
    out["auto"] = resurgo.load({k: torch.zeros_like(v) for k, v in ref.items()}, path).shared
    if rank < 2:
        mixed = {"d": torch.zeros_like(ref["d"])}
        expected = ref["d"]
    else:
        a, b = _bounds(ref["d"].shape[0], 2, rank - 2)
        mixed = {"d": resurgo.Shard(torch.zeros(b - a, ref["d"].shape[1]), ref["d"].shape, (a, 0))}
        expected = ref["d"][a:b]
    rep = resurgo.load(mixed, path, strict=False, share_reads=True)
    out["mixed"] = (bits(local_of(mixed["d"])) == bits(expected), rep.bytes_read, rep.bytes_received)
    dist.barrier()
    if rank == 0:
        entry = resurgo.read_manifest(path).tensors["d"].chunks[0]
        data = Path(path) / entry.file
        raw = bytearray(data.read_bytes())
        raw[entry.byte_range[0] + 100] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    try:
        resurgo.load({k: torch.zeros_like(v) for k, v in ref.items()}, path, share_reads=True)
        out["damaged"] = "loaded"
    except resurgo.CorruptCheckpointError as e:
        out["damaged"] = f"CorruptCheckpointError: {e}"
    return out


def mixed_share_reads(rank: int, world: int, root: str, pairs: list[tuple]) -> dict:
    """Load with each rank passing its own share_reads of each pair (what each rank raised), then
    with the same value everywhere (compared bitwise): the refused loads left no collective behind."""
    ref = reference()
    path = f"{root}/replicated"
    resurgo.save({k: v.clone() for k, v in ref.items()}, path)
    out: dict = {"refused": []}
    for choices in pairs:
        try:
            resurgo.load({k: torch.zeros_like(v) for k, v in ref.items()}, path, share_reads=choices[rank])
            out["refused"].append("loaded")
        except resurgo.ResurgoError as e:
            out["refused"].append(f"{type(e).__name__}: {e}")
    after = {k: torch.zeros_like(v) for k, v in ref.items()}
    out["after"] = resurgo.load(after, path, share_reads=True).shared
    out["equal"] = all(bits(after[k]) == bits(ref[k]) for k in ref)
    return out


def shared_reads_object_store(rank: int, world: int, url: str, options: dict) -> dict:
    """Save the reference state replicated to an object store, load it with the default
    share_reads (None): what the load read, received, and whether it is bit-exact."""
    ref = reference()
    resurgo.save({k: v.clone() for k, v in ref.items()}, url, storage_options=options)
    got = {k: torch.zeros_like(v) for k, v in ref.items()}
    report = resurgo.load(got, url, storage_options=options)
    return {"shared": report.shared, "bytes_read": report.bytes_read, "bytes_received": report.bytes_received,
            "equal": all(bits(got[k]) == bits(ref[k]) for k in ref)}
