"""Functions the atomic-load tests run on every rank (see dist_harness.run_ranks): a checkpoint
whose tensor ``big`` is saved in one chunk per rank, one chunk damaged, loaded in any layout."""

from __future__ import annotations

from pathlib import Path

import torch

import resurgo
from dist_workers import bits, hold, local_of

SENTINEL = -7.0  # what every target tensor holds before the load


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    out = {"big": torch.randn(256, 1024, generator=g)}  # 1 MiB: several checksum blocks per chunk
    for i in range(6):
        out[f"w{i}"] = torch.randn(64 * (i + 1), 256, generator=g)
    return out


def save(rank: int, world: int, path: str) -> None:
    """``big`` in row blocks, one per rank (one chunk each); the others written once."""
    state: dict = {k: (hold("manual", v, rank, world) if k == "big" else v.clone()) for k, v in reference().items()}
    state["step"] = 5
    resurgo.save(state, path)


def damage(path: str, key: str, chunk_at_row: int) -> str:
    """Flip one byte of row ``chunk_at_row`` of ``key`` where its chunk stores it; return the
    chunk's data file."""
    m = resurgo.read_manifest(path)
    chunk = next(c for c in m.tensors[key].chunks if c.place.offsets[0] <= chunk_at_row < c.place.offsets[0] + c.place.shape[0])
    f = Path(path) / chunk.file
    raw = bytearray(f.read_bytes())
    row_bytes = chunk.nbytes // chunk.place.shape[0]
    raw[chunk.byte_range[0] + (chunk_at_row - chunk.place.offsets[0]) * row_bytes + 5] ^= 0x40
    f.write_bytes(bytes(raw))
    return chunk.file


def held(layout: str, full: torch.Tensor, rank: int, world: int) -> object:
    """``full`` as this rank holds it: a layout of :func:`dist_workers.hold`, or ``mid_rows`` /
    ``mid_flat`` (one process: the middle half of the rows / of the flattened tensor, a piece
    that spans both of ``big``'s chunks when it was saved by 2 ranks)."""
    if layout == "mid_rows":
        a, b = full.shape[0] // 4, 3 * full.shape[0] // 4
        return resurgo.Shard(full[a:b].clone(), full.shape, (a,) + (0,) * (full.dim() - 1))
    if layout == "mid_flat":
        a, b = full.numel() // 4 + 3, 3 * full.numel() // 4 - 5
        return resurgo.FlatShard(full.reshape(-1)[a:b].clone(), full.shape, a)
    return hold(layout, full, rank, world)


def target(layout: str, rank: int, world: int) -> dict:
    out: dict = {k: held(layout, torch.full_like(v, SENTINEL), rank, world) for k, v in reference().items()}
    out["step"] = 0
    return out


def load_damaged(rank: int, world: int, path: str, layout: str, share_reads: bool | None, io_threads: int) -> dict:
    """Load into ``layout`` targets holding SENTINEL; per key, whether its local bytes are
    unchanged or equal the saved ones, and what the error said."""
    tgt = target(layout, rank, world)
    ref = reference()
    expected = {k: local_of(held(layout, v, rank, world)) for k, v in ref.items()}
    before = {k: bits(local_of(tgt[k])) for k in ref}
    out: dict = {}
    try:
        resurgo.load(tgt, path, share_reads=share_reads, io_threads=io_threads)
        out["error"] = None
    except resurgo.ResurgoError as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
        out["loaded"] = getattr(e, "loaded", None)
        out["untouched"] = getattr(e, "untouched", None)
    out["unchanged"] = sorted(k for k in ref if bits(local_of(tgt[k])) == before[k])
    out["as_saved"] = sorted(k for k in ref if bits(local_of(tgt[k])) == bits(expected[k]))
    out["step"] = tgt["step"]
    return out


def load_damaged_layouts(rank: int, world: int, path: str, layouts: list[str], share_reads: bool | None,
                         io_threads: int) -> dict:
    """:func:`load_damaged` for each layout, one after the other (a failed load leaves no rank
    inside a collective)."""
    return {layout: load_damaged(rank, world, path, layout, share_reads, io_threads) for layout in layouts}


def peer_restore_damaged(rank: int, world: int, tmp: str) -> dict:
    """A memory tier on 2 simulated nodes (memory_workers' layout): save step 1; wipe node 1's
    root and hide the durable tier's data; restore step 1 with one byte of every file node 0
    sends flipped on its way. Node 1's ranks read everything from node 0: the tensor holding the
    flipped byte fails its checksum and must be as it was; the others are either as they were or
    as saved, every byte verified."""
    import os
    import shutil

    import torch.distributed as dist

    import memory_workers as m
    from resurgo.storage.local import CheckpointDir

    m.save_steps(rank, world, tmp, [1])
    dist.barrier()
    if rank == 0:
        durable = Path(tmp) / "durable"
        for name in os.listdir(durable):
            (durable / name / "data").rename(durable / name / "moved")
    if rank == 2:
        shutil.rmtree(Path(tmp) / "mem" / "node1")
    dist.barrier()
    if rank in (0, 1):
        m.flip_what_is_sent(CheckpointDir)
    mgr = m.manager(tmp, rank)
    state = m.blank(rank, world)
    before = {"w": bits(state["w"].local), "b": bits(state["b"]), "mine": bits(state["mine"])}
    out: dict = {}
    try:
        mgr.restore(state, step=1)
        out["error"] = None
    except resurgo.ResurgoError as e:
        out["error"] = type(e).__name__
    mgr.close()
    now = {"w": bits(state["w"].local), "b": bits(state["b"]), "mine": bits(state["mine"])}
    out["unchanged"] = sorted(k for k in before if now[k] == before[k])
    saved = m.rank_state(1, rank, world)
    saved_bits = {"w": bits(saved["w"].local), "b": bits(saved["b"]), "mine": bits(saved["mine"])}
    out["as_saved"] = sorted(k for k in now if now[k] == saved_bits[k])
    out["step"] = state["step"]
    return out
