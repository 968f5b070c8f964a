"""The coordinator's plan (pure): any valid sharding across ranks, with replicas, is written
exactly once per distinct chunk, by a rank that holds it, with bytes balanced; shards that overlap
or leave a hole raise ShardingError naming the tensor and the ranks; per-rank values split."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.errors import ShardingError
from resurgo.format import checksum
from resurgo.layout.box import ChunkBox, covers_exactly_once
from resurgo.plan.global_plan import PlanCache, RankDecl, TensorDecl, layout_fingerprint, merge_trees, plan_global


def _tree(keys):
    return {"type": "dict", "items": [[k, {"type": "tensor", "key": k}] for k in keys]}


@st.composite
def sharded_job(draw):
    world = draw(st.integers(1, 6))
    tensors = {}
    holdings = [[] for _ in range(world)]
    for i in range(draw(st.integers(1, 5))):
        key = f"t{i}"
        rows = draw(st.integers(0, 12))
        shape = (rows, draw(st.integers(1, 5)))
        cuts = sorted(set(draw(st.lists(st.integers(0, rows), max_size=3))) | {0, rows})
        boxes = [ChunkBox((a, 0), (b - a, shape[1])) for a, b in zip(cuts, cuts[1:])] or [ChunkBox((0, 0), shape)]
        tensors[key] = shape
        for box in boxes:  # each box on one or more ranks (replicas)
            for r in draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world)):
                holdings[r].append((key, box))
    decls = []
    for r in range(world):
        mine: dict[str, list] = {}
        for key, box in holdings[r]:
            mine.setdefault(key, []).append(box)
        decls.append(RankDecl(_tree(sorted(tensors)), tuple(
            TensorDecl(k, "torch", "float32", tensors[k], tuple(boxes), True) for k, boxes in sorted(mine.items()))))
    return tensors, holdings, decls


@settings(max_examples=300)
@given(sharded_job())
def test_every_chunk_written_once_by_a_holder(job):
    tensors, holdings, decls = job
    plan = plan_global(decls, checksum.block_bytes_for)
    written = [(w.item.key, w.item.place, r) for r, ws in enumerate(plan.writes) for w in ws]
    for key, shape in tensors.items():
        places = [p for k, p, _ in written if k == key]
        assert len(places) == len(set(places))  # no chunk twice
        assert covers_exactly_once(places, shape)
    for key, place, r in written:
        assert (key, place) in holdings[r]  # written by a rank that holds it
    # LPT: the most loaded rank exceeds the least loaded holder choice by at most the largest chunk
    loads = plan.bytes_per_rank()
    sizes = [math.prod(p.shape) * 4 for _, p, _ in written]
    if sizes and all(len(h) for h in holdings):
        everyone = {(k, p) for h in holdings for k, p in h}
        if all(set(everyone) <= set(h) for h in holdings):  # fully replicated: free choice
            assert max(loads) - min(loads) <= max(sizes)


def test_overlap_and_hole_name_the_tensor_and_ranks():
    a = RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "float32", (4, 2), (ChunkBox((0, 0), (3, 2)),), True),))
    b = RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "float32", (4, 2), (ChunkBox((2, 0), (2, 2)),), True),))
    with pytest.raises(ShardingError, match=r"tensor 'x': the shards of ranks \[0\] .* and ranks \[1\] .* overlap"):
        plan_global([a, b], checksum.block_bytes_for)
    c = RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "float32", (4, 2), (ChunkBox((3, 0), (1, 2)),), True),))
    with pytest.raises(ShardingError, match=r"tensor 'x': the ranks' shards hold 6 of its 8 elements .*held by no rank"):
        plan_global([RankDecl(a.tree, (TensorDecl("x", "torch", "float32", (4, 2), (ChunkBox((0, 0), (2, 2)),), True),)), c],
                     checksum.block_bytes_for)
    d = RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "bfloat16", (4, 2), (ChunkBox((3, 0), (1, 2)),), True),))
    with pytest.raises(ShardingError, match=r"tensor 'x': rank 0 holds torch float32, rank 1 holds torch bfloat16"):
        plan_global([a, d], checksum.block_bytes_for)


def test_values_that_differ_become_per_rank_and_equal_ones_stay_single():
    trees = [{"type": "dict", "items": [["step", {"type": "int", "value": 5}], ["seen", {"type": "int", "value": r}],
                                        ["t", {"type": "tensor", "key": "t"}]]} for r in range(3)]
    merged, per_rank = merge_trees(trees, differing={"t"})
    items = dict((k, v) for k, v in merged["items"])
    assert items["step"] == {"type": "int", "value": 5}
    assert items["seen"] == {"type": "per_rank", "items": [{"type": "int", "value": r} for r in range(3)]}
    assert items["t"] == {"type": "per_rank", "items": [{"type": "tensor", "key": f"t@rank{r}"} for r in range(3)]}
    assert per_rank == {"t"}


# -- the plan cache: reuse only while nothing the plan depends on changed -----------------------
def _with_values(decls: list[RankDecl], step: int) -> list[RankDecl]:
    """The same layout, with a plain value that changes every save (as a step counter does)."""
    out = []
    for d in decls:
        tree = {"type": "dict", "items": d.tree["items"] + [["step", {"type": "int", "value": step}]]}
        out.append(RankDecl(tree, d.tensors))
    return out


@settings(max_examples=100)
@given(sharded_job())
def test_cached_plans_equal_fresh_plans_while_the_layout_holds(job):
    _, _, decls = job
    cache = PlanCache()
    for step in (1, 2, 3):
        now = _with_values(decls, step)
        assert cache.plan(now, checksum.block_bytes_for, None) == plan_global(now, checksum.block_bytes_for)
    assert cache.hits == 2


def _replicated(world: int, shape=(4, 3), digest: str | None = "a" * 32) -> list[RankDecl]:
    return [RankDecl(_tree(["x", "s"]), (
        TensorDecl("x", "torch", "float32", shape, (ChunkBox((0, 0), shape),), False),
        TensorDecl("s", "torch", "float32", (), (ChunkBox((), ()),), False, digest),
    )) for _ in range(world)]


def test_any_change_the_plan_depends_on_replans():
    cache = PlanCache()
    base = _replicated(2)
    cache.plan(base, checksum.block_bytes_for, None)
    cache.plan(_replicated(2, digest="b" * 32), checksum.block_bytes_for, None)  # new value, same on all ranks
    assert cache.hits == 1
    changes = {
        "shape": _replicated(2, shape=(5, 3)),
        "block rule": base,
        "a replica that now differs between ranks (kept per rank)": [base[0], _replicated(1, digest="c" * 32)[0]],
        "world size": _replicated(3),
    }
    for what, decls in changes.items():
        rule = 4096 if what == "block rule" else None
        block_fn = (lambda n, row_bytes: 4096) if rule else checksum.block_bytes_for
        primed = PlanCache()
        primed.plan(base, checksum.block_bytes_for, None)
        got = primed.plan(decls, block_fn, rule)
        assert primed.hits == 0, what
        assert got == plan_global(decls, block_fn), what
    per_rank = cache.plan(changes["a replica that now differs between ranks (kept per rank)"], checksum.block_bytes_for, None)
    assert {"s@rank0", "s@rank1"} <= set(per_rank.tensors)


def test_a_plan_that_fails_is_not_cached():
    cache = PlanCache()
    good = _replicated(2)
    cache.plan(good, checksum.block_bytes_for, None)
    bad = [RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "float32", (4, 2), (ChunkBox((0, 0), (3, 2)),), True),)),
           RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "float32", (4, 2), (ChunkBox((2, 0), (2, 2)),), True),))]
    with pytest.raises(ShardingError):
        cache.plan(bad, checksum.block_bytes_for, None)
    with pytest.raises(ShardingError):  # still refused the second time: nothing was kept
        cache.plan(bad, checksum.block_bytes_for, None)
    cache.plan(good, checksum.block_bytes_for, None)
    assert cache.hits == 0


def test_layout_fingerprint_ignores_values_but_not_layout():
    a = _replicated(1)[0]
    assert a.layout == _replicated(1, digest="f" * 32)[0].layout == layout_fingerprint(a.tensors)
    assert a.layout != _replicated(1, shape=(4, 4))[0].layout
    assert a.layout != _replicated(1, digest=None)[0].layout  # compared across ranks or not
