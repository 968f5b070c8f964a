"""Where a shared load's messages land (resurgo.pipeline.shared_read), one process: a piece sent
alone that lands as one contiguous run of a target goes straight into the target's memory, and
the parts it covers are not read again; small pieces packed together, and pieces a target needs
only part of, land in memory that the ordinary read ops scatter from. Ranks passing different
share_reads are refused with every rank's value named."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import resurgo
from resurgo.pipeline.manifest_read import read_manifest_and_bytes, resolve_for
from resurgo.errors import UnsupportedValueError
from resurgo.pipeline.shared_read import SharedLoad, _whole_chunks, mixed_share_reads
from resurgo.plan.load_plan import ReadOp, ReadPart
from resurgo.plan.share_plan import plan_shares
from resurgo.state.unflatten import TargetFill
from resurgo.storage.open import open_checkpoint


def _shared_load(path, target, verify: bool = True) -> SharedLoad:
    ckpt = open_checkpoint(str(path)).pinned()
    manifest, _ = read_manifest_and_bytes(ckpt, resolved=False)
    target_fill = TargetFill(manifest, strict=False)
    target_fill.plan(target)
    destinations = target_fill.destinations
    if manifest.indexed:
        manifest = resolve_for(ckpt, manifest, {d.key: [p.place for p in d.local_pieces()] for d in destinations}, {})
        destinations = [replace(d, entry=manifest.tensors[d.key]) for d in destinations]
    return SharedLoad(ckpt, manifest, destinations, verify=verify, threads=1)


@pytest.mark.parametrize("verify", [False, True])
def test_a_whole_piece_lands_in_the_target_and_small_ones_in_memory(tmp_path, verify):
    """Without verify, a whole piece lands straight in its target; verified, it lands in memory
    (the receiver cannot know beforehand whether the reader's bytes verify)."""
    state = {"w": torch.randn(512, 1024), "s1": torch.arange(100.0), "s2": torch.arange(7.0)}  # w (2 MiB) alone
    resurgo.save(state, tmp_path / "ck")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load = _shared_load(tmp_path / "ck", target, verify)
    try:
        plan = plan_shares([((0, 1), load.needs)])  # rank 0 reads w, rank 1 the small ones, in one message
        assert sorted(sorted(c.chunk[0] for c in m.chunks) for m in plan.messages) == [["s1", "s2"], ["w"]]
        landing = {m.chunks[0].chunk[0]: load._landing(m) for m in plan.messages}
        w_bytes = target["w"].view(-1).view(torch.uint8).numpy()
        assert np.shares_memory(landing["w"], w_bytes) is not verify and landing["w"].size == w_bytes.size
        small = landing["s1" if "s1" in landing else "s2"]
        assert not any(np.shares_memory(small, target[k].numpy()) for k in ("s1", "s2"))
        left = {p.key for op in load.ops for p in op.parts if not load._taken(p)}
        # unverified, w is neither read again from storage nor copied from memory
        assert left == ({"w", "s1", "s2"} if verify else {"s1", "s2"})
    finally:
        load.ckpt.close()


def test_a_piece_a_target_needs_part_of_lands_in_memory(tmp_path):
    w = torch.randn(512, 1024)
    resurgo.save({"w": w}, tmp_path / "ck")
    half = resurgo.Shard(torch.zeros(512, 512), (512, 1024), (0, 512))  # columns: not one run of the chunk
    load = _shared_load(tmp_path / "ck", {"w": half})
    try:
        plan = plan_shares([((0, 1), load.needs)])
        assert [len(m.chunks) for m in plan.messages] == [1]
        landed = load._landing(plan.messages[0])
        assert not np.shares_memory(landed, half.local.numpy()) and landed.size == w.numel() * 4
        assert not any(load._taken(p) for op in load.ops for p in op.parts)
        assert all(load.memory[op.file].holds(op.file_offset, op.length) for op in load.ops)
    finally:
        load.ckpt.close()


def test_only_chunks_read_straight_into_one_target_count_as_whole():
    def op(*parts: ReadPart) -> ReadOp:
        return ReadOp("data/f", 0, sum(p.length for p in parts), parts)

    ops = [
        op(ReadPart("a", 0, 100, 0, 2, 300), ReadPart("a", 0, 50, 1, 2, 400)),  # lands at 300 of target 2
        op(ReadPart("b", 0, 100, 0, 1, 0), ReadPart("b", 0, 100, 1, None)),  # partly through scratch
        op(ReadPart("c", 0, 100, 0, 0, 0), ReadPart("c", 0, 100, 1, 3, 100)),  # two targets
        op(ReadPart("d", 1, 100, 0, None)),
    ]
    assert _whole_chunks(ops) == {("a", 0): (2, 300)}


def test_different_share_reads_name_each_rank_by_value():
    error = mixed_share_reads("s3://b/ckpt", [None, False, None, True])
    assert isinstance(error, UnsupportedValueError)
    assert str(error) == ("s3://b/ckpt: the ranks of one load passed different share_reads (None on ranks 0, 2; "
                          "False on rank 1; True on rank 3); pass the same value on every rank")
