"""Incremental checkpoints in a manager root: base choice, full saves, retention and gc that never
delete a referenced byte, in the right order; random sequences of saves, retention and gc."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resurgo
from resurgo.errors import CheckpointExistsError
from resurgo.manager import FullEvery, IncrementalContext, KeepLast, steps_to_delete
from resurgo.manager.catalog import COMMITTED, CORRUPT, checkpoint_name, scan
from resurgo.manager.gc import run_gc
from resurgo.manager.retention import Kept
from resurgo.pipeline.verify import verify_checkpoint

ROWS, WIDTH = 2048, 128  # 1 MiB of float32: 4 KiB checksum blocks, the unit of reuse


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(ROWS, WIDTH, generator=g), "frozen": torch.randn(256, 1024, generator=g),
            "head": torch.randn(64, generator=g)}


def snapshot(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def check_root(root: Path, saved: dict[int, dict]) -> list[int]:
    """Every committed checkpoint verifies and loads bit for bit as saved; returns their steps."""
    steps = []
    for e in scan(root):
        assert e.status == COMMITTED, (e.name, e.status, e.detail)
        assert verify_checkpoint(root / e.name).ok, e.name
        loaded = resurgo.load_dict(root / e.name)
        for k, v in saved[e.step].items():
            assert torch.equal(bits(loaded[k]), bits(v)), (e.name, k)
        steps.append(e.step)
    return steps


def test_steps_to_delete_keeps_what_kept_ones_reference_and_orders_deletions():
    cps = [Kept(s) for s in (1, 2, 3, 4, 5)]
    # 5 references 4 and 3; 4 references 3; 2 references 1.
    refs = {5: {4, 3}, 4: {3}, 2: {1}}
    assert steps_to_delete(cps, KeepLast(1), references=refs) == [2, 1]  # 2 before the 1 it references
    assert steps_to_delete(cps, KeepLast(1)) == [1, 2, 3, 4]  # without references: oldest first
    # What a protected (or corrupt) checkpoint references stays, transitively.
    assert steps_to_delete(cps, KeepLast(1), protect=[2], references=refs) == []
    assert steps_to_delete(cps, KeepLast(1), references={5: {1}, 4: {3}, 3: {2}}) == [4, 3, 2]


def test_full_every():
    ctx = lambda since, share=0.0: IncrementalContext(since, 1000, int(1000 * share))  # noqa: E731
    assert [FullEvery(3).full(ctx(s)) for s in range(4)] == [False, False, True, True]  # 1 full, 2 incremental
    assert FullEvery(1).full(ctx(0))
    policy = FullEvery(100, referenced_share=0.5)
    assert not policy.full(ctx(1, 0.5)) and policy.full(ctx(1, 0.51))
    with pytest.raises(ValueError):
        FullEvery(0)
    with pytest.raises(ValueError):
        FullEvery(2, referenced_share=1.5)
    with pytest.raises(TypeError, match="incremental must be"):
        resurgo.CheckpointManager("/tmp/unused-h5", incremental="yes")  # type: ignore[arg-type]


def test_manager_saves_against_the_previous_checkpoint(tmp_path: Path):
    state, saved = make_state(), {}
    with resurgo.CheckpointManager(tmp_path, incremental=FullEvery(3), async_save=False) as m:
        for step in range(1, 6):
            state["emb"][step * 11] += 1.0
            m.save(state, step)
            saved[step] = snapshot(state)
    refs = {e.step: sorted(e.referenced) for e in scan(tmp_path)}
    # Full saves at 1 and 4; the others reference the files holding their unchanged bytes.
    assert refs == {1: [], 2: [checkpoint_name(1)], 3: [checkpoint_name(1), checkpoint_name(2)],
                    4: [], 5: [checkpoint_name(4)]}
    m2 = resurgo.read_manifest(tmp_path / checkpoint_name(2))
    assert m2.owned_bytes == 4096 and m2.save_info["incremental"] == {"saves_since_full": 1}
    assert check_root(tmp_path, saved) == [1, 2, 3, 4, 5]


def test_retention_keeps_referenced_checkpoints(tmp_path: Path):
    state, saved = make_state(), {}
    with resurgo.CheckpointManager(tmp_path, keep_last=1, incremental=FullEvery(3), async_save=True) as m:
        for step in range(1, 7):
            state["emb"][step * 8] -= 1.0  # a block of its own: the next save references this one's
            m.save(state, step)
            saved[step] = snapshot(state)
            m.wait()
            m._janitor.join()
            # Kept: the newest, and the chain back to its full save (1, 4 are full).
            assert check_root(tmp_path, saved) == list(range(1 if step < 4 else 4, step + 1))


def test_gc_keeps_what_is_referenced_and_deletes_the_rest(tmp_path: Path):
    state, saved = make_state(), {}
    with resurgo.CheckpointManager(tmp_path, incremental=FullEvery(3), async_save=False) as m:
        for step in range(1, 6):  # full saves at 1 and 4
            state["head"][step] += 1.0  # one block, rewritten each time: the rest is referenced
            m.save(state, step)
            saved[step] = snapshot(state)
    run = run_gc(tmp_path, keep_last=1)
    items = {i.entry.step: i for i in run.plan}
    assert [(s, items[s].action) for s in range(1, 6)] == [(1, "delete"), (2, "delete"), (3, "delete"), (4, "keep"), (5, "keep")]
    assert items[4].reason == "its data files are referenced by step 5"
    assert items[1].turn > max(items[2].turn, items[3].turn)  # 2 and 3 reference 1: deleted first
    assert check_root(tmp_path, saved) == [4, 5]


def two_incremental_steps(root: Path) -> dict:
    """Steps 1 and 2 saved by an incremental manager (step 2 references step 1); the state of step 2."""
    state = make_state()
    with resurgo.CheckpointManager(root, incremental=True, async_save=False) as m:
        m.save(state, 1)
        state["head"] += 1
        m.save(state, 2)
    return state


def test_replacing_a_referenced_checkpoint_is_refused(tmp_path: Path):
    state = two_incremental_steps(tmp_path)
    with resurgo.CheckpointManager(tmp_path, incremental=True, async_save=False) as m:
        assert m.restore(snapshot(state), step=1) == 1
        with pytest.raises(CheckpointExistsError, match="references its data files"):
            m.save(state, 1)
    assert verify_checkpoint(tmp_path / checkpoint_name(2)).ok


def test_a_missing_referenced_file_makes_the_checkpoint_corrupt_in_the_catalog(tmp_path: Path):
    state = two_incremental_steps(tmp_path)
    shutil.rmtree(tmp_path / checkpoint_name(1))
    (entry,) = scan(tmp_path)
    assert entry.status == CORRUPT and "step_000000001/data/" in entry.detail and "(referenced): missing" in entry.detail


# ------------------------------------------------------------------------------------------------
# Random sequences: saves with random changes, retention, gc; every retained checkpoint verifies
# and loads bit for bit at every point.
# ------------------------------------------------------------------------------------------------
change = st.one_of(
    st.tuples(st.just("rows"), st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=8)),
    st.tuples(st.just("whole"), st.sampled_from(["emb", "frozen", "head"])),
    st.tuples(st.just("inplace"), st.integers(0, 256 * 1024 - 1)),
    st.tuples(st.just("none"), st.none()),
)
op = st.one_of(st.tuples(st.just("save"), st.lists(change, max_size=3)),
               st.tuples(st.just("gc"), st.integers(1, 3)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=2, max_size=7), full_every=st.integers(1, 4), keep=st.one_of(st.none(), st.integers(1, 3)),
       seed=st.integers(0, 2**16))
def test_random_saves_retention_and_gc(tmp_path_factory, ops, full_every, keep, seed):
    root = tmp_path_factory.mktemp("root")
    g = torch.Generator().manual_seed(seed)
    state, saved = make_state(seed), {}
    with resurgo.CheckpointManager(root, keep_last=keep, incremental=FullEvery(full_every), async_save=False) as m:
        step = 0
        for kind, arg in ops:
            if kind == "gc":
                m._janitor.join()
                run_gc(root, keep_last=arg, stale_after=0)
            else:
                for what, where in arg:
                    if what == "rows":
                        state["emb"][torch.tensor(where)] += torch.randn(len(where), WIDTH, generator=g)
                    elif what == "whole":
                        state[where].copy_(torch.randn(state[where].shape, generator=g))
                    elif what == "inplace":  # dtype-preserving edit of one element's bits
                        state["frozen"].view(-1).view(torch.int32)[where] ^= 1
                step += 1
                m.save(state, step)
                saved[step] = snapshot(state)
            m._janitor.join()
            kept = check_root(root, saved)
            assert step in kept or not saved  # the newest is never deleted


def test_copies_to_a_durable_tier_are_self_contained(tmp_path: Path):
    state, saved = make_state(), {}
    tiers = [resurgo.Tier(tmp_path / "fast", keep_last=1), resurgo.Tier(tmp_path / "durable", keep_last=2)]
    with resurgo.CheckpointManager(tiers=tiers, incremental=True, async_save=False) as m:
        for step in (1, 2, 3):
            state["emb"][step * 8] += 1.0
            m.save(state, step)
            saved[step] = snapshot(state)
        m.wait()
    # The fast tier keeps 3 and what it references (keep_last=1); the copies hold all their bytes.
    assert [sorted(e.referenced) for e in scan(tmp_path / "fast")] == [[], [checkpoint_name(1)],
                                                                      [checkpoint_name(1), checkpoint_name(2)]]
    assert check_root(tmp_path / "durable", saved) == [2, 3]
    for e in scan(tmp_path / "durable"):
        m3 = resurgo.read_manifest(tmp_path / "durable" / e.name)
        assert not m3.references and m3.owned_bytes == m3.tensor_bytes
