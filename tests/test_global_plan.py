"""The coordinator's plan (pure): any valid sharding across ranks, with replicas, is written
exactly once per distinct chunk, by a rank that holds it, with bytes balanced; shards that overlap
or leave a hole raise ShardingError naming the tensor and the ranks; per-rank values split."""

from __future__ import annotations

import gc
import itertools
import math
import pickle
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.errors import ShardingError, UnsupportedValueError
from resurgo.format import checksum
from resurgo.layout.box import ChunkBox, FlatRange, covers_exactly_once, place_order
from resurgo.layout.grid import Grid
from resurgo.plan import core_plan
from resurgo.plan.global_plan import (GlobalPlan, PlanCache, PlanWrites, RankDecl, RankWrite, TensorDecl, layout_fingerprint,
                                      listed_chunks, merge_trees, plan_global, regular_chunks)
from resurgo.plan.save_plan import WriteItem


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


def _plain(key: str, shape=(3,), dtype="float32", digest=None) -> TensorDecl:
    return TensorDecl(key, "torch", dtype, shape, (ChunkBox.whole(shape),), False, digest)


def test_ranks_holding_different_tensors_are_refused_naming_a_few_keys_per_group():
    keys = [["a"] + [f"opt.{i}" for i in range(1000)], ["a"], ["a"] + [f"opt.{i}" for i in range(1000)], ["a", "z"]]
    decls = [RankDecl(_tree(k), tuple(_plain(x) for x in k)) for k in keys]
    with pytest.raises(UnsupportedValueError) as raised:
        plan_global(decls, checksum.block_bytes_for)
    assert str(raised.value).startswith(
        "the ranks' states hold different tensors ('opt.0', 'opt.1', 'opt.2', 'opt.3' and 996 more on ranks 0, 2; "
        "no other tensor on rank 1; 'z' on rank 3); every rank must hold the same tensors")
    assert len(str(raised.value)) < 400  # a few keys per group, not thousands


def test_values_of_the_ranks_own_may_differ_and_whole_tensors_may_not():
    per_rank_tree = {"type": "dict", "items": [["own", {"type": "per_rank", "items": [{"type": "tensor", "key": "own"}]}],
                                               ["n", {"type": "int", "value": 1}]]}
    own = [RankDecl(per_rank_tree, (_plain("own", (3 + r,)),)) for r in range(2)]
    plan = plan_global(own, checksum.block_bytes_for)  # a PerRank: each rank's of its own shape
    assert {k: m.shape for k, m in plan.tensors.items()} == {"own@rank0": (3,), "own@rank1": (4,)}
    for shape, dtype, digest in (((4,), "float32", None), ((3,), "float64", None), ((4,), "float32", "d")):
        whole = [RankDecl(_tree(["b"]), (_plain("b", (3,), "float32", digest and f"{digest}0"),)),
                 RankDecl(_tree(["b"]), (_plain("b", shape, dtype, digest and f"{digest}1"),))]
        with pytest.raises(UnsupportedValueError, match=rf"tensor 'b': the ranks hold it differently \(torch float32 "
                                                        rf"\[3\] on rank 0; torch {dtype} \[{shape[0]}\] on rank 1\)"):
            plan_global(whole, checksum.block_bytes_for)  # also when its values differ (saved per rank)
    trees = [{"type": "dict", "items": [["pos", {"type": "list", "items": [{"type": "int", "value": i} for i in range(r)]}],
                                        ["t", {"type": "tensor", "key": "t"}]]} for r in range(3)]
    merged, per_rank = merge_trees(trees, differing=set())  # values that differ in shape, no tensor among them
    assert dict(merged["items"])["pos"]["type"] == "per_rank" and per_rank == set()


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


# -- the fast path (regular_chunks, arrays) against the general path (listed_chunks) ---------------
NEVER = 1 << 30  # regular_from: no tensor takes the fast path


