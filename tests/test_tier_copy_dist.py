"""Copies to a durable tier in a distributed job: every rank copies its share of the files, rank 0
commits, and a failure on one rank leaves no copy and reaches every rank (2 real processes, gloo)."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import resurgo
from resurgo.manager import CheckpointManager, Tier
from resurgo.manager.catalog import COMMITTED, TEMPORARY, checkpoint_name, scan
from resurgo.plan.copy_plan import assign_files

from dist_harness import run_ranks

WORLD = 2


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 1000, generator=g), "b": torch.randn(300, generator=g), "step": step}


def tier_worker(rank: int, world: int, tmp: str, fail_rank: int) -> dict:
    from resurgo.storage import local

    durable = Path(tmp) / "durable"
    created: list[str] = []
    real_create = local.LocalStaging.create

    def spy(self, rel):  # which rank writes which file into the durable tier
        if str(self.final).startswith(str(durable)):
            if rank == fail_rank:
                raise resurgo.StorageError(errno.EIO, f"{self.final}: injected failure creating {rel}")
            created.append(rel)
        return real_create(self, rel)

    local.LocalStaging.create = spy
    full = full_state(7)
    rows = slice(4 * rank, 4 * rank + 4)
    state = {"w": resurgo.Shard(full["w"][rows].clone(), (8, 1000), (4 * rank, 0)), "b": full["b"], "step": 7}
    mgr = CheckpointManager(tiers=[Tier(Path(tmp) / "fast"), Tier(durable)], async_save=False)
    mgr.save(state, 7)
    errors = []
    try:
        mgr.close()  # waits for the copy; its error is raised on every rank
    except resurgo.ResurgoError as e:
        errors.append(f"{type(e).__name__}: {e}")
    return {"created": sorted(created), "errors": errors, "should_stop": mgr.should_stop}


def test_each_rank_copies_its_share_and_rank0_commits(tmp_path: Path):
    results = run_ranks(WORLD, "test_tier_copy_dist:tier_worker", str(tmp_path), -1)
    assert [r["errors"] for r in results] == [[], []] and not any(r["should_stop"] for r in results)
    fast, durable = tmp_path / "fast" / checkpoint_name(7), tmp_path / "durable" / checkpoint_name(7)
    files = sorted(str(p.relative_to(fast)) for p in (fast / "data").iterdir())
    shares = [r["created"] for r in results]
    assert all(shares) and sorted(shares[0] + shares[1]) == files  # both ranks copied, each file once
    for name in files + ["manifest.json"]:
        assert (durable / name).read_bytes() == (fast / name).read_bytes()
    loaded = resurgo.load_dict(durable)
    want = full_state(7)
    assert torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"]) and loaded["step"] == 7


def test_a_copy_failing_on_one_rank_leaves_no_copy_and_every_rank_hears(tmp_path: Path):
    results = run_ranks(WORLD, "test_tier_copy_dist:tier_worker", str(tmp_path), 1)
    for r in results:
        assert len(r["errors"]) == 1 and r["errors"][0].startswith("StorageError: rank 1 failed: ")
        assert r["should_stop"]
        assert re.search(r"injected failure creating data/rank0000[01]-(000|index)\.safetensors", r["errors"][0])
    assert [e.status for e in scan(tmp_path / "durable")] == []  # no copy, no temporary directory
    assert [(e.step, e.status) for e in scan(tmp_path / "fast")] == [(7, COMMITTED)]
    assert TEMPORARY not in {e.status for e in scan(tmp_path / "fast")}


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 10**9), max_size=40), ranks=st.integers(1, 9))
def test_assign_files_shares_every_file_once_and_balances_bytes(sizes: list[int], ranks: int):
    files = [(f"data/f{i:03d}.safetensors", s) for i, s in enumerate(sizes)]
    shares = assign_files(files, ranks)
    assert len(shares) == ranks
    assert sorted(n for share in shares for n in share) == sorted(n for n, _ in files)
    assert all(share == sorted(share) for share in shares)
    size = dict(files)
    loads = [sum(size[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes, default=0)
    assert assign_files(list(reversed(files)), ranks) == shares  # the same on every rank, whatever the order


def test_assign_files_refuses_no_ranks():
    with pytest.raises(ValueError, match="ranks"):
        assign_files([("data/a.safetensors", 1)], 0)