@st.composite
def mixed_job(draw):  # type: ignore[no-untyped-def]
    """A job of tensors laid out as DTensor does (torch.chunk over a mesh, uneven, trailing shards
    empty), cut by hand, as flat ranges (ZeRO), replicated on several ranks, with 0-d and empty
    tensors; when ``uniform``, every rank declares every tensor, one place each (the column path)."""
    world = draw(st.integers(1, 8))
    uniform = draw(st.booleans())
    holdings: list[dict[str, list]] = [{} for _ in range(world)]
    shapes, sharded = {}, {}
    for i in range(draw(st.integers(1, 5))):
        key = f"t{i}"
        how = draw(st.sampled_from(["mesh", "mesh", "flat", "replicated", "scalar"] + ([] if uniform else ["cuts"])))
        shape = tuple(draw(st.lists(st.integers(0 if how != "mesh" else 1, 9), min_size=1, max_size=2)))
        if how == "scalar":
            shape = ()
        shapes[key], sharded[key] = shape, how in ("mesh", "flat", "cuts")
        if how == "mesh":  # a mesh of world ranks, one box per rank, ranks in any order
            first = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
            parts = (first, world // first)[:len(shape)] if len(shape) == 2 else (world,)
            grid = Grid(parts, 0, tuple(math.prod(parts[d + 1:]) for d in range(len(parts))))
            ranks = draw(st.permutations(range(world)))
            for cell in itertools.product(*(range(p) for p in parts)):
                holdings[ranks[grid.writer(cell)]].setdefault(key, []).append(grid.box(shape, cell))
        elif how == "flat":  # cut anywhere, empty ranges allowed, one range per rank
            n = math.prod(shape)
            cuts = [0] + sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1))) + [n]
            for r in range(world):
                holdings[r].setdefault(key, []).append(FlatRange(cuts[r], cuts[r + 1]))
        elif how in ("replicated", "scalar"):
            holders = range(world) if uniform else draw(st.sets(st.integers(0, world - 1), min_size=1))
            for r in holders:
                holdings[r].setdefault(key, []).append(ChunkBox.whole(shape))
        else:  # boxes cut along dimension 0, each held by one or more ranks, a rank holding several
            cuts = sorted(set(draw(st.lists(st.integers(0, shape[0]), max_size=3))) | {0, shape[0]})
            for a, b in zip(cuts, cuts[1:]) if len(cuts) > 1 else [(0, 0)]:
                for r in draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=2)):
                    holdings[r].setdefault(key, []).append(ChunkBox((a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:]))
    decls = [RankDecl(_tree(sorted(shapes)), tuple(
        TensorDecl(k, "torch", "bfloat16", shapes[k], tuple(mine[k]), sharded[k]) for k in sorted(mine)))
        for mine in holdings]
    return world, decls


@settings(max_examples=200, deadline=None)
@given(mixed_job())
def test_the_fast_path_plans_what_the_general_path_plans(job):
    _, decls = job
    fast = plan_global(decls, checksum.block_bytes_for, regular_from=1)
    assert fast == plan_global(decls, checksum.block_bytes_for, regular_from=NEVER)
    assert _as_reference(fast) == _reference_plan(decls)


@settings(max_examples=100, deadline=None)
@given(mixed_job())
def test_the_writes_kept_as_arrays_read_as_the_plan_written_out(job):
    """plan.writes[rank], built when read, is the tuple of RankWrites the reference assignment
    gives (item, name, block size, local key and place), and behaves as a tuple of them."""
    world, decls = job
    plan = plan_global(decls, checksum.block_bytes_for, regular_from=1)
    shapes = {t.key: t.shape for d in decls for t in d.tensors}
    eager = tuple(tuple(RankWrite(WriteItem(key, name, "bfloat16", p, nbytes, checksum.block_bytes_for(
        math.prod(shapes[key]) * 2, math.prod(shapes[key][1:]) * 2)), key, p) for key, name, p, nbytes in ws)
        for ws in _reference_plan(decls))
    assert isinstance(plan.writes, PlanWrites) and len(plan.writes) == world
    assert tuple(plan.writes[r] for r in range(world)) == eager and plan.writes == eager
    assert plan.writes[-1] == eager[-1] and plan.writes[1:] == eager[1:] and repr(plan.writes) == f"PlanWrites({eager!r})"
    with pytest.raises(IndexError):
        plan.writes[world]
    assert plan.bytes_per_rank() == [sum(w.item.nbytes for w in ws) for ws in eager]
    received = pickle.loads(pickle.dumps(plan))
    assert received == plan
    # the layouts described from the planner's arrays are those of the writes listed rank by rank,
    # and those of a received plan (its places alone)
    listed = GlobalPlan(plan.tree, plan.tensors, tuple(plan.writes))
    assert core_plan.describe_layouts(plan) == core_plan.describe_layouts(listed) == core_plan.describe_layouts(received)


def _reference_plan(decls: list[RankDecl]) -> list:
    """The assignment written out plainly: every distinct place of a tensor named in place order,
    all sorted by (bytes descending, key, name), each to its least loaded holder, lowest rank first."""
    owners: dict[str, dict] = {}
    for r, d in enumerate(decls):
        for t in d.tensors:
            for p in t.places:
                owners.setdefault(t.key, {}).setdefault(p, set()).add(r)
    items = []
    for key, places in owners.items():
        ordered = sorted(places, key=place_order)
        for i, p in enumerate(ordered):
            items.append((p.numel * 2, key, key if len(ordered) == 1 else f"{key}#{i}", p, places[p]))
    load = [0] * len(decls)
    writes: list[list] = [[] for _ in decls]
    for nbytes, key, name, p, holders in sorted(items, key=lambda a: (-a[0], a[1], a[2])):
        r = min(holders, key=lambda h: (load[h], h))
        load[r] += nbytes
        writes[r].append((key, name, p, nbytes))
    return writes


def _as_reference(plan) -> list:  # type: ignore[no-untyped-def]
    return [[(w.item.key, w.item.name, w.item.place, w.item.nbytes) for w in ws] for ws in plan.writes]


def test_the_reference_is_compared_write_by_write():
    decls = [RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "bfloat16", (5, 2), (ChunkBox((0, 0), (3, 2)),), True),)),
             RankDecl(_tree(["x"]), (TensorDecl("x", "torch", "bfloat16", (5, 2), (ChunkBox((3, 0), (2, 2)),), True),))]
    assert _as_reference(plan_global(decls, checksum.block_bytes_for, regular_from=1)) == _reference_plan(decls) == [
        [("x", "x#0", ChunkBox((0, 0), (3, 2)), 12)], [("x", "x#1", ChunkBox((3, 0), (2, 2)), 8)]]


def _fsdp(world: int, rows: int, cols: int = 3) -> list[TensorDecl]:
    """Shard(0) of a (rows, cols) tensor over ``world`` ranks, as DTensor cuts it (trailing shards empty)."""
    step = -(-rows // world)
    return [TensorDecl("w", "torch", "bfloat16", (rows, cols),
                       (ChunkBox((min(r * step, rows), 0), (min(r * step + step, rows) - min(r * step, rows), cols)),), True)
            for r in range(world)]


def test_regular_layouts_take_the_fast_path_and_irregular_ones_do_not():
    world = 40
    for held in (_fsdp(world, 37), _fsdp(world, 80), _fsdp(world, 41)):
        fast = regular_chunks(held[0].shape, list(range(world)), held)
        assert fast is not None and fast == listed_chunks("w", held[0].shape, list(range(world)), held)
    empty_tail = regular_chunks((41, 3), list(range(world)), _fsdp(world, 41))  # 2 rows a rank: ranks 21 to 39 hold none
    assert empty_tail is not None and empty_tail.places[-1] == ChunkBox((41, 0), (0, 3))  # their empty shards: one place
    assert empty_tail.holders[-1] == tuple(range(21, world)) and len(empty_tail.places) == 22
    whole = [TensorDecl("w", "torch", "bfloat16", (4, 3), (ChunkBox.whole((4, 3)),), False)] * world
    assert regular_chunks((4, 3), list(range(world)), whole) is None  # replicated: held by several ranks
    overlapping = _fsdp(world, 80)
    overlapping[1] = TensorDecl("w", "torch", "bfloat16", (80, 3), (ChunkBox((1, 0), (2, 3)),), True)
    assert regular_chunks((80, 3), list(range(world)), overlapping) is None


@pytest.mark.parametrize("case", ["overlap", "hole", "outside", "dtype", "shape", "mixed"])
def test_errors_are_the_same_whichever_path_tried_first(case):
    world = 20
    held = _fsdp(world, 40)
    if case == "overlap":
        held[3] = TensorDecl("w", "torch", "bfloat16", (40, 3), (ChunkBox((5, 0), (2, 3)),), True)
    elif case == "hole":
        held[3] = TensorDecl("w", "torch", "bfloat16", (40, 3), (ChunkBox((6, 0), (1, 3)),), True)
    elif case == "outside":
        held[19] = TensorDecl("w", "torch", "bfloat16", (40, 3), (ChunkBox((38, 0), (3, 3)),), True)
    elif case == "dtype":
        held[7] = TensorDecl("w", "torch", "float32", (40, 3), held[7].places, True)
    elif case == "shape":
        held[7] = TensorDecl("w", "torch", "bfloat16", (41, 3), held[7].places, True)
    else:
        held[3] = TensorDecl("w", "torch", "bfloat16", (40, 3), (FlatRange(18, 24),), True)
    decls = [RankDecl(_tree(["w"]), (t,)) for t in held]
    messages = set()
    for regular_from in (1, NEVER):
        with pytest.raises(ShardingError) as raised:
            plan_global(decls, checksum.block_bytes_for, regular_from=regular_from)
        assert type(raised.value) is ShardingError
        messages.add(str(raised.value))
    assert len(messages) == 1 and "tensor 'w'" in messages.pop()


def test_repeated_plans_keep_no_objects_alive():
    """A plan leaves nothing behind once dropped: each one and its writes are collected (no cache
    holds them) and nothing is frozen away from the collector."""
    world = 64
    decls = [RankDecl(_tree(["w", "v"]), (_fsdp(world, 100)[r], TensorDecl("v", "torch", "bfloat16", (8,),
                                                                          (ChunkBox.whole((8,)),), False)))
             for r in range(world)]
    frozen = gc.get_freeze_count()
    for _ in range(4):
        plan = plan_global(decls, checksum.block_bytes_for)
        assert len(plan.writes[0]) >= 1
        refs = [weakref.ref(plan), weakref.ref(plan.writes)]
        del plan
        gc.collect()
        assert [r() for r in refs] == [None, None]  # nothing (no cache) keeps the plan or its writes
    assert gc.get_freeze_count() == frozen  # nothing was frozen away from the collector
